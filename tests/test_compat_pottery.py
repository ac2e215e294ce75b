"""docs/migrating.rst, section "pottery": one test per row of its behaviour table, on real nodes.
Each test runs pottery's ``Redlock`` (or ``AIORedlock``) over the three nodes and the guide's
translation over the same nodes, side by side, so both columns of the table are checked,
differences included.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from pottery import (
    AIORedlock,
    ExtendUnlockedLock,
    QuorumIsImpossible,
    QuorumNotAchieved,
    ReleaseUnlockedLock,
    TooManyExtensions,
    synchronize,
)
from pottery import Redlock as PotteryRedlock

from django_redlock import AsyncRedlock, LockNotAcquired, LockNotOwned, QuorumError, Redlock
from django_redlock.testing import RedisCluster
from tests.backends.cases import run_owned
from tests.compat_rows import assert_rows_match
from tests.helpers import node_client, pttls_on_nodes, settled_tokens, wait_until


@pytest.fixture
def masters(redis_nodes: RedisCluster) -> Iterator[set[redis.Redis]]:
    """pottery's side: one client per node (with a socket timeout, so nothing hangs)."""
    clients = {node_client(node) for node in redis_nodes.nodes}
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def rl(redis_nodes: RedisCluster, make_redlock: Any) -> Redlock:
    """The translation: a Redlock over the same three nodes."""
    return make_redlock(redis_nodes)


def pottery_pttls(masters: set[redis.Redis], key: str) -> list[int]:
    """The key's PTTL on the masters that took it: pottery's acquire needs only a quorum of
    them, and on a busy machine the last one may answer after it returned (no key there)."""
    pttls = [m.pttl(f"redlock:{key}") for m in masters]
    taken = [p for p in pttls if p != -2]
    assert len(taken) > len(masters) // 2, pttls
    return taken


