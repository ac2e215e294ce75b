"""Fair locks: waiters in separate processes get the lock in arrival order, and a waiter that
dies leaves the line within its heartbeat timeout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from django_redlock import Redlock

pytestmark = pytest.mark.slow

CTX = multiprocessing.get_context("fork")


def _waiter(urls, index, arrived, results, heartbeat, done=None):
    """A fair lock's waiter; with ``done``, a fair semaphore's (limit 2), which keeps its
    permit until ``done`` is set (so no two waiters are served at the same moment)."""
    redlock = Redlock(urls, ttl=5, fair_heartbeat=heartbeat)
    lock = (
        redlock.lock("fair", fair=True) if done is None else redlock.semaphore("fair", 2, fair=True)
    )
    # Join the line, then report: the line position is fixed once the first attempt returns.
    arrived.put(index)
    acquired = lock.acquire(timeout=30)
    results.put((index, acquired, time.monotonic()))
    if acquired:
        if done is not None:
            done.wait(30)
        lock.release()


def _join_in_order(urls, count, heartbeat=1.0, done=None):
    arrived, results = CTX.Queue(), CTX.Queue()
    processes = []
    for index in range(count):
        args = (urls, index, arrived, results, heartbeat, None if done is None else done[index])
        process = CTX.Process(target=_waiter, args=args)
        process.start()
        assert arrived.get(timeout=10) == index
        _wait_for_line(urls, index + 1)
        processes.append(process)
    return processes, results


def _wait_for_line(urls, length, timeout=30.0):
    """The queue zset on a quorum has `length` waiters (event-free, but bounded polling of the
    nodes' own state is the only signal another process gives us here)."""
    import redis

    clients = [redis.Redis.from_url(url) for url in urls]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(c.zcard("redlock:queue:fair") >= length for c in clients) >= len(urls) // 2 + 1:
            return
        time.sleep(0.01)
    raise AssertionError(f"line never reached {length} waiters")


def test_waiters_in_separate_processes_acquire_in_arrival_order(redis_nodes):
    holder = Redlock(redis_nodes.urls, ttl=10).lock("fair")
    assert holder.acquire(blocking=False)
    # A heartbeat of 3 s: eight processes starting one after the other on a busy machine
    # take seconds, and a waiter whose refresh comes later than its heartbeat drops out of
    # the line (a full suite run on a loaded host once saw the line stop short of eight).
    processes, results = _join_in_order(redis_nodes.urls, 8, heartbeat=3.0)
    holder.release()
    # By the time each waiter got the lock (CLOCK_MONOTONIC is one clock for every process):
    # the queue's own order is the order its feeder threads flushed, not the order of put().
    order = sorted((results.get(timeout=30) for _ in processes), key=lambda r: r[2])
    for process in processes:
        process.join(10)
    assert all(acquired for _, acquired, _ in order)
    assert [index for index, _, _ in order] == list(range(8))


def test_semaphore_waiters_take_freed_slots_in_arrival_order(redis_nodes):
    """Both permits held, six waiters line up and wait longer than their heartbeat (a waiter
    that stops refreshing its place drops out of the line, and a later one passes it). Each
    slot freed, one at a time, goes to the first waiter still waiting."""
    rl = Redlock(redis_nodes.urls, ttl=10)
    holders = [rl.semaphore("fair", 2, owner=k) for k in range(2)]
    assert all(h.acquire(blocking=False) for h in holders)
    done = [CTX.Event() for _ in range(6)]
    processes, results = _join_in_order(redis_nodes.urls, 6, done=done)
    time.sleep(2.5)  # the fault: the waiters wait well past their 1 s heartbeat
    served = []
    for free_a_slot in [*(h.release for h in holders), *(d.set for d in done[:4])]:
        free_a_slot()
        index, acquired, _ = results.get(timeout=30)
        assert acquired
        served.append(index)
    for event in done:
        event.set()
    for process in processes:
        process.join(10)
    assert served == list(range(6))


def test_dead_waiter_is_dropped_within_its_heartbeat(redis_nodes):
    heartbeat = 1.0
    holder = Redlock(redis_nodes.urls, ttl=10).lock("fair")
    assert holder.acquire(blocking=False)
    processes, results = _join_in_order(redis_nodes.urls, 3, heartbeat)
    os.kill(processes[0].pid, signal.SIGKILL)  # the first in line dies while waiting
    processes[0].join(5)
    holder.release()
    released_at = time.monotonic()
    order = sorted((results.get(timeout=30) for _ in processes[1:]), key=lambda r: r[2])
    for process in processes[1:]:
        process.join(10)
    assert [index for index, _, _ in order] == [1, 2]
    # The line moved on once the dead waiter's heartbeat ran out, not after the holder's ttl.
    assert order[0][2] - released_at < heartbeat + 1.0


def test_fair_lock_without_contention_is_granted_at_once(redis_nodes):
    lock = Redlock(redis_nodes.urls, ttl=5).lock("fair", fair=True)
    assert lock.acquire(blocking=False)
    assert lock.held
    lock.release()
    client = redis_nodes.nodes[0].client()
    assert client.zcard("redlock:queue:fair") == 0
