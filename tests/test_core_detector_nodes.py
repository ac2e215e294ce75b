"""The failure detector on real nodes: a stalled client does not call live nodes down; a killed
or frozen node is found down on evidence, costs little, and votes again as soon as it answers."""

from __future__ import annotations

import re
import select
import threading
import time
import types
from typing import Any

from django_redlock import QuorumError
from django_redlock.core import fanout
from django_redlock.core.algorithm import Refusal
from django_redlock.core.detector import MIN_SPAN, MISSES_TO_DOWN
from django_redlock.core.nodes import BEHIND_LATE, TIMED_OUT, Failure
from tests.faults.proxy import Proxy
from tests.helpers import tokens_on_nodes, wait_until, warm_up

_CATASTROPHIC = re.compile(r"(a+)+$")


def _gil_stall_size(at_least: float) -> int:
    """A subject the regex engine needs ``at_least`` seconds on, with the GIL held the whole
    time (the engine never lets go of it): this process does not run its other threads."""
    size = 18
    while True:
        started = time.perf_counter()
        _CATASTROPHIC.match("a" * size + "b")
        if time.perf_counter() - started >= at_least:
            return size
        size += 1


def test_a_stalled_process_does_not_call_live_nodes_down(redis_cluster_factory, make_redlock):
    """A thread takes and releases locks (50 ms node timeout) while the main thread holds the
    GIL for 0.2 s at a time, again and again: its waits overrun by far, replies are read late
    and connections look overdue. Not one node counts as down, not one operation fails."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    size = _gil_stall_size(0.2)
    errors: list[BaseException] = []
    refused: list[str] = []
    done = threading.Event()
    slow_cycles = 0
    took: list[float] = []

    def cycles() -> None:
        nonlocal slow_cycles
        try:
            for i in range(2000):
                if slow_cycles >= 10:
                    break
                lock = rl.lock(f"stalled-{i % 7}", ttl=10)
                started = time.monotonic()
                if not lock.acquire(blocking=False):
                    refused.append(lock.name)
                    continue
                lock.release()
                took.append(time.monotonic() - started)
                if took[-1] > 0.15:
                    slow_cycles += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=cycles, name="cycles")
    worker.start()
    stalls = 0
    while not done.is_set():
        _CATASTROPHIC.match("a" * size + "b")  # the GIL held: no other thread runs
        stalls += 1
        done.wait(0.01)
    worker.join(30)
    assert not errors, errors
    assert not refused
    assert stalls >= 3 and slow_cycles >= 3, (
        stalls,
        slow_cycles,
        sorted(took)[-5:],
    )  # it did stall the cycles
    assert [node.detector.down for node in rl.nodes] == [False] * 3
    assert [node.unreachable() for node in rl.nodes] == [None] * 3


def test_a_killed_node_is_down_at_once_and_costs_at_most_one_node_timeout(
    redis_cluster_factory, make_redlock
):
    """A node killed (its port refuses): the connection error is evidence enough. The first
    operation after the kill costs at most one node timeout, the next ones nothing; when the
    node is started again it answers the next operation."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5)
    warm_up(rl)
    node = rl.nodes[2]
    cluster[2].kill()
    started = time.monotonic()
    lock = rl.lock("killed-first", ttl=30)
    assert lock.acquire(blocking=False)  # two of three
    assert time.monotonic() - started < 0.5 + 0.4
    lock.release()
    assert node.detector.down and "connection failed" in node.detector.reason
    started = time.monotonic()
    for i in range(20):
        lock = rl.lock(f"killed-{i}", ttl=30)
        assert lock.acquire(blocking=False)
        lock.release()
    assert time.monotonic() - started < 2.0  # twenty node timeouts would be 10 s
    cluster[2].start()
    assert rl.locked("after") is False  # reaches the node again
    assert not node.detector.down and node.unreachable() is None


