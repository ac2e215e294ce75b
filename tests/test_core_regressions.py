"""Regression tests for the faults found by testing from outside the project, one per
fault and named after it, on real redis-server processes (sync and async where the fault
existed in both clients)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import threading
import time

import pytest

from django_redlock import AsyncRedlock, QuorumError, Redlock
from django_redlock.core import validation
from tests.helpers import (
    held_everywhere,
    node_client,
    occupy,
    release_listeners,
    settled_tokens,
    tokens_on_nodes,
    vacate,
    wait_until,
    warm_up,
)

pytestmark = pytest.mark.faults


def _hold_on_first_two(cluster, rl, name: str, ttl: float):
    """A lock held on exactly nodes 0 and 1 of 3 (a bare quorum)."""
    occupy(cluster[2], name)
    lock = rl.lock(name, ttl=ttl)
    assert lock.acquire(blocking=False)
    vacate(cluster[2], name)
    assert tokens_on_nodes(cluster, name) == [lock.token, lock.token, None]
    return lock


def _try(rl, name: str) -> bool:
    try:
        return bool(rl.lock(name).acquire(blocking=False))
    except QuorumError:
        return False


# ---- 1. orphan lease after a brief freeze -----------------------------------------------------


def _freeze_two_and_fail(cluster, attempt) -> None:
    cluster[1].pause()
    cluster[2].pause()
    try:
        with pytest.raises(QuorumError):
            attempt()
        time.sleep(0.2)  # the freeze lasts ~0.2 s in all (the fault's own duration)
    finally:
        cluster[1].resume()
        cluster[2].resume()


def test_orphan_lease_after_brief_freeze(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    lock = rl.lock("orphan")
    _freeze_two_and_fail(cluster, lambda: lock.acquire(blocking=False))
    # The undo went out behind the acquire on each frozen node's connection: once the nodes
    # run again, the key is free within a round trip (not after the 30 s lease).
    wait_until(lambda: tokens_on_nodes(cluster, "orphan") == [None] * 3, timeout=1.0)


def test_orphan_lease_after_brief_freeze_async(redis_cluster_factory) -> None:
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.05)
        try:
            async with rl.lock("warm-up"):
                pass
            lock = rl.lock("orphan")
            cluster[1].pause()
            cluster[2].pause()
            try:
                with pytest.raises(QuorumError):
                    await lock.acquire(blocking=False)
                await asyncio.sleep(0.2)
            finally:
                cluster[1].resume()
                cluster[2].resume()
        finally:
            await rl.close()

    asyncio.run(main())
    wait_until(lambda: tokens_on_nodes(cluster, "orphan") == [None] * 3, timeout=1.0)


# ---- 2. a node that lost its data without restarting --------------------------------------


def test_flushed_node_does_not_vote_at_once(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    kw = {"ttl": 0.8, "max_ttl": 1.0, "node_timeout": 0.1}
    a_rl = make_redlock(cluster, **kw)
    b_rl = make_redlock(cluster, **kw)
    warm_up(a_rl)
    time.sleep(1.2)  # every node is up longer than max_ttl (a duration, not a sync)
    a = _hold_on_first_two(cluster, a_rl, "flushed", ttl=0.8)
    with node_client(cluster[0]) as c:
        c.flushall()
    assert not _try(b_rl, "flushed"), "a flushed node voted at once: double grant"
    assert a.held
    guarded = b_rl.health()[0]
    assert guarded.guarded_for and guarded.guarded_for > 0.5, guarded


# ---- 3. (tests/test_trust.py) -------------------------------------------------------------

# ---- 4. leaks -------------------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_fd_or_thread_leak_after_200_cycles(redis_nodes) -> None:
    # A lease the 200 cycles cannot outlast on a loaded host (no renewal: its connections
    # would be counted).
    holder = Redlock(redis_nodes.urls, max_ttl=600)
    held = holder.lock("leak", ttl=600)
    assert held.acquire(blocking=False)
    try:
        gc.collect()
        fds, threads = _fds(), threading.active_count()
        for _ in range(200):
            rl = Redlock(redis_nodes.urls, node_timeout=0.5)
            # A blocking attempt that fails: it subscribes to the release channel (the
            # listener thread and its connections) before giving up.
            assert not rl.lock("leak").acquire(timeout=0.01)
            rl.close()
        gc.collect()
        wait_until(lambda: (_fds(), threading.active_count()) == (fds, threads), timeout=5)
    finally:
        held.release()
        holder.close()


def test_no_fd_or_thread_leak_after_200_cycles_async(redis_nodes) -> None:
    async def main() -> None:
        # A lease the 200 cycles cannot outlast on a loaded host (no renewal: its
        # connections would be counted).
        holder = AsyncRedlock(redis_nodes.urls, max_ttl=600)
        held = holder.lock("leak", ttl=600)
        assert await held.acquire(blocking=False)
        try:
            gc.collect()
            fds, threads = _fds(), threading.active_count()
            for _ in range(200):
                rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.5)
                assert not await rl.lock("leak").acquire(timeout=0.01)
                await rl.close()
            gc.collect()
            deadline = time.monotonic() + 5
            while (_fds(), threading.active_count()) != (fds, threads):
                assert time.monotonic() < deadline, ((_fds(), fds), threading.enumerate())
                await asyncio.sleep(0.01)
        finally:
            await held.release()
            await holder.close()

    asyncio.run(main())


# ---- 5. force release is seen by the holder -----------------------------------------------


def test_force_release_turns_holder_held_false(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, node_timeout=0.5)
    operator = make_redlock(redis_nodes, node_timeout=0.5)
    lock = rl.lock("forced", ttl=9.0, auto_renew=True)
    assert lock.acquire(blocking=False)
    held_everywhere(redis_nodes, "forced")
    assert operator.force_release("forced") == 3
    # Renewal is due only after 3 s: the notice must come well before.
    wait_until(lambda: not lock.held, timeout=1.0)
    assert "force" in (lock.lost or "")


def test_force_release_turns_holder_held_false_async(redis_nodes, make_redlock) -> None:
    operator = make_redlock(redis_nodes, node_timeout=0.5)

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.5)
        try:
            lock = rl.lock("forced", ttl=9.0, auto_renew=True)
            assert await lock.acquire(blocking=False)
            await asyncio.get_running_loop().run_in_executor(None, operator.force_release, "forced")
            deadline = time.monotonic() + 1.0
            while lock.held:
                assert time.monotonic() < deadline, "the holder never heard the force release"
                await asyncio.sleep(0.01)
            assert "force" in (lock.lost or "")
        finally:
            await rl.close()

    asyncio.run(main())


# ---- 7. the restart guard survives rolling restarts ----------------------------------------


def _armed_after_warm_up(rl, node, name: str) -> bool:
    warm_up(rl, name)
    with node_client(node) as client:
        return bool(client.exists("redlock:node"))


def test_restart_guard_survives_rolling_restarts(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    kw = {"ttl": 0.8, "max_ttl": 1.0, "node_timeout": 0.1}
    a_rl = make_redlock(cluster, **kw)
    b_rl = make_redlock(cluster, **kw)
    warm_up(a_rl)
    for index in range(3):  # a rolling upgrade, restarts spaced beyond max_ttl
        cluster[index].restart(empty=True)
        # The other two vote; an acquire arms the restarted node's marker. It ends once those
        # two granted, so the restarted node may first be reached by the next acquire.
        wait_until(lambda i=index: _armed_after_warm_up(a_rl, cluster[i], f"arm-{i}"))
        time.sleep(1.2)  # the guard of the restarted node runs out (a duration, not a sync)
    a = _hold_on_first_two(cluster, a_rl, "rolling", ttl=0.8)
    cluster[0].restart(empty=True)
    assert not _try(b_rl, "rolling"), "the restarted node voted at once: double grant"
    assert a.validity > 0
    health = b_rl.health()
    assert health[0].guarded_for and health[0].guarded_for > 0.5, health[0]
    assert [h.guarded_for for h in health[1:]] == [0.0, 0.0]


# ---- 8. a forked child does not release its parent's lock ----------------------------------


def _fork_inside(hold) -> None:
    parent = os.getpid()
    try:
        hold()
    except BaseException:
        if os.getpid() != parent:
            os._exit(0)
        raise
    if os.getpid() != parent:
        os._exit(0)


def test_forked_child_does_not_release_parents_lock(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    third = make_redlock(redis_nodes)

    def hold() -> None:
        with rl.lock("forked", ttl=5) as lock:
            pid = os.fork()
            if pid == 0:
                raise SystemExit(0)  # unwinds the with block in the child only
            os.waitpid(pid, 0)
            assert settled_tokens(redis_nodes, "forked") == [lock.token] * 3
            assert not _try(third, "forked")
            assert lock.held

    _fork_inside(hold)


def test_forked_child_does_not_release_parents_lock_async(redis_nodes, make_redlock) -> None:
    third = make_redlock(redis_nodes)

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls)
        try:
            async with rl.lock("forked", ttl=5) as lock:
                pid = os.fork()
                if pid == 0:
                    raise SystemExit(0)
                os.waitpid(pid, 0)
                assert settled_tokens(redis_nodes, "forked") == [lock.token] * 3
                assert not _try(third, "forked")
                assert lock.held
        finally:
            await rl.close()

    _fork_inside(lambda: asyncio.run(main()))


# ---- 9. a paused node costs no renewed lock -------------------------------------------------


def test_paused_node_costs_no_renewed_lock(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    # 0.2 s per silent node: one per round is harmless, one per lease (60) loses most of them.
    rl = make_redlock(cluster, node_timeout=0.2)
    warm_up(rl)
    locks = [rl.lock(f"renewed:{i}", ttl=1.5, auto_renew=True) for i in range(60)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    with cluster[2].paused():
        time.sleep(4.0)  # several renewal rounds (every 0.5 s) with one node silent
    lost = [lock.name for lock in locks if not lock.held]
    assert lost == [], f"{len(lost)} of 60 renewed locks lost to one paused node"
    for lock in locks:
        lock.release()


def test_paused_node_costs_no_renewed_lock_async(redis_cluster_factory) -> None:
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.2)
        try:
            locks = [rl.lock(f"renewed:{i}", ttl=1.5, auto_renew=True) for i in range(60)]
            for lock in locks:
                assert await lock.acquire(blocking=False)
            cluster[2].pause()
            try:
                await asyncio.sleep(4.0)
            finally:
                cluster[2].resume()
            lost = [lock.name for lock in locks if not lock.held]
            assert lost == [], f"{len(lost)} of 60 renewed locks lost to one paused node"
            for lock in locks:
                await lock.release()
        finally:
            await rl.close()

    asyncio.run(main())


# ---- 10. the release-notice listener survives connection resets ----------------------------


def _kill_subscribers(cluster) -> None:
    for node in cluster:
        with node_client(node) as c:
            c.client_kill_filter(_type="pubsub")


def _subscribed(cluster, channel: str) -> bool:
    return all(release_listeners(node, channel) >= 1 for node in cluster)


def test_release_notice_listener_survives_connection_resets(redis_nodes, make_redlock) -> None:
    # A generous node timeout: the machine is shared, and a slow answer is not the point here.
    holder = make_redlock(redis_nodes, node_timeout=0.5)
    waiter = make_redlock(redis_nodes, node_timeout=0.5)
    for _ in range(3):
        a = holder.lock("resets", ttl=8)
        assert a.acquire(blocking=False)
        got: list[bool] = []
        b = waiter.lock("resets", ttl=8, owner="waiter")
        thread = threading.Thread(target=lambda b=b, got=got: got.append(b.acquire(timeout=10)))
        thread.start()
        wait_until(lambda: _subscribed(redis_nodes, "redlock:released:resets"))
        _kill_subscribers(redis_nodes)
        # The listener reconnects and subscribes again.
        wait_until(lambda: _subscribed(redis_nodes, "redlock:released:resets"), timeout=3)
        released = time.monotonic()
        a.release()
        thread.join(10)
        assert got == [True]
        assert time.monotonic() - released < 2.0, "the waiter slept through the release"
        b.release()


def test_release_notice_listener_survives_connection_resets_async(
    redis_nodes, make_redlock
) -> None:
    holder = make_redlock(redis_nodes, node_timeout=0.5)

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.5)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(3):
                a = holder.lock("resets", ttl=8, owner="holder")
                assert a.acquire(blocking=False)
                b = rl.lock("resets", ttl=8)
                task = asyncio.create_task(b.acquire(timeout=10))
                channel = "redlock:released:resets"
                while not await loop.run_in_executor(None, _subscribed, redis_nodes, channel):
                    await asyncio.sleep(0.005)
                await loop.run_in_executor(None, _kill_subscribers, redis_nodes)
                deadline = time.monotonic() + 3
                while not await loop.run_in_executor(None, _subscribed, redis_nodes, channel):
                    assert time.monotonic() < deadline, "the listener did not reconnect"
                    await asyncio.sleep(0.01)
                released = time.monotonic()
                await loop.run_in_executor(None, a.release)
                assert await asyncio.wait_for(task, 10)
                assert time.monotonic() - released < 2.0, "the waiter slept through the release"
                await b.release()
        finally:
            await rl.close()

    asyncio.run(main())


# ---- 11. a node that does not speak Redis ---------------------------------------------------


@contextlib.contextmanager
def _not_redis():
    """A TCP service that answers everything like a web server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join()
        server.close()


