"""The Lock contract on three real redis-server nodes: acquire/release, held, validity, check,
tokens, contention, blocking with a timeout, extend, force_release, listing, fencing, and the
rule that no lock key ever exists without an expiry."""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
import time

import pytest

from django_redlock import LockLost, LockNotAcquired, LockNotOwned, QuorumError
from django_redlock.testing import RedisCluster
from tests.helpers import (
    all_keys,
    held_everywhere,
    pttls_on_nodes,
    release_listeners,
    script_calls,
    settled_lock_keys,
    settled_tokens,
    wait_until,
    warm_up,
)

HEX32 = re.compile(r"^[0-9a-f]{32}$")


def test_acquire_release_held_validity_check(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("basic", ttl=5.0)
    assert not lock.held and lock.validity == 0.0 and lock.token is None
    assert lock.acquire(blocking=False) is True
    assert lock.held
    assert 0 < lock.validity <= 5.0
    assert lock.check() is True
    # The token is on every node, with a lease no longer than the ttl.
    assert settled_tokens(redis_nodes, "basic") == [lock.token] * 3
    assert all(0 < p <= 5000 for p in pttls_on_nodes(redis_nodes, "basic"))
    lock.release()
    assert not lock.held and lock.validity == 0.0
    assert lock.check() is False
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_held_turns_false_when_the_lease_runs_out(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("short", ttl=0.3)
    assert lock.acquire(blocking=False)
    time.sleep(0.35)  # let the TTL expire
    assert not lock.held
    assert lock.validity == 0.0
    assert lock.check() is False


def test_token_is_32_hex_and_new_per_acquisition(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("tok")
    seen = set()
    for _ in range(5):
        assert lock.acquire(blocking=False)
        assert HEX32.match(lock.token), lock.token
        seen.add(lock.token)
        lock.release()
    assert len(seen) == 5


def test_context_manager_raises_when_held_elsewhere(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    holder, other = make_redlock(redis_nodes), make_redlock(redis_nodes)
    with holder.lock("cm", ttl=5.0) as held:
        assert held.held
        with pytest.raises(LockNotAcquired) as info:
            with other.lock("cm", blocking=False):
                pytest.fail("the body must not run")  # pragma: no cover
        assert type(info.value) is LockNotAcquired  # busy, not a node failure
        assert info.value.name == "cm"
        assert 0 < info.value.retry_after <= 5.0
        assert held.check()
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]
    # Free again: the other client's context manager now works.
    with other.lock("cm", blocking=False) as mine:
        assert mine.held


def test_non_blocking_is_one_attempt_with_retry_after(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    holder, other = make_redlock(redis_nodes), make_redlock(redis_nodes)
    h = holder.lock("nb", ttl=2.0)
    assert h.acquire(blocking=False)
    time.sleep(0.5)  # let part of the lease pass, so retry_after must reflect the remainder
    before = script_calls(redis_nodes)
    contender = other.lock("nb")
    t0 = time.monotonic()
    assert contender.acquire(blocking=False) is False
    elapsed = time.monotonic() - t0
    after = script_calls(redis_nodes)
    assert elapsed < 0.25
    # One attempt: one acquire script per node, no retry (a refused attempt with no grant
    # sends no release either).
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    remaining = min(pttls_on_nodes(redis_nodes, "nb")) / 1000
    assert contender.retry_after is not None
    assert abs(contender.retry_after - remaining) < 0.1, (contender.retry_after, remaining)
    assert 1.2 < contender.retry_after <= 1.55
    h.release()


def test_an_uncontended_blocking_acquire_costs_what_a_non_blocking_one_does(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    """A blocking acquire of a name nobody wants is one plain SET per node (its connections
    saw the nodes vote), as a non-blocking one is: no script, no subscription, no thread."""
    rl = make_redlock(redis_nodes)
    warm_up(rl)
    threads = threading.active_count()
    for blocking in (False, True):
        before = node_calls(redis_nodes)
        lock = rl.lock("uncontended")
        assert lock.acquire(timeout=5) if blocking else lock.acquire(blocking=False)
        after = node_calls(redis_nodes)
        lock.release()
        sent = [
            {c: a.get(c, 0) - b.get(c, 0) for c in ("set", "evalsha", "subscribe")}
            for b, a in zip(before, after, strict=True)
        ]
        assert sent == [{"set": 1, "evalsha": 0, "subscribe": 0}] * 3, (blocking, sent)
    assert threading.active_count() == threads


def test_blocking_with_timeout_gives_up_after_about_timeout(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    holder, other = make_redlock(redis_nodes), make_redlock(redis_nodes, retry_delay=0.05)
    h = holder.lock("bt", ttl=5.0)
    assert h.acquire(blocking=False)
    contender = other.lock("bt")
    t0 = time.monotonic()
    assert contender.acquire(timeout=0.4) is False
    elapsed = time.monotonic() - t0
    # At once after its timeout, well short of the holder's 5 s lease (a loaded host adds to
    # the time a give-up takes, not to the timeout itself).
    assert 0.4 <= elapsed < 0.4 + 2.0, elapsed
    assert h.check()
    h.release()


def test_acquire_after_the_holder_releases(redis_nodes: RedisCluster, make_redlock) -> None:
    # A long jittered retry delay (2.5-5 s): a waiter that merely polled would be slow to
    # notice the release; the core wakes waiters on the release notice instead.
    holder, other = make_redlock(redis_nodes), make_redlock(redis_nodes, retry_delay=5.0)
    h = holder.lock("handoff", ttl=10.0)
    assert h.acquire(blocking=False)
    contender = other.lock("handoff")
    assert contender.acquire(blocking=False) is False
    result: dict[str, object] = {}
    checked = threading.Event()

    def wait_for_it() -> None:
        t0 = time.monotonic()
        result["ok"] = contender.acquire(timeout=8.0)
        result["waited"] = time.monotonic() - t0
        result["held"] = contender.held and contender.check()
        checked.wait(10)
        contender.release()  # by the thread that took it: a handle belongs to its acquirer

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    # The waiter has tried once and is now waiting: it subscribed to the release channel.
    wait_until(lambda: all(release_listeners(n, "redlock:released:handoff") for n in redis_nodes))
    released_at = time.monotonic()
    h.release()
    wait_until(lambda: "held" in result, timeout=10)
    # Woken by the release, not by the holder's 10 s lease running out.
    assert time.monotonic() - released_at < 2.0
    assert result["ok"] is True and result["held"] is True
    checked.set()
    waiter.join(10)
    assert not waiter.is_alive() and not contender.held


def test_locked_reports_the_quorum_view(redis_nodes: RedisCluster, make_redlock) -> None:
    rl, observer = make_redlock(redis_nodes), make_redlock(redis_nodes)
    assert observer.locked("lk") is False
    lock = rl.lock("lk", ttl=5.0)
    assert lock.acquire(blocking=False)
    assert observer.locked("lk") is True
    assert rl.locked("lk") is True
    # One node's copy alone is not a lock: with 2 of 3 copies gone nobody holds it.
    for node in list(redis_nodes)[:2]:
        with node.client() as c:
            c.delete("redlock:lock:lk")
    assert observer.locked("lk") is False
    with pytest.raises(LockNotOwned):
        lock.release()
    assert observer.locked("lk") is False


def test_extend_rearms_the_nodes_and_recomputes_validity(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("ext", ttl=1.0)
    assert lock.acquire(blocking=False)
    time.sleep(0.3)  # let part of the lease pass
    before = pttls_on_nodes(redis_nodes, "ext")
    validity_before = lock.validity
    assert all(0 < p <= 700 for p in before), before
    assert lock.extend(5.0) is True
    after = pttls_on_nodes(redis_nodes, "ext")
    assert all(4500 < p <= 5000 for p in after), after
    assert 4.5 < lock.validity <= 5.0
    assert lock.validity > validity_before
    # Default ttl: the lock's own (1 s) again, not the 5 s of the last extend.
    assert lock.extend() is True
    assert all(0 < p <= 1000 for p in pttls_on_nodes(redis_nodes, "ext"))
    assert 0.8 < lock.validity <= 1.0
    assert settled_tokens(redis_nodes, "ext") == [lock.token] * 3
    lock.release()


def test_extend_fails_once_the_lock_is_gone(redis_nodes: RedisCluster, make_redlock) -> None:
    rl, other = make_redlock(redis_nodes), make_redlock(redis_nodes)
    lock = rl.lock("ext-gone", ttl=0.3)
    assert lock.acquire(blocking=False)
    time.sleep(0.35)  # let the TTL expire
    thief = other.lock("ext-gone", ttl=5.0)
    assert thief.acquire(blocking=False)
    assert lock.extend(5.0) is False
    assert not lock.held
    # The thief's lease was not touched by the failed extend.
    assert settled_tokens(redis_nodes, "ext-gone") == [thief.token] * 3
    assert all(4000 < p <= 5000 for p in pttls_on_nodes(redis_nodes, "ext-gone"))
    thief.release()


def test_force_release_returns_the_node_count(redis_nodes: RedisCluster, make_redlock) -> None:
    rl, admin = make_redlock(redis_nodes), make_redlock(redis_nodes)
    assert admin.force_release("nothing-here") == 0
    lock = rl.lock("fr", ttl=5.0)
    assert lock.acquire(blocking=False)
    held_everywhere(redis_nodes, "fr")
    assert admin.force_release("fr") == 3
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]
    assert lock.check() is False
    with pytest.raises(LockNotOwned):
        lock.release()
    # A lock present on only two nodes: two removed.
    again = rl.lock("fr", ttl=5.0)
    assert again.acquire(blocking=False)
    with redis_nodes[0].client() as c:
        c.delete("redlock:lock:fr")
    assert admin.force_release("fr") == 2
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_live_locks_and_lock_info_show_the_holder(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, meta={"service": "billing"})
    viewer = make_redlock(redis_nodes)
    a = rl.lock("inv:1", ttl=5.0, meta={"job": "j1", "user": 42})
    b = rl.lock("inv:2", ttl=5.0)
    c = rl.lock("other", ttl=5.0)
    results: dict[str, bool] = {}
    taken, listed = threading.Event(), threading.Event()

    def take() -> None:
        results["a"] = a.acquire(blocking=False)
        taken.set()
        listed.wait(10)
        a.release()  # a handle belongs to the thread that acquired it

    worker = threading.Thread(target=take, name="invoice-worker")
    worker.start()
    assert taken.wait(10)
    assert results["a"]
    assert b.acquire(blocking=False) and c.acquire(blocking=False)

    info = viewer.lock_info("inv:1")
    assert info is not None
    assert info.name == "inv:1"
    assert info.token == a.token
    assert info.meta["host"] == socket.gethostname()
    assert info.meta["pid"] == os.getpid()
    assert info.meta["thread"] == "invoice-worker"
    assert info.meta["job"] == "j1" and info.meta["user"] == 42
    assert info.meta["service"] == "billing"
    assert info.nodes == 3 and info.total_nodes == 3 and info.quorum == 2
    assert 0 < info.ttl <= 5.0
    assert info.acquired_at is not None
    assert not info.split

    names = [i.name for i in viewer.live_locks("inv:*")]
    assert names == ["inv:1", "inv:2"]
    assert sorted(i.name for i in viewer.live_locks()) == ["inv:1", "inv:2", "other"]
    assert viewer.lock_info("absent") is None
    for lock in (b, c):
        lock.release()
    listed.set()
    worker.join(10)
    assert not a.held
    assert list(viewer.live_locks()) == []


def test_fencing_tokens_strictly_increase(redis_nodes: RedisCluster, make_redlock) -> None:
    one, two = make_redlock(redis_nodes), make_redlock(redis_nodes)
    fences = []
    for i in range(8):
        client = one if i % 2 == 0 else two
        lock = client.lock("fenced", ttl=5.0, fencing=True)
        assert lock.acquire(blocking=False)
        assert isinstance(lock.fence, int)
        fences.append(lock.fence)
        info = client.lock_info("fenced")
        assert info is not None and info.fence == lock.fence
        lock.release()
    assert all(a < b for a, b in itertools.pairwise(fences)), fences
    # Without fencing there is no fence.
    plain = one.lock("plain")
    assert plain.acquire(blocking=False)
    assert plain.fence is None
    plain.release()


def test_fence_keeps_increasing_after_a_lease_expires(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    one, two = make_redlock(redis_nodes), make_redlock(redis_nodes)
    first = one.lock("fenced-exp", ttl=0.2, fencing=True)
    assert first.acquire(blocking=False)
    time.sleep(0.25)  # let the TTL expire without a release
    second = two.lock("fenced-exp", ttl=5.0, fencing=True)
    assert second.acquire(blocking=False)
    assert second.fence > first.fence
    second.release()


def test_every_lock_key_has_an_expiry_on_every_node(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    held = []
    for i, kwargs in enumerate([{}, {"fencing": True}, {"ttl": 0.5}, {"meta": {"a": 1}}]):
        lock = rl.lock(f"exp:{i}", **kwargs)
        assert lock.acquire(blocking=False)
        held.append(lock)
    held[0].extend(7.0)
    for node_keys in all_keys(redis_nodes):
        lock_entries = {k: p for k, p in node_keys.items() if k.startswith("redlock:lock:")}
        assert len(lock_entries) == 4, node_keys
        for key, pttl in lock_entries.items():
            ttl_ms = 7000 if key == "redlock:lock:exp:0" else (500 if key.endswith(":2") else 30000)
            assert 0 < pttl <= ttl_ms, (key, pttl)
        # The only keys allowed without expiry are documented bookkeeping: the fencing counter
        # (must outlive leases to stay monotonic) and the node's restart-guard marker.
        for key, pttl in node_keys.items():
            if pttl == -1:
                assert key in ("redlock:node", "redlock:fence:exp:1"), key
    for lock in held:
        lock.release()
    for node_keys in all_keys(redis_nodes):
        assert not any(k.startswith("redlock:lock:") for k in node_keys)


def test_release_twice_raises_not_owned(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("twice")
    assert lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(LockNotOwned):
        lock.release()


def test_wait_until_helper_sanity() -> None:
    assert wait_until(lambda: 7, timeout=0.1) == 7
    with pytest.raises(AssertionError):
        wait_until(lambda: False, timeout=0.02)


def test_concurrent_first_use_of_a_fresh_cluster(redis_nodes: RedisCluster, make_redlock) -> None:
    """Eight threads take eight different names at once on a cluster nobody used yet (as
    when a new deployment's workers start together). Every node is healthy and every name is
    free, so every non-blocking attempt must succeed. Repeated on re-emptied nodes because
    the failure is a race (it shows in most rounds). A generous node_timeout: a node too slow
    to answer the first contact (a loaded CI machine) rightly keeps the cluster from being
    trusted as brand-new (docs/guarantees.rst), which is not the race tested here."""
    threads = 8
    for round_ in range(15):
        for node in redis_nodes:
            node.flush()
        rl = make_redlock(redis_nodes, node_timeout=1.0)
        errors: list[BaseException] = []
        results: list[bool] = []
        gate = threading.Barrier(threads)

        def take(i: int, rl=rl, gate=gate, errors=errors, results=results) -> None:
            gate.wait(10)
            try:
                lock = rl.lock(f"fresh:{i}")
                results.append(lock.acquire(blocking=False))
                lock.release()
            except QuorumError as exc:
                errors.append(exc)

        workers = [threading.Thread(target=take, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(10)
        assert not errors, f"round {round_}: {errors[0]}"
        assert results == [True] * threads, f"round {round_}: {results}"


def test_lock_events_reach_the_log_without_listeners(
    redis_nodes: RedisCluster, make_redlock, caplog
) -> None:
    """Events are built only for someone: a listener, or the ``django_redlock`` logger at the
    event's level (DEBUG for acquired/released)."""
    rl = make_redlock(redis_nodes)
    assert rl.listeners == []
    with rl.lock("logged"):
        pass
    assert not [r for r in caplog.records if getattr(r, "lock_name", None) == "logged"]
    caplog.set_level(logging.DEBUG, logger="django_redlock")
    with rl.lock("logged"):
        pass
    kinds = [r.lock_event for r in caplog.records if getattr(r, "lock_name", None) == "logged"]
    assert kinds == ["acquired", "released"]


def test_a_lost_lock_says_why_in_its_log_line(
    redis_nodes: RedisCluster, make_redlock, caplog
) -> None:
    """The WARNING a lost lock logs names the reason in its text, not only in ``extra``: a
    log reader must tell "the nodes refused" from a paused process or a late renewal."""
    rl = make_redlock(redis_nodes)
    lock = rl.lock("logged-lost", ttl=5)
    assert lock.acquire(blocking=False)
    caplog.set_level(logging.WARNING, logger="django_redlock")
    held_everywhere(redis_nodes, "logged-lost")
    assert rl.force_release("logged-lost") == 3
    [record] = [r for r in caplog.records if getattr(r, "lock_event", None) == "lost"]
    assert record.lock_reason == "force-released by an operator"
    assert record.getMessage() == "lock logged-lost lost: force-released by an operator"


def test_a_holder_without_auto_renew_learns_of_a_force_release_at_its_next_call(
    redis_nodes, make_redlock
) -> None:
    """docs/backends.rst, the Redlock: only ``auto_renew`` holders listen for force releases
    (test_force_release_turns_holder_held_false). A holder without it learns of one done by
    its own client at once, and of one done by another client (another process, the admin,
    manage.py redlock release) at its next ``check()`` (False, ``lost`` set, then
    ``release()`` raises LockLost), ``extend()`` (False, ``lost`` set) or ``release()``
    (LockNotOwned: it did not know)."""
    rl = make_redlock(redis_nodes, node_timeout=0.5)
    operator = make_redlock(redis_nodes, node_timeout=0.5)

    own = rl.lock("forced-plain-own", ttl=30)
    assert own.acquire(blocking=False)
    held_everywhere(redis_nodes, "forced-plain-own")
    assert rl.force_release("forced-plain-own") == 3
    assert not own.held and "force" in (own.lost or "")
    with pytest.raises(LockLost):
        own.release()

    checked, extended, released = (rl.lock(f"forced-plain-{n}", ttl=30) for n in range(3))
    for lock in (checked, extended, released):
        assert lock.acquire(blocking=False)
        held_everywhere(redis_nodes, lock.name)
        assert operator.force_release(lock.name) == 3
    # Nothing tells them: the operator's notice reaches listening holders only, and the
    # round trips above (the other two force releases) gave it time to arrive.
    assert all(lock.held and lock.lost is None for lock in (checked, extended, released))
    assert checked.check() is False and checked.lost and not checked.held
    with pytest.raises(LockLost):
        checked.release()
    assert extended.extend() is False and extended.lost and not extended.held
    with pytest.raises(LockLost):
        extended.release()
    with pytest.raises(LockNotOwned) as raised:
        released.release()
    assert type(raised.value) is LockNotOwned, raised.value
    assert not any(rl.locked(lock.name) for lock in (own, checked, extended, released))


def test_a_fresh_clients_first_lock_is_on_every_healthy_node(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    # A fresh client opens its connections while the acquire waits: the node whose connection
    # opens last still gets its copy (a lock on a bare quorum is lost to one more failure).
    # The connection threads finish in any order, so many fresh clients are tried.
    for attempt in range(25):
        rl = make_redlock(redis_nodes)
        lock = rl.lock(f"fresh-first:{attempt}", ttl=30)
        assert lock.acquire(blocking=False)
        assert settled_tokens(redis_nodes, lock.name) == [lock.token] * 3, attempt
        lock.release()
        rl.close()
