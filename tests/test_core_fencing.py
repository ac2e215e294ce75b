"""Fencing tokens (``fencing=True``) on real nodes: strictly increasing per name, across
clients and processes, after nodes restarted empty, at the cost of one extra round trip."""

from __future__ import annotations

import itertools
import multiprocessing
import time

import pytest

from django_redlock import QuorumError
from django_redlock.testing import RedisCluster
from tests.helpers import node_client, occupy, wait_until, warm_up

CTX = multiprocessing.get_context("fork")


def _fence_counters(nodes, name: str) -> list[int | None]:
    out = []
    for node in nodes:
        with node_client(node) as c:
            raw = c.get(f"redlock:fence:{name}")
            out.append(int(raw) if raw is not None else None)
    return out


def test_fences_strictly_increase_over_50_acquisitions(
    redis_nodes: RedisCluster, make_redlock, event_log
) -> None:
    clients = [make_redlock(redis_nodes), make_redlock(redis_nodes)]
    log = event_log(clients[0])
    fences = []
    for i in range(50):
        lock = clients[i % 2].lock("fence:seq", fencing=True)
        assert lock.acquire(blocking=False)
        assert isinstance(lock.fence, int) and lock.fence > 0
        fences.append(lock.fence)
        info = clients[0].lock_info("fence:seq")
        assert info.fence == lock.fence  # written back into the lock's hash on the nodes
        # The agreed fence was written back to a quorum's counters before acquire returned;
        # it is sent to every node, and the third gets it as it reaches it, unless it already
        # proposed a higher one (first use: each node starts its counter from its own clock,
        # and a node that answered after the quorum may be a millisecond ahead). A write-back
        # never lowers a counter, so the next fence is above both.
        assert _fence_counters(redis_nodes, "fence:seq").count(lock.fence) >= 2
        wait_until(
            lambda: min(_fence_counters(redis_nodes, "fence:seq")) >= lock.fence  # noqa: B023
        )
        lock.release()
    assert all(b > a for a, b in itertools.pairwise(fences)), fences
    assert [e.fence for e in log.of("acquired", "fence:seq")] == fences[0::2]
    # A lock taken without fencing has none, and does not move the counter.
    plain = clients[0].lock("fence:seq")
    assert plain.acquire(blocking=False) and plain.fence is None
    plain.release()
    assert _fence_counters(redis_nodes, "fence:seq") == [fences[-1]] * 3


def _fenced_worker(urls, count, results) -> None:
    from django_redlock import Redlock

    rl = Redlock(urls, ttl=5.0)
    records = []
    try:
        for _ in range(count):
            lock = rl.lock("fence:procs", fencing=True)
            assert lock.acquire(timeout=20)
            records.append((time.monotonic(), lock.fence))  # taken while holding the lock
            lock.release()
    finally:
        results.put(records)


def test_fences_from_concurrent_processes_follow_acquisition_order(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    warm_up(make_redlock(redis_nodes))
    results = CTX.Queue()
    workers = [
        CTX.Process(target=_fenced_worker, args=(list(redis_nodes.urls), 25, results))
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    records = [r for _ in workers for r in results.get(timeout=60)]
    for w in workers:
        w.join(10)
    assert len(records) == 100
    # Hold periods do not overlap (mutual exclusion), so the timestamps taken while holding
    # order the acquisitions; the fences must follow that order strictly.
    in_order = [fence for _, fence in sorted(records)]
    assert all(b > a for a, b in itertools.pairwise(in_order)), in_order


def test_fences_keep_increasing_after_a_majority_restarted_empty(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=0.5, max_ttl=1.0, restart_guard=True)
    warm_up(rl)
    fences = []
    for _ in range(5):
        lock = rl.lock("fence:restart", fencing=True)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    # Two of three nodes lose their counters. The third is taken by someone else for the
    # next acquire, so the fence can only come from the two restarted nodes' counters.
    cluster[0].restart(empty=True)
    cluster[2].restart(empty=True)
    occupy(cluster[1], "fence:restart", token="someone-else")
    lock = rl.lock("fence:restart", fencing=True)
    with pytest.raises(QuorumError, match="guarded"):  # guarded for max_ttl after their start
        lock.acquire(blocking=False)
    assert lock.acquire(timeout=5)  # granted by nodes 0 and 2 once their guard passed
    fences.append(lock.fence)
    lock.release()
    with node_client(cluster[1]) as c:
        c.delete("redlock:lock:fence:restart")
    for _ in range(3):
        lock = rl.lock("fence:restart", fencing=True)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    assert all(b > a for a, b in itertools.pairwise(fences)), fences


def test_fencing_costs_one_extra_round_trip(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    rl = make_redlock(redis_nodes)
    warm_up(rl)
    for fencing in (False, True):  # load the scripts, so no NOSCRIPT retry is counted
        lock = rl.lock("fence:cost", fencing=fencing)
        assert lock.acquire(blocking=False)
        lock.release()

    def calls_per_node(fencing: bool, command: str) -> list[int]:
        before = node_calls(redis_nodes)
        lock = rl.lock("fence:cost", fencing=fencing)
        assert lock.acquire(blocking=False)
        after = node_calls(redis_nodes)
        lock.release()
        return [a.get(command, 0) - b.get(command, 0) for b, a in zip(before, after, strict=True)]

    # Without fencing, an uncontended acquire on nodes that voted before is a plain SET.
    assert calls_per_node(fencing=False, command="evalsha") == [0, 0, 0]
    assert calls_per_node(fencing=False, command="set") == [1, 1, 1]
    assert calls_per_node(fencing=True, command="evalsha") == [2, 2, 2]  # ACQUIRE, FENCE_SYNC


def test_lock_info_shows_the_holders_fence_while_a_slower_node_shows_its_own(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """An acquire returns once a quorum has the fence it took; a slower node may still carry
    the fence it proposed (higher: it ran later) until the write-back reaches it. The listing
    shows the fence a quorum agrees on, the one the holder got."""
    rl = make_redlock(redis_nodes)
    lock = rl.lock("fence-shown", fencing=True)
    assert lock.acquire(blocking=False)
    slow = node_client(redis_nodes[2])
    key = "redlock:lock:fence-shown"
    token, fence, rest = slow.get(key).split(b" ", 2)
    assert int(fence) == lock.fence
    slow.set(key, b" ".join([token, str(lock.fence + 1000).encode(), rest]), keepttl=True)
    info = rl.lock_info("fence-shown")
    assert info is not None and info.fence == lock.fence
    assert sorted(s.fence for s in info.per_node) == [lock.fence, lock.fence, lock.fence + 1000]
    lock.release()
