"""docs/migrating.rst, section "redis-py Lock": one test per row of its behaviour table, on real
nodes. Each test runs redis-py's ``Lock`` (sync, or ``redis.asyncio``'s) on one node and the
guide's translation on three, side by side, so both columns of the table are checked,
differences included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.exceptions import LockError, LockNotOwnedError

from django_redlock import AsyncRedlock, LockLost, LockNotAcquired, LockNotOwned, Redlock
from django_redlock.testing import RedisCluster
from tests.backends.cases import run_owned
from tests.compat_rows import assert_rows_match
from tests.helpers import node_client, pttls_on_nodes, settled_tokens, wait_until


@pytest.fixture
def r(redis_nodes: RedisCluster) -> Iterator[redis.Redis]:
    """redis-py's side: a client on one node, as its users have."""
    client = node_client(redis_nodes[0])
    yield client
    client.close()


@pytest.fixture
def rl(redis_nodes: RedisCluster, make_redlock: Any) -> Redlock:
    """The translation: a Redlock over the three nodes."""
    return make_redlock(redis_nodes)


def in_thread(target: Any) -> Any:
    return run_owned(target, "other-thread")


def test_row_timeout_is_ttl(r, rl, redis_nodes) -> None:
    """``r.lock(name, timeout=10)`` -> ``rl.lock(name, ttl=10)``: the lease in seconds. No
    ``timeout`` never expires in redis-py; here the client's ``ttl`` (30 s) applies."""
    theirs = r.lock("rp:ttl", timeout=10)
    assert theirs.acquire(blocking=False)
    assert 9000 < r.pttl("rp:ttl") <= 10000
    forever = r.lock("rp:forever")
    assert forever.acquire(blocking=False) and r.pttl("rp:forever") == -1
    ours = rl.lock("ttl", ttl=10)
    assert ours.acquire(blocking=False)
    assert all(9000 < pttl <= 10000 for pttl in pttls_on_nodes(redis_nodes, "ttl"))
    default = rl.lock("default")
    assert default.acquire(blocking=False)
    assert all(25000 < pttl <= 30000 for pttl in pttls_on_nodes(redis_nodes, "default"))
    for lock in (theirs, forever, ours, default):
        lock.release()


def test_row_acquire_waits_until_acquired(r, rl, make_redlock, redis_nodes) -> None:
    """``lock.acquire()`` -> the same: blocks until acquired (no bound, on either side)."""
    for holder, waiter in (
        (r.lock("rp:wait", timeout=30), r.lock("rp:wait", timeout=30)),
        (rl.lock("wait", ttl=30), make_redlock(redis_nodes).lock("wait", ttl=30)),
    ):
        assert holder.acquire(blocking=False)
        got: list[bool] = []

        def wait(w: Any = waiter, got: list[bool] = got) -> None:
            got.append(w.acquire())
            w.release()

        thread = threading.Thread(target=wait)
        thread.start()
        thread.join(1.5)  # past any retry bound: still waiting
        assert thread.is_alive() and not got
        holder.release()
        thread.join(30)
        assert got == [True]


def test_row_non_blocking_acquire_is_false_when_held(r, rl, make_redlock, redis_nodes) -> None:
    """``acquire(blocking=False)`` -> the same: one attempt, False when someone holds it."""
    assert r.lock("rp:nb").acquire(blocking=False)
    assert r.lock("rp:nb").acquire(blocking=False) is False
    assert rl.lock("nb").acquire(blocking=False)
    assert make_redlock(redis_nodes).lock("nb").acquire(blocking=False) is False


def test_row_blocking_timeout_is_timeout(r, rl, make_redlock, redis_nodes) -> None:
    """``acquire(blocking_timeout=t)`` (or ``r.lock(name, blocking_timeout=t)``) ->
    ``acquire(timeout=t)`` (or ``rl.lock(name, timeout=t)``): False after ``t`` seconds."""
    assert r.lock("rp:bt").acquire(blocking=False)
    assert r.lock("rp:bt").acquire(blocking_timeout=0.3) is False  # gives up a sleep early
    assert rl.lock("bt").acquire(blocking=False)
    other = make_redlock(redis_nodes)
    started = time.monotonic()
    assert other.lock("bt").acquire(timeout=0.3) is False
    assert other.lock("bt", timeout=0.3).acquire() is False
    assert time.monotonic() - started >= 0.6


