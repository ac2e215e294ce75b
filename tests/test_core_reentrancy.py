"""Reentrancy (``reentrant=True``, per lock or per client): the owner that holds a lock takes it again
with one read and no write, the nodes' key stays until the outermost release, and owners are threads,
asyncio tasks or an explicit id. Traffic is counted on the real nodes (``INFO commandstats``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import pytest

from django_redlock import RedlockError
from django_redlock.testing import RedisCluster
from tests.helpers import settled_tokens, tokens_on_nodes, wait_until, warm_up

IGNORED = {"info", "client", "hello", "select", "ping"}  # our own counting and connection setup


def _gets(node_calls, nodes) -> list[int]:
    return [calls.get("get", 0) for calls in node_calls(nodes)]


def _writes(node_calls, nodes) -> list[int]:
    return [
        sum(v for k, v in calls.items() if k.split("|")[0] not in IGNORED | {"get"})
        for calls in node_calls(nodes)
    ]


def test_same_thread_reenters_with_one_read_and_no_write(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    """A reentrant acquire asks the nodes whether the hold is still there (one GET on each,
    as ``check()`` does: someone else may have force-released it), writes nothing, and the
    inner releases write nothing either."""
    rl = make_redlock(redis_nodes, reentrant=True)
    warm_up(rl)
    outer = rl.lock("re:nested", ttl=5.0)
    assert outer.acquire(blocking=False)
    before, reads = _writes(node_calls, redis_nodes), _gets(node_calls, redis_nodes)
    inner = rl.lock("re:nested")
    assert inner.acquire(blocking=False) is True
    innermost = rl.lock("re:nested")
    assert innermost.acquire() is True  # blocking: still a hit
    assert inner.token == outer.token == innermost.token
    innermost.release()
    inner.release()
    assert _writes(node_calls, redis_nodes) == before, "a reentrant hold wrote to the nodes"
    # One read per reentry per node (a quorum's answer ends the wait; the rest come in later).
    wait_until(lambda: _gets(node_calls, redis_nodes) == [n + 2 for n in reads])
    # The inner releases only dropped the hold count: the key is still there.
    assert settled_tokens(redis_nodes, "re:nested") == [outer.token] * 3
    assert outer.held and outer.check()
    outer.release()
    assert settled_tokens(redis_nodes, "re:nested") == [None] * 3


def test_another_thread_blocks_until_the_outermost_release(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes, reentrant=True)
    outer = rl.lock("re:other-thread", ttl=5.0)
    assert outer.acquire(blocking=False)
    inner = rl.lock("re:other-thread")
    assert inner.acquire(blocking=False)
    outcome = {}
    attempted = threading.Event()
    acquired = threading.Event()

    def other() -> None:
        lock = rl.lock("re:other-thread")
        outcome["try"] = lock.acquire(blocking=False)
        t0 = time.monotonic()
        outcome["timed"] = lock.acquire(timeout=0.3)
        outcome["timed_wait"] = time.monotonic() - t0
        attempted.set()
        outcome["blocking"] = lock.acquire(timeout=5)
        acquired.set()
        outcome["token"] = lock.token
        lock.release()

    thread = threading.Thread(target=other)
    thread.start()
    assert attempted.wait(5)
    assert outcome["try"] is False and outcome["timed"] is False, outcome
    assert outcome["timed_wait"] >= 0.3, outcome
    inner.release()
    assert not acquired.wait(0.2), "released the nodes' key at the inner release"
    outer.release()
    assert acquired.wait(5)
    thread.join(5)
    assert outcome["blocking"] is True and outcome["token"] != outer.token


def test_reentrant_false_refuses_the_same_thread(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, reentrant=True)
    first = rl.lock("re:off", reentrant=False)
    assert first.acquire(blocking=False)
    assert rl.lock("re:off", reentrant=False).acquire(blocking=False) is False
    # The same applies client-wide, and is the default (as redis-py, pottery and kazoo).
    strict = make_redlock(redis_nodes)
    assert strict.reentrant is False
    lock = strict.lock("re:off-client")
    assert lock.acquire(blocking=False)
    assert strict.lock("re:off-client").acquire(blocking=False) is False
    lock.release()
    first.release()


def test_explicit_owner_is_shared_across_threads(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, reentrant=True)
    held = rl.lock("re:owner", owner="task-1", ttl=5.0)
    assert held.acquire(blocking=False)
    results = {}

    def other_thread() -> None:
        same = rl.lock("re:owner", owner="task-1")
        results["same_owner"] = same.acquire(blocking=False)
        results["same_token"] = same.token
        results["other_owner"] = rl.lock("re:owner", owner="task-2").acquire(blocking=False)
        results["thread_owner"] = rl.lock("re:owner").acquire(blocking=False)
        same.release()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(5)
    assert results == {
        "same_owner": True,
        "same_token": held.token,
        "other_owner": False,
        "thread_owner": False,
    }, results
    # The other thread's release only dropped its hold.
    assert settled_tokens(redis_nodes, "re:owner") == [held.token] * 3
    held.release()
    assert settled_tokens(redis_nodes, "re:owner") == [None] * 3


def test_an_explicit_owner_is_one_holder_per_client(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """Holds are counted in the client that took the lock: another client (another process,
    or another Redlock in this one) with the same ``owner=`` is another holder, refused."""
    rl = make_redlock(redis_nodes, reentrant=True)
    held = rl.lock("re:client", owner="task-1", ttl=5.0)
    assert held.acquire(blocking=False)
    other = make_redlock(redis_nodes, reentrant=True)
    assert other.lock("re:client", owner="task-1").acquire(blocking=False) is False
    assert settled_tokens(redis_nodes, "re:client") == [held.token] * 3
    held.release()


def test_asyncio_tasks_on_one_thread_are_different_owners(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """The sync client called from coroutines: the owner is the task, not the thread (a
    thread-local owner would let every coroutine of the loop walk into each other's lock)."""
    rl = make_redlock(redis_nodes, reentrant=True)

    async def main() -> tuple[bool, bool]:
        first = rl.lock("re:tasks", ttl=5.0)
        assert first.acquire(blocking=False)

        async def same_task_again() -> bool:
            return rl.lock("re:tasks").acquire(blocking=False)

        other = await asyncio.create_task(same_task_again())
        again = rl.lock("re:tasks")
        mine = again.acquire(blocking=False)
        again.release()
        first.release()
        return other, mine

    other, mine = asyncio.run(main())
    assert other is False and mine is True


def test_reentrant_hold_asking_for_more_than_the_outer_one_is_not_silently_downgraded(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes, reentrant=True)
    outer = rl.lock("re:upgrade", ttl=0.6)  # e.g. @locked on a view: no renewal, no fence
    assert outer.acquire(blocking=False)
    inner = rl.lock("re:upgrade", ttl=0.6, fencing=True, auto_renew=True)  # a long job
    try:
        acquired = inner.acquire(blocking=False)
    except (ValueError, RedlockError):
        outer.release()
        return  # refusing the mismatch is a fine answer
    assert acquired
    time.sleep(1.0)  # past the outer lease
    assert isinstance(inner.fence, int), inner.fence
    assert inner.held, "the inner hold asked for auto_renew but its lease ran out"
    inner.release()
    outer.release()


def test_a_reentry_with_no_node_answering_keeps_the_hold(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """The nodes cannot say whether the hold is still there: it stands, as far as this
    process knows (the reentry joins it; nothing is marked lost)."""
    rl = make_redlock(redis_nodes, reentrant=True, node_timeout=0.05)
    warm_up(rl)
    outer = rl.lock("re:silent", ttl=10.0)
    assert outer.acquire(blocking=False)
    inner = rl.lock("re:silent")
    with contextlib.ExitStack() as paused:
        for node in redis_nodes:
            paused.enter_context(node.paused())
        assert inner.acquire(blocking=False) is True
    assert inner.token == outer.token and outer.held
    wait_until(outer.check, timeout=10.0)  # the nodes answer again: still ours
    inner.release()
    outer.release()
    assert settled_tokens(redis_nodes, "re:silent") == [None] * 3


def test_a_second_handle_given_up_leaves_the_first_handles_lock_alone(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """Two handles of one name are two contenders, even in one task or thread: the second,
    cancelled (or interrupted) while it waits, gives back nothing of the first's (an outside
    test saw the first holder's keys removed, with a 'released' event and no loss)."""

    async def main() -> None:
        rl = make_async_redlock(redis_nodes)
        first = rl.lock("two-handles", ttl=10.0)
        assert await first.acquire(blocking=False)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(rl.lock("two-handles", ttl=10.0).acquire(timeout=8), 0.3)
        assert first.held and first.lost is None
        assert settled_tokens(redis_nodes, "two-handles") == [first.token] * 3
        await first.release()

    asyncio.run(main())

    rl = make_redlock(redis_nodes)
    first = rl.lock("two-handles", ttl=10.0)
    assert first.acquire(blocking=False)
    second = rl.lock("two-handles", ttl=10.0)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with contextlib.suppress(KeyboardInterrupt):
            second.acquire(timeout=8)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert first.held and first.lost is None
    assert settled_tokens(redis_nodes, "two-handles") == [first.token] * 3
    first.release()


def test_cancelled_reentries_leave_nothing_held(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """A reentrant acquire cancelled while it asks the nodes about the hold adds no hold:
    once every returned handle is released the key is gone and nothing renews it."""

    async def main() -> None:
        rl = make_async_redlock(redis_nodes, reentrant=True)
        outer = rl.lock("re:cancelled", ttl=3.0, auto_renew=True)
        assert await outer.acquire(blocking=False)
        joined = []
        for _ in range(20):
            inner = rl.lock("re:cancelled", ttl=3.0)
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(inner.acquire(), 1e-4):
                    joined.append(inner)
        for inner in joined:
            await inner.release()
        assert outer.held
        await outer.release()
        assert settled_tokens(redis_nodes, "re:cancelled") == [None] * 3

    asyncio.run(main())


# ---- a sync and an async client that share holds (Redlock.share_holds) ----------------------


def _shared_pair(redis_nodes: RedisCluster, make_redlock, make_async_redlock):
    sync = make_redlock(redis_nodes, reentrant=True)
    aio = make_async_redlock(redis_nodes, reentrant=True)
    aio.share_holds(sync)
    return sync, aio


def test_clients_that_share_holds_reenter_each_others_hold(
    redis_nodes: RedisCluster, make_redlock, make_async_redlock
) -> None:
    """An async view's hold joined by the sync function it calls through a thread (what
    ``sync_to_async`` does), with the view's explicit owner: one lease, one token, the key
    released at the outer release only; another owner is refused throughout."""
    sync, aio = _shared_pair(redis_nodes, make_redlock, make_async_redlock)

    def inner() -> str | None:
        lock = sync.lock("re:across", owner="view-1")
        assert lock.acquire(blocking=False)
        assert not sync.lock("re:across", owner="view-2").acquire(blocking=False)
        token = lock.token
        lock.release()
        return token

    async def outer() -> tuple[str | None, str | None, list[str | None]]:
        lock = aio.lock("re:across", ttl=5.0, owner="view-1")
        assert await lock.acquire(blocking=False)
        token = await asyncio.to_thread(inner)
        after = tokens_on_nodes(redis_nodes, "re:across")
        assert not await aio.lock("re:across", owner="view-2").acquire(blocking=False)
        mine = lock.token
        await lock.release()
        return mine, token, after

    outer_token, inner_token, after = asyncio.run(outer())
    assert inner_token == outer_token and after == [outer_token] * 3
    assert settled_tokens(redis_nodes, "re:across") == [None] * 3


def test_an_async_call_reenters_a_sync_hold_from_its_own_event_loop(
    redis_nodes: RedisCluster, make_redlock, make_async_redlock
) -> None:
    """The reverse (``async_to_sync`` in a sync view: a fresh event loop that ends with the
    call). The nested hold asks for renewal the outer one did not: it is renewed after that
    loop ended, past the outer lease, until the outer release."""
    sync, aio = _shared_pair(redis_nodes, make_redlock, make_async_redlock)
    outer = sync.lock("re:across-sync", ttl=0.6, owner="view-1")
    assert outer.acquire(blocking=False)

    async def inner() -> str | None:
        lock = aio.lock("re:across-sync", ttl=0.6, owner="view-1", auto_renew=True)
        assert await lock.acquire(blocking=False)
        token = lock.token
        await lock.release()
        return token

    assert asyncio.run(inner()) == outer.token
    time.sleep(1.0)  # past the outer lease: renewed since the inner hold asked for it
    assert outer.held and outer.check()
    assert not sync.lock("re:across-sync", owner="view-2").acquire(blocking=False)
    outer.release()
    assert settled_tokens(redis_nodes, "re:across-sync") == [None] * 3


def test_the_last_hold_ends_the_lease_whichever_client_drops_it(
    redis_nodes: RedisCluster, make_redlock, make_async_redlock
) -> None:
    """The outer hold released first (an async view cancelled while the sync function it
    called runs on in its thread): the nested hold keeps the lock, and its release, through
    the other client, ends it on the nodes."""
    sync, aio = _shared_pair(redis_nodes, make_redlock, make_async_redlock)
    inner = sync.lock("re:across-last", ttl=5.0, owner="view-1")

    async def outer() -> str | None:
        lock = aio.lock("re:across-last", ttl=5.0, owner="view-1")
        assert await lock.acquire(blocking=False)
        assert await asyncio.to_thread(inner.acquire, False)
        mine = lock.token
        await lock.release()
        return mine

    token = asyncio.run(outer())
    assert inner.held and settled_tokens(redis_nodes, "re:across-last") == [token] * 3
    inner.release()
    assert settled_tokens(redis_nodes, "re:across-last") == [None] * 3
    # Gone from both clients' tables: the owner takes it anew (a new token), not rejoins.
    again = sync.lock("re:across-last", owner="view-1")
    assert again.acquire(blocking=False) and again.token != token
    again.release()


def test_only_clients_of_the_same_locks_share_holds(
    redis_nodes: RedisCluster, make_redlock, make_async_redlock
) -> None:
    sync = make_redlock(redis_nodes)
    with pytest.raises(ValueError, match="share holds"):
        make_async_redlock(redis_nodes, key_prefix="other").share_holds(sync)
    with pytest.raises(ValueError, match="share holds"):
        make_async_redlock(list(redis_nodes.urls)[:2]).share_holds(sync)
