"""What happened to a lock, for whoever listens (the Django layer turns these into signals).

Listeners run in the thread that caused the event (the renewal thread for ``lost``); one that
raises is logged and skipped, so a broken listener can never break locking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EventKind", "Listener", "LockEvent", "emit", "heard", "printable"]

logger = logging.getLogger("django_redlock")


def printable(value: object) -> str:
    """``str(value)`` safe to write into a log line or onto a terminal: each character that is
    not printable (CR, LF, ESC and the other control characters, line separators) and the
    backslash in Python's escaped form (``\\r``, ``\\x1b``, ``\\\\``), as Django's request
    logger writes a client's path, so a value cannot forge a line or steer the terminal.
    Printable letters of every script stay as they are. Every log line of this package that
    carries a lock name (the client's, through a key template or a key function), a path, a
    holder or an error that may quote them writes them through this."""
    text = str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


EventKind = Literal["acquired", "released", "contended", "lost", "force_released"]


@dataclass(frozen=True)
class LockEvent:
    kind: EventKind
    name: str
    token: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    waited: float | None = None  #: seconds spent acquiring (acquired, contended)
    held: float | None = None  #: seconds the lock was held (released, lost)
    fence: int | None = None
    reason: str | None = None  #: why it was lost / not acquired
    retry_after: float | None = None  #: contended: seconds until the holder's lease ends
    nodes: int | None = None  #: force_released: nodes the key was removed from

    @classmethod
    def of_acquisition(cls, hold: Any, waited: float) -> LockEvent:
        """The ``acquired`` event of a lease (or a backend's grant): anything with ``name``,
        ``token``, ``meta`` and ``fence``."""
        return cls(
            "acquired", hold.name, token=hold.token, meta=hold.meta, waited=waited, fence=hold.fence
        )

    @classmethod
    def of_end(
        cls, kind: Literal["released", "lost"], hold: Any, reason: str | None = None
    ) -> LockEvent:
        """The end of a hold (as :meth:`of_acquisition`, plus ``acquired``, its
        ``time.monotonic()`` start)."""
        return cls(
            kind,
            hold.name,
            token=hold.token,
            meta=hold.meta,
            held=time.monotonic() - hold.acquired,
            fence=hold.fence,
            reason=reason,
        )


Listener = Callable[[LockEvent], None]


#: The log level of an event's kind (DEBUG unless named here).
_LEVELS = {"lost": logging.WARNING, "force_released": logging.WARNING}


def heard(listeners: list[Listener], kind: EventKind) -> bool:
    """Whether an event of ``kind`` reaches anyone (a listener or the log): the hot path
    builds its ``acquired`` and ``released`` events only then."""
    return bool(listeners) or logger.isEnabledFor(_LEVELS.get(kind, logging.DEBUG))


def emit(listeners: list[Listener], event: LockEvent) -> None:
    level = _LEVELS.get(event.kind, logging.DEBUG)
    if logger.isEnabledFor(level):
        # A lost lock's line says why (the renewal fell behind, the process was paused, the
        # nodes refused): the reason is what an operator reading the log acts on.
        logger.log(
            level,
            "lock %s %s: %s" if event.reason else "lock %s %s",
            printable(event.name),
            event.kind,
            *((printable(event.reason),) if event.reason else ()),
            extra={
                "lock_event": event.kind,
                "lock_name": event.name,
                "lock_token": event.token,
                "lock_reason": event.reason,
                "lock_waited": event.waited,
                "lock_held": event.held,
            },
        )
    for listener in list(listeners):
        try:
            listener(event)
        except Exception:
            logger.exception("lock event listener %r failed on %s", listener, event.kind)