def test_row_with_raises_when_not_acquired(r, rl, make_redlock, redis_nodes) -> None:
    """``with r.lock(name, blocking_timeout=t):`` raises ``LockError`` when not acquired ->
    ``with rl.lock(name, timeout=t):`` raises ``LockNotAcquired``."""
    assert r.lock("rp:with").acquire(blocking=False)
    with pytest.raises(LockError):
        with r.lock("rp:with", blocking_timeout=0.2):
            pass
    assert rl.lock("with").acquire(blocking=False)
    with pytest.raises(LockNotAcquired) as caught:
        with make_redlock(redis_nodes).lock("with", timeout=0.2):
            pass
    assert caught.value.name == "with" and caught.value.retry_after is not None


def test_row_a_thread_that_did_not_acquire_cannot_release(r, rl, redis_nodes) -> None:
    """The token is per thread: another thread's ``release()`` raises ``LockError`` and the
    lock stays held -> ``LockNotOwned``, and nothing is sent to the nodes."""
    theirs = r.lock("rp:tl", timeout=10)
    assert theirs.acquire(blocking=False)
    # redis-py 5-7 raise LockError; 8 trips over the thread's missing token first
    assert isinstance(in_thread(theirs.release), (LockError, AttributeError))
    assert r.exists("rp:tl") == 1
    theirs.release()
    ours = rl.lock("tl", ttl=10)
    assert ours.acquire(blocking=False)
    refused = in_thread(ours.release)
    assert isinstance(refused, LockNotOwned) and "other-thread" in str(refused)
    assert isinstance(in_thread(ours.extend), LockNotOwned)
    assert settled_tokens(redis_nodes, "tl") == [ours.token] * 3
    ours.release()


def test_row_thread_local_false_is_an_owner(r, rl, redis_nodes) -> None:
    """``thread_local=False`` (one thread acquires, another releases) ->
    ``rl.lock(name, owner="job-7")``: every thread naming that owner may release."""
    theirs = r.lock("rp:shared", timeout=10, thread_local=False)
    assert theirs.acquire(blocking=False)
    assert in_thread(theirs.release) is None and r.exists("rp:shared") == 0
    ours = rl.lock("shared", ttl=10, owner="job-7")
    assert ours.acquire(blocking=False)
    assert in_thread(ours.release) is None
    assert settled_tokens(redis_nodes, "shared") == [None] * 3


def test_row_two_handles_of_one_name_contend(r, rl, make_redlock, redis_nodes) -> None:
    """redis-py's ``test_competing_locks``: two ``Lock`` objects of one name in one thread are
    two contenders -> the same (``reentrant=False`` is the default of ``Redlock``; see the
    reentrancy rule for ``reentrant=True`` and Django's ``REENTRANT``)."""
    first, second = r.lock("rp:compete"), r.lock("rp:compete")
    assert first.acquire(blocking=False) and second.acquire(blocking=False) is False
    first.release()
    mine, again = rl.lock("compete"), rl.lock("compete")
    assert mine.acquire(blocking=False) and again.acquire(blocking=False) is False
    assert not again.held
    mine.release()
    reentrant = make_redlock(redis_nodes, reentrant=True)
    outer, inner = reentrant.lock("compete"), reentrant.lock("compete")
    assert outer.acquire(blocking=False) and inner.acquire(blocking=False)  # re-enters
    inner.release()
    outer.release()


def test_row_the_holder_acquiring_its_own_handle_again(r, rl) -> None:
    """The holder calls ``acquire()`` on its own handle again: redis-py answers False, or
    waits for itself (until ``blocking_timeout``, or for ever) -> False, False after
    ``timeout``, and **RuntimeError** instead of waiting for ever."""
    theirs = r.lock("rp:again", timeout=10)
    assert theirs.acquire(blocking=False)
    assert theirs.acquire(blocking=False) is False
    assert theirs.acquire(blocking_timeout=0.1) is False
    assert theirs.owned()  # its token survived
    theirs.release()
    ours = rl.lock("again", ttl=10)
    assert ours.acquire(blocking=False)
    token = ours.token
    assert ours.acquire(blocking=False) is False
    assert ours.acquire(timeout=0.1) is False
    with pytest.raises(RuntimeError, match="wait for itself"):
        ours.acquire()
    assert ours.held and ours.token == token
    ours.release()


