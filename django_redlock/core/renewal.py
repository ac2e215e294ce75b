"""The watchdog: one thread per process re-arms every auto-renewed lease (Redisson's idea).

A lease is re-armed every ttl/3 while its holder holds it. When a renewal finds the token gone,
or cannot reach a quorum before the lease runs out, the lease is marked lost: ``held`` turns
False, a ``lost`` event fires and the next ``release()`` raises :class:`LockLost`. A holder that
was frozen (SIGSTOP, a long GC pause) past its lease finds its lease already run out by the
monotonic clock when it resumes, and it is marked lost instead of being renewed.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING

from .lock import Lease

if TYPE_CHECKING:
    from .redlock import Redlock

__all__ = ["Renewer", "renewer"]


class Renewer:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Redlock, Lease]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, redlock: Redlock, lease: Lease) -> None:
        self._schedule(redlock, lease, time.monotonic() + lease.ttl / 3)

    def _schedule(self, redlock: Redlock, lease: Lease, when: float) -> None:
        with self._cond:
            heapq.heappush(self._due, (when, next(self._seq), redlock, lease))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redlock-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    self._cond.wait(timeout)
                _, _, redlock, lease = heapq.heappop(self._due)
            if lease.released or lease.lost:
                continue
            try:
                when = redlock._renew(lease)
            except Exception:
                redlock._mark_lost(lease, "renewal failed with an unexpected error")
                when = None
            if when is not None:
                self._schedule(redlock, lease, when)

    def _after_fork(self) -> None:
        # The child inherits the heap but not the thread: it renews only what it acquires.
        self.__init__()  # type: ignore[misc]


renewer = Renewer()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=renewer._after_fork)