def test_non_redis_service_is_a_failed_node_and_attempt_undone(redis_nodes, make_redlock) -> None:
    warm_up(make_redlock(redis_nodes))  # a cluster in service (markers armed and trusted)
    with _not_redis() as bogus, _not_redis() as bogus2:
        rl = make_redlock([redis_nodes.urls[0], bogus, bogus2])
        with pytest.raises(QuorumError) as info:
            rl.lock("bogus").acquire(blocking=False)
        assert bogus in str(info.value) and "Redis" in str(info.value)
        assert tokens_on_nodes(redis_nodes, "bogus")[0] is None
        two_good = make_redlock([*redis_nodes.urls[:2], bogus])
        lock = two_good.lock("bogus")
        assert lock.acquire(blocking=False)  # 2 of 3 is a quorum; the bogus node failed
        lock.release()


def test_non_redis_service_is_a_failed_node_and_attempt_undone_async(
    redis_nodes, make_redlock
) -> None:
    warm_up(make_redlock(redis_nodes))
    with _not_redis() as bogus, _not_redis() as bogus2:

        async def main() -> None:
            rl = AsyncRedlock([redis_nodes.urls[0], bogus, bogus2])
            try:
                with pytest.raises(QuorumError) as info:
                    await rl.lock("bogus").acquire(blocking=False)
                assert bogus in str(info.value) and "Redis" in str(info.value)
            finally:
                await rl.close()

        asyncio.run(main())
        assert tokens_on_nodes(redis_nodes, "bogus")[0] is None