def test_row_auto_release_time_is_ttl(masters, rl, redis_nodes) -> None:
    """``Redlock(key=, masters=, auto_release_time=10)`` -> ``rl.lock(name, ttl=10)``: the
    lease in seconds on every node."""
    theirs = PotteryRedlock(key="ttl", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    # Seconds, not milliseconds; the margin is for a busy machine between the SET and the read.
    assert all(5000 < p <= 10000 for p in pottery_pttls(masters, "ttl"))
    ours = rl.lock("ttl", ttl=10)
    assert ours.acquire(blocking=False)
    assert all(9000 < p <= 10000 for p in pttls_on_nodes(redis_nodes, "ttl"))
    theirs.release()
    ours.release()


def test_row_acquire_waits_until_acquired(masters, rl, make_redlock, redis_nodes) -> None:
    """``acquire()`` (``timeout=-1``) waits until acquired, polling -> ``acquire()``: waits
    until acquired, woken by the release; ``timeout=-1`` itself is a ``ValueError`` here
    (``timeout=math.inf`` is the explicit spelling)."""
    pairs = (
        (
            PotteryRedlock(key="wait", masters=masters, auto_release_time=30),
            PotteryRedlock(key="wait", masters=masters, auto_release_time=30),
        ),
        (rl.lock("wait", ttl=30), make_redlock(redis_nodes).lock("wait", ttl=30)),
    )
    for holder, waiter in pairs:
        assert holder.acquire(blocking=False)
        got: list[bool] = []

        def wait(w: Any = waiter, got: list[bool] = got) -> None:
            got.append(w.acquire())
            w.release()

        thread = threading.Thread(target=wait)
        thread.start()
        thread.join(1.5)
        assert thread.is_alive() and not got
        holder.release()
        thread.join(30)
        assert got == [True]
    with pytest.raises(ValueError, match="timeout"):
        rl.lock("wait").acquire(timeout=-1)
    forever = rl.lock("wait")
    assert forever.acquire(timeout=math.inf)
    forever.release()


def test_row_non_blocking_acquire_is_false_when_held(masters, rl, make_redlock, redis_nodes):
    """``acquire(blocking=False)`` -> the same: one attempt, False when someone holds it."""
    assert PotteryRedlock(key="nb", masters=masters).acquire(blocking=False)
    assert PotteryRedlock(key="nb", masters=masters).acquire(blocking=False) is False
    assert rl.lock("nb").acquire(blocking=False)
    assert make_redlock(redis_nodes).lock("nb").acquire(blocking=False) is False


def test_row_timeout_is_timeout(masters, rl, make_redlock, redis_nodes) -> None:
    """``acquire(timeout=t)`` -> the same: False after ``t`` seconds. pottery refuses
    ``acquire(blocking=False, timeout=t)``; here the timeout of a non-blocking call is
    ignored (one attempt)."""
    assert PotteryRedlock(key="to", masters=masters).acquire(blocking=False)
    assert PotteryRedlock(key="to", masters=masters).acquire(timeout=0.3) is False
    with pytest.raises(ValueError):
        PotteryRedlock(key="to", masters=masters).acquire(blocking=False, timeout=0.3)
    assert rl.lock("to").acquire(blocking=False)
    other = make_redlock(redis_nodes)
    started = time.monotonic()
    assert other.lock("to").acquire(timeout=0.3) is False
    assert time.monotonic() - started >= 0.3
    assert other.lock("to").acquire(blocking=False, timeout=0.3) is False


def test_row_with_blocks_or_raises(masters, rl, make_redlock, redis_nodes) -> None:
    """``with printer:`` blocks until acquired (``context_manager_timeout=t``: raises
    ``QuorumNotAchieved`` after ``t``) -> ``with rl.lock(name):`` blocks until acquired
    (``rl.lock(name, timeout=t)``: raises ``LockNotAcquired``); ``context_manager_blocking
    =False`` -> ``rl.lock(name, blocking=False)``."""
    with PotteryRedlock(key="cm", masters=masters) as theirs:
        assert theirs.locked() > 0
        with pytest.raises(QuorumNotAchieved):
            with PotteryRedlock(key="cm", masters=masters, context_manager_timeout=0.2):
                pass
        with pytest.raises(QuorumNotAchieved):
            with PotteryRedlock(key="cm", masters=masters, context_manager_blocking=False):
                pass
    other = make_redlock(redis_nodes)
    with rl.lock("cm") as ours:
        assert ours.held
        with pytest.raises(LockNotAcquired):
            with other.lock("cm", timeout=0.2):
                pass
        with pytest.raises(LockNotAcquired):
            with other.lock("cm", blocking=False):
                pass
    assert not ours.held and not rl.locked("cm")


def test_row_locked_is_validity(masters, rl) -> None:
    """``printer.locked()``: seconds of the lease left (pottery 3), 0
    when not held by this handle -> ``lock.validity`` (seconds, local clock, no round trip)
    and ``lock.check()`` (asks the nodes); ``rl.locked(name)`` tells whether *anyone* holds
    it."""
    theirs = PotteryRedlock(key="left", masters=masters, auto_release_time=10)
    assert theirs.locked() == 0
    assert theirs.acquire(blocking=False)
    assert 9 < theirs.locked() <= 10
    assert PotteryRedlock(key="left", masters=masters).locked() == 0
    ours = rl.lock("left", ttl=10)
    assert ours.validity == 0 and not ours.check()
    assert ours.acquire(blocking=False)
    assert 9 < ours.validity <= 10 and ours.check()
    assert rl.locked("left") and not rl.lock("left").check()
    theirs.release()
    ours.release()


def test_row_extend_has_no_limit(masters, rl, redis_nodes) -> None:
    """``extend()`` re-arms the lease to ``auto_release_time``, at most ``num_extensions`` (3)
    times, then ``TooManyExtensions`` -> ``extend()`` re-arms to ``ttl`` (or ``extend(t)``
    to ``t``) with no limit; ``auto_renew=True`` does it for you (``renew_for`` caps it)."""
    theirs = PotteryRedlock(key="ext", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    for _ in range(3):
        theirs.extend()
    assert all(5000 < p <= 10000 for p in pottery_pttls(masters, "ext"))
    with pytest.raises(TooManyExtensions):
        theirs.extend()
    theirs.release()
    ours = rl.lock("ext", ttl=10)
    assert ours.acquire(blocking=False)
    for _ in range(5):
        assert ours.extend()
    assert all(9000 < p <= 10000 for p in pttls_on_nodes(redis_nodes, "ext"))
    assert ours.extend(20) and all(15000 < p <= 20000 for p in pttls_on_nodes(redis_nodes, "ext"))
    ours.release()


def test_row_extend_of_a_lock_not_held(masters, rl) -> None:
    """``extend()`` of a lock not held raises ``ExtendUnlockedLock`` -> ``LockNotOwned`` when
    this handle never took it, **False** when it was lost (``lock.lost`` says why)."""
    with pytest.raises(ExtendUnlockedLock):
        PotteryRedlock(key="noext", masters=masters).extend()
    with pytest.raises(LockNotOwned):
        rl.lock("noext").extend()
    ours = rl.lock("noext", ttl=10)
    assert ours.acquire(blocking=False)
    assert rl.force_release("noext") == 3
    assert ours.extend() is False and ours.lost


def test_row_release_of_a_lock_not_held(masters, rl) -> None:
    """``release()`` of a lock not held (never, or expired) raises ``ReleaseUnlockedLock`` ->
    ``LockNotOwned`` (``LockLost`` when it was known lost while held)."""
    with pytest.raises(ReleaseUnlockedLock):
        PotteryRedlock(key="norel", masters=masters).release()
    theirs = PotteryRedlock(key="norel", masters=masters, auto_release_time=0.3)
    assert theirs.acquire(blocking=False)
    wait_until(lambda: not any(m.exists("redlock:norel") for m in masters))
    with pytest.raises(ReleaseUnlockedLock):
        theirs.release()
    with pytest.raises(LockNotOwned):
        rl.lock("norel").release()
    ours = rl.lock("norel", ttl=0.3)
    assert ours.acquire(blocking=False)
    wait_until(lambda: not ours.held)
    with pytest.raises(LockNotOwned):
        ours.release()


def test_row_only_the_owner_releases(masters, rl, redis_nodes) -> None:
    """Any thread may ``release()`` a pottery handle -> only the thread (asyncio task) that
    acquired, else **``LockNotOwned``** and nothing is sent; ``owner=`` names an owner that
    threads share."""
    theirs = PotteryRedlock(key="own", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    assert run_owned(theirs.release) is None
    ours = rl.lock("own", ttl=10)
    assert ours.acquire(blocking=False)
    assert isinstance(run_owned(ours.release), LockNotOwned)
    assert settled_tokens(redis_nodes, "own") == [ours.token] * 3
    ours.release()
    shared = rl.lock("own", ttl=10, owner="nightly-job")
    assert shared.acquire(blocking=False)
    assert run_owned(shared.release) is None
    assert settled_tokens(redis_nodes, "own") == [None] * 3


def test_row_handles_of_one_key_contend(masters, rl) -> None:
    """pottery's contention test: ten ``Redlock`` objects of one key, one holder -> the same
    with ten ``rl.lock(name)`` handles in one thread (``Redlock``'s ``reentrant=False``
    default; see the reentrancy rule)."""
    theirs = [PotteryRedlock(key="ten", masters=masters) for _ in range(10)]
    assert [h.acquire(blocking=False) for h in theirs].count(True) == 1
    assert sum(1 for h in theirs if h.locked()) == 1
    ours = [rl.lock("ten") for _ in range(10)]
    assert [h.acquire(blocking=False) for h in ours].count(True) == 1
    assert sum(h.held for h in ours) == 1
    next(h for h in ours if h.held).release()
    next(h for h in theirs if h.locked()).release()


def test_row_the_holder_acquiring_its_handle_again(masters, rl) -> None:
    """The holder calls ``acquire(blocking=False)`` on its handle again: pottery answers
    False and the handle forgets its hold (its ``release()`` raises, the keys stay until they
    expire) -> False, and the handle keeps its hold."""
    theirs = PotteryRedlock(key="again", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    assert theirs.acquire(blocking=False) is False
    with pytest.raises(ReleaseUnlockedLock):
        theirs.release()
    # Still held: pottery's own acquire may have reached a bare quorum of its masters.
    assert sum(bool(m.exists("redlock:again")) for m in masters) > len(masters) // 2
    ours = rl.lock("again", ttl=10)
    assert ours.acquire(blocking=False)
    assert ours.acquire(blocking=False) is False
    assert ours.held
    ours.release()
    assert not rl.locked("again")


def test_row_synchronize_is_locked(masters, redlock_settings) -> None:
    """``@synchronize(key=, masters=, auto_release_time=60)`` (calls wait for each other) ->
    ``@locked(name, ttl=60, wait=math.inf)`` (``wait=0``, the default, refuses a busy call
    with ``LockNotAcquired`` instead)."""
    from django_redlock import get_redlock, locked

    inside: list[str] = []
    overlap: list[bool] = []
    gate = threading.Lock()

    def body(tag: str) -> None:
        with gate:
            overlap.append(bool(inside))
            inside.append(tag)
        time.sleep(0.05)  # the other call must find it held
        with gate:
            inside.remove(tag)

    @synchronize(key="nightly", masters=masters, auto_release_time=60)
    def theirs(tag: str) -> None:
        body(tag)

    @locked("nightly", ttl=60, wait=math.inf)
    def ours(tag: str) -> None:
        body(tag)

    for func in (theirs, ours):
        threads = [threading.Thread(target=func, args=(str(i),)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert overlap == [False] * 3 and not inside
        overlap.clear()

    @locked("nightly", ttl=60)
    def refused() -> None:  # pragma: no cover - never runs
        raise AssertionError

    holder = get_redlock().lock("nightly", owner="someone-else")
    assert holder.acquire(blocking=False)
    with pytest.raises(LockNotAcquired):
        refused()
    holder.release()


def test_row_errors_raise_where_pottery_returns_false(redis_cluster_factory, make_redlock):
    """Too few nodes reachable: pottery's ``acquire()`` returns False (``QuorumIsImpossible``
    with ``raise_on_redis_errors=True``) -> always ``QuorumError`` (a ``LockNotAcquired``
    naming each node and why)."""
    cluster = redis_cluster_factory(3)  # its own: two of its nodes are killed
    rl = make_redlock(cluster)
    warm = rl.lock("warm")
    assert warm.acquire(blocking=False)  # a brand-new cluster is trusted at the first lock
    warm.release()
    cluster[1].kill()
    cluster[2].kill()
    short = {node_client(n) for n in cluster.nodes}
    try:
        assert PotteryRedlock(key="down", masters=short).acquire(blocking=False) is False
        with pytest.raises(QuorumIsImpossible):
            PotteryRedlock(key="down", masters=short, raise_on_redis_errors=True).acquire(
                blocking=False
            )
    finally:
        for client in short:
            client.close()
    with pytest.raises(QuorumError) as caught:
        rl.lock("down").acquire(blocking=False)
    assert sorted(caught.value.failures) == sorted(n.url for n in cluster.nodes[1:])


def test_row_keys_share_one_namespace_under_the_default_prefix(
    masters, rl, redis_nodes, make_redlock
) -> None:
    """pottery's keys are ``redlock:<key>``; here ``<KEY_PREFIX>:lock:<name>``. The same name is
    two keys, so the two do not exclude each other; but under the default prefix pottery's
    ``lock:<name>`` is our ``<name>``: they exclude each other, and our operator views do not
    see pottery's hold. Another ``KEY_PREFIX`` keeps every pottery key out of ours."""
    theirs = PotteryRedlock(key="printer", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    ours = rl.lock("printer", ttl=10)
    assert ours.acquire(blocking=False)  # both "hold" printer: never mix the two
    ours.release()
    theirs.release()

    theirs = PotteryRedlock(key="lock:invoice:42", masters=masters, auto_release_time=10)
    assert theirs.acquire(blocking=False)
    try:
        assert rl.lock("invoice:42", ttl=10).acquire(blocking=False) is False
        assert rl.locked("invoice:42")
        # ...yet invisible to what an operator reads and frees
        assert rl.lock_info("invoice:42") is None
        assert "invoice:42" not in [info.name for info in rl.live_locks()]
        assert rl.force_release("invoice:42") == 0
        assert theirs.locked() > 0
        apart = make_redlock(redis_nodes, key_prefix="app").lock("invoice:42", ttl=10)
        assert apart.acquire(blocking=False)
        apart.release()
    finally:
        theirs.release()


# --- AIORedlock ----------------------------------------------------------------------------------


def test_row_aioredlock_is_asyncredlock(redis_nodes) -> None:
    """``AIORedlock(key=, masters=)`` with ``async with`` and ``await acquire()`` ->
    ``AsyncRedlock(urls).lock(name)``, the same calls awaited. Any task may release an
    ``AIORedlock``; here only the task that acquired (``LockNotOwned`` for another)."""

    async def main() -> None:
        amasters = {redis.asyncio.Redis.from_url(n.url) for n in redis_nodes.nodes}
        arl = AsyncRedlock(redis_nodes.urls)
        try:
            async with AIORedlock(key="aio", masters=amasters, auto_release_time=10) as held:
                assert await held.locked() > 0
                other = AIORedlock(key="aio", masters=amasters)
                assert await other.acquire(blocking=False) is False
            theirs = AIORedlock(key="aio", masters=amasters, auto_release_time=10)
            assert await theirs.acquire(blocking=False)
            await asyncio.create_task(theirs.release())  # another task released it
            async with arl.lock("aio", ttl=10) as lock:
                assert lock.held
                assert await arl.lock("aio").acquire(blocking=False) is False
            ours = arl.lock("aio", ttl=10)
            assert await ours.acquire(blocking=False)

            async def intrude() -> None:
                await ours.release()

            with pytest.raises(LockNotOwned):
                await asyncio.create_task(intrude())
            assert await ours.extend(20)
            await ours.release()
        finally:
            await arl.close()
            for m in amasters:
                await m.aclose()

    asyncio.run(main())


def test_every_row_of_the_guide_is_a_test_here() -> None:
    """The guide's table and this file name each other, row for test."""
    assert_rows_match(sys.modules[__name__], "pottery")
