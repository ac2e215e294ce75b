"""When a node counts as down: from evidence over time, never from one late reply.

Pure: no I/O, no clock of its own (every time is handed in, on the caller's monotonic clock),
no threads. The transports (:mod:`.nodes`, :mod:`.fanout`, :mod:`.aionodes`) report what they
see; this module decides.

Why not "one answer later than ``node_timeout`` is a failed node": on a busy host the client
itself (GC, a busy core, a throttled container, the GIL held by another thread) or the nodes on
the same host run late, and on a lossy link TCP resends a lost packet after 200 ms at the
earliest. Each would be an outage report for a node that is fine. The small per-node timeout
of the Redlock spec exists so that a dead node does not block the caller; with a concurrent
fan-out that stops at quorum, a slow node already does not.

The rules:

- A node is **down** on a connection error (refused, reset: the node itself said no), or after
  :data:`MISSES_TO_DOWN` consecutive misses (no answer within the budget) that are spread over
  at least :data:`MIN_SPAN` seconds (a burst of misses from one bad moment is one piece of
  evidence, not several). Any answer clears the misses.
- A miss while this process was stalled (:class:`Wait` saw its own wait overrun by far: the
  process did not run) is excused: it says nothing about the node.
- A down node is not waited for; the reconnector probes it in the background and it votes
  again as soon as it answers (:meth:`NodeDetector.answered`).
- The budget a node gets may grow with its observed round trips (a distant node, a lossy
  link), never beyond the cap the caller hands in (what the lease's validity allows), and never
  below ``node_timeout``.
"""

from __future__ import annotations

from collections import deque

__all__ = [
    "CONNECT_AT_LEAST",
    "MAX_STALLS",
    "MIN_SPAN",
    "MISSES_TO_DOWN",
    "STALL_SLACK",
    "NodeDetector",
    "PauseLog",
    "Wait",
    "connect_budget",
    "overrun",
    "why_lost",
]

#: Consecutive misses that make a node down (with :data:`MIN_SPAN` between the first and the
#: last). Three: one late reply is noise, two may be one bad second of a loaded host.
MISSES_TO_DOWN = 3

#: Shortest time (seconds) the misses that make a node down must be spread over. A node that
#: is really silent costs each operation at most one budget (its connection attempt) until
#: then, and nothing after.
MIN_SPAN = 0.5

#: How much longer than asked a wait may take before the excess counts as time in which this
#: process did not run (the scheduler's and the GIL's ordinary lateness is below it).
STALL_SLACK = 0.005

#: How many times a :class:`Wait` pushes its deadline out for time the process did not run:
#: a process that stalls over and over still ends its wait.
MAX_STALLS = 3

#: Shortest time (seconds) allowed for setting up a connection (TCP, TLS, AUTH, INFO): a
#: fresh connection on a busy host needs the node's process to run for its handshake, which
#: the reply budget (``node_timeout``) does not have to cover. A node that is really silent
#: costs an operation that must connect to it this much, until it is found down.
CONNECT_AT_LEAST = 1.0

# Round-trip smoothing (RFC 6298's gains) and how many deviations the budget allows.
_ALPHA = 0.125
_BETA = 0.25
_DEVIATIONS = 4.0
#: How far :attr:`NodeDetector.quick` follows a round trip longer than it (see there).
_QUICK_GAIN = 0.02


def connect_budget(node_timeout: float) -> float:
    """How long setting up a connection may take: its own budget, not the node's silence
    (the reply budget starts once the command is out)."""
    return node_timeout if node_timeout > CONNECT_AT_LEAST else CONNECT_AT_LEAST


def overrun(asked: float, waited: float) -> float:
    """Time in which this process did not run, as seen by a wait for ``asked`` seconds that
    took ``waited``: the excess beyond :data:`STALL_SLACK` (0 when there is none)."""
    excess = waited - asked - STALL_SLACK
    return excess if excess > 0.0 else 0.0


