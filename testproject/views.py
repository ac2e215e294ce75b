"""Example views: every kind of callable ``@locked`` guards.

Each answers JSON with the lock name it held and the monotonic start/end of its critical
section, so tests (and the demo) can see who held what when.

A request with ``?gate=<name>`` (when DEBUG or the ``TESTPROJECT_GATES`` setting is on) waits inside its critical section until that gate is
opened (:func:`gate`). The concurrency tests use it to hold a lock exactly as long as they need,
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import threading
import time

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_redlock import LockNotAcquired, locked
from django_redlock.decorators import current_lock, retry_after_seconds

# --------------------------------------------------------------------------- gates


class Gate:
    """Requests arrive and wait; the test counts arrivals and opens it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.arrived = 0
        self.is_open = False

    def arrive_and_wait(self, timeout: float = 60.0) -> None:
        with self._cond:
            self.arrived += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.is_open, timeout)

    def wait_arrivals(self, n: int, timeout: float = 60.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.arrived >= n, timeout)

    def open(self) -> None:
        with self._cond:
            self.is_open = True
            self._cond.notify_all()


_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()


def gate(name: str) -> Gate:
    with _gates_lock:
        return _gates.setdefault(name, Gate())


def _gates_on() -> bool:
    return bool(getattr(settings, "TESTPROJECT_GATES", settings.DEBUG))


def _hold(request: HttpRequest) -> None:
    name = request.GET.get("gate")
    if name and _gates_on():
        gate(name).arrive_and_wait()


async def _ahold(request: HttpRequest) -> None:
    name = request.GET.get("gate")
    if name and _gates_on():
        await asyncio.to_thread(gate(name).arrive_and_wait)


def _report(start: float, **extra: object) -> JsonResponse:
    lock = current_lock()
    return JsonResponse(
        {
            "lock": lock.name if lock is not None else None,
            "fence": lock.fence if lock is not None else None,
            "start": start,
            "end": time.monotonic(),
            "thread": threading.current_thread().name,
            **extra,
        }
    )


# --------------------------------------------------------------------------- function views


@locked("order:{order_id}", ttl=10)
def order_pay(request: HttpRequest, order_id: int) -> JsonResponse:
    """Sync function view; a second payment of the same order at the same time gets 423."""
    start = time.monotonic()
    _hold(request)
    return _report(start, order_id=order_id)


@locked("order:{order_id}", ttl=10, wait=30)
def order_pay_wait(request: HttpRequest, order_id: int) -> JsonResponse:
    """Same lock, but waits up to 30 s for it: concurrent payments run one after another."""
    start = time.monotonic()
    _hold(request)
    return _report(start, order_id=order_id)


@locked("report:{name}", ttl=10)
async def report(request: HttpRequest, name: str) -> JsonResponse:
    """Async function view."""
    start = time.monotonic()
    await _ahold(request)
    return _report(start, name=name)


@locked("profile:{request.user.pk}", ttl=10)
def profile(request: HttpRequest) -> JsonResponse:
    """Keyed by the user: one profile update per user at a time (anonymous users share
    the key ``profile:%none``)."""
    start = time.monotonic()
    _hold(request)
    return _report(start, user=request.user.pk)


@locked("ledger:{account}", ttl=10, fencing=True)
def ledger(request: HttpRequest, account: str) -> JsonResponse:
    """Fenced: ``fence`` grows with every holder; pass it to the storage you write to."""
    return _report(time.monotonic(), account=account)


# --------------------------------------------------------------------------- class-based views


@method_decorator(locked("invoice:{invoice_id}", ttl=10), name="get")
@method_decorator(locked("invoice:{invoice_id}", ttl=10, wait=30), name="post")
class InvoiceView(View):
    """Sync class-based view: GET refuses at once when busy, POST waits its turn."""

    def get(self, request: HttpRequest, invoice_id: int) -> JsonResponse:
        start = time.monotonic()
        _hold(request)
        return _report(start, invoice_id=invoice_id)

    def post(self, request: HttpRequest, invoice_id: int) -> JsonResponse:
        return self.get(request, invoice_id)


class AsyncInvoiceView(View):
    """Async class-based view (every handler async). Decorated directly: before Django 5.0,
    ``method_decorator`` turns an ``async def`` into a sync method."""

    @locked("invoice:{invoice_id}", ttl=10)
    async def get(self, request: HttpRequest, invoice_id: int) -> JsonResponse:
        start = time.monotonic()
        await _ahold(request)
        return _report(start, invoice_id=invoice_id)


# --------------------------------------------------------------------------- streaming


@locked("export:{name}", ttl=10)
def export(request: HttpRequest, name: str) -> StreamingHttpResponse:
    """Streaming: the lock is held until the last row is sent (or the client goes away)."""

    def rows():
        yield b"id,name\r\n"
        _hold(request)
        for i in range(3):
            yield f"{i},{name}\r\n".encode()

    return StreamingHttpResponse(rows(), content_type="text/csv")


@locked("export:{name}", ttl=10)
async def async_export(request: HttpRequest, name: str) -> StreamingHttpResponse:
    """Async streaming (an async iterator), same lock as :func:`export`."""

    async def rows():
        yield b"id,name\r\n"
        await _ahold(request)
        for i in range(3):
            yield f"{i},{name}\r\n".encode()

    return StreamingHttpResponse(rows(), content_type="text/csv")


@locked("renewed-export:{name}", ttl=1, auto_renew=True)
async def renewed_export(request: HttpRequest, name: str) -> StreamingHttpResponse:
    """An async view whose renewed lock outlives its loop under a WSGI server: the loop ends
    when the view returns, and the (sync) stream goes on in the server's thread."""

    def rows():
        yield b"id,name\r\n"
        _hold(request)
        yield f"0,{name}\r\n".encode()

    return StreamingHttpResponse(rows(), content_type="text/csv")


@locked("renewed-export:{name}", ttl=1, auto_renew=True)
async def renewed_async_export(request: HttpRequest, name: str) -> StreamingHttpResponse:
    """The same with an async iterator (a WSGI server consumes it in another loop)."""

    async def rows():
        yield b"id,name\r\n"
        await _ahold(request)
        yield f"0,{name}\r\n".encode()

    return StreamingHttpResponse(rows(), content_type="text/csv")


# --------------------------------------------------------------------------- overhead baseline


def ping(request: HttpRequest) -> HttpResponse:
    """Undecorated baseline for measuring the decorator's overhead."""
    return HttpResponse(b"pong", content_type="text/plain")


@locked("ping", ttl=10)
def ping_locked(request: HttpRequest) -> HttpResponse:
    """The same view under ``@locked``."""
    return HttpResponse(b"pong", content_type="text/plain")


# --------------------------------------------------------------------------- custom refusal


def busy_response(request: HttpRequest, exc: LockNotAcquired) -> JsonResponse:
    """An example ``REDLOCK["LOCKED_RESPONSE"] = "testproject.views.busy_response"``: the
    project's own error format (``Retry-After`` is added for 423/429/503 answers only)."""
    return JsonResponse({"code": "busy", "retry_after": retry_after_seconds(exc)}, status=409)
