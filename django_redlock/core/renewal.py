"""The watchdog: one thread per process re-arms every auto-renewed lease (Redisson's idea).

The leases due in a round are renewed together, one pipelined fan-out per Redlock, so a
silent node costs one ``node_timeout`` per round, never one per lease.

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
from typing import Protocol

from .detector import PauseLog, overrun
from .lock import Lease

__all__ = ["BATCH_WINDOW", "Renewer", "RenewingClient", "pauses", "renewer"]

#: When this process did not run, as the watchdogs saw it (their waits came back late): what
#: tells "the process was paused" from "renewal fell behind" when a lease runs out.
pauses = PauseLog()

#: Leases due within this many seconds of the first are renewed in the same round.
BATCH_WINDOW = 0.05


class RenewedTable(Protocol):
    """What the watchdog asks of a client's lease table (:class:`~.leases.LeaseTable`)."""

    def renewal_failed(self, leases: list[Lease]) -> None: ...


class RenewingClient(Protocol):
    """What the watchdog asks of a client (:class:`~.redlock.Redlock`); named here so this
    module does not import the client that imports it."""

    def _renew(self, leases: list[Lease]) -> list[float | None]: ...

    @property
    def leases(self) -> RenewedTable: ...


class Renewer:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, RenewingClient, Lease]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        #: ``(when, for how long)`` the watchdog thread went to sleep, while it sleeps.
        self._sleeping: tuple[float, float] | None = None

    def add(self, redlock: RenewingClient, lease: Lease) -> None:
        self._schedule(redlock, lease, time.monotonic() + lease.ttl / 3)

    def _schedule(self, redlock: RenewingClient, lease: Lease, when: float) -> None:
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
                    asked = time.monotonic()
                    if timeout is not None:
                        self._sleeping = (asked, timeout)
                    self._cond.wait(timeout)
                    self._sleeping = None
                    if timeout is not None:
                        now = time.monotonic()
                        pauses.note(timeout, now - asked, now)
                # Every lease due now or very soon goes in one round: renewed together, they
                # stay together, and each round costs one fan-out per Redlock.
                horizon = time.monotonic() + BATCH_WINDOW
                groups: dict[int, tuple[RenewingClient, list[Lease]]] = {}
                while self._due and self._due[0][0] <= horizon:
                    _, _, redlock, lease = heapq.heappop(self._due)
                    if not (lease.released or lease.lost):
                        groups.setdefault(id(redlock), (redlock, []))[1].append(lease)
            for redlock, leases in groups.values():
                try:
                    whens = redlock._renew(leases)
                except Exception:
                    redlock.leases.renewal_failed(leases)
                    continue
                for lease, when in zip(leases, whens, strict=True):
                    if when is not None:
                        self._schedule(redlock, lease, when)

    def overslept(self, now: float) -> float:
        """How much longer than it asked the watchdog thread has been asleep by ``now``: a
        process that was frozen finds this out before the thread has run again."""
        sleeping = self._sleeping
        if sleeping is None:
            return 0.0
        return overrun(sleeping[1], now - sleeping[0])

    def _after_fork(self) -> None:
        # The child inherits the heap but not the thread: it renews only what it acquires.
        self.__init__()  # type: ignore[misc]
        pauses.clear()


renewer = Renewer()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=renewer._after_fork)