class Wait:
    """One operation's wait for the nodes' replies, on a clock that stops while this process
    does not run: ``remaining(now)`` before each wait; a wait that overran is given back (the
    deadline moves out by the whole wait), at most :data:`MAX_STALLS` times and ``cap``
    seconds in all (if given: what the lease's validity allows; an acquire's validity is
    counted from its start, so a longer wait only leaves it less).
    :attr:`stalled` is the time given back. :attr:`excused` tells whether a node that did
    not answer had less than its budget of time in which this process ran since the last
    stall: its miss then says nothing about it (:meth:`NodeDetector.missed`)."""

    __slots__ = ("asked", "budget", "clean", "credit", "deadline", "last", "stalled", "stalls")

    def __init__(self, budget: float, now: float, cap: float | None = None) -> None:
        self.budget = budget
        #: Time waited since the last stall, without one.
        self.clean = 0.0
        self.deadline = now + budget
        self.last = now
        self.asked = 0.0
        #: Seconds given back, and how many stalls they came from.
        self.stalled = 0.0
        self.stalls = 0
        self.credit = float("inf") if cap is None else cap

    @property
    def excused(self) -> bool:
        """Whether the nodes not heard from had less than their budget since the last stall
        (never, when there was no stall)."""
        return self.stalls > 0 and self.clean < self.budget

    def remaining(self, now: float) -> float:
        """Seconds left to wait (0 once the deadline passed); the next wait is expected to
        return within them. A wait that overran is taken as not having happened at all: the
        nodes on a host where this process did not run may not have run either, so they get
        the time that was left before it again."""
        waited = now - self.last
        if overrun(self.asked, waited) and self.credit > 0.0 and self.stalls < MAX_STALLS:
            given = waited if waited < self.credit else self.credit
            self.credit -= given
            self.deadline += given
            self.stalled += given
            self.stalls += 1
            self.clean = 0.0
        elif waited > 0.0:
            self.clean += waited
        left = self.deadline - now
        if left < 0.0:
            left = 0.0
        self.last = now
        self.asked = left
        return left


class NodeDetector:
    """What one process knows about one node's health: its misses, whether it is down and
    why, and its round trips. Not locked: every update is a few attribute writes, and a lost
    update between threads only delays a verdict by one observation."""

    __slots__ = (
        "down_since",
        "first_miss",
        "heard_at",
        "min_span",
        "missed_since",
        "misses",
        "misses_to_down",
        "node_timeout",
        "quick",
        "reason",
        "rttvar",
        "srtt",
    )

    def __init__(
        self,
        node_timeout: float,
        *,
        misses_to_down: int = MISSES_TO_DOWN,
        min_span: float = MIN_SPAN,
    ) -> None:
        if misses_to_down < 1:
            raise ValueError(f"misses_to_down must be at least 1, got {misses_to_down!r}")
        if min_span < 0:
            raise ValueError(f"min_span must not be negative, got {min_span!r}")
        self.node_timeout = node_timeout
        self.misses_to_down = misses_to_down
        self.min_span = min_span
        #: Consecutive misses not excused, and when the first of them was.
        self.misses = 0
        self.first_miss = 0.0
        #: When the node was found down, or None while it is up.
        self.down_since: float | None = None
        #: Why it is down ("" while up).
        self.reason = ""
        #: Smoothed round trip and its mean deviation (seconds); None before the first one.
        self.srtt: float | None = None
        self.rttvar = 0.0
        #: The node's round trip when nothing holds it up (seconds; None before the first):
        #: it follows a shorter one at once and a longer one by :data:`_QUICK_GAIN` of the
        #: difference, so a reply late by a retransmission barely moves it (the smoothed
        #: round trip takes an eighth of it, and its deviation a quarter).
        self.quick: float | None = None
        #: When the newest command the node answered (on any connection) was sent; -inf
        #: before the first answer that says.
        self.heard_at = float("-inf")
        #: When the first of the misses went out (its command or connection attempt).
        self.missed_since = 0.0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def answered(self, now: float, rtt: float | None = None, sent: float | None = None) -> bool:
        """The node answered (a reply, a probe's connection): its misses are forgotten and,
        if it was down, it votes again. ``rtt``: the round trip of the reply, for the budget;
        ``sent``: when the command it answered was sent (see :meth:`heard_since`): a reply
        to a command sent before the misses began (read late) clears nothing. Returns
        whether it was down."""
        if sent is not None:
            if sent > self.heard_at:
                self.heard_at = sent
            if self.down_since is not None and sent < self.down_since:
                return False
            if self.misses and sent < self.missed_since:
                return False
        if rtt is not None and rtt >= 0.0:
            quick = self.quick
            self.quick = (
                rtt if quick is None or rtt < quick else quick + _QUICK_GAIN * (rtt - quick)
            )
            srtt = self.srtt
            if srtt is None:
                self.srtt = rtt
                self.rttvar = rtt / 2
            else:
                self.rttvar += _BETA * (abs(srtt - rtt) - self.rttvar)
                self.srtt = srtt + _ALPHA * (rtt - srtt)
        self.misses = 0
        if self.down_since is None:
            return False
        self.down_since = None
        self.reason = ""
        return True

    def heard_since(self, when: float) -> bool:
        """Whether the node answered a command (on any connection) sent at or after ``when``:
        it ran what reached it after that moment, so it is not frozen or gone."""
        return self.heard_at >= when

    def missed(self, now: float, *, excused: bool = False, since: float | None = None) -> bool:
        """The node did not answer within its budget (a reply, or a connection attempt).
        ``excused``: this process was stalled meanwhile, so the silence says nothing about the
        node. ``since``: when the unanswered command went out; a node that answered a command
        sent on another connection after that is not silent (one reply held up on a lossy link
        is late, not lost), so the miss says nothing about it either. Returns True when this
        miss made the node down."""
        if excused or self.down_since is not None:
            return False
        if since is not None and self.heard_since(since):
            return False
        if not self.misses:
            self.first_miss = now
            self.missed_since = now if since is None else since
        self.misses += 1
        if self.misses >= self.misses_to_down and now - self.first_miss >= self.min_span:
            self.down_since = now
            self.reason = (
                f"no answer {self.misses} times in a row over {now - self.first_miss:.1f} s"
            )
            return True
        return False

    def refused(self, now: float, detail: str) -> bool:
        """A connection to the node failed outright (refused, reset): the node is down at
        once. Returns True when it was up."""
        self.misses = 0
        if self.down_since is not None:
            return False
        self.down_since = now
        self.reason = f"connection failed: {detail}" if detail else "connection failed"
        return True

    def budget(self, cap: float) -> float:
        """How long to wait for this node's reply: ``node_timeout``, or more for a node whose
        round trips are longer (smoothed round trip plus four deviations), at most ``cap``
        (what the lease's validity allows; never less than ``node_timeout``)."""
        timeout = self.node_timeout
        srtt = self.srtt
        if srtt is None:
            return timeout
        wanted = srtt + _DEVIATIONS * self.rttvar
        if wanted <= timeout:
            return timeout
        return wanted if wanted < cap else max(cap, timeout)

    def reset(self) -> None:
        """Forget everything (a forked child starts over with the node)."""
        self.misses = 0
        self.first_miss = 0.0
        self.down_since = None
        self.reason = ""
        self.srtt = None
        self.rttvar = 0.0
        self.quick = None
        self.heard_at = float("-inf")
        self.missed_since = 0.0