# ---- 12. per-name state is bounded ----------------------------------------------------------


def test_per_name_state_is_bounded(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, node_timeout=0.5)
    other = make_redlock(redis_nodes, node_timeout=0.5)
    for i in range(50):
        name = f"entity:{i}"
        a = rl.lock(name)
        assert a.acquire()
        # A second owner in this process times out in the local queue.
        assert not rl.lock(name, owner="someone else").acquire(timeout=0.01)
        # A waiter in another process is woken by the release (a courtesy entry here).
        woken = other.lock(name, owner="woken")
        thread = threading.Thread(target=woken.acquire, kwargs={"timeout": 5})
        thread.start()
        wait_until(lambda name=name: _subscribed(redis_nodes, f"redlock:released:{name}"))
        a.release()
        thread.join(5)
        assert woken.held
        woken.release()
    # Only the names in use keep state (none now; at most the last wake-up's courtesy).
    assert rl._queues == {}
    assert len(rl.leases._yield_until) <= 1


def test_per_name_state_is_bounded_async(redis_nodes) -> None:
    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.5)
        try:
            for i in range(50):
                name = f"entity:{i}"
                a = rl.lock(name)
                assert await a.acquire()
                assert not await rl.lock(name, owner="someone else").acquire(timeout=0.01)
                await a.release()
            assert rl._state().queues == {}
        finally:
            await rl.close()

    asyncio.run(main())


