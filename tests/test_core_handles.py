"""A lock handle behaves as the peers' handles do (redis-py's thread-local token, kazoo's Lock,
``threading.Lock``): it belongs to whoever acquired it, a failed attempt never touches the
holder's lease, a blocking acquire without a timeout waits until acquired, and two handles of
one name contend unless ``reentrant=True``. The same on every supported Python."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redlock import AsyncRedlock, LockNotAcquired, LockNotOwned
from django_redlock.testing import RedisCluster
from tests.helpers import settled_tokens


def test_a_thread_that_did_not_acquire_a_shared_handle_cannot_release_it(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("handle:shared", ttl=5.0)
    assert lock.acquire(blocking=False)
    errors: list[BaseException] = []

    def intruder() -> None:
        for call in (lock.release, lock.extend):
            try:
                call()
            except LockNotOwned as exc:
                errors.append(exc)

    thread = threading.Thread(target=intruder, name="intruder")
    thread.start()
    thread.join(5)
    assert len(errors) == 2, errors
    assert "another owner" in str(errors[0]) and "intruder" in str(errors[0])
    # Nothing was sent: the holder still holds it everywhere, and a third client is refused.
    assert settled_tokens(redis_nodes, "handle:shared") == [lock.token] * 3
    assert make_redlock(redis_nodes).lock("handle:shared").acquire(blocking=False) is False
    lock.release()
    assert settled_tokens(redis_nodes, "handle:shared") == [None] * 3


def test_racing_non_blocking_acquires_on_one_handle_leave_the_winner_its_lease(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("handle:race", ttl=10.0, auto_renew=True)
    start = threading.Barrier(8)
    results: dict[str, bool] = {}
    winner_released = threading.Event()
    release_errors: list[BaseException] = []

    def contender(i: int) -> None:
        start.wait(5)
        won = lock.acquire(blocking=False)
        results[f"t{i}"] = won
        if won:
            # The others' failed attempts must not have touched this lease.
            assert lock.held
            start_release.wait(5)
            try:
                lock.release()
            except BaseException as exc:
                release_errors.append(exc)
            winner_released.set()

    start_release = threading.Event()
    threads = [threading.Thread(target=contender, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(results) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    start_release.set()
    for t in threads:
        t.join(10)
    assert sorted(results.values()) == [False] * 7 + [True], results
    assert winner_released.is_set() and release_errors == [], release_errors
    assert settled_tokens(redis_nodes, "handle:race") == [None] * 3
    assert not lock.held


def test_threads_sharing_a_held_handle_wait_or_get_false(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("handle:wait", ttl=10.0)
    assert lock.acquire(blocking=False)
    outcome: dict[str, object] = {}
    tried = threading.Event()

    def other() -> None:
        outcome["try"] = lock.acquire(blocking=False)
        tried.set()
        outcome["wait"] = lock.acquire(timeout=10)
        outcome["held_by_me"] = lock.held
        lock.release()

    thread = threading.Thread(target=other)
    thread.start()
    assert tried.wait(5)
    assert outcome["try"] is False
    lock.release()
    thread.join(10)
    assert outcome["wait"] is True and outcome["held_by_me"] is True, outcome
    assert settled_tokens(redis_nodes, "handle:wait") == [None] * 3


def test_blocking_acquire_without_a_timeout_waits_until_acquired(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    holder = make_redlock(redis_nodes).lock("handle:forever", ttl=10.0)
    assert holder.acquire(blocking=False)
    rl = make_redlock(redis_nodes)  # retry_count=3, retry_delay=0.2: the old bound was ~0.8 s
    got: dict[str, object] = {}

    def waiter() -> None:
        lock = rl.lock("handle:forever")
        t0 = time.monotonic()
        got["acquired"] = lock.acquire()
        got["waited"] = time.monotonic() - t0
        lock.release()

    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(1.5)  # well past the old bound: the waiter must still be waiting
    assert thread.is_alive() and not got
    holder.release()
    thread.join(10)
    assert got["acquired"] is True and got["waited"] >= 1.5, got


def test_a_with_block_given_a_timeout_raises_when_it_stays_taken(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """The README's and usage page's ``with`` forms: ``timeout=`` on the handle turns "still
    taken" into LockNotAcquired (without it, ``with`` waits as ``acquire()`` does)."""
    holder = make_redlock(redis_nodes)
    held = holder.lock("handle:with", ttl=10.0)
    assert held.acquire(blocking=False)
    permits = [holder.semaphore("handle:sem", limit=2, ttl=10.0, owner=i) for i in range(2)]
    assert all(p.acquire(blocking=False) for p in permits)
    rl = make_redlock(redis_nodes)
    for handle in (
        rl.lock("handle:with", ttl=10, timeout=0.3, fencing=True),
        rl.semaphore("handle:sem", limit=2, ttl=10.0, timeout=0.3),
    ):
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired):
            with handle:
                raise AssertionError("entered a lock that is taken")
        assert time.monotonic() - t0 < 5.0  # the timeout, not the 10 s lease
    held.release()
    for p in permits:
        p.release()
    with rl.lock("handle:with", ttl=10, timeout=0.3) as lock:
        assert lock.held