class PauseLog:
    """When this process did not run: the stalls a thread of it saw (a wait that came back far
    later than asked), the last :attr:`KEEP` of them. Read to say why a lease ran out."""

    KEEP = 64

    __slots__ = ("_stalls",)

    def __init__(self) -> None:
        #: ``(when it ended, how long it was)``, oldest first.
        self._stalls: deque[tuple[float, float]] = deque(maxlen=self.KEEP)

    def note(self, asked: float, waited: float, now: float) -> float:
        """A wait for ``asked`` seconds that ended at ``now`` after ``waited``: records the
        stall in it, if any, and returns its length (0 when there was none)."""
        stall = overrun(asked, waited)
        if stall:
            self._stalls.append((now, stall))
        return stall

    def since(self, start: float) -> float:
        """The longest stall that ended after ``start``."""
        return max((length for end, length in self._stalls if end > start), default=0.0)

    def clear(self) -> None:
        self._stalls.clear()


def why_lost(
    *, refused: str | None, paused: float, late: float, ttl: float, took: float | None = None
) -> str:
    """Why an auto-renewed lease ran out before the watchdog renewed it, in the words an
    operator acts on: the nodes refused (the last renewal was answered by too few nodes:
    ``refused`` says how), the process was paused (it did not run for ``paused`` seconds, a
    third of the lease or more: a SIGSTOP, a VM or container freeze, a long GC), or renewal
    fell behind (the watchdog reached the lease ``late`` seconds after it was due, and its
    round then took ``took`` seconds, when known: too much renewal work for this process,
    or a CPU too busy to run it or the nodes)."""
    if refused:
        return f"the nodes refused: {refused}"
    if paused >= ttl / 3:
        return (
            f"the process was paused: it did not run for {paused:.1f} s of a {ttl:g} s lease "
            "(a frozen process, VM or container, or a long GC)"
        )
    round_took = "" if took is None else f", and its round took {took:.1f} s"
    return (
        f"renewal fell behind: the watchdog reached it {late:.1f} s after it was due"
        f"{round_took} ({ttl:g} s lease, renewed every {ttl / 3:.1f} s)"
    )
