"""Waiting without polling, on real nodes: a blocked acquire is woken by the holder's release
(pub/sub) or at the end of the holder's lease (the PTTL the nodes reported), and the threads of
one process queue locally so only one of them contends with the nodes.

Network traffic is counted on the nodes themselves (``INFO commandstats``), never through the
code under test.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time

import pytest

from django_redlock.testing import RedisCluster
from tests.helpers import release_listeners, tokens_on_nodes, wait_until, warm_up

CTX = multiprocessing.get_context("fork")


def _subscribers(nodes: RedisCluster, channel: str) -> list[int]:
    return [release_listeners(node, channel) for node in nodes]


def _scripts(calls: dict[str, int]) -> int:
    return calls.get("evalsha", 0) + calls.get("eval", 0)


def _waiter(urls, name, results) -> None:
    from django_redlock import Redlock

    rl = Redlock(urls, ttl=10.0)
    lock = rl.lock(name)
    try:
        ok = lock.acquire(timeout=15)
        results.put((ok, time.monotonic()))
        if ok:
            lock.release()
    except BaseException as exc:
        results.put((repr(exc), time.monotonic()))


def test_waiter_in_another_process_is_woken_by_release(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0)
    holder = rl.lock("wait:release")
    assert holder.acquire(blocking=False)
    results = CTX.Queue()
    child = CTX.Process(target=_waiter, args=(list(redis_nodes.urls), holder.name, results))
    child.start()
    try:
        # The waiter's process has subscribed to the release channel on every node: it has
        # tried once, been refused, and is now blocked (the nodes are the only witness).
        wait_until(
            lambda: _subscribers(redis_nodes, "redlock:released:wait:release") == [1] * 3,
            timeout=10,
        )
        assert results.empty()
        released_at = time.monotonic()
        holder.release()
        ok, acquired_at = results.get(timeout=5)
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    assert ok is True, ok
    # Woken by the release, not by the end of the 10 s lease (monotonic clocks are shared by
    # the processes of one machine).
    assert 0 < acquired_at - released_at < 0.5, acquired_at - released_at


def test_waiter_gets_the_lock_when_the_lease_runs_out_without_polling(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    ttl = 1.0
    holder_rl = make_redlock(redis_nodes, ttl=ttl)
    # A short retry_delay: a waiter that polled would call the nodes ~20 times per second.
    waiter_rl = make_redlock(redis_nodes, ttl=ttl, retry_delay=0.05)
    warm_up(holder_rl)
    warm_up(waiter_rl)
    holder = holder_rl.lock("wait:expiry")
    before = node_calls(redis_nodes)
    taken_at = time.monotonic()
    assert holder.acquire(blocking=False)  # ... and never released: the holder "crashed"
    waiter = waiter_rl.lock("wait:expiry")
    assert waiter.acquire(timeout=5)
    waited = time.monotonic() - taken_at
    after = node_calls(redis_nodes)
    assert ttl - 0.05 <= waited <= ttl + 0.5, waited
    assert tokens_on_nodes(redis_nodes, waiter.name).count(waiter.token) >= 2  # a quorum
    # Holder: one acquire. Waiter: first try, a try right after subscribing, and the one at the
    # end of the lease (one more if it woke a hair before the nodes expired the key).
    for b, a in zip(before, after, strict=True):
        assert _scripts(a) - _scripts(b) <= 1 + 4, (b, a)
    waiter.release()


def _run_contenders(rl, name: str, threads: int, seconds: float) -> list[int]:
    counts = [0] * threads
    start = threading.Barrier(threads)
    stop_at = []

    def worker(index: int) -> None:
        start.wait()
        if not stop_at:
            stop_at.append(time.monotonic() + seconds)
        while time.monotonic() < stop_at[0]:
            lock = rl.lock(name, ttl=5.0)
            assert lock.acquire(timeout=10), "a contender timed out"
            counts[index] += 1
            time.sleep(0.001)  # the critical section
            lock.release()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 30)
    assert not any(w.is_alive() for w in workers)
    return counts


def test_threads_of_one_process_do_not_stampede_the_nodes(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    rl = make_redlock(redis_nodes, ttl=5.0)
    warm_up(rl)
    before = node_calls(redis_nodes)
    counts = _run_contenders(rl, "wait:herd", threads=4, seconds=2.0)
    after = node_calls(redis_nodes)
    acquisitions = sum(counts)
    assert acquisitions > 20, counts
    for b, a in zip(before, after, strict=True):
        scripts = _scripts(a) - _scripts(b)
        acquire_calls = scripts - acquisitions  # each acquisition was released once
        # Only the thread at the front of the local queue talks to the nodes: about one acquire
        # script per acquisition, where 4 independent contenders would send up to 4.
        assert acquire_calls <= acquisitions * 1.5 + 5, (acquire_calls, acquisitions)


def test_threads_of_one_process_get_the_lock_in_turn(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes, ttl=5.0)
    warm_up(rl)
    counts = _run_contenders(rl, "wait:fifo", threads=4, seconds=2.0)
    mean = statistics.mean(counts)
    assert mean > 5, counts
    assert all(abs(c - mean) <= 0.2 * mean for c in counts), counts


def test_queue_front_holder_that_never_releases_does_not_block_the_queue(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    ttl = 0.8
    rl = make_redlock(redis_nodes, ttl=ttl)
    warm_up(rl)
    taken = threading.Event()
    abandoned = []

    def forgetful() -> None:
        lock = rl.lock("wait:abandoned")
        assert lock.acquire(timeout=5)  # a blocking acquire: it is the local queue's front
        abandoned.append(lock)
        taken.set()  # ... and the thread ends without releasing

    thread = threading.Thread(target=forgetful)
    thread.start()
    assert taken.wait(5)
    started = time.monotonic()
    thread.join()
    lock = rl.lock("wait:abandoned")
    assert lock.acquire(timeout=5)
    waited = time.monotonic() - started
    assert waited <= ttl + 0.5, waited
    assert tokens_on_nodes(redis_nodes, lock.name).count(lock.token) >= 2  # a quorum
    lock.release()
    # The forgetful thread's handle is stale: releasing it now must not touch anything.
    from django_redlock import LockNotOwned

    with pytest.raises(LockNotOwned):
        abandoned[0].release()


def test_a_thread_queued_while_the_front_contends_moves_up_when_the_front_lease_ends(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """The front thread got the lock only after waiting, then let its lease run out: the
    thread queued behind it while it waited must move up at the lease's end (it used to
    sleep until its own timeout, for ever with ``timeout=inf``)."""
    ttl = 0.8
    other = make_redlock(redis_nodes, ttl=2.0)
    assert other.lock("wait:front").acquire(blocking=False)  # ends in 2 s, never released
    rl = make_redlock(redis_nodes, ttl=ttl)
    first, front, second, behind = _front_then_queued(
        redis_nodes, rl, "wait:front", behind_timeout=float("inf")
    )  # the front never releases
    first.join(5)
    second.join(5 + ttl)
    assert "at" in front, "the front thread did not get the lock"
    assert not second.is_alive(), "the queued thread still waits, the name long free"
    assert behind["ok"] is True
    assert behind["at"] - front["at"] <= ttl + 0.5, behind["at"] - front["at"]


def test_a_thread_queued_behind_a_force_released_holder_moves_up_at_once(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """An operator's force release frees the name for every waiter, including the threads
    of the holder's own process queued behind it (they used to sleep until the end of the
    lease the holder no longer has)."""
    other = make_redlock(redis_nodes, ttl=1.0)
    assert other.lock("wait:forced").acquire(blocking=False)  # ends in 1 s
    rl = make_redlock(redis_nodes, ttl=3.0)
    first, front, second, behind = _front_then_queued(
        redis_nodes, rl, "wait:forced", auto_renew=True, behind_timeout=10
    )
    first.join(5)
    assert "at" in front, "the front thread did not get the lock"
    # Both threads are users of the name's local queue: the second waits behind the holder.
    wait_until(lambda: getattr(rl._queues.get("wait:forced"), "users", 0) == 2, timeout=5)
    forced_at = time.monotonic()
    # A quorum at least (a contended acquire is often granted by just a quorum).
    assert make_redlock(redis_nodes).force_release("wait:forced") >= 2
    second.join(5)
    assert behind.get("ok") is True
    # Not the up to 3 s the lost lease had left.
    assert behind["at"] - forced_at < 1.0, behind["at"] - forced_at


def _front_then_queued(
    redis_nodes: RedisCluster, rl, name: str, *, behind_timeout: float, auto_renew: bool = False
) -> tuple[threading.Thread, dict[str, float], threading.Thread, dict[str, object]]:
    """A front thread that gets ``name`` only after waiting for another client (and then
    holds it), and a second thread queued behind it meanwhile, which takes the lock (within
    ``behind_timeout``) and releases it. Returns both threads and what each recorded."""
    warm_up(rl)
    front: dict[str, float] = {}
    behind: dict[str, object] = {}

    def holder() -> None:
        if rl.lock(name, auto_renew=auto_renew).acquire(timeout=5):  # the queue's front
            front["at"] = time.monotonic()

    def queued() -> None:
        lock = rl.lock(name)
        behind["ok"] = lock.acquire(timeout=behind_timeout)
        behind["at"] = time.monotonic()
        lock.release()

    first = threading.Thread(target=holder)
    first.start()
    # The front thread was refused once and now waits on the release channel.
    wait_until(lambda: _subscribers(redis_nodes, f"redlock:released:{name}") == [1] * 3)
    second = threading.Thread(target=queued, daemon=True)
    second.start()
    return first, front, second, behind


def test_a_waiter_behind_a_lossy_link_looks_again_without_a_notice() -> None:
    """On a lossy link a release notice may come 200 ms+ late: the waiter's wait is bounded
    by its poll, not by the holder's lease end; a notice that comes still ends it at once."""
    from django_redlock.core.waiting import ReleaseNotice

    notice = ReleaseNotice(2, poll=0.05)
    started = time.monotonic()
    assert notice.wait(30.0) == 0
    assert time.monotonic() - started < 10.0  # the lease end asked for would be 30 s
    heard = ReleaseNotice(2, poll=30.0)
    threading.Timer(0.01, heard.hear, (0, b"token")).start()
    threading.Timer(0.01, heard.hear, (1, b"token")).start()
    started = time.monotonic()
    assert heard.wait(60.0) == 1
    assert time.monotonic() - started < 10.0
