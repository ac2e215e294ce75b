"""Faults found by the fourth outside test (scripts written from the README and the docs only,
run against real redis-server processes), each named after the fault and checked to fail
before its fix."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque

import pytest

from django_redlock import AsyncRedlock, LockLost, LockNotOwned, QuorumError, Redlock
from django_redlock.core.nodes import Due, Node, pack
from tests.helpers import (
    PREFIX,
    node_client,
    occupy,
    settled_tokens,
    tokens_on_nodes,
    wait_until,
    warm_up,
)

pytestmark = pytest.mark.faults


def _keys(node, pattern: str = f"{PREFIX}:*") -> dict[str, int]:
    """Every key on the node matching ``pattern``, with its PTTL."""
    with node_client(node) as client:
        return {key.decode(): client.pttl(key) for key in client.scan_iter(pattern)}


# ---- nodes that lost their data apart are not a brand-new cluster ---------------------------


def test_nodes_that_lost_their_data_apart_are_not_a_brand_new_cluster(
    redis_cluster_factory, make_redlock
) -> None:
    """Node 2 restarts empty and sits out its guard; a lock is taken on nodes 0 and 1; then
    they restart empty together. Every node is fresh now, but node 2 came back into a running
    cluster earlier: the three are no brand-new cluster, and trusting them would hand the lock
    to a second client while the first still holds it."""
    cluster = redis_cluster_factory(3)
    kw = {"ttl": 30.0, "max_ttl": 60.0, "node_timeout": 0.1}
    first = make_redlock(cluster, **kw)
    warm_up(first)
    cluster[2].restart(empty=True)
    wait_until(lambda: _armed(first, cluster[2]))  # node 2 now sits out its guard
    holder = first.lock("job")
    assert holder.acquire(blocking=False)
    wait_until(lambda: tokens_on_nodes(cluster, "job") == [holder.token, holder.token, None])
    time.sleep(0.5)  # the next two lose their data later than node 2 (a duration, not a sync)
    _first_two_restart_and_a_second_client_is_refused(cluster, make_redlock(cluster, **kw))
    assert holder.held


def _first_two_restart_and_a_second_client_is_refused(cluster, second) -> None:
    cluster[0].restart(empty=True)
    cluster[1].restart(empty=True)
    with pytest.raises(QuorumError):
        second.lock("job").acquire(blocking=False)


def _armed(rl, node) -> bool:
    """An attempt reached ``node`` (arming its restart guard when it had no marker)."""
    warm_up(rl, "arm")
    with node_client(node) as client:
        return bool(client.exists(f"{PREFIX}:node"))


# ---- renewal keeps a bare-quorum lock through a minority pause ------------------------------


def _bare_quorum_hold(cluster, rl, name: str):
    """An auto-renewed lock on nodes 0 and 1 only: a racing loser held node 2 when it was
    taken (what contention leaves behind), and is gone now."""
    occupy(cluster[2], name, ms=300, token="racing-loser")
    lock = rl.lock(name, ttl=1.0, auto_renew=True)
    return lock


def test_a_renewed_bare_quorum_lock_survives_a_minority_pause(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    lock = _bare_quorum_hold(cluster, rl, "bare")
    assert lock.acquire(blocking=False)
    assert tokens_on_nodes(cluster, "bare")[2] == "racing-loser"
    wait_until(lambda: tokens_on_nodes(cluster, "bare")[2] != "racing-loser")
    cluster[1].pause()
    try:
        # Three renewals with node 1 silent: the lease must live on nodes 0 and 2.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert lock.held, lock.lost
            time.sleep(0.02)
        assert settled_tokens([cluster[0], cluster[2]], "bare") == [lock.token] * 2
    finally:
        cluster[1].resume()
    lock.release()


def test_a_renewed_bare_quorum_lock_survives_a_minority_pause_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.05)
        try:
            async with rl.lock("warm-up"):
                pass
            lock = _bare_quorum_hold(cluster, rl, "bare")
            assert await lock.acquire(blocking=False)
            await asyncio.sleep(0.35)  # the loser's key ran out (a duration, not a sync)
            cluster[1].pause()
            try:
                for _ in range(75):
                    assert lock.held, lock.lost
                    await asyncio.sleep(0.02)
                assert settled_tokens([cluster[0], cluster[2]], "bare") == [lock.token] * 2
            finally:
                cluster[1].resume()
            await lock.release()
        finally:
            await rl.close()

    asyncio.run(main())


# ---- a release whose reply was lost is not a false LockNotOwned -----------------------------


def _kill_after_release_runs(node) -> list[threading.Thread]:
    """Node busy for 0.1 s, with a CLIENT KILL of every normal connection queued behind the
    release about to be sent: the node runs the release, then cuts the connection before the
    client reads the answer."""
    busy, killer = node.client(socket_timeout=5), node.client(socket_timeout=5)
    killer.ping()
    threads = [
        threading.Thread(target=lambda: busy.execute_command("DEBUG", "SLEEP", 0.1)),
        threading.Thread(
            target=lambda: (
                time.sleep(0.03),
                killer.execute_command("CLIENT", "KILL", "TYPE", "normal"),
            )
        ),
    ]
    threads[0].start()
    time.sleep(0.01)
    threads[1].start()
    time.sleep(0.01)
    return threads


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_release_whose_answer_was_cut_off_is_not_reported_lost(
    redis_cluster_factory, client
) -> None:
    """The release runs on node 0, whose connection is then cut before its answer is read;
    sent again, it finds nothing to remove there. That says nothing of whether the key was
    ours: no LockNotOwned (the key was ours on both nodes until this release)."""
    cluster = redis_cluster_factory(3, extra_args=["--enable-debug-command", "yes"])
    setup = Redlock(cluster.urls)
    warm_up(setup)
    setup.close()
    occupy(cluster[2], "cut", ms=200, token="racing-loser")

    def sync() -> None:
        rl = Redlock(cluster.urls, node_timeout=0.2, ttl=20.0)
        try:
            lock = rl.lock("cut")
            assert lock.acquire(blocking=False)  # on nodes 0 and 1 only
            wait_until(lambda: tokens_on_nodes(cluster, "cut")[2] is None)
            threads = _kill_after_release_runs(cluster[0])
            lock.release()
            for thread in threads:
                thread.join()
        finally:
            rl.close()

    async def async_() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.2, ttl=20.0)
        try:
            lock = rl.lock("cut")
            assert await lock.acquire(blocking=False)
            await asyncio.sleep(0.25)  # the loser's key ran out (a duration, not a sync)
            threads = _kill_after_release_runs(cluster[0])
            await lock.release()
            for thread in threads:
                thread.join()
        finally:
            await rl.close()

    if client == "sync":
        sync()
    else:
        asyncio.run(async_())
    assert tokens_on_nodes(cluster, "cut")[:2] == [None, None]


# ---- a force release does not depend on the slow node's script cache -----------------------


def test_a_force_release_reaching_a_slow_node_with_an_empty_script_cache_removes_the_key(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    holder = make_redlock(cluster, node_timeout=0.05, ttl=30.0)
    operator = make_redlock(cluster, node_timeout=0.05)
    warm_up(holder)
    operator.locked("stuck")  # a connection open to every node
    lock = holder.lock("stuck")
    assert lock.acquire(blocking=False)
    with node_client(cluster[2]) as client:
        client.script_flush()
    cluster[2].pause()
    try:
        assert operator.force_release("stuck") == 2
    finally:
        cluster[2].resume()
    wait_until(lambda: tokens_on_nodes(cluster, "stuck") == [None] * 3)


def test_a_force_release_of_a_token_reaches_a_node_it_could_not_reach_later(
    redis_cluster_factory, make_redlock
) -> None:
    """The operator's client has no connection to the frozen node: the release of what the
    operator saw (that token only) goes out once the node answers again; one without a token
    could remove the next holder's copy, and is not kept."""
    cluster = redis_cluster_factory(3)
    holder = make_redlock(cluster, node_timeout=0.05, ttl=30.0)
    operator = make_redlock(cluster, node_timeout=0.05)
    warm_up(holder)
    lock = holder.lock("stuck")
    assert lock.acquire(blocking=False)
    cluster[2].pause()
    try:
        assert operator.force_release("stuck", token=lock.token) == 2
    finally:
        cluster[2].resume()
    wait_until(lambda: tokens_on_nodes(cluster, "stuck") == [None] * 3)


