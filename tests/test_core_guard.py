"""The restart guard on real nodes: a node that restarted (lost its data or its run id changed)
within the last ``max_ttl`` does not vote, so a lock it held before the restart cannot be granted
twice; a brand-new cluster is usable at once. A node that lost its data without restarting
(FLUSHALL) is guarded like a restarted one (tests/test_core_regressions.py).

"A holds the lock on exactly 3 of 5 nodes" is arranged by having the other two nodes held by a
stale lease of some earlier client while A acquires (removed right after). Pausing them instead
does not work: the acquire command waits in the paused server's socket buffer and runs when the
server resumes, so A ends up on all five nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from django_redlock import LockNotOwned, QuorumError
from django_redlock.testing import RedisCluster, RedisNode
from tests.helpers import node_client, occupy, tokens_on_nodes, vacate, wait_until, warm_up


def _hold_on_first_three(cluster: RedisCluster, rl, name: str, ttl: float):
    for node in cluster.nodes[3:]:
        occupy(cluster[cluster.nodes.index(node)], name)
    lock = rl.lock(name, ttl=ttl)
    assert lock.acquire(blocking=False)
    for node in cluster.nodes[3:]:
        vacate(node, name)
    assert tokens_on_nodes(cluster, name) == [lock.token] * 3 + [None, None]
    return lock


@pytest.mark.faults
@pytest.mark.parametrize("guard", [True, False], ids=["guard-on", "guard-off"])
def test_node_restarted_empty_within_a_lease_cannot_grant_it_twice(
    guard: bool, redis_cluster_factory, make_redlock
) -> None:
    """A on exactly 3 of 5 nodes; one of them is killed and restarts empty at
    once. With the guard, B cannot take the lock while A's is valid (and takes it once A's
    lease is over). Without it, B gets the restarted node plus the two A never had: a
    quorum, while A still holds the lock: the double grant the guard exists for."""
    cluster = redis_cluster_factory(5)
    a_rl = make_redlock(cluster, max_ttl=3.0, ttl=2.5, node_timeout=0.05)
    b_rl = make_redlock(cluster, max_ttl=3.0, ttl=2.5, node_timeout=0.05, restart_guard=guard)
    warm_up(a_rl)
    warm_up(b_rl)
    a = _hold_on_first_three(cluster, a_rl, "guard:double", ttl=2.5)
    cluster[0].restart(empty=True)
    b = b_rl.lock("guard:double", ttl=2.5)
    if not guard:
        assert b.acquire(blocking=False) is True
        assert a.held and b.held  # two holders at once
        assert tokens_on_nodes(cluster, "guard:double") == [
            b.token,
            a.token,
            a.token,
            b.token,
            b.token,
        ]
        b.release()
        with pytest.raises(LockNotOwned):  # A's lock was taken from under it
            a.release()
        return
    # B keeps trying for as long as A's lock is valid, and is refused every time.
    attempts = 0
    while a.validity > 0.3:
        assert b.acquire(blocking=False) is False, "B got the lock while A's was still valid"
        assert a.held
        attempts += 1
    assert attempts >= 5
    assert tokens_on_nodes(cluster, "guard:double")[:3] == [None, a.token, a.token]
    # Once A's lease is over, B gets it from nodes 1-4 (node 0 is still in its guard period;
    # a node where A's key lingers a few ms longer may be left out).
    assert b.acquire(timeout=3) is True
    assert not a.held
    tokens = tokens_on_nodes(cluster, "guard:double")
    assert tokens[0] is None and tokens.count(b.token) >= 3, tokens
    b.release()


def test_brand_new_cluster_is_usable_at_once(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, max_ttl=60.0)
    lock = rl.lock("guard:fresh")
    t0 = time.monotonic()
    assert lock.acquire(blocking=False) is True  # every node without a marker: trusted
    assert time.monotonic() - t0 < 0.5
    lock.release()
    assert all(h.guarded_for == 0 for h in rl.health())


def test_a_brand_new_cluster_whose_node_answers_late_once_is_trusted(
    redis_cluster_factory, make_redlock
) -> None:
    """A busy host: one node's first reply comes after the node timeout (its command ran in
    time, the reply did not). No node could then vouch for the cluster being new, and the
    first lock was refused; the guard now waits a node timeout and asks again, as it does
    for a cluster another client is trusting."""
    from bench.lossy_proxy import LossyProxy

    cluster = redis_cluster_factory(3)
    with LossyProxy((cluster[2].host, cluster[2].port)) as late:
        rl = make_redlock([*cluster.urls[:2], late.url], node_timeout=0.05, max_ttl=60.0)
        assert rl.locked("guard:late-once") is False  # connected; no marker armed
        # The first round's reply comes 60 ms after it was asked, past the node timeout; the
        # link is quick again by the time the guard asks again.
        late.set_link(0.0, 0.03)
        quick = threading.Timer(0.05, late.set_link, (0.0, 0.0))
        quick.start()
        try:
            lock = rl.lock("guard:late-once")
            assert lock.acquire(blocking=False) is True
        finally:
            quick.cancel()
        lock.release()
        assert all(h.guarded_for == 0 for h in rl.health())


def test_brand_new_cluster_is_guarded_without_trust_fresh_cluster(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=0.5, max_ttl=2.0, trust_fresh_cluster=False)
    lock = rl.lock("guard:distrust")
    with pytest.raises(QuorumError, match="guarded"):
        lock.acquire(blocking=False)
    assert any(h.guarded_for for h in rl.health())
    # Usable once max_ttl has passed since the nodes started.
    assert lock.acquire(timeout=5) is True
    lock.release()


@pytest.mark.faults
@pytest.mark.parametrize("trust", [True, False], ids=["trust-fresh", "distrust-fresh"])
def test_whole_cluster_emptied_within_a_lease_looks_brand_new(
    trust: bool, redis_cluster_factory, make_redlock
) -> None:
    """The documented risk of trusting a brand-new cluster: when every node loses its data at
    once, within a lease, nothing distinguishes it from a new cluster. Trusted (the default)
    it grants the lock again at once; with trust_fresh_cluster=False it waits out max_ttl."""
    cluster = redis_cluster_factory(3)
    a_rl = make_redlock(cluster, ttl=2.0, max_ttl=2.0)
    b_rl = make_redlock(cluster, ttl=2.0, max_ttl=2.0, trust_fresh_cluster=trust)
    warm_up(a_rl)
    a = a_rl.lock("guard:all-lost")
    assert a.acquire(blocking=False)
    for node in cluster:
        node.restart(empty=True)
    b = b_rl.lock("guard:all-lost")
    if trust:
        assert b.acquire(blocking=False) is True and a.held
        b.release()
    else:
        with pytest.raises(QuorumError, match="guarded"):
            b.acquire(blocking=False)


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_running_client_s_first_acquire_after_every_node_was_flushed_is_granted(
    client: str, redis_cluster_factory, make_redlock, make_async_redlock
) -> None:
    """docs/guarantees.rst: every node losing its data at once looks like a brand-new cluster,
    trusted at once. A client that had locked before (its connections saw the old markers)
    sent its plain ``SET`` first, which landed everywhere; the guard's second look then had
    the nodes sit out, and the attempt was not undone: its next attempt (a new token) found
    its own first key "held", returned False, and the key refused everyone for a whole lease.
    """
    cluster = redis_cluster_factory(3)
    if client == "sync":
        rl = make_redlock(cluster, ttl=5.0)

        def attempt(name: str) -> bool:
            lock = rl.lock(name)
            got = lock.acquire(blocking=False)
            if got:
                lock.release()
            return got

    else:
        arl = make_async_redlock(cluster, ttl=5.0)

        async def attempt_async(name: str) -> bool:
            lock = arl.lock(name)
            got = await lock.acquire(blocking=False)
            if got:
                await lock.release()
            return got

        def attempt(name: str) -> bool:
            return asyncio.run(attempt_async(name))

    for i in range(3):
        assert attempt(f"flush:before:{i}")
    for node in cluster:
        with node_client(node) as redis_client:
            redis_client.flushall()
    assert attempt("flush:after")
    for node in cluster:
        with node_client(node) as redis_client:
            assert redis_client.keys("flush:*") == []  # nothing left behind


def _probed(rl, node) -> bool:
    """One acquire+release by ``rl``; True once ``node`` holds a restart-guard marker."""
    probe = rl.lock("guard:other")
    if probe.acquire(blocking=False):
        probe.release()
    with node_client(node) as client:
        return bool(client.exists("redlock:node"))


@pytest.mark.faults
def test_guard_period_is_not_shortened_by_a_client_with_a_smaller_max_ttl(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(5)
    long_rl = make_redlock(cluster, ttl=8.0, max_ttl=10.0, node_timeout=0.05)
    # B is another process in real life: its own client, so no reentrant hit on A's lease.
    b_rl = make_redlock(cluster, ttl=8.0, max_ttl=10.0, node_timeout=0.05)
    short_rl = make_redlock(cluster, ttl=0.4, max_ttl=0.5, node_timeout=0.05)
    warm_up(long_rl)
    warm_up(b_rl)
    warm_up(short_rl)
    a = _hold_on_first_three(cluster, long_rl, "guard:mixed", ttl=8.0)
    cluster[0].restart(empty=True)
    # A short-lease client reaches the restarted node first (any lock name will do). An
    # acquire ends once the others granted it, so it may take more than one to reach it.
    wait_until(lambda: _probed(short_rl, cluster[0]))
    # The short client's guard (0.5 s) has passed; the long client's own (10 s) has not.
    time.sleep(0.6)
    assert short_rl.health()[0].guarded_for == 0
    assert long_rl.health()[0].guarded_for > 8
    b = b_rl.lock("guard:mixed", ttl=8.0)
    granted = b.acquire(blocking=False)
    both = granted and a.held
    if granted:
        b.release()
    with contextlib.suppress(LockNotOwned):
        a.release()
    assert not both, "double grant: the guard for 10 s leases lasted 0.5 s"


@pytest.mark.faults
def test_refused_attempt_during_a_restart_guard_is_one_round_trip(
    redis_cluster_factory, make_redlock, node_calls
) -> None:
    cluster = redis_cluster_factory(3)
    a_rl = make_redlock(cluster, ttl=5.0, max_ttl=10.0, node_timeout=0.05)
    b_rl = make_redlock(cluster, ttl=5.0, max_ttl=10.0, node_timeout=0.05)
    warm_up(a_rl)
    warm_up(b_rl)
    a = a_rl.lock("guard:one-try")
    assert a.acquire(blocking=False)
    cluster[2].restart(empty=True)
    b = b_rl.lock("guard:one-try")
    assert b.acquire(blocking=False) is False  # load the scripts on the restarted node
    before = node_calls(cluster)
    t0 = time.monotonic()
    assert b.acquire(blocking=False) is False
    elapsed = time.monotonic() - t0
    after = node_calls(cluster)
    a.release()
    attempts = [
        sum(x.get(c, 0) - y.get(c, 0) for c in ("evalsha", "set"))
        for y, x in zip(before, after, strict=True)
    ]
    # blocking=False is one attempt: one acquire per node (the full script on the restarted
    # node, a plain SET on the two that voted before), no sleeping.
    assert attempts == [1, 1, 1] and elapsed < 0.05, (attempts, elapsed)


def test_a_servers_start_time_is_read_by_its_own_clock_not_by_when_the_reply_was_read() -> None:
    """INFO's uptime is counted from the server's clock at the moment it wrote INFO: a reply
    read seconds later (a busy client) gives the same start time, so servers started
    together still look together."""
    from django_redlock.core.nodes import server_of

    info = (
        b"# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\n"
        b"server_time_usec:1000000000000000\r\nuptime_in_seconds:10\r\n"
    )
    assert server_of(info) == ("abc", 1_000_000_000.0 - 10)
    # Without server_time_usec (older servers) the local clock stands in.
    old = b"redis_version:6.0.0\r\nrun_id:abc\r\nuptime_in_seconds:10\r\n"
    before = time.time()
    _, started = server_of(old)
    assert before - 10 <= started <= time.time() - 10


def test_a_refusal_that_hangs_on_a_late_answer_says_so() -> None:
    from django_redlock.core.guard import RestartGuard
    from django_redlock.core.nodes import TIMED_OUT

    fresh = [2, 60000, 1, 5, "marker"]
    why = RestartGuard(None).explain(fresh, [fresh, fresh, TIMED_OUT])  # type: ignore[arg-type]
    assert "did not answer in time" in why
    assert "not every node is new" not in why


def _start_seconds(nodes) -> list[int]:
    """Each server's start, in whole seconds of its own clock (what INFO says exactly)."""
    seconds = []
    for node in nodes:
        with node_client(node) as client:
            info = client.info("server")
        seconds.append(int(info["server_time_usec"]) // 1_000_000 - int(info["uptime_in_seconds"]))
    return seconds


def _spread_cluster(gap: float) -> tuple[list, float, float]:
    """Three brand-new servers, the last two started ``gap`` seconds after the first, which
    starts late in a wall-clock second (so whole-second uptimes put them a second further
    apart than they are). Returns the nodes and the bounds of the real spread."""
    nodes = [RedisNode(autostart=False) for _ in range(3)]
    wait_until(lambda: time.time() % 1 >= 0.8, timeout=2.0, interval=0.001)
    before_first = time.time()
    nodes[0].start()
    after_first = time.time()
    time.sleep(max(before_first + gap - time.time(), 0))  # the spread under test
    before_last = time.time()
    nodes[1].start()
    nodes[2].start()
    return nodes, before_last - after_first, time.time() - before_first


def test_servers_started_within_2s_are_a_brand_new_cluster(make_redlock) -> None:
    """FRESH_START_SPREAD is 2 s although INFO's uptime is in whole seconds: servers started
    1.2 s apart across two second boundaries are trusted at the first lock."""
    for _ in range(4):
        nodes, _, at_most = _spread_cluster(1.2)
        try:
            starts = _start_seconds(nodes)
            if at_most > 2.0 or max(starts) - min(starts) != 2:
                continue  # a slow start, or no second boundary crossed twice: try again
            rl = make_redlock([n.url for n in nodes], node_timeout=0.5)
            lock = rl.lock("first")
            assert lock.acquire(blocking=False)
            lock.release()
            return
        finally:
            for node in nodes:
                node.stop()
    pytest.skip("the machine never started the servers 1.2 s apart in time")


def test_servers_started_more_than_2s_apart_are_refused_truthfully(make_redlock) -> None:
    nodes, at_least, _ = _spread_cluster(3.2)
    try:
        assert at_least > 2.0
        rl = make_redlock([n.url for n in nodes], node_timeout=0.5)
        with pytest.raises(QuorumError, match=r"started more than 2s apart"):
            rl.lock("first").acquire(blocking=False)
    finally:
        for node in nodes:
            node.stop()
