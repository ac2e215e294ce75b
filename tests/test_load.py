"""Dependable on a busy host and a lossy link: small runs of ``bench/load.py``'s scenarios.

Each scenario test runs the bench's own code (real ``redis-server`` nodes, real CPU burners,
real SIGSTOP, a real lossy proxy) at a size that fits in about a minute, and asserts what the
README promises while a quorum of nodes is up and reachable: no spurious error (no
``QuorumError``, no refused acquire of a free key), no lost lock, and no two holders of one key
at once. The numbers of the same scenarios at full size are in docs/operating.rst, "Under load
and on lossy links".

The proxy tests check the packet-loss model itself (``bench/lossy_proxy.py``).

Run them with ``pytest -m load``; they are also ``slow``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import redis

from bench import load
from bench.lossy_proxy import RTO_MIN, LossyProxy, ProxyProcess, check_link, late_by
from django_redlock import AsyncRedlock, Redlock
from django_redlock.testing import RedisCluster


def dependable(row: load.Row) -> None:
    """No spurious error, no lost lock, no overlap: with the first message of each error."""
    assert row.spurious == 0, f"{row.spurious} spurious errors: {row.detail}; {row.errors}"
    assert row.lost == 0, f"{row.lost} locks lost: {row.detail}"
    assert row.overlaps in (None, 0), f"{row.overlaps} overlapping holds: {row.detail}"


def only(rows: list[load.Row]) -> load.Row:
    assert len(rows) == 1, rows
    return rows[0]


# -- the scenarios -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.load
def test_uncontended_cycles_under_cpu_burners_never_fail():
    """a: 10,000 acquire+release cycles of a free key on 3 nodes, 2 x cores burners beside."""
    row = only(load.scenario_a(cycles=10_000, baseline_cycles=0, node_counts=(3,)))
    assert row.condition == "burners"
    dependable(row)
    assert row.rate is not None and row.rate > 0


@pytest.mark.slow
@pytest.mark.load
def test_a_thousand_renewed_locks_survive_a_loaded_host():
    """c: 1,000 auto-renewed locks (ttl 5-6 s) held 15 s in one process under burners: the
    watchdog keeps every one, and every release is clean."""
    row = only(load.scenario_c(1_000, 15.0, burners_only=True))
    assert not row.extra["causes"], row.errors
    dependable(row)
    assert row.extra["held"] == 1_000, row.detail
    assert row.extra["release_errors"] == 0


@pytest.mark.slow
@pytest.mark.load
def test_renewed_locks_outlive_busy_caller_threads_beside_burners():
    """c with 2,000 renewed locks held 15 s under burners while eight threads take and
    release other locks as fast as they can: the watchdog is one thread among nine, yet it
    is not starved (new acquires wait while it runs behind), so no lock is lost; a loss
    would name its cause. The watchdog never started a round more than a third of a lease
    late."""
    row = only(load.scenario_c(2_000, 15.0, burners_only=True, callers=8))
    assert not row.extra["causes"], row.errors
    dependable(row)
    assert row.extra["held"] == 2_000, row.detail
    assert row.extra["release_errors"] == 0
    assert row.extra["caller_ops"] > 0, "the busy threads took no lock"
    assert row.extra["renewal"]["late"][2] < load.RENEWED_TTL[0] / 3, row.detail


@pytest.mark.slow
@pytest.mark.load
def test_renewed_locks_outlive_one_paused_node_and_release_cleanly():
    """d: one of three nodes SIGSTOPped 20 s while 2,000 renewed locks are held: two nodes are
    a quorum, so none is lost; after the resume every lock releases without LockNotOwned or
    LockLost; a probe taking another key meanwhile never gets a QuorumError."""
    row = only(load.scenario_d(2_000, 20.0, baseline=False))
    assert row.condition == "node paused 20 s"
    dependable(row)
    assert row.extra["held"] == 2_000, row.detail
    assert row.extra["release_errors"] == 0
    assert row.extra["probe_ops"] > 0, "the probe took no lock while the node was paused"


@pytest.mark.slow
@pytest.mark.load
def test_fifteen_percent_packet_loss_costs_time_not_correctness():
    """e: 15 % emulated loss on every node for 10 s, four threads on two keys: late replies
    are not a quorum failure, no lock is lost, and holders never overlap."""
    row = only(load.scenario_e(10.0, levels=(0.15,)))
    assert row.extra["chunks_lost"] > 0, "the proxy injected no loss"
    assert row.n > 0, f"no lock was taken in 10 s: {row.detail}"
    dependable(row)


@pytest.mark.load
def test_at_fifteen_percent_loss_most_cycles_do_not_wait_for_a_retransmission():
    """Through 15 % loss about 28 % of round trips to a node pay TCP's 200 ms retransmission,
    so most acquire+release cycles on 3 nodes have a late node where the quorum needs it.
    Without copies of the command on a second connection, the median cycle waited for the
    node timeout (50 ms): 150 cycles took 9.9-12.5 s with a median of 51 ms (quiet
    machine), 14.7 s beside two CPU burners. With them the late node is asked again on
    another connection after a few of its round trips: 3.4-5.1 s with a median of 7-15 ms
    (quiet), 7.9 s with a median of 24 ms beside two burners."""
    cycles = 150
    with (
        RedisCluster(3) as cluster,
        ProxyProcess([(n.host, n.port) for n in cluster], seed=5) as proxy,
    ):
        rl = Redlock(proxy.urls, key_prefix="hedge")
        try:
            # Each connection's first use on a clean link: the nodes' markers are set.
            load.sync_cycles(rl, "warm", 20, load.Tally())
            proxy.set_link(0.15, 0.0)
            before = proxy.stats()
            times = []
            started = time.monotonic()
            for i in range(cycles):
                lock = rl.lock(f"k{i}", ttl=10)
                t0 = time.monotonic()
                assert lock.acquire(blocking=True, timeout=10), f"cycle {i} gave up"
                lock.release()
                times.append(time.monotonic() - t0)
            elapsed = time.monotonic() - started
            assert proxy.stats().lost - before.lost > 50, "the proxy injected too little loss"
        finally:
            rl.close()
        no_copies_left(cluster, "hedge:lock:k*")
    few_waited_for_a_retransmission(times, elapsed)


@pytest.mark.load
def test_at_fifteen_percent_loss_a_release_leaves_the_key_on_no_node():
    """A release that returned at a quorum left the key, on about one release in seven at
    15 % loss, on the third node, whose delete was behind a lost packet: the key stayed there
    for the retransmission (200 ms or more), so the next acquire of the name needed both
    other nodes in time, and two such leftovers of successive holds refused it outright. On
    a lossy link a release now waits for every node that did not miss lately (copies go out
    while it waits): measured, 33 of 217 releases left the key somewhere before, 4 of 518
    after (four threads on two keys, load average 22-34)."""
    cycles = 120
    with (
        RedisCluster(3) as cluster,
        ProxyProcess([(n.host, n.port) for n in cluster], seed=3) as proxy,
    ):
        rl = Redlock(proxy.urls, key_prefix="left")
        clients = cluster.clients()
        try:
            load.sync_cycles(rl, "warm", 20, load.Tally())
            proxy.set_link(0.15, 0.0)
            before = proxy.stats()
            left = 0
            for i in range(cycles):
                lock = rl.lock("k", ttl=10)
                assert lock.acquire(blocking=True, timeout=10), f"cycle {i} gave up"
                token = lock.token
                lock.release()
                # Straight to the nodes, around the proxy: is our lease's key still there?
                held = [c.get("left:lock:k") for c in clients]
                left += any(v is not None and v.split(b" ", 1)[0].decode() == token for v in held)
            assert proxy.stats().lost - before.lost > 50, "the proxy injected too little loss"
        finally:
            rl.close()
        no_copies_left(cluster, "left:lock:k*")
    assert left <= cycles // 15, f"{left} of {cycles} releases left the key on a node"


@pytest.mark.load
def test_at_fifteen_percent_loss_threads_sharing_a_client_do_not_wait_for_retransmissions():
    """Two threads of one client, each cycling on keys of its own through 15 % loss: their
    fan-outs used to meet in shared rounds, which send no copies, so a late node cost a
    command the node timeout whenever the other thread was on the wire too. On a lossy link
    each fan-out now goes alone, with its copies."""
    cycles = 80
    with (
        RedisCluster(3) as cluster,
        ProxyProcess([(n.host, n.port) for n in cluster], seed=9) as proxy,
    ):
        rl = Redlock(proxy.urls, key_prefix="pair")
        times: list[float] = []
        failures: list[str] = []

        def cycle(me: int) -> None:
            for i in range(cycles):
                lock = rl.lock(f"k{me}-{i}", ttl=10)
                t0 = time.monotonic()
                if not lock.acquire(blocking=True, timeout=10):
                    failures.append(f"thread {me} cycle {i} gave up")
                    return
                lock.release()
                times.append(time.monotonic() - t0)

        try:
            load.sync_cycles(rl, "warm", 20, load.Tally())
            proxy.set_link(0.15, 0.0)
            before = proxy.stats()
            started = time.monotonic()
            threads = [threading.Thread(target=cycle, args=(me,)) for me in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - started
            assert proxy.stats().lost - before.lost > 50, "the proxy injected too little loss"
        finally:
            rl.close()
        no_copies_left(cluster, "pair:lock:k*")
    assert not failures, failures
    few_waited_for_a_retransmission(times, elapsed)


def no_copies_left(cluster: RedisCluster, pattern: str) -> None:
    """Every copy of every acquire was ended by its release: once the late packets are in
    (a retransmission backs off to 1.4 s at most three losses in a row), no key is left on
    any node."""
    left: list[bytes] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [k for c in cluster.clients() for k in c.keys(pattern)]
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"{len(left)} lock copies left behind: {left[:5]}"


def few_waited_for_a_retransmission(times: list[float], elapsed: float) -> None:
    median = sorted(times)[len(times) // 2]
    assert median < 0.035, f"median cycle {median * 1000:.1f} ms (the node timeout is 50 ms)"
    assert elapsed < 10.0, f"{len(times)} cycles took {elapsed:.1f} s"


@pytest.mark.load
def test_asyncio_at_fifteen_percent_loss_most_cycles_do_not_wait_for_a_retransmission():
    """The same through the asyncio client: a node late to answer is asked again on another
    connection after a few of its round trips, and the late connection is kept, read as its
    reply comes. Without copies the median cycle waited for the node timeout (50 ms)."""
    cycles = 150

    async def run(urls: list[str]) -> tuple[list[float], float]:
        rl = AsyncRedlock(urls, key_prefix="ahedge")
        try:
            for i in range(20):  # each connection's first use on a clean link
                lock = rl.lock(f"warm{i}", ttl=10)
                assert await lock.acquire(blocking=True, timeout=10)
                await lock.release()
            proxy.set_link(0.15, 0.0)
            times = []
            started = time.monotonic()
            for i in range(cycles):
                lock = rl.lock(f"k{i}", ttl=10)
                t0 = time.monotonic()
                assert await lock.acquire(blocking=True, timeout=10), f"cycle {i} gave up"
                await lock.release()
                times.append(time.monotonic() - t0)
            return times, time.monotonic() - started
        finally:
            await rl.aclose()

    with (
        RedisCluster(3) as cluster,
        ProxyProcess([(n.host, n.port) for n in cluster], seed=5) as proxy,
    ):
        before = proxy.stats()
        times, elapsed = asyncio.run(run(proxy.urls))
        assert proxy.stats().lost - before.lost > 50, "the proxy injected too little loss"
        no_copies_left(cluster, "ahedge:lock:k*")
    few_waited_for_a_retransmission(times, elapsed)


# -- the instrument ----------------------------------------------------------------------------


@pytest.mark.load
def test_overlaps_are_holds_of_one_key_that_begin_before_the_last_one_ended():
    hold = load.Hold
    in_turn = [hold("k", 0.0, 1.0, 1.1), hold("k", 1.0, 2.0, 2.1), hold("k", 2.5, 3.0, 3.0)]
    assert load.count_overlaps(in_turn) == 0
    assert load.count_overlaps([*in_turn, hold("k", 0.5, 0.6, 0.7)]) == 1
    # A short hold inside a long one, then one after the short one but inside the long one.
    nested = [hold("k", 0.0, 10.0, 10.0), hold("k", 1.0, 2.0, 2.0), hold("k", 3.0, 4.0, 4.0)]
    assert load.count_overlaps(nested) == 2
    assert load.count_overlaps([hold("a", 0.0, 5.0, 5.0), hold("b", 1.0, 2.0, 2.0)]) == 0


@pytest.mark.load
def test_the_harness_counts_each_lock_taken_away_as_lost_once(redis_cluster_factory):
    """The ``lost`` column is not blind: five of forty renewed locks force-released by an
    operator while held are counted, each once, and the other 35 release cleanly."""
    cluster = redis_cluster_factory(3)
    operator = load.Redlock(cluster.urls, key_prefix="taken")

    removed = []

    def take_five():
        removed.extend(operator.force_release(f"r:{i}") for i in range(5))

    try:
        tally, info = load.renewed_hold(
            cluster.urls, 40, 3.0, burners=False, prefix="taken", during=take_five
        )
    finally:
        operator.close()
    assert info["held"] == 40
    assert len(removed) == 5 and min(removed) >= 2, removed  # each was on a quorum
    assert sum(tally.lost.values()) == 5, tally.lost
    assert sum(tally.spurious.values()) == 0, tally.first


# -- the loss model ----------------------------------------------------------------------------


class Draws(random.Random):
    """A Random whose ``random()`` answers from a fixed list."""

    # random.Random's constructor seeds from its argument, which a list cannot be.
    def __new__(cls, values: list[float]) -> Draws:
        return super().__new__(cls, 0)

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


@pytest.mark.load
def test_a_lost_chunk_waits_one_rto_and_each_repeated_loss_doubles_it():
    assert late_by(Draws([0.5]), 0.15) == (0.0, 0)
    assert late_by(Draws([0.1, 0.5]), 0.15) == (RTO_MIN, 1)
    extra, lost = late_by(Draws([0.1, 0.1, 0.1, 0.9]), 0.15)
    assert lost == 3
    assert extra == pytest.approx(RTO_MIN * (1 + 2 + 4))


@pytest.mark.load
@pytest.mark.parametrize(
    ("loss", "delay", "error"),
    [
        (1.0, 0.0, ValueError),
        (-0.1, 0.0, ValueError),
        (0.1, -1.0, ValueError),
        ("0.1", 0, TypeError),
    ],
)
def test_a_link_setting_out_of_range_is_refused(loss, delay, error):
    with pytest.raises(error, match="loss" if loss != 0.1 else "delay"):
        check_link(loss, delay)


@pytest.mark.load
def test_the_lossy_proxy_delivers_every_byte_in_order_some_late_by_an_rto(redis_node):
    """Through 30 % loss every command still gets its own reply (nothing dropped, nothing
    reordered), and the losses show as round trips of at least one RTO."""
    with LossyProxy((redis_node.host, redis_node.port), loss=0.3, seed=11) as proxy:
        client = redis.Redis.from_url(proxy.url, socket_timeout=60, socket_connect_timeout=10)
        try:
            slow = 0
            for i in range(15):
                started = time.monotonic()
                assert client.set(f"k{i}", "v" * i)
                assert client.get(f"k{i}") == b"v" * i
                slow += time.monotonic() - started >= RTO_MIN
        finally:
            client.close()
        assert proxy.stats.lost > 0
        assert slow > 0
