"""Django signals sent for lock events (documented in docs/usage.rst, "Signals").

The Redlocks built by :func:`django_redlock.get_redlock` / :func:`get_async_redlock` turn the
core's :class:`~django_redlock.core.LockEvent` into these signals. Each is sent with
``sender`` = the Redlock class (``Redlock`` or ``AsyncRedlock``) and these keyword arguments:

``redlock``
    the instance that took the lock;
``name``
    the lock name (the key without ``KEY_PREFIX``);
``token``
    the holder's token (None for ``lock_contended``);
``meta``
    the holder metadata stored with the lock (view, path, method, user, host, pid, ...);
``waited`` / ``held``
    seconds spent acquiring (acquired, contended) / seconds the lock was held (released, lost);
``fence``, ``reason``, ``retry_after``, ``nodes``
    fencing token; why it was lost or not acquired; seconds until the holder's lease ends
    (contended); nodes the key was removed from (force_released);
``event``
    the core's ``LockEvent`` itself.

Receivers run synchronously in the thread that caused the event (the renewal thread for
``lock_lost``). A receiver that raises is logged on the ``django_redlock`` logger (one record,
naming the lock and the event, with the traceback) and skipped: a broken receiver can never
break locking. Django's ``send_robust`` would log it too, on ``django.dispatch``, without the
lock: that record is dropped for these signals (:class:`_LoggedHere`, installed by the
app's ``ready()``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from .core import LockEvent, printable

logger = logging.getLogger("django_redlock")

__all__ = [
    "install",
    "listener_for",
    "lock_acquired",
    "lock_contended",
    "lock_force_released",
    "lock_lost",
    "lock_released",
    "send_event",
]

#: A lock was taken on a quorum of nodes.
lock_acquired = Signal()
#: A lock was given back while it was still held (a hold ends with this or ``lock_lost``,
#: never both).
lock_released = Signal()
#: A lock could not be taken (held by someone else, or too few nodes answered).
lock_contended = Signal()
#: A held lock was lost: the lease ran out, renewal failed, or it was force-released.
lock_lost = Signal()
#: An operator removed a lock whoever held it (admin page, ``manage.py redlock release``).
lock_force_released = Signal()

SIGNALS: dict[str, Signal] = {
    "acquired": lock_acquired,
    "released": lock_released,
    "contended": lock_contended,
    "lost": lock_lost,
    "force_released": lock_force_released,
}


#: The lock signal send_event is sending in this context, if any.
_sending: contextvars.ContextVar[Signal | None] = contextvars.ContextVar(
    "django_redlock_sending", default=None
)


class _LoggedHere(logging.Filter):
    """Drops Django's own record of a failing receiver (``send_robust`` logs one on
    ``django.dispatch`` since Django 4.1) when send_event logs that failure itself, with the
    lock's name: one record per failure. Only a receiver of the signal send_event is sending
    is dropped: the frame that caught the error is that signal's ``send_robust`` (or, for an
    async receiver, its wrapper, where the signal is ``self`` too). Another signal sent
    robustly from inside a receiver keeps Django's record."""

    def filter(self, record: logging.LogRecord) -> bool:
        signal = _sending.get()
        error = record.exc_info[1] if record.exc_info else None
        if signal is None or error is None or error.__traceback__ is None:
            return True
        return error.__traceback__.tb_frame.f_locals.get("self") is not signal


_LOGGED_HERE = _LoggedHere()


def install() -> None:
    """Drop Django's duplicate records of the lock signals' failing receivers (called by the
    app's ``ready()``; idempotent: a filter is added to a logger once)."""
    logging.getLogger("django.dispatch").addFilter(_LOGGED_HERE)


def send_event(event: LockEvent, redlock: Any = None) -> None:
    """Send the signal for ``event`` to every receiver: one that raises is logged and skipped,
    and the others still run (an alerting receiver must not be silenced by another app's bug)."""
    signal = SIGNALS.get(event.kind)
    if signal is None or not signal.receivers:  # cheap: most events have no receiver
        return
    sending = _sending.set(signal)
    try:
        replies = signal.send_robust(
            sender=type(redlock) if redlock is not None else LockEvent,
            redlock=redlock,
            name=event.name,
            token=event.token,
            meta=event.meta,
            waited=event.waited,
            held=event.held,
            fence=event.fence,
            reason=event.reason,
            retry_after=event.retry_after,
            nodes=event.nodes,
            event=event,
        )
    finally:
        _sending.reset(sending)
    for receiver, reply in replies:
        if isinstance(reply, Exception):
            logger.error(
                "lock_%s receiver %r failed on lock %s: %s",
                event.kind,
                receiver,
                printable(event.name),
                printable(reply),
                exc_info=(type(reply), reply, reply.__traceback__),
                extra={"lock_name": event.name, "lock_event": event.kind},
            )


def listener_for(redlock: Any) -> Callable[[LockEvent], None]:
    """The core listener that turns ``redlock``'s events into these signals."""

    def listener(event: LockEvent) -> None:
        send_event(event, redlock)

    return listener
