"""Django signals sent for lock events (see docs/usage, "signals").

Each is sent with ``sender`` = the lock name's owning Redlock class and the keyword arguments
``name``, ``token``, ``meta``, ``event`` (the core's :class:`~django_redlock.core.LockEvent`).
"""

from __future__ import annotations

from django.dispatch import Signal

from .core import LockEvent

__all__ = [
    "lock_acquired",
    "lock_contended",
    "lock_force_released",
    "lock_lost",
    "lock_released",
    "send_event",
]

lock_acquired = Signal()
lock_released = Signal()
lock_contended = Signal()
lock_lost = Signal()
lock_force_released = Signal()

_BY_KIND = {
    "acquired": lock_acquired,
    "released": lock_released,
    "contended": lock_contended,
    "lost": lock_lost,
    "force_released": lock_force_released,
}


def send_event(event: LockEvent) -> None:
    """The core listener that turns events into signals (receivers' errors are logged by
    the core, never raised into the locking code)."""
    _BY_KIND[event.kind].send(
        sender=LockEvent, name=event.name, token=event.token, meta=event.meta, event=event
    )