# ---- a fair waiter's ticket sequence expires ------------------------------------------------


def test_a_fair_ticket_drawn_on_a_guarded_node_expires(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    kw = {"node_timeout": 0.05, "ttl": 2.0, "fair_heartbeat": 1.0}
    holder = make_redlock(cluster, **kw)
    waiter = make_redlock(cluster, **kw)
    warm_up(holder)
    with node_client(cluster[2]) as client:
        client.flushall()  # node 2 sits out its restart guard from the next attempt on
    lock = holder.lock("order", fair=True)
    assert lock.acquire(blocking=False)  # on nodes 0 and 1
    assert not waiter.lock("order", fair=True).acquire(timeout=0.3)
    lock.release()
    for node in cluster:
        for key, pttl in _keys(node).items():
            kind = key.split(":")[1]
            assert kind in ("fence", "node") or pttl > 0, f"{key} never expires on {node}"


# ---- bad input is refused before anything is sent -------------------------------------------


def test_huge_meta_is_refused_before_anything_is_sent(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    with pytest.raises(ValueError, match="meta"):
        rl.lock("big", meta={"note": "x" * 10_000_000})
    assert settled_tokens(redis_nodes, "big") == [None] * len(redis_nodes)


def test_the_meta_limit_holds_for_the_client_and_lock_meta_together(
    redis_nodes, make_redlock
) -> None:
    """Each part passes alone; what goes to the nodes is both."""
    from django_redlock.core import MAX_META_BYTES

    half = "x" * (MAX_META_BYTES * 5 // 8)
    rl = make_redlock(redis_nodes, meta={"service": half})
    with pytest.raises(ValueError, match=r"meta is \d+ bytes of JSON with the client's"):
        rl.lock("both", meta={"detail": half})
    assert settled_tokens(redis_nodes, "both") == [None] * len(redis_nodes)
    small = rl.lock("both", meta={"detail": "y"})  # fits with the client's
    assert small.acquire(blocking=False)
    small.release()


def test_meta_that_is_no_json_names_meta(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="meta"):
        rl.lock("circular", meta=circular)
    with pytest.raises(ValueError, match="meta"):
        rl.lock("nan", meta={"x": float("nan")})  # not JSON, whatever Python's json writes


def test_a_command_larger_than_the_socket_buffer_goes_out_whole(redis_nodes) -> None:
    """A round of many threads' acquires with large metas is one write per node, more than a
    socket with a small send buffer takes at once (the first writes of a connection over a
    real network): a non-blocking socket sends it in parts instead of failing the node."""
    node = Node(redis_nodes.urls[0], node_timeout=2.0)
    try:
        wire = node.connect(2.0)
        wire.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1024)
        wire.write(pack(["SET", "big", b"x" * 2_000_000]), 2.0)
        wire.due.append(Due(b"", None, time.monotonic()))
        wire.settle_within(2.0)
        assert wire.due == deque() and node_client(redis_nodes[0]).strlen("big") == 2_000_000
        wire.close()
    finally:
        node.close()


def test_blocking_must_be_a_bool(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    with pytest.raises(TypeError, match="blocking"):
        rl.lock("b").acquire(blocking="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blocking"):
        rl.lock("b", blocking="no")  # type: ignore[arg-type]
    assert settled_tokens(redis_nodes, "b") == [None] * len(redis_nodes)


def test_renew_for_without_auto_renew_is_refused(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    with pytest.raises(ValueError, match="renew_for"):
        rl.lock("r", renew_for=10.0)


@pytest.mark.parametrize(
    "options",
    [
        {"bogus": 1},
        {"socket_timeout": "abc"},
        {"socket_connect_timeout": -1},
        {"password": 5},
        {"port": 7000},
    ],
)
def test_bad_node_options_are_refused(redis_nodes, options) -> None:
    with pytest.raises((TypeError, ValueError), match=next(iter(options))):
        Redlock([{"URL": url, "OPTIONS": options} for url in redis_nodes.urls])


# ---- a refused attempt with a frozen node costs one node timeout ----------------------------


@pytest.mark.parametrize("client", ["sync", "async"])
@pytest.mark.parametrize("warm", [True, False], ids=["connected", "fresh"])
def test_a_refused_attempt_with_a_frozen_node_costs_one_node_timeout(
    redis_cluster_factory, client, warm
) -> None:
    """A refused attempt waits one node timeout for the frozen node, and its undo does not
    wait again: for a client connected to it before it froze (the undo goes behind the
    acquire on that connection), and for a fresh one (a new worker), whose connection to it
    never opened, so nothing went out there (the asyncio client paid two node timeouts per
    refusal, an outside tester found)."""
    cluster = redis_cluster_factory(3)
    setup = Redlock(cluster.urls)
    warm_up(setup)  # a cluster in service: every node armed and voting
    setup.close()
    for node in cluster:
        occupy(node, "busy", ms=30_000, token="holder")
    # Shorter than the connect budget (1 s), which a fresh client's refusal must not wait
    # for; long enough that once and twice are told apart on a busy host.
    timeout = 0.5

    def sync() -> float:
        rl = Redlock(cluster.urls, node_timeout=timeout)
        try:
            if warm:
                rl.locked("warm-up")  # a connection open to every node
            cluster[2].pause()
            started = time.monotonic()
            assert rl.lock("busy").acquire(blocking=False) is False
            return time.monotonic() - started
        finally:
            cluster[2].resume()
            rl.close()

    async def async_() -> float:
        rl = AsyncRedlock(cluster.urls, node_timeout=timeout)
        try:
            if warm:
                await rl.locked("warm-up")
            cluster[2].pause()
            started = time.monotonic()
            assert await rl.lock("busy").acquire(blocking=False) is False
            return time.monotonic() - started
        finally:
            cluster[2].resume()
            await rl.close()

    took = sync() if client == "sync" else asyncio.run(async_())
    assert took < 1.5 * timeout, took


# ---- a lease that simply ran out is LockNotOwned on release ---------------------------------


def test_a_lease_that_ran_out_without_renewal_is_not_owned_on_release(
    redis_nodes, make_redlock
) -> None:
    rl = make_redlock(redis_nodes)
    lock = rl.lock("short", ttl=0.2)
    assert lock.acquire(blocking=False)
    time.sleep(0.3)  # the lease runs out (a duration, not a sync)
    assert lock.lost is None
    with pytest.raises(LockNotOwned) as raised:
        lock.release()
    assert type(raised.value) is LockNotOwned
    assert not isinstance(raised.value, LockLost)


# ---- fifth outside test ---------------------------------------------------------------------


def test_a_new_thread_is_not_the_finished_thread_that_holds_a_lock(
    redis_nodes, make_redlock
) -> None:
    """A thread takes a lock and ends without releasing it (its handle still holds it); the
    next thread often gets the same ident from the OS. It is another owner all the same: no
    reentrant grant."""
    rl = make_redlock(redis_nodes)

    def take(box: dict, key: str, name: str) -> None:
        box[key] = rl.lock(name)
        box[key + "-got"] = box[key].acquire(blocking=False)

    granted = []
    for i in range(10):
        box: dict = {}
        for key in ("first", "second"):
            thread = threading.Thread(target=take, args=(box, key, f"dead-{i}"))
            thread.start()
            thread.join()
        assert box["first-got"] and box["first"].held
        granted.append(box["second-got"])
        # Its owner ended: whoever has the handle may give the lock back (nobody else could).
        box["first"].release()
        assert not box["first"].held
        assert rl.locked(f"dead-{i}") is False
    assert granted == [False] * 10


def test_a_task_run_by_wait_for_is_not_an_earlier_one_that_holds_a_lock(redis_nodes) -> None:
    """``asyncio.wait_for`` runs the acquire in a task of its own (Python < 3.12): the next
    one may reuse the id of the first, collected one. It is another owner all the same."""

    async def main() -> list[bool]:
        rl = AsyncRedlock(redis_nodes.urls)
        granted = []
        try:
            for i in range(10):
                first = rl.lock(f"waited-{i}")
                assert await asyncio.wait_for(first.acquire(blocking=False), 5)
                second = rl.lock(f"waited-{i}")
                granted.append(await asyncio.wait_for(second.acquire(blocking=False), 5))
                await first.release()
        finally:
            await rl.close()
        return granted

    assert asyncio.run(main()) == [False] * 10


def test_nodes_that_lost_their_data_apart_unseen_in_between_are_not_brand_new(
    redis_cluster_factory, make_redlock
) -> None:
    """Node 2 is down while a lock is taken on nodes 0 and 1, and comes back empty without
    anything reaching it (no marker); 3 s later nodes 0 and 1 restart empty together. The
    next attempt arms all three markers at once, but node 2's server started seconds before
    the others: they lost their data apart, and the first holder still holds the lock."""
    cluster = redis_cluster_factory(3)
    kw = {"ttl": 30.0, "max_ttl": 60.0, "node_timeout": 0.1}
    first = make_redlock(cluster, **kw)
    warm_up(first)
    cluster[2].stop()
    holder = first.lock("job")
    assert holder.acquire(blocking=False)
    cluster[2].start()
    time.sleep(3.0)  # the others lose their data later than node 2 (a duration, not a sync)
    _first_two_restart_and_a_second_client_is_refused(cluster, make_redlock(cluster, **kw))
    assert holder.held


def test_health_calls_nodes_that_lost_their_data_apart_guarded_as_the_acquire_does(
    redis_cluster_factory, make_redlock
) -> None:
    """Every node restarted empty, node 2 seconds before the others: an acquire refuses them
    (no brand-new cluster), and health() says so too (it said "voting" with guarded_for 0,
    so `redlock check` and the readiness view passed while every lock was refused)."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=30.0, max_ttl=60.0, node_timeout=0.1)
    cluster[2].restart(empty=True)
    time.sleep(3.0)  # node 2's server starts earlier than the others' (a duration, not a sync)
    cluster[0].restart(empty=True)
    cluster[1].restart(empty=True)
    before = rl.health()
    assert [h.status for h in before] == ["guarded"] * 3, before
    assert all(h.guarded_for and h.guarded_for > 0 for h in before)
    with pytest.raises(QuorumError, match="servers started more than 2s apart"):
        rl.lock("job").acquire(blocking=False)
    after = rl.health()
    assert [h.status for h in after] == ["guarded"] * 3, after
    # Restarted together, the same nodes are one brand-new cluster: voting, and a lock is taken.
    for node in cluster:
        node.restart(empty=True)
    fresh = make_redlock(cluster, ttl=30.0, max_ttl=60.0, node_timeout=0.1)
    assert [h.status for h in fresh.health()] == ["voting"] * 3
    assert fresh.lock("job").acquire(blocking=False)


class _Interrupted(BaseException):
    """Stands for KeyboardInterrupt (which would end the test session if it escaped)."""


def test_an_acquire_interrupted_after_its_win_gives_the_lease_back(
    redis_nodes, make_redlock
) -> None:
    """The lock was won (renewal already started) when the acquire was interrupted: its caller
    never got a handle that holds it, so nobody could release it, and the watchdog would renew
    it for ever. The acquire gives it back."""
    rl = make_redlock(redis_nodes, ttl=1.0)

    def interrupted(name: bytes, listener: object) -> None:
        raise _Interrupted

    rl._notices.keep = interrupted  # the last step of winning an auto-renewed lock
    lock = rl.lock("won", auto_renew=True)
    with pytest.raises(_Interrupted):
        lock.acquire(blocking=False)
    assert not lock.held
    assert settled_tokens(redis_nodes, "won") == [None] * len(redis_nodes)
    time.sleep(1.2)  # a lease later nothing renewed it back (a duration, not a sync)
    assert settled_tokens(redis_nodes, "won") == [None] * len(redis_nodes)
    assert rl.lock("won").acquire(blocking=False)


def test_an_acquire_cancelled_after_its_win_gives_the_lease_back(redis_nodes) -> None:
    from django_redlock.core.aiowaiting import AsyncReleaseNotices

    async def cancelled(self: object) -> None:
        raise asyncio.CancelledError

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, ttl=1.0)
        try:
            lock = rl.lock("won", auto_renew=True)
            original = AsyncReleaseNotices.ready
            AsyncReleaseNotices.ready = cancelled  # type: ignore[method-assign]
            try:
                with pytest.raises(asyncio.CancelledError):
                    await lock.acquire(blocking=False)
            finally:
                AsyncReleaseNotices.ready = original  # type: ignore[method-assign]
            assert not lock.held
            for _ in range(100):  # given back in the background
                if tokens_on_nodes(redis_nodes, "won") == [None] * len(redis_nodes):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.2)  # a lease later nothing renewed it back
            assert settled_tokens(redis_nodes, "won") == [None] * len(redis_nodes)
            assert await rl.lock("won").acquire(blocking=False)
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_release_refused_by_a_node_that_lost_the_key_says_so(
    redis_cluster_factory, make_redlock
) -> None:
    """Held on nodes 0 and 1 (a racing loser had node 2), node 1 restarts empty: the release
    finds the key on one node only. Its lease has not run out; the error says what else may
    have happened."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=30.0)
    warm_up(rl)
    occupy(cluster[2], "lost-it", ms=30_000, token="racing-loser")
    lock = rl.lock("lost-it")
    assert lock.acquire(blocking=False)
    cluster[1].restart(empty=True)
    with pytest.raises(LockNotOwned) as raised:
        lock.release()
    assert "restarted empty" in str(raised.value)
    assert "lease ran out before release" not in str(raised.value)
