"""Hedged requests: when a node late to answer gets a copy of the command on another
connection, and how the copies' replies make the node's one answer.

Pure: no I/O, no clock of its own (every time is handed in, on the caller's monotonic clock).
Both transports (the sync :mod:`.fanout` and the asyncio :mod:`.aionodes`) send the copies;
this module decides when, and what their replies say.

Why copies: on a lossy link a lost packet delays a reply by TCP's retransmission (200 ms or
more), far beyond the node timeout, while a copy on a second connection usually crosses the
link in one round trip. A copy is safe only for a command the node may run twice: a
token-checked delete (a release, an undo), or the acquire script, which takes our own token
as our grant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "HEDGE_AFTER",
    "HEDGE_TRIPS",
    "LOSSY_FOR",
    "MAX_COPIES",
    "MAX_DELETE_COPIES",
    "copies_allowed",
    "first_word",
    "granted",
    "heard_out",
    "hedge_at",
    "lossy",
]

#: The shortest wait before a copy of a command goes out on a second connection to a node
#: that has not answered (seconds): well above a loopback or LAN round trip, far below TCP's
#: 200 ms retransmission timeout, which is what a lost packet costs the first connection.
HEDGE_AFTER = 0.002

#: How many of the slowest node's unhindered round trips pass before the copies go out.
HEDGE_TRIPS = 3

#: How many connections to one node may carry copies of one acquire (the first included).
MAX_COPIES = 3

#: How many connections to one node may carry copies of a token-checked delete (a release,
#: an undo; the first included). More than an acquire's: a release waits for every node
#: (:func:`heard_out`), so a node whose copies were all late cost the release the whole
#: node timeout; with about 28 % of round trips late at 15 % loss, that was one release in
#: eight with three connections. A late copy of a delete finds nothing left to do, where a
#: late copy of an acquire sets the key again until its reply is read.
MAX_DELETE_COPIES = 5

#: How long a node counts as behind a lossy link after a reply of it came later than the node
#: timeout (seconds): commands late to be answered then get copies. A busy host alone makes
#: replies slow, not that late: no copies.
LOSSY_FOR = 10.0


class _Late(Protocol):
    @property
    def late_at(self) -> float: ...


class _Detector(Protocol):
    @property
    def quick(self) -> float | None: ...
    @property
    def misses(self) -> int: ...


class _Node(Protocol):
    @property
    def late_at(self) -> float: ...
    @property
    def detector(self) -> _Detector: ...


def lossy(nodes: Sequence[_Late], now: float) -> bool:
    """Whether some node answered later than the node timeout lately (within
    :data:`LOSSY_FOR` of ``now``: a lost packet's retransmission), the state in which
    commands get copies."""
    # A loop, not any() over a generator: this runs on every fan-out of a shared round.
    since = now - LOSSY_FOR
    for node in nodes:
        if node.late_at > since:
            break
    else:
        return False
    return True


def hedge_at(nodes: Sequence[_Node], now: float, start: float, timeout: float) -> float | None:
    """When a node that has not answered a command sent at ``start`` gets a copy on another
    connection, while some node's replies come late enough to be lost packets (within
    :data:`LOSSY_FOR` of ``now``, one came later than the node timeout: ``late_at``; None
    otherwise): after :data:`HEDGE_AFTER`, or :data:`HEDGE_TRIPS` of the slowest node's
    unhindered round trips (``detector.quick``: the round trips late by a retransmission,
    which the copies are for, do not count), and never later than a quarter of the node
    timeout. None when even :data:`HEDGE_AFTER` is later than that (a node timeout under
    8 ms leaves a copy no time).

    Capped, not called off: on a busy host the round trips run to several milliseconds, and
    a copy then sent at a quarter of the node timeout still beats a retransmission (200 ms)
    by far; without it every late node cost its command the whole node timeout."""
    cap = timeout / 4
    if cap < HEDGE_AFTER or not lossy(nodes, now):
        return None
    after = HEDGE_AFTER
    for node in nodes:
        quick = node.detector.quick
        if quick is not None and quick * HEDGE_TRIPS > after:
            after = quick * HEDGE_TRIPS
    return start + (after if after < cap else cap)


def heard_out(nodes: Sequence[_Node], replies: Sequence[Any], out: Any) -> bool:
    """Whether a release on a lossy link may stop waiting: every node answered (a reply, or
    a failure), except a node whose last answer was already missed (``detector.misses``).
    ``out`` is the reply of a node still owing one.

    Why not stop at a quorum there: a node whose delete is behind a lost packet keeps the key
    for the retransmission (200 ms or more), and the next acquire then needs every other node
    in time; two such leftovers of successive holds refuse it outright. The wait costs the
    release a copy's round trip (copies go out while it waits), rarely the node timeout.
    A node that missed is not waited for again: one really down or frozen costs one node
    timeout once, not one per release. Asked only while copies go out (:func:`hedge_at`)."""
    for node, reply in zip(nodes, replies, strict=True):
        if reply is out and not node.detector.misses:
            return False
    return True


def copies_allowed(idempotent: bool) -> int:
    """How many connections to one node may carry copies of a command (the first included):
    :data:`MAX_DELETE_COPIES` for one the node may run twice (``idempotent``), else
    :data:`MAX_COPIES`."""
    return MAX_DELETE_COPIES if idempotent else MAX_COPIES


def granted(reply: Any) -> bool:
    """Whether an acquire script's reply grants the lock to our token."""
    return reply.__class__ is list and bool(reply) and reply[0] == 0


def first_word(
    reply: Any, *, answered: bool, prior: Any, idempotent: bool, other_out: bool, nothing_left: Any
) -> Any:
    """A node's answer from the reply of one copy of a hedged command, or None when it does
    not change it. ``answered``: another copy's reply already gave the node's answer
    (``prior``); ``other_out``: another copy is still out to the node. The first reply wins,
    except that a grant of our token counts from whichever copy it came (both carried the
    same token, and the lease's validity runs from the first send). A token-checked delete's
    "nothing to do" while another copy is still out is ``nothing_left``: that one may have
    deleted the key first."""
    if answered:
        if not idempotent and granted(reply) and not granted(prior):
            return reply
        return None
    if idempotent and reply == 0 and other_out:
        return nothing_left
    return reply
