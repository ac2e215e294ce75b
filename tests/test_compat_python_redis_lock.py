"""docs/migrating.rst, section "python-redis-lock": one test per row of its behaviour table, on
real nodes. Each test runs python-redis-lock's ``Lock`` on one node and the guide's translation
on three, side by side, so both columns of the table are checked, differences included.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis_lock

from django_redlock import LockLost, LockNotAcquired, LockNotOwned, Redlock
from django_redlock.testing import RedisCluster
from tests.backends.cases import run_owned
from tests.compat_rows import assert_rows_match
from tests.helpers import held_everywhere, node_client, pttls_on_nodes, settled_tokens, wait_until


@pytest.fixture
def conn(redis_nodes: RedisCluster) -> Iterator[redis.Redis]:
    """python-redis-lock's side: a client on one node, as its users have."""
    client = node_client(redis_nodes[0])
    yield client
    client.close()


@pytest.fixture
def rl(redis_nodes: RedisCluster, make_redlock: Any) -> Redlock:
    """The translation: a Redlock over the three nodes."""
    return make_redlock(redis_nodes)


def test_row_expire_is_ttl(conn, rl, redis_nodes) -> None:
    """``Lock(conn, name, expire=60)`` -> ``rl.lock(name, ttl=60)``: the lease in seconds.
    No ``expire`` never expires there; here the client's ``ttl`` (30 s) applies."""
    theirs = redis_lock.Lock(conn, "ttl", expire=60)
    assert theirs.acquire(blocking=False)
    assert 59000 < conn.pttl("lock:ttl") <= 60000
    forever = redis_lock.Lock(conn, "forever")
    assert forever.acquire(blocking=False) and conn.pttl("lock:forever") == -1
    ours = rl.lock("ttl", ttl=60)
    assert ours.acquire(blocking=False)
    assert all(59000 < p <= 60000 for p in pttls_on_nodes(redis_nodes, "ttl"))
    default = rl.lock("default")
    assert default.acquire(blocking=False)
    assert all(25000 < p <= 30000 for p in pttls_on_nodes(redis_nodes, "default"))
    for lock in (theirs, forever, ours, default):
        lock.release()


