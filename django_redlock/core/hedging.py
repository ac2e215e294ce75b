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
    "first_word",
    "granted",
    "hedge_at",
]

#: The shortest wait before a copy of a command goes out on a second connection to a node
#: that has not answered (seconds): well above a loopback or LAN round trip, far below TCP's
#: 200 ms retransmission timeout, which is what a lost packet costs the first connection.
HEDGE_AFTER = 0.002

#: How many of the slowest node's unhindered round trips pass before the copies go out.
HEDGE_TRIPS = 3

#: How many connections to one node may carry copies of one command (the first included).
MAX_COPIES = 3

#: How long a node counts as behind a lossy link after a reply of it came later than the node
#: timeout (seconds): commands late to be answered then get copies. A busy host alone makes
#: replies slow, not that late: no copies.
LOSSY_FOR = 10.0


class _Detector(Protocol):
    @property
    def quick(self) -> float | None: ...


class _Node(Protocol):
    @property
    def late_at(self) -> float: ...
    @property
    def detector(self) -> _Detector: ...


def hedge_at(nodes: Sequence[_Node], now: float, start: float, timeout: float) -> float | None:
    """When a node that has not answered a command sent at ``start`` gets a copy on another
    connection, while some node's replies come late enough to be lost packets (within
    :data:`LOSSY_FOR` of ``now``, one came later than the node timeout: ``late_at``; None
    otherwise): after :data:`HEDGE_AFTER`, or :data:`HEDGE_TRIPS` of the slowest node's
    unhindered round trips (``detector.quick``: the round trips late by a retransmission,
    which the copies are for, do not count), and never later than a quarter of the node
    timeout (a copy sent later could hardly beat it). None when that leaves no time."""
    # A loop, not any() over a generator: this runs on every hedged fan-out.
    since = now - LOSSY_FOR
    for node in nodes:
        if node.late_at > since:
            break
    else:
        return None
    after = HEDGE_AFTER
    for node in nodes:
        quick = node.detector.quick
        if quick is not None and quick * HEDGE_TRIPS > after:
            after = quick * HEDGE_TRIPS
    if after > timeout / 4:
        return None
    return start + after


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
