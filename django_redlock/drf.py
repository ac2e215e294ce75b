"""Django REST framework refusals of ``@locked``: the 423/503 of a busy lock as DRF exceptions.

Imported by :mod:`django_redlock.decorators` only when a call's request is a DRF ``Request``
(so DRF is installed and already imported); nothing else in the package imports DRF.

A refused DRF view raises one of these instead of returning a Django response, the way DRF
reports its own refusals (``Throttled``): the project's ``EXCEPTION_HANDLER`` shapes the
body, the renderer DRF negotiated writes it, and DRF's default handler turns ``wait`` into
``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import APIException

from .core import LockNotAcquired, QuorumError

__all__ = ["LockBusy", "LockServiceUnavailable", "raise_refusal"]

_BUSY = "This resource is being modified by another request; try again later."
_UNAVAILABLE = "The lock service is unavailable; try again later."


class _Refusal(APIException):
    """A refused view's answer: ``wait`` is the ``Retry-After`` seconds, and the body is the
    one a plain view answers with (DRF's "detail" plus the two fields API clients of plain
    @locked views already read)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__()
        self.wait = retry_after
        self.detail: Any = {
            "error": self.default_code,
            "detail": self.default_detail,
            "retry_after": retry_after,
        }


class LockBusy(_Refusal):
    """423 Locked: another holder has the lock."""

    status_code = 423
    default_detail = _BUSY
    default_code = "locked"


class LockServiceUnavailable(_Refusal):
    """503: too few lock nodes answered (an outage, not contention)."""

    status_code = 503
    default_detail = _UNAVAILABLE
    default_code = "unavailable"


def raise_refusal(request: Any, exc: LockNotAcquired, retry_after: int) -> None:
    """The default answer of a refused DRF view: raise the matching DRF exception."""
    if isinstance(exc, QuorumError):
        raise LockServiceUnavailable(retry_after) from exc
    raise LockBusy(retry_after) from exc