def test_a_frozen_node_is_down_after_the_evidence_and_votes_again_once_it_answers(
    redis_cluster_factory, make_redlock
):
    """A node frozen (SIGSTOP: connections open, nothing answered). One late answer is not
    enough: it is found down after consecutive misses over at least ``MIN_SPAN``; from then on
    it costs nothing, the reconnector probes it, and once it runs again it votes at once."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.1)
    warm_up(rl)
    node = rl.nodes[2]
    with cluster[2].paused():
        assert rl.locked("probe") is False  # one miss
        assert node.detector.misses >= 1 and not node.detector.down
        first = time.monotonic()
        wait_until(lambda: rl.locked("probe") is False and node.detector.down, 10.0)
        assert time.monotonic() - first >= MIN_SPAN * 0.9
        assert "in a row" in node.detector.reason
        started = time.monotonic()
        for i in range(20):
            lock = rl.lock(f"frozen-{i}", ttl=30)
            assert lock.acquire(blocking=False)
            lock.release()
        assert time.monotonic() - started < 1.5  # twenty connect timeouts would be 2 s more
        failure = node.unreachable()
        assert failure is not None and "in a row" in str(failure)
    wait_until(lambda: node.unreachable() is None, 5.0)  # the probe reached it
    assert not node.detector.down
    lock = rl.lock("back", ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    wait_until(lambda: tokens_on_nodes(cluster, "back") == [token] * 3)
    lock.release()


def test_a_quorum_down_is_still_a_quorum_error(redis_cluster_factory, make_redlock):
    """The detector only decides whom to wait for: two of three nodes killed, an acquire
    still fails with the nodes named."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.1, retry_count=0)
    warm_up(rl)
    cluster[1].kill()
    cluster[2].kill()
    lock = rl.lock("no-quorum", ttl=30)
    try:
        acquired = lock.acquire(blocking=False)
    except QuorumError as exc:
        assert "refused" in str(exc) or "connection" in str(exc)
    else:
        raise AssertionError(f"acquired without a quorum: {acquired}")
    assert rl.nodes[1].detector.down and rl.nodes[2].detector.down


class _HostStall:
    """A deliberate stall hook in the sync fan-out's wait: once armed, the next wait freezes
    every node (SIGSTOP), lets its poll time out, then keeps this thread from running for
    ``seconds`` before it thaws the nodes and returns empty-handed: what a client sees when the
    whole host (a VM pause, a CPU-starved container) stopped, nodes included."""

    def __init__(self, cluster: Any, seconds: float) -> None:
        self.cluster = cluster
        self.seconds = seconds
        self.armed = False
        self.fired = 0

    def poll(self) -> Any:
        real = select.poll()
        hook = self

        class Poller:
            def register(self, fd: int, mask: int) -> None:
                real.register(fd, mask)

            def unregister(self, fd: int) -> None:
                real.unregister(fd)

            def poll(self, ms: float) -> list[tuple[int, int]]:
                if not hook.armed:
                    return real.poll(ms)
                hook.armed = False
                hook.fired += 1
                for node in hook.cluster:
                    node.pause()
                try:
                    real.poll(ms)
                    time.sleep(hook.seconds)
                finally:
                    for node in hook.cluster:
                        node.resume()
                return []

        return Poller()


