"""When a late node gets a copy of the command, and which reply is its answer (pure rules
shared by the sync and asyncio transports: ``core/hedging.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from django_redlock.core.hedging import (
    HEDGE_AFTER,
    HEDGE_TRIPS,
    LOSSY_FOR,
    MAX_COPIES,
    copies_allowed,
    first_word,
    heard_out,
    hedge_at,
    lossy,
)
from tests.helpers import warm_up

NOTHING_LEFT = object()


@dataclass
class Detector:
    quick: float | None = None
    misses: int = 0


@dataclass
class Node:
    late_at: float = float("-inf")
    detector: Detector = field(default_factory=Detector)


def test_no_copies_while_no_node_was_late_recently():
    nodes = [Node(), Node(late_at=100.0 - LOSSY_FOR - 0.1)]
    assert hedge_at(nodes, 100.0, 100.0, 0.05) is None


def test_copies_go_out_after_a_few_of_the_slowest_nodes_unhindered_round_trips():
    lossy = [Node(late_at=99.0), Node()]
    assert hedge_at(lossy, 100.0, 100.0, 0.05) == 100.0 + HEDGE_AFTER
    lossy[1].detector.quick = 0.003
    assert hedge_at(lossy, 100.0, 100.0, 0.05) == 100.0 + 0.003 * HEDGE_TRIPS
    # Slow round trips (a busy host) send the copies at a quarter of the node timeout.
    lossy[1].detector.quick = 0.005
    assert hedge_at(lossy, 100.0, 100.0, 0.05) == 100.0 + 0.05 / 4
    # A node timeout that leaves no time for a copy sends none.
    assert hedge_at(lossy, 100.0, 100.0, HEDGE_AFTER * 4 - 0.001) is None


def test_a_link_is_lossy_while_a_node_answered_later_than_the_node_timeout_lately():
    assert not lossy([Node(), Node()], 100.0)
    assert lossy([Node(), Node(late_at=100.0 - LOSSY_FOR + 0.1)], 100.0)
    assert not lossy([Node(), Node(late_at=100.0 - LOSSY_FOR - 0.1)], 100.0)


def test_a_lossy_release_waits_for_every_node_but_one_that_missed_lately():
    out = object()
    nodes = [Node(), Node(), Node()]
    # A quorum removed the key; the third node's delete may be behind a lost packet.
    assert not heard_out(nodes, [1, 1, out], out)
    assert heard_out(nodes, [1, 1, 0], out)
    assert heard_out(nodes, [1, 1, ConnectionError("refused")], out)
    # A node that missed its last answer (down, frozen) is not waited for again.
    nodes[2].detector.misses = 1
    assert heard_out(nodes, [1, 1, out], out)


def word(reply, **kw):
    args = {"answered": False, "prior": None, "idempotent": False, "other_out": False}
    return first_word(reply, nothing_left=NOTHING_LEFT, **{**args, **kw})


def test_the_first_reply_is_the_nodes_answer_but_a_grant_counts_from_any_copy():
    assert word([0, 1]) == [0, 1]
    assert word([1, 5], answered=True, prior=[0, 1]) is None
    assert word([0, 1], answered=True, prior=[1, 5]) == [0, 1]
    assert word(1, answered=True, prior=0, idempotent=True) is None


def test_a_release_copys_nothing_to_do_while_the_first_is_out_is_not_evidence_of_a_loss():
    assert word(0, idempotent=True, other_out=True) is NOTHING_LEFT
    assert word(0, idempotent=True) == 0
    assert word(1, idempotent=True, other_out=True) == 1


class Pool:
    """A node whose pool gives the owing connection back (``Node.reclaim``)."""

    def __init__(self) -> None:
        self.later: list[bytes] = []
        self.pooled: list[object] = []

    def reclaim(self, wire: object) -> bool:
        return True

    def checkin(self, wire: object) -> None:
        self.pooled.append(wire)


class Wire:
    """A connection that keeps what was written on it, and the replies it owes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.due: list[object] = []

    def write(self, data: bytes) -> None:
        self.sent.append(bytes(data))


