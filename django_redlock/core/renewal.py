"""The watchdog: one thread per process re-arms every auto-renewed lease (Redisson's idea).

The leases due in a round are renewed together, one pipelined fan-out per Redlock, so a
silent node costs one ``node_timeout`` per round, never one per lease.

A lease is re-armed every ttl/3 while its holder holds it. When a renewal finds the token gone,
or cannot reach a quorum before the lease runs out, the lease is marked lost: ``held`` turns
False, a ``lost`` event fires and the next ``release()`` raises :class:`LockLost`. A holder that
was frozen (SIGSTOP, a long GC pause) past its lease finds its lease already run out by the
monotonic clock when it resumes, and it is marked lost instead of being renewed.

Renewal goes first. The watchdog is one thread among the caller's, and CPython runs one
thread at a time: eight threads taking locks as fast as they can leave it an eighth of the
interpreter, and the leases it keeps run out while it waits for its turn. So while it runs
behind (:data:`BEHIND_AFTER`), this process's new acquires wait for it to catch up (at most
:data:`YIELD_AT_MOST` each, never beyond their own timeout): taking more locks adds renewal
work, and losing held ones is worse than taking a new one later.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections import deque
from typing import NamedTuple, Protocol

from .detector import PauseLog, overrun
from .lock import Lease

__all__ = [
    "BATCH_WINDOW",
    "BEHIND_AFTER",
    "ROUND_MAX",
    "YIELD_AT_MOST",
    "Renewer",
    "RenewingClient",
    "RoundRecord",
    "pauses",
    "renewer",
]

#: When this process did not run, as the watchdogs saw it (their waits came back late): what
#: tells "the process was paused" from "renewal fell behind" when a lease runs out.
pauses = PauseLog()

#: Leases due within this many seconds of the first are renewed in the same round.
BATCH_WINDOW = 0.05

#: The most leases one fan-out of a round carries; a round that has more (the watchdog ran
#: behind and every lease came due at once) goes out in parts of this size, the leases due
#: first in the first part. Each part is judged as it comes back: a part of 10,000 took 3 s
#: on a loaded host, and the leases that ran out meanwhile here were not yet renewed although
#: the nodes had answered in time.
ROUND_MAX = 1000

#: How late (seconds after a lease was due) the watchdog may start a round before this
#: process's new acquires wait for it to catch up (see :meth:`Renewer.make_way`).
BEHIND_AFTER = 0.1

#: The longest one acquire waits for the watchdog to catch up (seconds).
YIELD_AT_MOST = 0.5


class RoundRecord(NamedTuple):
    """One watchdog round, as :attr:`Renewer.rounds` keeps it (for an operator, or a load
    test, to see how far renewal is behind and how long its rounds take)."""

    started: float  #: monotonic
    late: float  #: seconds after its first lease was due
    leases: int
    took: float  #: seconds, the whole round (its fan-outs and their judgement)


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
    """The process's watchdog thread and its schedule.

    The schedule is a wheel of :data:`BATCH_WINDOW`-wide slots (the slot's number, then per
    client the leases due in it), not a heap of one entry per renewal: each entry would live
    until the lease's next round, long enough for the garbage collector to promote it, and
    thousands of renewals a second would make it run full collections over every object of
    the process, each a pause of its own (a fifth of a second for 10,000 renewed locks on an
    idle core, several seconds on a loaded host).
    """

    #: How many of the latest rounds :attr:`rounds` keeps.
    KEEP_ROUNDS = 4096

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Slot number -> the leases due in it, per client (``id`` -> client, leases).
        self._slots: dict[int, dict[int, tuple[RenewingClient, list[Lease]]]] = {}
        #: The slot numbers in :attr:`_slots`, a heap (plain ints: nothing for the collector).
        self._order: list[int] = []
        self._thread: threading.Thread | None = None
        #: ``(when, for how long)`` the watchdog thread went to sleep, while it sleeps.
        self._sleeping: tuple[float, float] | None = None
        #: The latest rounds, oldest first.
        self.rounds: deque[RoundRecord] = deque(maxlen=self.KEEP_ROUNDS)
        #: Clear while the watchdog runs behind: new acquires wait on it (:meth:`make_way`).
        self.caught_up = threading.Event()
        self.caught_up.set()

    def add(self, redlock: RenewingClient, lease: Lease) -> None:
        self._schedule(redlock, [lease], [time.monotonic() + lease.ttl / 3])

    def _schedule(
        self, redlock: RenewingClient, leases: list[Lease], whens: list[float | None]
    ) -> None:
        """Put each lease in the slot of its next renewal (None: not again)."""
        key = id(redlock)
        with self._cond:
            for lease, when in zip(leases, whens, strict=True):
                if when is None:
                    continue
                number = int(when // BATCH_WINDOW)
                slot = self._slots.get(number)
                if slot is None:
                    slot = self._slots[number] = {}
                    heapq.heappush(self._order, number)
                entry = slot.get(key)
                if entry is None:
                    slot[key] = (redlock, [lease])
                else:
                    entry[1].append(lease)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redlock-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def make_way(self, at_most: float) -> float:
        """Called before an acquire: while the watchdog runs behind, wait (at most
        ``at_most`` seconds) for it to catch up, so that this process's threads do not take
        the interpreter from it. Returns the seconds waited (0.0 at once when it is not
        behind, and in the watchdog's own thread: a ``lost`` listener may acquire)."""
        if self.caught_up.is_set() or threading.current_thread() is self._thread:
            return 0.0
        started = time.monotonic()
        self.caught_up.wait(at_most)
        return time.monotonic() - started

    def _next_due(self) -> float | None:
        return self._order[0] * BATCH_WINDOW if self._order else None

    def _run(self) -> None:
        while True:
            with self._cond:
                while (due := self._next_due()) is None or due > time.monotonic():
                    self.caught_up.set()
                    timeout = None if due is None else due - time.monotonic()
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
                started = time.monotonic()
                late = started - due
                if late > BEHIND_AFTER:
                    self.caught_up.clear()
                else:
                    self.caught_up.set()
                horizon = int(started // BATCH_WINDOW) + 1
                groups: dict[int, tuple[RenewingClient, list[Lease]]] = {}
                while self._order and self._order[0] <= horizon:
                    for key, (redlock, leases) in self._slots.pop(
                        heapq.heappop(self._order)
                    ).items():
                        group = groups.get(key)
                        if group is None:
                            groups[key] = (redlock, leases)
                        else:
                            group[1].extend(leases)
            count = 0
            for redlock, leases in groups.values():
                for first in range(0, len(leases), ROUND_MAX):
                    part = leases[first : first + ROUND_MAX]
                    live = [lease for lease in part if not (lease.released or lease.lost)]
                    if not live:
                        continue
                    count += len(live)
                    try:
                        whens = redlock._renew(live)
                    except Exception:
                        redlock.leases.renewal_failed(live)
                        continue
                    self._schedule(redlock, live, whens)
            if count:
                self.rounds.append(RoundRecord(started, late, count, time.monotonic() - started))

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
