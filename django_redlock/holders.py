"""When a lock's holder will probably let go.

Shared by ``@locked`` (the ``Retry-After`` of a 423) and ``LockedTask`` (when a busy key's task
should come back), so the rule exists once. Whether a holder's process is gone is the core's
judgement (:func:`django_redlock.core.process_gone`), shared with the admin page and
``manage.py redlock list``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TYPICAL_HOLD",
    "HoldTimes",
    "expected_free_in",
]

#: Holder metadata key: the holder's typical hold in seconds (its own recent holds).
TYPICAL_HOLD = "typical_hold"


class HoldTimes:
    """How long this process held each kind of lock lately (exponentially weighted mean).

    A holder stores its typical hold in its lock metadata (:data:`TYPICAL_HOLD`), so a
    contender in any process can estimate when the lock frees, instead of assuming the
    whole lease.
    """

    #: Weight of the newest hold: the mean follows a changed workload within a few holds.
    WEIGHT = 0.3

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._means: dict[str, float] = {}

    def record(self, kind: str, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        with self._guard:
            mean = self._means.get(kind)
            self._means[kind] = seconds if mean is None else mean + self.WEIGHT * (seconds - mean)

    def typical(self, kind: str) -> float | None:
        """The mean hold of ``kind`` in seconds (None before the first hold)."""
        return self._means.get(kind)

    def meta(self, kind: str) -> dict[str, float]:
        """``{TYPICAL_HOLD: seconds}`` for a lock's metadata, empty before the first hold."""
        typical = self._means.get(kind)
        return {} if typical is None else {TYPICAL_HOLD: round(typical, 4)}


def expected_free_in(meta: Mapping[str, Any], age: float | None, ttl: float) -> float:
    """Seconds until a held lock probably frees: the holder's typical hold minus what it has
    held so far (one more typical hold once it is past it: it is running late, not
    forever), never beyond the remaining lease ``ttl``. Without a typical hold the remaining
    lease is the only bound known."""
    typical = meta.get(TYPICAL_HOLD)
    if isinstance(typical, (int, float)) and not isinstance(typical, bool) and typical >= 0:
        left = float(typical) - (age or 0.0)
        return min(left if left > 0 else float(typical), ttl)
    return ttl
