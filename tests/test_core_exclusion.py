"""Mutual exclusion across processes on three real nodes.

Six processes hammer one lock name (and sixteen a hot key, fair and not, where every release
hands the lock to a waiter another process woke); each records the (start, end) of every critical section
with time.monotonic() (CLOCK_MONOTONIC: one clock for the whole machine on Linux, so intervals
of different processes compare) and, inside the lock, increments a counter in Redis with a
deliberately non-atomic GET then SET. Any overlap of two holders shows up twice: as overlapping
intervals and as a lost update.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
import time
import traceback

import pytest

from django_redlock.testing import RedisCluster

PROCESSES = 6
CYCLES = 50
COUNTER = "exclusion:counter"  # outside the lock prefix: plain data the lock protects

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="compares time.monotonic() across processes (system-wide only on Linux)",
)


def _worker(
    urls: list[str],
    counter_url: str,
    start_gate,
    results,
    cycles: int = CYCLES,
    fair: bool = False,
    counter: str = COUNTER,
) -> None:
    """One contender process: ``cycles`` times lock, GET+SET the counter, unlock."""
    import redis

    from django_redlock import Redlock

    intervals: list[tuple[float, float]] = []
    error = None
    try:
        rl = Redlock(urls, ttl=10.0, retry_delay=0.02)
        data = redis.Redis.from_url(counter_url, socket_timeout=5)
        start_gate.wait(30)
        for _ in range(cycles):
            lock = rl.lock("exclusion:shared", fair=fair)
            if not lock.acquire(timeout=60.0):
                raise AssertionError("could not acquire within 60 s")
            begin = time.monotonic()
            value = int(data.get(counter) or 0)
            data.set(counter, value + 1)
            end = time.monotonic()
            still_ours = lock.held
            lock.release()
            if not still_ours:
                raise AssertionError("the lease ran out inside the critical section")
            intervals.append((begin, end))
        rl.close()
    except BaseException:
        error = traceback.format_exc()
    results.put((intervals, error))


def _contend(
    redis_nodes: RedisCluster, processes: int, cycles: int, fair: bool, counter: str
) -> None:
    """``processes`` processes take the lock ``cycles`` times each; asserts that no two
    critical sections overlapped, no update was lost and nothing is left on the nodes."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    gate = ctx.Barrier(processes)
    counter_url = redis_nodes[0].url
    procs = [
        ctx.Process(
            target=_worker,
            args=(redis_nodes.urls, counter_url, gate, results, cycles, fair, counter),
        )
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    collected = []
    try:
        for _ in procs:
            collected.append(results.get(timeout=180))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():  # pragma: no cover - only on a hang
                p.kill()
                p.join()
    errors = [e for _, e in collected if e]
    assert not errors, errors[0]
    # Every process got every one of its turns (none waited out its 60 s).
    assert sorted(len(chunk) for chunk, _ in collected) == [cycles] * processes
    intervals = sorted(i for chunk, _ in collected for i in chunk)
    for (s1, e1), (s2, e2) in itertools.pairwise(intervals):
        assert e1 <= s2, f"critical sections overlap: ({s1}, {e1}) and ({s2}, {e2})"
    with redis_nodes[0].client() as c:
        assert int(c.get(counter)) == processes * cycles
    # Every holder released: nothing left on the nodes.
    for node in redis_nodes:
        with node.client() as c:
            assert c.keys("redlock:lock:*") == []


def test_processes_never_overlap_and_lose_no_update(redis_nodes: RedisCluster) -> None:
    _contend(redis_nodes, PROCESSES, CYCLES, False, COUNTER)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_sixteen_processes_on_a_hot_key_never_overlap(
    redis_nodes: RedisCluster, fair: bool
) -> None:
    # Each release wakes one waiting process by name, which takes the lock while the
    # releaser holds back and lines up again: the path from one holder to the next.
    _contend(redis_nodes, 16, 20, fair, f"{COUNTER}:hot:{int(fair)}")