def test_a_whole_host_stall_does_not_call_the_nodes_down(
    redis_cluster_factory, make_redlock, monkeypatch
):
    """The host stops (nodes and client) in the middle of a fan-out: the client's wait for
    its 50 ms comes back after 0.3 s with no reply, because the nodes did not run either.
    That time is not the nodes' silence: the wait is given back, the replies come, the lock
    is taken, and no node has even a miss."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    hook = _HostStall(cluster, 0.3)
    shim = types.SimpleNamespace(poll=hook.poll, POLLIN=select.POLLIN, POLLOUT=select.POLLOUT)
    monkeypatch.setattr(fanout, "select", shim)
    for i in range(3):
        hook.armed = True
        lock = rl.lock(f"host-stall-{i}", ttl=30)
        assert lock.acquire(blocking=False)
        assert hook.fired == i + 1
        lock.release()
    # (A reply genuinely late on this loaded machine may still count as one miss.)
    assert all(node.detector.misses < MISSES_TO_DOWN for node in rl.nodes)
    assert [node.detector.down for node in rl.nodes] == [False] * 3
    assert [node.unreachable() for node in rl.nodes] == [None] * 3


def test_one_late_answer_is_not_a_failed_node(redis_cluster_factory, make_redlock):
    """A node that answers one operation late (frozen for a moment longer than the node
    timeout) is not down: a miss is counted, the reconnector replaces the connection given
    up, and the node votes again as soon as that is done."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    node = rl.nodes[2]
    for _ in range(10):
        with cluster[2].paused():
            assert rl.locked("late") is False  # waits for every node: node 2 misses
        # A loaded host may stall this process through the pause: the miss is then excused
        # (the silence said nothing about the node), and the node is paused once more.
        if node.detector.misses:
            break
    assert node.detector.misses >= 1
    assert node.unreachable() is None and not node.detector.down
    wait_until(lambda: node.not_now() is None)  # reconnected in the background
    lock = rl.lock("next", ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    wait_until(lambda: tokens_on_nodes(cluster, "next") == [token] * 3)
    lock.release()
    assert rl.locked("next") is False  # waits for every node's answer
    assert node.detector.misses == 0  # an answer clears the misses


def test_a_late_reply_keeps_its_connection(redis_cluster_factory, make_redlock):
    """A lossy link: node 2's replies are held up past the node timeout (as TCP's
    retransmission of a lost packet holds them) while the node runs every command. The
    connection that missed its deadline is not closed: the next operations do not queue
    behind it, it is read as its reply comes, and then, owing nothing, it is pooled again
    (or closed, when the stand-in opened meanwhile gives the pool all it wants)."""
    cluster = redis_cluster_factory(3)
    proxy = Proxy((cluster[2].host, cluster[2].port))
    try:
        rl = make_redlock([*cluster.urls[:2], proxy.url], node_timeout=0.1)
        warm_up(rl)
        node = rl.nodes[2]
        assert rl.locked("late") is False  # waits for every node: one connection each
        wire = node._idle[-1]
        proxy.delay = 0.5
        assert rl.locked("late") is False  # node 2's reply misses the deadline
        assert wire not in node._idle and wire.due and wire.sock.fileno() >= 0
        proxy.delay = 0.0
        # Taking a lock meanwhile does not wait behind the late reply; another connection
        # to the node is opened in the background.
        lock = rl.lock("meanwhile", ttl=30)
        assert lock.acquire(blocking=False)
        lock.release()
        wait_until(lambda: any(other is not wire for other in node._idle), timeout=5.0)
        wait_until(lambda: rl.locked("late") is False and not wire.due, timeout=5.0)
        assert wire in node._idle or wire.node is None  # pooled, or closed once it was read
    finally:
        proxy.close()


def test_a_refusal_for_lateness_alone_is_retried_after_a_short_pause(redis_nodes, make_redlock):
    """An attempt refused only because replies were late (no node holds the lock for
    anyone else on enough nodes to keep a quorum away) is tried again within a node
    timeout, not after a retry delay: there is no split vote to break up."""
    rl = make_redlock(redis_nodes, node_timeout=0.05, retry_delay=0.4)
    handle = rl.lock("late")
    granted = [0, 0, 0, 0, 0, 0]
    held = [1, 9_000]
    late = rl.algorithm.refusal([granted, TIMED_OUT, held])  # one held copy: a quorum is still free
    assert late.late and late.retry_after is None
    contended = rl.algorithm.refusal([held, TIMED_OUT, held])
    assert not contended.late and contended.retry_after == 9.0
    assert not rl.algorithm.refusal([granted, held, held]).late  # nothing was late
    assert rl.algorithm.refusal(
        [granted, BEHIND_LATE, held]
    ).late  # its connections owed late replies
    assert not rl.algorithm.refusal([granted, Failure("refused", "x"), held]).late
    for _ in range(50):
        assert rl.algorithm.pause_for(handle, late, None, None, 0.0) <= 0.05
        assert rl.algorithm.pause_for(handle, Refusal({}, 3, None), None, None, 0.0) >= 0.2


def test_the_fan_out_measures_each_nodes_round_trips(redis_cluster_factory, make_redlock):
    """The round trips that time a hedged request's copies are measured on pooled
    connections: a node that answered on one has them, one never asked has none."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5)
    assert all(node.detector.quick is None for node in rl.nodes)
    warm_up(rl)
    for _ in range(3):
        assert rl.locked("measured") is False  # waits for every node's answer
    for node in rl.nodes:
        assert node.detector.quick is not None and 0 < node.detector.quick < 0.5
        assert node.detector.srtt is not None and node.detector.srtt >= node.detector.quick