def test_row_acquire_waits_until_acquired(conn, rl, make_redlock, redis_nodes) -> None:
    """``acquire()`` waits until acquired (woken through its signal list) -> the same
    (woken by the release notice)."""
    pairs = (
        (redis_lock.Lock(conn, "wait", expire=30), redis_lock.Lock(conn, "wait", expire=30)),
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
        thread.join(25)  # well before the 30 s lease: woken by the release
        assert got == [True]


def test_row_non_blocking_acquire_is_false_when_held(conn, rl, make_redlock, redis_nodes):
    """``acquire(blocking=False)`` -> the same: one attempt, False when someone holds it."""
    assert redis_lock.Lock(conn, "nb").acquire(blocking=False)
    assert redis_lock.Lock(conn, "nb").acquire(blocking=False) is False
    assert rl.lock("nb").acquire(blocking=False)
    assert make_redlock(redis_nodes).lock("nb").acquire(blocking=False) is False


def test_row_timeout_is_timeout(conn, rl, make_redlock, redis_nodes) -> None:
    """``acquire(blocking=True, timeout=t)`` -> the same: False after ``t`` seconds.
    python-redis-lock counts whole seconds (``timeout=0.5`` is 0: no bound), refuses a
    negative timeout (``InvalidTimeout``), one longer than ``expire`` (``TimeoutTooLarge``)
    and one with ``blocking=False`` (``TimeoutNotUsable``); here a timeout is any number of
    seconds >= 0 (``timeout=0`` is one attempt; negative: ``ValueError``), it may exceed the
    ttl, and a non-blocking call ignores it."""
    assert redis_lock.Lock(conn, "to", expire=10).acquire(blocking=False)
    assert redis_lock.Lock(conn, "to", expire=10).acquire(timeout=1) is False
    with pytest.raises(redis_lock.InvalidTimeout):
        redis_lock.Lock(conn, "to", expire=10).acquire(timeout=-1)
    with pytest.raises(redis_lock.TimeoutTooLarge):
        redis_lock.Lock(conn, "to", expire=1).acquire(timeout=5)
    with pytest.raises(redis_lock.TimeoutNotUsable):
        redis_lock.Lock(conn, "to", expire=10).acquire(blocking=False, timeout=1)
    assert rl.lock("to", ttl=10).acquire(blocking=False)
    other = make_redlock(redis_nodes)
    started = time.monotonic()
    assert other.lock("to", ttl=10).acquire(timeout=0.3) is False
    assert time.monotonic() - started >= 0.3
    assert other.lock("to", ttl=10).acquire(timeout=0) is False
    with pytest.raises(ValueError):
        other.lock("to", ttl=10).acquire(timeout=-1)
    assert other.lock("to", ttl=0.5).acquire(timeout=0.6) in (True, False)  # accepted
    assert other.lock("to", ttl=10).acquire(blocking=False, timeout=1) is False


def test_row_with_blocks_or_raises(conn, rl, make_redlock, redis_nodes) -> None:
    """``with Lock(conn, name):`` blocks until acquired; ``Lock(..., blocking=False)`` raises
    ``NotAcquired`` when held -> ``with rl.lock(name):`` blocks; ``rl.lock(name,
    blocking=False)`` (or ``timeout=t``) raises ``LockNotAcquired``."""
    with redis_lock.Lock(conn, "cm", expire=10):
        with pytest.raises(redis_lock.NotAcquired):
            with redis_lock.Lock(conn, "cm", expire=10, blocking=False):
                pass
    other = make_redlock(redis_nodes)
    with rl.lock("cm", ttl=10) as ours:
        assert ours.held
        with pytest.raises(LockNotAcquired):
            with other.lock("cm", blocking=False):
                pass
    assert not rl.locked("cm")


def test_row_the_same_handle_twice(conn, rl, make_redlock, redis_nodes) -> None:
    """The same handle acquires twice: ``AlreadyAcquired`` -> False (``blocking=False``, or
    after ``timeout``), **RuntimeError** for a wait without a timeout; the owner re-enters
    only with ``reentrant=True`` (see the reentrancy rule)."""
    theirs = redis_lock.Lock(conn, "twice", expire=10)
    assert theirs.acquire(blocking=False)
    with pytest.raises(redis_lock.AlreadyAcquired):
        theirs.acquire(blocking=False)
    theirs.release()
    ours = rl.lock("twice", ttl=10)
    assert ours.acquire(blocking=False)
    assert ours.acquire(blocking=False) is False
    assert ours.acquire(timeout=0.1) is False
    with pytest.raises(RuntimeError):
        ours.acquire()
    ours.release()
    reentrant = make_redlock(redis_nodes).lock("twice", ttl=10, reentrant=True)
    assert reentrant.acquire(blocking=False) and reentrant.acquire(blocking=False)
    reentrant.release()
    assert reentrant.held  # one hold left
    reentrant.release()
    assert not rl.locked("twice")


def test_row_release_when_not_held(conn, rl) -> None:
    """``release()`` never acquired or after expiry raises ``NotAcquired`` -> ``LockNotOwned``
    (``LockLost`` when the lock was known lost while held)."""
    with pytest.raises(redis_lock.NotAcquired):
        redis_lock.Lock(conn, "norel", expire=10).release()
    theirs = redis_lock.Lock(conn, "norel", expire=1)
    assert theirs.acquire(blocking=False)
    wait_until(lambda: conn.exists("lock:norel") == 0, 10)
    with pytest.raises(redis_lock.NotAcquired):
        theirs.release()
    with pytest.raises(LockNotOwned):
        rl.lock("norel").release()
    ours = rl.lock("norel", ttl=0.3)
    assert ours.acquire(blocking=False)
    wait_until(lambda: not ours.held)
    with pytest.raises(LockNotOwned):
        ours.release()
    assert ours.acquire(blocking=False)
    rl.force_release("norel")
    with pytest.raises(LockLost):
        ours.release()


def test_row_extend_sets_the_expiry(conn, rl, redis_nodes) -> None:
    """``extend(expire=120)`` sets the lease to 120 s -> ``extend(ttl=120)``, the same; a
    lease longer than ``max_ttl`` (``MAX_TTL``: 60 s or the larger ``TTL``) is a
    ``ValueError`` before anything is sent."""
    theirs = redis_lock.Lock(conn, "ext", expire=60)
    assert theirs.acquire(blocking=False)
    theirs.extend(expire=120)
    assert 119000 < conn.pttl("lock:ext") <= 120000
    ours = rl.lock("ext", ttl=10)
    assert ours.acquire(blocking=False)
    assert ours.extend(ttl=50)
    assert all(49000 < p <= 50000 for p in pttls_on_nodes(redis_nodes, "ext"))
    with pytest.raises(ValueError, match="max_ttl"):
        ours.extend(ttl=120)
    assert all(p > 40000 for p in pttls_on_nodes(redis_nodes, "ext"))
    roomy = Redlock(redis_nodes.urls, max_ttl=300)
    try:
        long = roomy.lock("ext-long", ttl=60)
        assert long.acquire(blocking=False) and long.extend(ttl=120)
        long.release()
    finally:
        roomy.close()
    theirs.release()
    ours.release()


def test_row_extend_of_an_expired_lock_is_false(conn, rl) -> None:
    """``extend()`` of a lock that expired raises ``NotAcquired`` -> returns **False** (the
    handle is marked lost: ``held`` False, ``lock.lost`` says why)."""
    theirs = redis_lock.Lock(conn, "gone", expire=10)
    assert theirs.acquire(blocking=False)
    conn.delete("lock:gone")
    with pytest.raises(redis_lock.NotAcquired):
        theirs.extend(expire=10)
    ours = rl.lock("gone", ttl=10)
    assert ours.acquire(blocking=False)
    rl.force_release("gone")
    assert ours.extend() is False and ours.lost and not ours.held


def test_row_auto_renewal_is_auto_renew(conn, rl, make_redlock, redis_nodes) -> None:
    """``auto_renewal=True`` (renewed every ``expire * 2/3``) -> ``auto_renew=True``
    (renewed every ttl/3): the lock outlives its first lease while held."""
    theirs = redis_lock.Lock(conn, "renew", expire=1, auto_renewal=True)
    ours = rl.lock("renew", ttl=0.6, auto_renew=True)
    assert theirs.acquire(blocking=False) and ours.acquire(blocking=False)
    first = ours.token
    time.sleep(1.5)  # past both first leases: only renewal keeps them
    assert conn.exists("lock:renew") == 1
    assert ours.held and settled_tokens(redis_nodes, "renew") == [first] * 3
    assert make_redlock(redis_nodes).lock("renew").acquire(blocking=False) is False
    theirs.release()
    ours.release()


def test_row_locked_is_rl_locked(conn, rl) -> None:
    """``lock.locked()`` (anyone holds the name) -> ``rl.locked(name)``."""
    holder = redis_lock.Lock(conn, "any")
    assert redis_lock.Lock(conn, "any").locked() is False
    assert holder.acquire(blocking=False) and redis_lock.Lock(conn, "any").locked() is True
    assert rl.locked("any") is False
    lock = rl.lock("any")
    assert lock.acquire(blocking=False) and rl.locked("any") is True
    holder.release()
    lock.release()


def test_row_id_is_metadata(conn, rl) -> None:
    """``Lock(conn, name, id="worker-1")`` and ``get_owner_id()`` -> ``rl.lock(name,
    meta={"id": "worker-1"})`` and ``rl.lock_info(name).meta``; the token itself is random
    per acquisition (``lock.token``), never chosen by the caller."""
    theirs = redis_lock.Lock(conn, "who", id="worker-1")
    assert theirs.acquire(blocking=False)
    assert redis_lock.Lock(conn, "who").get_owner_id() in ("worker-1", b"worker-1")
    ours = rl.lock("who", meta={"id": "worker-1"})
    assert ours.acquire(blocking=False)
    info = rl.lock_info("who")
    assert info is not None and info.meta["id"] == "worker-1" and info.token == ours.token
    theirs.release()
    ours.release()


def test_row_only_the_owner_releases(conn, rl, redis_nodes) -> None:
    """Any thread may ``release()`` a python-redis-lock handle -> only the thread (asyncio
    task) that acquired, else **``LockNotOwned``** and nothing is sent; ``owner=`` names an
    owner threads share."""
    theirs = redis_lock.Lock(conn, "own", expire=10)
    assert theirs.acquire(blocking=False)
    assert run_owned(theirs.release) is None
    ours = rl.lock("own", ttl=10)
    assert ours.acquire(blocking=False)
    assert isinstance(run_owned(ours.release), LockNotOwned)
    assert settled_tokens(redis_nodes, "own") == [ours.token] * 3
    ours.release()
    shared = rl.lock("own", ttl=10, owner="import-job")
    assert shared.acquire(blocking=False)
    assert run_owned(shared.release) is None


def test_row_reset_is_force_release(conn, rl, redis_nodes, make_redlock) -> None:
    """``lock.reset()`` / ``reset_all(conn)`` (remove locks whoever holds them) ->
    ``rl.force_release(name)``, one name at a time (no "remove all"); the holder's ``lost``
    is set at once when the same Redlock released it, without a call when it holds with
    ``auto_renew``, else at its next ``check()`` (its ``release()`` would raise
    LockNotOwned: test_a_holder_without_auto_renew_learns_of_a_force_release_at_its_next_call)."""
    assert redis_lock.Lock(conn, "a").acquire(blocking=False)
    assert redis_lock.Lock(conn, "b").acquire(blocking=False)
    redis_lock.reset_all(conn)
    assert conn.exists("lock:a", "lock:b") == 0
    ours = rl.lock("a", ttl=10)
    assert ours.acquire(blocking=False)
    held_everywhere(redis_nodes, "a")
    assert rl.force_release("a") == 3
    assert not rl.locked("a")
    assert ours.lost and not ours.held  # the same client: at once
    operator = make_redlock(redis_nodes)
    renewed, plain = rl.lock("r", ttl=10, auto_renew=True), rl.lock("p", ttl=10)
    assert renewed.acquire(blocking=False) and plain.acquire(blocking=False)
    assert operator.force_release("r") == 3 and operator.force_release("p") == 3
    wait_until(lambda: renewed.lost, timeout=10)  # heard: no call of the holder's
    assert not renewed.held
    assert plain.lost is None and plain.held  # told nothing
    assert plain.check() is False and plain.lost and not plain.held


def test_row_one_node_becomes_a_quorum(redis_cluster_factory, make_redlock) -> None:
    """python-redis-lock locks one Redis: that server restarting empty loses the lock, and a
    second client takes it while the first still holds it -> a quorum holds it: one node
    restarting empty changes nothing, and it does not vote until its guard ends."""
    cluster = redis_cluster_factory(3)  # its own: a node restarts empty
    conn = node_client(cluster[0])
    theirs = redis_lock.Lock(conn, "job", expire=30)
    assert theirs.acquire(blocking=False)
    rl = make_redlock(cluster)
    ours = rl.lock("job", ttl=30)
    assert ours.acquire(blocking=False)
    cluster[0].restart(empty=True)
    conn.close()
    conn = node_client(cluster[0])
    try:
        assert redis_lock.Lock(conn, "job", expire=30).acquire(blocking=False)  # twice held
    finally:
        conn.close()
    assert make_redlock(cluster).lock("job").acquire(blocking=False) is False
    assert ours.check()
    ours.release()


def test_every_row_of_the_guide_is_a_test_here() -> None:
    """The guide's table and this file name each other, row for test."""
    assert_rows_match(sys.modules[__name__], "python-redis-lock")
