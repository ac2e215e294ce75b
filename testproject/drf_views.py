"""Django REST framework views under ``@locked``, in the three forms docs/usage.rst shows.

Imported (by ``testproject.drf_urls``) only when DRF is installed. Each lock is per client
(``{client}``: the user DRF authenticated, by token or session), and each view answers the
lock name it held and the user DRF saw; ``?gate=<name>`` holds the critical section open
like the plain views' (``testproject.views.gate``).
"""

from __future__ import annotations

import time

from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_redlock import locked
from django_redlock.decorators import current_lock

from .views import _hold


def _report(request: Request, start: float, **extra: object) -> Response:
    lock = current_lock()
    return Response(
        {
            "lock": lock.name if lock is not None else None,
            "user": request.user.pk,
            "start": start,
            "end": time.monotonic(),
            **extra,
        }
    )


@api_view(["POST"])
@locked("api-order:{order_id}:{client}", ttl=10)
def order_pay(request: Request, order_id: int) -> Response:
    """A function view: ``@locked`` goes below ``@api_view``."""
    start = time.monotonic()
    _hold(request)
    return _report(request, start, order_id=order_id)


class InvoiceAPIView(APIView):
    """A class-based API view: ``@locked`` on the handler method."""

    @locked("api-invoice:{invoice_id}:{client}", ttl=10)
    def post(self, request: Request, invoice_id: int) -> Response:
        start = time.monotonic()
        _hold(request)
        return _report(request, start, invoice_id=invoice_id)


class AccountViewSet(ViewSet):
    """A ViewSet: ``@locked`` on a standard action and below ``@action`` on an extra one."""

    @locked("api-account:{pk}:{client}", ttl=10)
    def update(self, request: Request, pk: str) -> Response:
        start = time.monotonic()
        _hold(request)
        return _report(request, start, account=pk)

    @action(detail=True, methods=["post"])
    @locked("api-account-sync:{pk}:{client}", ttl=10)
    def sync(self, request: Request, pk: str) -> Response:
        start = time.monotonic()
        _hold(request)
        return _report(request, start, account=pk)