def test_retries_bound_an_acquire_by_attempts(redis_nodes: RedisCluster, make_redlock) -> None:
    holder = make_redlock(redis_nodes).lock("handle:retries", ttl=10.0)
    assert holder.acquire(blocking=False)
    rl = make_redlock(redis_nodes, retry_delay=0.1)
    t0 = time.monotonic()
    assert rl.lock("handle:retries").acquire(retries=2) is False
    assert time.monotonic() - t0 < 5.0  # bounded by attempts, not by the 10 s lease
    assert rl.lock("handle:retries", retries=0).acquire() is False
    holder.release()


def test_the_same_handle_again_by_its_holder_without_reentrancy(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("handle:again", ttl=0.5)
    assert lock.acquire(blocking=False)
    token = lock.token
    assert lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=0.05) is False
    with pytest.raises(RuntimeError, match="wait for itself"):
        lock.acquire()
    assert lock.token == token and lock.held  # the failed attempts left the lease alone
    # Once its lease ran out, the handle takes the lock anew.
    deadline = time.monotonic() + 5
    while lock.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock.acquire(timeout=5)
    assert lock.token != token
    lock.release()


def test_two_handles_of_one_name_in_one_thread_contend(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """redis-py's ``test_competing_locks`` and pottery's contention test: without
    ``reentrant=True`` (the default), handles are independent contenders."""
    rl = make_redlock(redis_nodes)
    handles = [rl.lock("handle:compete", ttl=5.0) for _ in range(10)]
    won = [h.acquire(blocking=False) for h in handles]
    assert won.count(True) == 1
    assert sum(h.held for h in handles) == 1
    handles[won.index(True)].release()
    reentrant = make_redlock(redis_nodes, reentrant=True)
    first, second = reentrant.lock("handle:re"), reentrant.lock("handle:re")
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    assert first.token == second.token
    second.release()
    first.release()


def test_asyncio_wait_for_acquire_is_owned_by_the_caller_on_every_python(
    redis_nodes: RedisCluster,
) -> None:
    """Before Python 3.12 ``asyncio.wait_for`` runs the coroutine in a task of its own; the
    owner is the task that called ``acquire()``, so the caller can release it either way."""

    async def main() -> tuple[bool, bool]:
        rl = AsyncRedlock(redis_nodes.urls)
        try:
            lock = rl.lock("handle:wait-for", ttl=5.0)
            assert await asyncio.wait_for(lock.acquire(), 5)

            # Another task of the same loop is another owner: it cannot release.
            async def intrude() -> None:
                await lock.release()

            with pytest.raises(LockNotOwned):
                await asyncio.create_task(intrude())
            # Another handle of the same name in this task contends (not reentrant).
            other = await rl.lock("handle:wait-for").acquire(blocking=False)
            held = lock.held
            await lock.release()
            return other, held
        finally:
            await rl.close()

    other, held = asyncio.run(main())
    assert other is False and held is True
    assert settled_tokens(redis_nodes, "handle:wait-for") == [None] * 3


def test_a_reentrant_handle_acquired_twice_is_held_until_its_last_release(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """python-redis-lock's ``AlreadyAcquired`` translated to ``reentrant=True``: the owner
    acquires its own handle twice; the first release leaves one hold (the handle still
    holds it and can release again), the second frees the nodes."""
    rl = make_redlock(redis_nodes, reentrant=True)
    lock = rl.lock("handle:twice", ttl=10.0)
    assert lock.acquire(blocking=False) and lock.acquire(blocking=False)
    lock.release()
    assert lock.held and settled_tokens(redis_nodes, "handle:twice") == [lock.token] * 3
    lock.release()
    assert not lock.held and settled_tokens(redis_nodes, "handle:twice") == [None] * 3
    with pytest.raises(LockNotOwned):
        lock.release()
    # Two handles: each release ends that handle's own hold only.
    outer, inner = rl.lock("handle:twice"), rl.lock("handle:twice")
    assert outer.acquire(blocking=False) and inner.acquire(blocking=False)
    inner.release()
    assert not inner.held and outer.held
    outer.release()
    assert settled_tokens(redis_nodes, "handle:twice") == [None] * 3

    async def main() -> None:
        arl = AsyncRedlock(redis_nodes.urls, reentrant=True)
        try:
            alock = arl.lock("handle:twice-async", ttl=10.0)
            assert await alock.acquire(blocking=False) and await alock.acquire(blocking=False)
            await alock.release()
            assert alock.held
            await alock.release()
            assert not alock.held
        finally:
            await arl.close()

    asyncio.run(main())
    assert settled_tokens(redis_nodes, "handle:twice-async") == [None] * 3
