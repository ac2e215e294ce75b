"""``locked()`` and ``lock_info()`` beside a node that sits out its restart guard, on real nodes.

A node that restarted empty (or any node in its restart guard) may have lost the lock's key:
its "not held" is no evidence that the lock is free, exactly as a silent node's answer is
none. ``locked()`` answers True when a quorum holds the name, False when enough voting nodes
rule that out, and otherwise raises QuorumError naming the guarded node; the acquire path
refuses the same state for the same reason.

"Node 2 did not get the lock" is arranged two ways: node 2 down during the acquire and started
again afterwards (a new server process: guarded too), or node 2 held by a stale lease of an
earlier client during the acquire (removed right after: node 2 votes, without the key).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from django_redlock import QuorumError
from django_redlock.testing import RedisCluster
from tests.helpers import node_client, occupy, tokens_on_nodes, vacate, warm_up

#: The lease and guard of these tests: far longer than any of them runs on a busy host, so
#: every node restarted in a test is still in its guard when the test asks.
TTL = 60.0


def _held_on_first_two(cluster: RedisCluster, rl, name: str, *, node_2_down: bool):
    """A lock on nodes 0 and 1 only; node 2 either down during the acquire (then started
    again, empty: a new server process) or held by a stale lease then (then vacated)."""
    if node_2_down:
        cluster[2].kill()
    else:
        occupy(cluster[2], name, ms=int(TTL * 1000))
    lock = rl.lock(name, ttl=TTL)
    assert lock.acquire(blocking=False)
    if node_2_down:
        cluster[2].start()
    else:
        vacate(cluster[2], name)
    assert tokens_on_nodes(cluster.nodes[:2], name) == [lock.token] * 2
    return lock


def _flush(node) -> None:
    with node_client(node) as c:
        c.flushall()


def _node_0_emptied_beside_a_lock(
    cluster: RedisCluster, make_redlock, *, node_2_down: bool, restart: bool
):
    """A lock on nodes 0+1 (:func:`_held_on_first_two`), then node 0 restarted empty (or
    flushed): the holder's lock, and a client made afterwards."""
    holder = make_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
    warm_up(holder)
    lock = _held_on_first_two(cluster, holder, "job", node_2_down=node_2_down)
    if restart:
        cluster[0].restart(empty=True)
    else:
        _flush(cluster[0])
    return lock, make_redlock(cluster, max_ttl=TTL, node_timeout=0.2)


def test_locked_beside_a_flushed_node_is_not_false(redis_cluster_factory, make_redlock) -> None:
    """Held on nodes 0+1, node 2 votes without it, node 0 loses its data: node 1's copy and
    node 2's "not held" cannot tell whether a quorum holds it; node 0 sits out."""
    cluster = redis_cluster_factory(3)
    lock, viewer = _node_0_emptied_beside_a_lock(
        cluster, make_redlock, node_2_down=False, restart=False
    )
    with pytest.raises(QuorumError, match="could not tell whether it is held") as caught:
        viewer.locked("job")
    assert list(caught.value.failures) == [viewer.nodes[0].name]
    assert _sits_out(caught.value, viewer.nodes[0])
    assert lock.validity > 0


def _sits_out(error: QuorumError, node) -> bool:
    return "sits out its restart guard" in error.failures.get(node.name, "")


@pytest.mark.faults
@pytest.mark.parametrize("node_2_down", [True, False], ids=["node-2-was-down", "node-2-votes"])
@pytest.mark.parametrize("frozen", [False, True], ids=["node-1-up", "node-1-frozen"])
def test_locked_counts_no_key_on_a_node_restarted_empty_as_no_answer(
    node_2_down: bool, frozen: bool, redis_cluster_factory, make_redlock
) -> None:
    """Held on nodes 0+1; node 0 restarts empty. Node 0's (and a restarted node 2's) "not
    held" cannot rule out that a quorum holds the lock: locked() raises QuorumError naming
    them, never False, for the holder's client and a fresh one alike."""
    cluster = redis_cluster_factory(3)
    lock, viewer = _node_0_emptied_beside_a_lock(
        cluster, make_redlock, node_2_down=node_2_down, restart=True
    )
    with cluster[1].paused() if frozen else contextlib.nullcontext():
        for client in (lock.redlock, viewer):
            with pytest.raises(QuorumError, match="could not tell whether it is held") as caught:
                client.locked("job")
            assert _sits_out(caught.value, client.nodes[0]), caught.value.failures
            assert _sits_out(caught.value, client.nodes[2]) is node_2_down, caught.value.failures
            assert (client.nodes[1].name in caught.value.failures) is frozen
        assert lock.validity > 0


