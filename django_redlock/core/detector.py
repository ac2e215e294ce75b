"""When a node counts as down: from evidence over time, never from one late reply.

This module holds the rules' settings and the pure helpers the transports share; the rules
themselves are applied by :class:`.nodes.NodeDetector` (one per node: what this process has
seen of it) and the fan-out's :class:`.fanout.Wait` (one per operation: time in which this
process did not run), which live beside the code that calls them on every reply. No I/O, no
clock of its own (every time is handed in, on the caller's monotonic clock), no threads.

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
- A miss while this process was stalled (:class:`.fanout.Wait` saw its own wait overrun by far:
  the process did not run) is excused: it says nothing about the node.
- A down node is not waited for; the reconnector probes it in the background and it votes
  again as soon as it answers (:meth:`.nodes.NodeDetector.answered`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = [
    "CONNECT_AT_LEAST",
    "MAX_STALLS",
    "MIN_SPAN",
    "MISSES_TO_DOWN",
    "QUICK_GAIN",
    "REPLY_BUDGET_CAP",
    "RTTVAR_KEEP",
    "RTT_GAIN",
    "SRTT_GAIN",
    "STALL_SLACK",
    "PauseLog",
    "connect_budget",
    "far_rto",
    "overrun",
    "reply_budget",
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
#: the reply budget (``node_timeout``) does not have to cover. The connection is opened in
#: the background: an operation waits this long for it only while too few other nodes can
#: decide it; one that is really silent costs the attempt this much (a miss), not the caller.
CONNECT_AT_LEAST = 1.0


#: How far :attr:`.nodes.NodeDetector.quick` follows a round trip longer than it.
QUICK_GAIN = 0.02

#: The gains of the smoothed round trip and of its mean deviation (RFC 6298's, as TCP's).
#: The deviation is kept four times over (``rttvar4``, the timeout's term ``K * RTTVAR``):
#: with a gain of a quarter, the new deviation goes into it whole, beside
#: :data:`RTTVAR_KEEP` of the old (the fan-out's hot path counts on that quarter).
SRTT_GAIN = 0.125
RTT_GAIN = 0.25
RTTVAR_KEEP = 1 - RTT_GAIN

#: The most an operation's reply budget follows the nodes' round trips to (seconds): on a
#: busy host (replies 100-300 ms late at the 99th percentile beside CPU burners and 32
#: locking threads) a quorum answers within it, and a lease of the default 30 s loses at most
#: this much of its validity to the wait.
REPLY_BUDGET_CAP = 0.5


def reply_budget(node_timeout: float, rtos: Iterable[float], quorum: int) -> float:
    """How long an operation waits for the nodes' replies: ``node_timeout``, or longer while
    the round trips of a quorum of them run longer (``rtos``: the ``rto`` of each node that
    may answer, a node found down left out: its smoothed round trip and four deviations,
    after RFC 6298, backed off by its late replies, as :func:`far_rto` counts it), at most
    :data:`REPLY_BUDGET_CAP`. It is the quorum-th smallest: one slow or silent node among
    quicker ones does not stretch the wait, and a quorum that answers ends it early anyway;
    what a longer budget costs is a later verdict when too few nodes answer at all."""
    ordered = sorted(rtos)
    if len(ordered) < quorum:
        return node_timeout  # no quorum can answer: nothing to wait longer for
    slow = ordered[quorum - 1]
    if slow <= node_timeout:
        return node_timeout
    return slow if slow < REPLY_BUDGET_CAP else max(REPLY_BUDGET_CAP, node_timeout)


def far_rto(rto: float, srtt: float | None, node_timeout: float) -> float:
    """A node's ``rto`` as the waits count it: once past ``node_timeout`` (a far node, or one
    backed off), at least ``node_timeout`` beyond its smoothed round trip ``srtt``, as Linux's
    TCP keeps its minimum timeout beyond it. A near node's reply may be late by nearly the
    node timeout (a busy host's scheduling, at either end) and still count; with RFC 6298's
    four deviations alone, a far node whose round trips barely vary got a few milliseconds,
    and beside CPU burners the far reply a quorum needed missed that now and then."""
    if rto <= node_timeout or srtt is None:
        return rto
    floor = srtt + node_timeout
    return rto if rto > floor else floor


def connect_budget(node_timeout: float) -> float:
    """How long setting up a connection may take: its own budget, not the node's silence
    (the reply budget starts once the command is out)."""
    return node_timeout if node_timeout > CONNECT_AT_LEAST else CONNECT_AT_LEAST


def overrun(asked: float, waited: float) -> float:
    """Time in which this process did not run, as seen by a wait for ``asked`` seconds that
    took ``waited``: the excess beyond :data:`STALL_SLACK` (0 when there is none)."""
    excess = waited - asked - STALL_SLACK
    return excess if excess > 0.0 else 0.0


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