def test_row_release_after_expiry(r, rl) -> None:
    """``release()`` after the lease ran out raises ``LockNotOwnedError`` -> ``LockNotOwned``
    (``LockLost`` when the lock was known to be lost while held, e.g. force-released)."""
    theirs = r.lock("rp:exp", timeout=0.3)
    assert theirs.acquire(blocking=False)
    wait_until(lambda: r.exists("rp:exp") == 0)
    with pytest.raises(LockNotOwnedError):
        theirs.release()
    ours = rl.lock("exp", ttl=0.3)
    assert ours.acquire(blocking=False)
    wait_until(lambda: not ours.held)
    with pytest.raises(LockNotOwned):
        ours.release()
    assert ours.acquire(blocking=False)
    assert rl.force_release("exp") == 3
    with pytest.raises(LockLost):
        ours.release()


def test_row_release_of_an_unacquired_lock(r, rl) -> None:
    """``release()`` of a lock never acquired raises ``LockError`` -> ``LockNotOwned``."""
    with pytest.raises(LockError):
        r.lock("rp:never").release()
    with pytest.raises(LockNotOwned):
        rl.lock("never").release()


def test_row_extend_re_arms_where_redis_py_adds(r, rl, redis_nodes) -> None:
    """``extend(t)`` adds ``t`` to the time left -> ``extend(t)`` re-arms the lease to ``t``
    (redis-py's ``extend(t, replace_ttl=True)``); ``reacquire()`` -> ``extend()``."""
    theirs = r.lock("rp:ext", timeout=10)
    assert theirs.acquire(blocking=False)
    assert theirs.extend(20) is True
    assert 25000 < r.pttl("rp:ext") <= 30000  # 10 + 20
    assert theirs.extend(5, replace_ttl=True) and 4000 < r.pttl("rp:ext") <= 5000
    assert theirs.reacquire() and 9000 < r.pttl("rp:ext") <= 10000
    ours = rl.lock("ext", ttl=10)
    assert ours.acquire(blocking=False)
    assert ours.extend(20) is True
    assert all(15000 < p <= 20000 for p in pttls_on_nodes(redis_nodes, "ext"))  # 20, not 30
    assert 15 < ours.validity <= 20
    assert ours.extend(5) and all(4000 < p <= 5000 for p in pttls_on_nodes(redis_nodes, "ext"))
    assert ours.extend() and all(9000 < p <= 10000 for p in pttls_on_nodes(redis_nodes, "ext"))
    theirs.release()
    ours.release()


def test_row_extend_of_a_lost_lock_is_false_where_redis_py_raises(r, rl) -> None:
    """``extend()`` of a lock no longer ours raises ``LockNotOwnedError`` -> returns
    **False**, and the handle is marked lost (``held`` False, ``lock.lost`` says why)."""
    theirs = r.lock("rp:lost", timeout=10)
    assert theirs.acquire(blocking=False)
    r.delete("rp:lost")
    with pytest.raises(LockNotOwnedError):
        theirs.extend(5)
    ours = rl.lock("lost", ttl=10)
    assert ours.acquire(blocking=False)
    assert rl.force_release("lost") == 3
    assert ours.extend(5) is False
    assert not ours.held and ours.lost


def test_row_extend_of_an_unacquired_lock(r, rl) -> None:
    """``extend()`` of a lock never acquired raises ``LockError`` -> ``LockNotOwned``."""
    with pytest.raises(LockError):
        r.lock("rp:none", timeout=10).extend(5)
    with pytest.raises(LockNotOwned):
        rl.lock("none", ttl=10).extend(5)