@pytest.mark.faults
@pytest.mark.parametrize("frozen", [False, True], ids=["node-1-up", "node-1-frozen"])
def test_async_locked_counts_no_key_on_a_node_restarted_empty_as_no_answer(
    frozen: bool, redis_cluster_factory, make_redlock, make_async_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    lock, sync_client = _node_0_emptied_beside_a_lock(
        cluster, make_redlock, node_2_down=True, restart=True
    )

    async def ask() -> QuorumError:
        viewer = make_async_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
        try:
            with pytest.raises(QuorumError, match="could not tell whether it is held") as caught:
                await viewer.locked("job")
            return caught.value
        finally:
            await viewer.close()

    with cluster[1].paused() if frozen else contextlib.nullcontext():
        error = asyncio.run(ask())
    assert _sits_out(error, sync_client.nodes[0]) and _sits_out(error, sync_client.nodes[2])
    assert (sync_client.nodes[1].name in error.failures) is frozen
    assert lock.validity > 0


def test_locked_beside_a_guarded_node_answers_what_the_voting_nodes_can_tell(
    redis_cluster_factory, make_redlock, make_async_redlock
) -> None:
    """Node 0 lost its data (FLUSHALL: guarded as a node restarted empty is): a name a quorum
    still holds is locked (True); a name two voting nodes do not hold is free (False): a
    guarded node's "not held" only matters where the others cannot settle it."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
    warm_up(rl)
    everywhere = rl.lock("everywhere", ttl=TTL)
    assert everywhere.acquire(blocking=False)
    assert rl.locked("everywhere")  # every node answered: none is still taking it
    _flush(cluster[0])
    viewer = make_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
    assert viewer.locked("everywhere") is True
    assert viewer.locked("nobody") is False

    async def ask() -> tuple[bool, bool]:
        client = make_async_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
        try:
            return await client.locked("everywhere"), await client.locked("nobody")
        finally:
            await client.close()

    assert asyncio.run(ask()) == (True, False)


def test_locked_on_a_brand_new_cluster_is_false(redis_cluster_factory, make_redlock) -> None:
    """No node has a marker yet (none ever voted): nothing can be held, as the acquire that
    trusts such a cluster at once also says."""
    cluster = redis_cluster_factory(3)
    assert make_redlock(cluster, max_ttl=TTL).locked("never") is False


def test_lock_info_counts_a_guarded_node_without_the_key_as_unknown(
    redis_cluster_factory, make_redlock, make_async_redlock
) -> None:
    """Held on nodes 0+1, node 2 votes without it, node 0 loses its data: the one copy left
    is not shown as a split leftover about to be free: node 0 is listed as guarded, and the
    lock's time left is node 1's."""
    cluster = redis_cluster_factory(3)
    lock, viewer = _node_0_emptied_beside_a_lock(
        cluster, make_redlock, node_2_down=False, restart=False
    )
    info = viewer.lock_info("job")
    assert info is not None and info.token == lock.token
    assert info.nodes == 1 and info.guarded == (viewer.nodes[0].name,)
    assert not info.split and "split" not in info.stuck_reasons(None)
    assert TTL - 30 < info.ttl <= TTL
    [listed] = [i for i in viewer.live_locks() if i.name == "job"]
    assert listed.guarded == info.guarded

    async def ask():
        client = make_async_redlock(cluster, max_ttl=TTL, node_timeout=0.2)
        try:
            return await client.lock_info("job")
        finally:
            await client.close()

    async_info = asyncio.run(ask())
    assert async_info is not None and async_info.guarded == info.guarded
    assert not async_info.split


def test_lock_info_with_every_node_voting_shows_no_guarded_node(
    redis_cluster_factory, make_redlock
) -> None:
    """A copy left on one node of three that all vote (the others answered "not held"): a
    split leftover, as before."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, max_ttl=TTL)
    warm_up(rl)
    occupy(cluster[1], "leftover", ms=int(TTL * 1000))
    info = rl.lock_info("leftover")
    assert info is not None and info.guarded == () and info.split and info.ttl == 0.0