# ---- 13. huge durations refused up front ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 1e300, "max_ttl": 1e300},
        {"max_ttl": 1e308},
        {"node_timeout": 2147484.0, "ttl": 2147485.0},
        {"retry_delay": 1e300},
        {"fair_heartbeat": 1e300},
    ],
)
def test_huge_durations_refused_up_front(redis_nodes, kwargs) -> None:
    with pytest.raises(ValueError) as info:
        Redlock(redis_nodes.urls, **kwargs)
    assert any(key in str(info.value) for key in kwargs), info.value


def test_huge_acquire_timeout_refused_up_front(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    for bad in (1e10, 9.3e9, 1e300):
        with pytest.raises(ValueError, match="timeout"):
            rl.lock("huge", timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            rl.lock("huge").acquire(timeout=bad)
    assert validation.check_timeout(float("inf")) == float("inf")


# ---- 15. node health and "stuck" judged once, in the core ---------------------------------


def test_node_health_judged_once_in_the_core(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=0.8, max_ttl=1.0)
    # Brand-new: every node fresh, so all vote at the first lock (not "guarded").
    health = rl.health()
    assert [(h.status, h.fresh, h.guarded_for) for h in health] == [("voting", True, 0.0)] * 3
    warm_up(rl)
    with node_client(cluster[0]) as c:
        c.flushall()
    warm_up(rl, "arm")  # arms node 0's marker: it sits out its guard
    health = rl.health()
    assert [h.status for h in health] == ["guarded", "voting", "voting"]
    assert health[0].guarded_for > 0 and not health[0].voting
    cluster[2].stop()
    assert rl.health()[2].status == "down"


def test_stuck_reasons_judged_once_in_the_core(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("stuck", ttl=5, meta={"pid": 2**22 + 12345})  # no such process
    assert lock.acquire(blocking=False)
    info = rl.lock_info("stuck")
    assert info.stuck_reasons(None) == ("dead",)
    assert info.stuck_reasons(0.0, now=time.time() + 1) == ("old", "dead")
    lock.release()