def test_row_locked_is_rl_locked(r, rl) -> None:
    """``lock.locked()`` (anyone holds the name) -> ``rl.locked(name)``."""
    probe = r.lock("rp:any")
    assert probe.locked() is False
    holder = r.lock("rp:any")
    assert holder.acquire(blocking=False) and probe.locked() is True
    assert rl.locked("any") is False
    lock = rl.lock("any")
    assert lock.acquire(blocking=False) and rl.locked("any") is True
    holder.release()
    lock.release()
    assert rl.locked("any") is False


def test_row_owned_is_held_and_check(r, rl) -> None:
    """``lock.owned()`` (asks Redis) -> ``lock.held`` (local view, no round trip) and
    ``lock.check()`` (asks the nodes)."""
    theirs = r.lock("rp:own", timeout=10)
    assert not theirs.owned()
    assert theirs.acquire(blocking=False) and theirs.owned()
    r.delete("rp:own")
    assert not theirs.owned()
    ours = rl.lock("own", ttl=10)
    assert not ours.held and not ours.check()
    assert ours.acquire(blocking=False) and ours.held and ours.check()
    rl.force_release("own")
    assert ours.check() is False and not ours.held


def test_row_raise_on_release_error_false_is_an_except(r, rl, caplog) -> None:
    """``raise_on_release_error=False`` (a ``with`` block whose lock expired logs instead of
    raising) has **no option** here: a release that finds the lock gone always raises
    ``LockNotOwned`` (``LockLost``); catch it where losing the lock is acceptable."""
    caplog.set_level(logging.WARNING, logger="redis.lock")
    with r.lock("rp:quiet", timeout=0.3, raise_on_release_error=False):
        wait_until(lambda: r.exists("rp:quiet") == 0)
    assert "no longer owned" in caplog.text
    with pytest.raises(LockNotOwned):
        with rl.lock("quiet", ttl=0.3) as lock:
            wait_until(lambda: not lock.held)
    lock = rl.lock("quiet", ttl=0.3)
    assert lock.acquire(blocking=False)
    try:
        wait_until(lambda: not lock.held)
    finally:
        with contextlib.suppress(LockNotOwned):
            lock.release()


def test_row_tokens_are_random_per_acquisition(r, rl) -> None:
    """Tokens: redis-py's are ``uuid1`` (host and time; can repeat after ``fork``) -> 128
    random bits from the OS per acquisition (``lock.token``)."""
    theirs = r.lock("rp:tok")
    assert theirs.acquire(blocking=False)
    assert len(theirs.local.token) == 32
    theirs.release()
    ours = rl.lock("tok")
    seen = set()
    for _ in range(3):
        assert ours.acquire(blocking=False)
        seen.add(ours.token)
        ours.release()
    assert len(seen) == 3 and all(len(t) >= 22 for t in seen)


def test_row_waiters_wake_on_release(rl, make_redlock, redis_nodes) -> None:
    """``sleep=0.1`` (waiters poll every 0.1 s) -> no polling: a waiter is woken by the
    release (well before the holder's 30 s lease would end)."""
    holder = rl.lock("wake", ttl=30)
    assert holder.acquire(blocking=False)
    got: list[float] = []
    waiter = make_redlock(redis_nodes).lock("wake", ttl=30)
    ready = threading.Event()

    def wait() -> None:
        ready.set()
        assert waiter.acquire(timeout=60)
        got.append(time.monotonic())
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    ready.wait(5)
    time.sleep(0.3)  # let it reach its wait (the assertion holds either way)
    released = time.monotonic()
    holder.release()
    thread.join(60)
    assert got and got[0] - released < 10


# --- redis.asyncio -------------------------------------------------------------------------------