def test_a_release_behind_an_acquire_whose_copy_is_out_reads_nothing_to_do_as_no_loss():
    # The copy is ended too: whoever reads its reply sends the undo behind it, which may
    # reach the node before the release does. The release then finds nothing there, which
    # must not count as a key that was not ours (two such nodes made a false LockNotOwned).
    from django_redlock.core.fanout import FanOut, _reclaim
    from django_redlock.core.nodes import NOTHING_LEFT as LEFT
    from django_redlock.core.nodes import Due, settled

    first, copy = Due(b"acquire", lambda: b"undo", 0.0), Due(b"acquire", lambda: b"undo", 0.0)
    first.twins = [copy]
    release = FanOut(3, lambda node, wire: b"release", idempotent=True)
    assert _reclaim(Pool(), (object(), first), release, 1)  # type: ignore[arg-type]
    assert copy.unwanted and not first.unwanted
    assert settled(0, 1, release.cut, release.undone) is LEFT
    assert (
        settled(0, 0, release.cut, release.undone) == 0
    )  # no copy was out there: the key was not ours
    assert settled(1, 1, release.cut, release.undone) == 1

    # A command that does not end the acquire (not idempotent) leaves its copies alone.
    other = FanOut(3, lambda node, wire: b"acquire")
    second = Due(b"acquire", lambda: b"undo", 0.0)
    first.twins = [second]
    assert _reclaim(Pool(), (object(), first), other, 1)  # type: ignore[arg-type]
    assert not second.unwanted and settled(0, 1, other.cut, other.undone) == 0


def test_a_release_goes_behind_each_copy_of_the_acquire_still_out_on_an_idle_connection():
    # Not left to whoever reads the copy's reply next: a copy that landed late on a
    # connection nobody took would keep the key set until its lease ran out.
    from django_redlock.core.fanout import FanOut, _reclaim
    from django_redlock.core.nodes import Due

    first, copy = Due(b"acquire", lambda: b"undo", 0.0), Due(b"acquire", lambda: b"undo", 0.0)
    copy.wire = Wire()
    first.twins = [copy]
    release = FanOut(3, lambda node, wire: b"release", idempotent=True)
    node = Pool()
    assert _reclaim(node, (Wire(), first), release, 2)  # type: ignore[arg-type]
    assert copy.wire.sent == [b"release"] and not copy.unwanted
    (owed,) = copy.wire.due
    assert owed.left and node.pooled == [copy.wire]  # read by the connection's next user


async def _release_held_back(urls: list[str], link: Any) -> None:
    """The async twin of the sync test's steps (see below)."""
    from django_redlock import AsyncRedlock

    arl = AsyncRedlock(urls, node_timeout=0.2)
    try:
        for i in range(21):
            warm = arl.lock(f"warm-{i}")
            assert await warm.acquire(blocking=False)
            await warm.release()
            await arl.locked(f"warm-{i}")
            if i == 0:
                link.hold(b"lossy-now", 1, 0.5)
                await arl.locked("lossy-now")
        lock = arl.lock("held-back")
        assert await lock.acquire(blocking=False)
        link.hold(lock.token.encode(), 3, 2.0)
        await lock.release()
    finally:
        await arl.close()


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_release_gets_past_three_connections_whose_copies_are_all_lost(
    client, redis_cluster_factory, make_redlock
):
    # At 15 % loss about 28 % of round trips are late, and a lossy release waits for every
    # node: with copies on three connections at most, a node whose three were all late (one
    # release in eight) cost the release the whole node timeout, the key staying there for
    # the retransmission. A delete's copies now go out on more connections.
    from bench.lossy_proxy import LossyProxy
    from tests.helpers import tokens_on_nodes

    assert copies_allowed(True) > 3 and copies_allowed(False) == MAX_COPIES
    cluster = redis_cluster_factory(3)
    with LossyProxy((cluster[2].host, cluster[2].port)) as link:
        urls = [*cluster.urls[:2], link.url]
        if client == "async":
            asyncio.run(_release_held_back(urls, link))
            assert tokens_on_nodes(cluster, "held-back") == [None, None, None]
            return
        rl = make_redlock(urls, node_timeout=0.2)
        warm_up(rl)
        # A reply later than the node timeout: the link counts as lossy (copies go out).
        link.hold(b"lossy-now", 1, 0.5)
        rl.locked("lossy-now")
        # The node answers in time again (it is waited for), with spare connections idle.
        for i in range(20):
            warm_up(rl, f"warm-{i}")
        lock = rl.lock("held-back")
        assert lock.acquire(blocking=False)
        # The release and its first two copies are lost on the third node's link.
        link.hold(lock.token.encode(), 3, 2.0)
        lock.release()
        assert tokens_on_nodes(cluster, "held-back") == [None, None, None]