def test_row_async_coroutines_of_one_thread_are_different_owners(redis_nodes) -> None:
    """``redis.asyncio``'s token is per thread, so another coroutine (task) of the same
    thread can release a lock it never took -> ``AsyncRedlock``: owned by the asyncio task;
    another task's ``release()`` raises ``LockNotOwned`` and nothing is sent."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_nodes[0].url)
        rl = AsyncRedlock(redis_nodes.urls)
        try:
            theirs = r.lock("rp:task", timeout=10)
            assert await theirs.acquire(blocking=False)
            await asyncio.create_task(theirs.release())  # another task released it
            assert await r.exists("rp:task") == 0
            ours = rl.lock("task", ttl=10)
            assert await ours.acquire(blocking=False)

            async def intrude() -> None:
                await ours.release()

            with pytest.raises(LockNotOwned):
                await asyncio.create_task(intrude())
            assert settled_tokens(redis_nodes, "task") == [ours.token] * 3
            await ours.release()
        finally:
            await rl.close()
            await r.aclose()

    asyncio.run(main())


def test_row_async_with_and_wait_for(redis_nodes) -> None:
    """``async with r.lock(name, blocking_timeout=t)`` -> ``async with rl.lock(name,
    timeout=t)`` (``LockNotAcquired`` when not taken), and ``await asyncio.wait_for(
    lock.acquire(), t)`` is owned by the caller on every Python (before 3.12 ``wait_for``
    runs it in a task of its own): the caller releases it."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_nodes[0].url)
        rl, other = AsyncRedlock(redis_nodes.urls), AsyncRedlock(redis_nodes.urls)
        try:
            async with r.lock("rp:awith", timeout=10):
                with pytest.raises(LockError):
                    async with r.lock("rp:awith", blocking_timeout=0.2):
                        pass
            async with rl.lock("awith", ttl=10) as lock:
                assert lock.held
                with pytest.raises(LockNotAcquired):
                    async with other.lock("awith", timeout=0.2):
                        pass
            lock = rl.lock("awith", ttl=10)
            assert await asyncio.wait_for(lock.acquire(), 10)
            assert lock.held
            await lock.release()
            assert not await rl.locked("awith")
        finally:
            await rl.close()
            await other.close()
            await r.aclose()

    asyncio.run(main())


def test_row_async_extend_re_arms(redis_nodes) -> None:
    """``await lock.extend(t)`` adds ``t`` -> ``await lock.extend(t)`` re-arms to ``t``, and
    is False (not ``LockNotOwnedError``) when the lock was lost."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_nodes[0].url)
        rl = AsyncRedlock(redis_nodes.urls)
        try:
            theirs = r.lock("rp:aext", timeout=10)
            assert await theirs.acquire(blocking=False)
            assert await theirs.extend(20) and 25000 < await r.pttl("rp:aext") <= 30000
            await r.delete("rp:aext")
            with pytest.raises(LockNotOwnedError):
                await theirs.extend(5)
            ours = rl.lock("aext", ttl=10)
            assert await ours.acquire(blocking=False)
            assert await ours.extend(20)
            assert all(15000 < p <= 20000 for p in pttls_on_nodes(redis_nodes, "aext"))
            assert await rl.force_release("aext") == 3
            assert await ours.extend(5) is False and not ours.held
        finally:
            await rl.close()
            await r.aclose()

    asyncio.run(main())


# --- django-redis ``cache.lock`` (redis-py's Lock through Django's cache) -------------------------


def test_row_django_redis_lease_above_max_ttl(redlock_settings, settings) -> None:
    """``cache.lock(key, timeout=600)`` -> ``locked(key, ttl=600)`` needs ``REDLOCK["MAX_TTL"]``
    of 600 or more: beyond ``MAX_TTL`` (the larger of ``TTL`` and 60 s) it is a
    ``ValueError``, raised when the lock is taken (the call), not when the code is imported."""
    from django_redlock import locked

    @locked("rebuild-index", ttl=600)
    def rebuild() -> str:
        return "done"

    with pytest.raises(ValueError, match="max_ttl"):
        rebuild()
    with pytest.raises(ValueError, match="max_ttl"):
        with locked("rebuild-index", ttl=600):
            pass
    settings.REDLOCK = {**redlock_settings, "MAX_TTL": 600}
    assert rebuild() == "done"
    with locked("rebuild-index", ttl=600) as lock:
        assert 590 < lock.validity <= 600


def test_every_row_of_the_guide_is_a_test_here() -> None:
    """The guide's table and this file name each other, row for test."""
    assert_rows_match(sys.modules[__name__], "redis-py ``Lock``", "django-redis ``cache.lock``")
