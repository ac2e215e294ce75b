"""A slow or frozen minority of nodes never sets the pace: an acquire ends once a quorum granted
it and a release once a quorum removed the key. The slower nodes' connections go back to the
pool owing their replies; what they carried still runs in order on the node (no orphan key),
and a connection that owes a reply for longer than ``node_timeout`` is given up with the undo
of what it carried sent behind it. Real redis-server processes, SIGSTOP for the freeze."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from django_redlock import AsyncRedlock, Redlock
from django_redlock.core.algorithm import Contender
from django_redlock.core.lock import Lease
from django_redlock.core.nodes import TIMED_OUT, Failure, Wire
from django_redlock.core.waiting import HolderWatch
from tests.faults.proxy import Proxy
from tests.helpers import (
    node_client,
    run_python,
    settled_tokens,
    tokens_on_nodes,
    wait_until,
    warm_up,
)

pytestmark = pytest.mark.faults


def _sets_run(node) -> int:
    """How many plain ``SET`` commands the node has run (the uncontended acquire's)."""
    return int(node.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


@contextlib.contextmanager
def _third_node_frozen(cluster, names: list[str], sets: int) -> Iterator[None]:
    """Node 2 frozen (SIGSTOP) inside the block. On leaving, it resumes and runs the ``sets``
    plain SETs queued meanwhile, and none of ``names`` is left on it: what ran behind each SET
    on the same connection removed it again."""
    frozen = cluster[2]
    sets_before = _sets_run(frozen)
    frozen.pause()
    try:
        yield
    finally:
        frozen.resume()
        wait_until(
            lambda: (
                _sets_run(frozen) >= sets_before + sets
                and all(tokens_on_nodes(cluster, name)[2] is None for name in names)
            ),
            timeout=2.0,
        )


def test_acquire_and_release_do_not_wait_for_a_frozen_minority(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    # The release goes out behind the SET on the frozen node's connection.
    with _third_node_frozen(cluster, ["pace"], sets=1):
        lock = rl.lock("pace")
        started = time.monotonic()
        assert lock.acquire(blocking=False)
        assert tokens_on_nodes(cluster[:2], "pace") == [lock.token, lock.token]
        lock.release()
        # Waiting for the frozen node would take node_timeout (2 s) per step.
        assert time.monotonic() - started < 1.0
        assert tokens_on_nodes(cluster[:2], "pace") == [None, None]


def test_a_connection_owing_past_node_timeout_is_set_aside_with_its_undo(
    redis_cluster_factory, make_redlock
) -> None:
    """The next acquire does not queue behind a reply owed past the node timeout (it would
    wait for it too): the connection is set aside with the undo of its SET sent behind it,
    and the acquire is granted by the quorum without that node (no other connection to it
    is open; one is opened in the background)."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.2)
    warm_up(rl)
    sets_before = _sets_run(cluster[2])
    with _third_node_frozen(cluster, ["first", "second"], sets=1):
        first = rl.lock("first")
        assert first.acquire(blocking=False)
        time.sleep(0.25)  # the frozen node's connection now owes a reply older than 0.2 s
        second = rl.lock("second")
        assert second.acquire(blocking=False)
    assert _sets_run(cluster[2]) == sets_before + 1  # the second SET never queued there
    assert settled_tokens(cluster[:2], "first") == [first.token] * 2
    assert settled_tokens(cluster[:2], "second") == [second.token] * 2
    first.release()
    second.release()
    assert tokens_on_nodes(cluster, "first") == settled_tokens(cluster, "second") == [None] * 3


async def _warm_up_async(rl: AsyncRedlock) -> None:
    """As :func:`tests.helpers.warm_up`, on the loop the test then uses."""
    async with rl.lock("warm-up"):
        pass
    await rl.locked("warm-up")  # waits for every node: no connection still owes a reply


def test_acquire_and_release_do_not_wait_for_a_frozen_minority_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=2.0)
        try:
            await _warm_up_async(rl)
            with _third_node_frozen(cluster, ["pace"], sets=1):
                lock = rl.lock("pace")
                started = time.monotonic()
                assert await lock.acquire(blocking=False)
                assert tokens_on_nodes(cluster[:2], "pace") == [lock.token, lock.token]
                await lock.release()
                assert time.monotonic() - started < 1.0
                assert tokens_on_nodes(cluster[:2], "pace") == [None, None]
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_connection_owing_past_node_timeout_is_set_aside_with_its_undo_async(
    redis_cluster_factory,
) -> None:
    """As the sync client: the next acquire does not queue behind the shared connection's
    reply owed past the node timeout; that connection is set aside with the undo of its SET
    sent behind it, and the quorum grants the acquire without the node."""
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.2)
        try:
            await _warm_up_async(rl)
            sets_before = _sets_run(cluster[2])
            with _third_node_frozen(cluster, ["first", "second"], sets=1):
                first = rl.lock("first", ttl=30)
                assert await first.acquire(blocking=False)
                await asyncio.sleep(0.25)  # the connection now owes a reply older than 0.2 s
                second = rl.lock("second", ttl=30)
                assert await second.acquire(blocking=False)
            assert _sets_run(cluster[2]) == sets_before + 1  # the second SET never queued there
            assert settled_tokens(cluster[:2], "first") == [first.token] * 2
            assert settled_tokens(cluster[:2], "second") == [second.token] * 2
            await first.release()
            await second.release()
            await rl.locked("first")
            assert settled_tokens(cluster, "first") == [None] * 3
            assert settled_tokens(cluster, "second") == [None] * 3
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_release_goes_out_behind_its_acquire_on_the_same_connection(
    redis_cluster_factory, make_redlock
) -> None:
    """Even when another idle connection to the slow node is first in the pool, the release
    takes the one that still owes the acquire's reply, so the node runs them in order."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    node = rl.nodes[2]
    node.checkin(Wire(node, 1.0))  # a second idle connection to the node
    with _third_node_frozen(cluster, ["behind"], sets=1):
        lock = rl.lock("behind")
        assert lock.acquire(blocking=False)
        owing = node._idle[-1]
        assert len(owing.due) == 1
        other = node._idle[0]
        node._idle.remove(other)
        node.checkin(other)  # now first in line
        lock.release()
        assert len(owing.due) == 2 and not other.due


def _frozen_third_node(redis_cluster_factory, make_redlock):
    """A warmed-up 3-node client with a short node timeout, node 2 frozen (the caller resumes
    it): (cluster, redlock, SETs node 2 had run before)."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.3)
    warm_up(rl)
    sets_before = _sets_run(cluster[2])
    cluster[2].pause()
    return cluster, rl, sets_before


def test_a_release_overtaking_its_acquire_on_another_connection_undoes_it_there(
    redis_cluster_factory, make_redlock
) -> None:
    """The connection that still owes the acquire's reply is busy elsewhere when the lock is
    released (another thread has it: taken out of the pool here), so the release goes out on
    another connection and overtakes the acquire on the node. Whoever then reads the
    acquire's reply sends the undo behind it on that connection."""
    cluster = redis_cluster_factory(3)
    with _third_node_behind_a_proxy(cluster) as (urls, proxy):
        rl = make_redlock(urls, node_timeout=2.0)
        warm_up(rl)
        busy = _release_overtakes_acquire(rl, cluster, proxy, "overtaken")
        # The key is back on the node, with nobody holding it, until the busy connection is
        # used again and reads the acquire's reply.
        rl.nodes[2].checkin(busy)
        assert rl.locked("overtaken") is False
        wait_until(lambda: tokens_on_nodes(cluster, "overtaken") == [None] * 3, timeout=2.0)


def _release_overtakes_acquire(rl, cluster, proxy: Proxy, name: str) -> Wire:
    """Node 2 (behind ``proxy``) runs a lock's release before its acquire: the acquire waits
    in the proxy, and its connection is in use elsewhere (taken out of the pool: returned)
    when the release goes out, on a new connection the proxy lets through. Returns once the
    node ran the acquire (its key is back there)."""
    proxy.hold_open()
    lock = rl.lock(name, ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    busy = rl.nodes[2]._idle.pop()
    assert busy.due, "the connection should still owe the acquire's reply"
    lock.release()
    assert settled_tokens(cluster, name) == [None] * 3
    proxy.let_through()
    wait_until(lambda: tokens_on_nodes(cluster, name)[2] == token)
    return busy


def _evals_run(node) -> int:
    """How many scripts the node has run (``EVALSHA`` and ``EVAL``: a release or an undo)."""
    stats = node.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))


def test_an_overtaken_acquire_is_undone_when_its_connection_goes_back_owing(
    redis_cluster_factory, make_redlock
) -> None:
    """The connection owing the acquire's reply is busy elsewhere at the release; the thread
    that has it puts it back in the pool still owing (its own fan-out ended at a quorum). It
    sends the undo behind the acquire then, before anyone reads the late reply (nobody may
    ever read it: the pool has other connections)."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    node, frozen = rl.nodes[2], cluster[2]
    node.checkin(Wire(node, 1.0))  # a second idle connection to the node
    sets_before, evals_before = _sets_run(frozen), _evals_run(frozen)
    frozen.pause()
    try:
        lock = rl.lock("overtaken", ttl=30)
        assert lock.acquire(blocking=False)
        busy = node._idle.pop()  # owes the acquire's reply, in use by another thread
        lock.release()  # goes out on the other connection
        node.checkin(busy)  # the other thread's fan-out uses it and ends at a quorum
        other = rl.lock("other", ttl=30)
        assert other.acquire(blocking=False)
        assert len(busy.due) == 3  # the acquire, the other acquire, and the undo behind them
        while node._idle:  # nobody reads these connections again
            node._idle.pop().close()
    finally:
        frozen.resume()
    wait_until(lambda: _sets_run(frozen) >= sets_before + 2)
    # The release (on the other connection) and the undo (behind the acquire) both ran.
    wait_until(lambda: _evals_run(frozen) >= evals_before + 2)
    assert settled_tokens(cluster, "overtaken") == [None] * 3
    other.release()


def test_a_release_survives_a_slow_node_losing_its_script_cache(
    redis_cluster_factory, make_redlock
) -> None:
    """A slow node whose script cache is empty (a restart, SCRIPT FLUSH) answers the release,
    which arrives after the client stopped waiting, with NOSCRIPT: whoever reads that answer
    (the next operation on the connection) sends the body behind it, and the copy goes."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    with node_client(cluster[2]) as client:
        client.script_flush()
    frozen = cluster[2]
    sets_before = _sets_run(frozen)
    frozen.pause()
    try:
        lock = rl.lock("uncached")
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        frozen.resume()
    wait_until(lambda: _sets_run(frozen) >= sets_before + 1, timeout=2.0)

    def gone() -> bool:
        rl.locked("uncached")  # reads what the connection owes, sends the body behind it
        return tokens_on_nodes(cluster, "uncached")[2] is None

    wait_until(gone, timeout=2.0)


def test_a_late_undo_of_a_minority_copy_is_not_a_force_release() -> None:
    """An auto-renewed holder's own undo of a copy on a node that answered late publishes its
    token on that node, as a force release does on every node that had it: the holder counts
    the lock as force-released only once a quorum of nodes announced its token."""
    lease = Lease(name="watched", token="t" * 32, ttl=30.0, owner=None, valid_until=1e18)
    lost: list[str] = []
    watch = HolderWatch(lease, lambda lease, why: lost.append(why), quorum=2)
    watch.hear(2, b"another-token")
    watch.hear(2, lease.token.encode())  # the undo on the node that answered late
    watch.hear(2, lease.token.encode())
    assert lost == []
    watch.hear(0, lease.token.encode())  # a second node: a quorum of 3 announced it
    assert lost == ["force-released by an operator"]


def test_a_connection_given_up_stays_open_until_the_node_ran_what_it_carries(
    redis_cluster_factory, make_redlock
) -> None:
    """More is queued on a frozen node's connection than the node reads at once (Redis reads
    16 KB per turn). Closing the connection while its replies are still coming would reset it,
    and the node would drop what it had not read yet: most of the acquires would run, their
    undos not. The connection is given up with the undos behind, kept open and read, and
    closed once the node answered everything."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=1.0)
    warm_up(rl)
    frozen = cluster[2]
    names = [f"queued-{i}" for i in range(150)]
    locks = [rl.lock(name, meta={"pad": "x" * 200}) for name in names]
    frozen.pause()
    try:
        for lock in locks:  # each ends at the quorum; the frozen node's connection owes them
            assert lock.acquire(blocking=False)
        assert rl.locked("other") is False  # waits for every node: gives that connection up
    finally:
        frozen.resume()

    def undone() -> bool:
        rl.locked("other")  # every operation reads the connections being given up
        with node_client(frozen) as client:
            return _sets_run(frozen) >= 150 and not client.keys("redlock:lock:queued-*")

    # No promise of how soon: a loaded host takes seconds to run 150 queued scripts twice.
    wait_until(undone, timeout=30.0)
    assert [tokens_on_nodes(cluster[:2], name) for name in names] == [
        [lock.token] * 2 for lock in locks
    ]


def test_a_connection_given_up_stays_open_until_the_node_ran_what_it_carries_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)
    frozen = cluster[2]
    names = [f"queued-{i}" for i in range(150)]

    def undone() -> bool:
        with node_client(frozen) as client:
            return _sets_run(frozen) >= 150 and not client.keys("redlock:lock:queued-*")

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=1.0)
        try:
            await _warm_up_async(rl)
            locks = [rl.lock(name, meta={"pad": "x" * 200}) for name in names]
            frozen.pause()
            try:
                for lock in locks:
                    assert await lock.acquire(blocking=False)
                assert await rl.locked("other") is False  # gives that connection up
            finally:
                frozen.resume()
            deadline = time.monotonic() + 30.0  # no promise of how soon (loaded host)
            while not undone():  # the loop reads the connection being given up meanwhile
                assert time.monotonic() < deadline, "the undos did not all run"
                await asyncio.sleep(0.02)
            assert [tokens_on_nodes(cluster[:2], name) for name in names] == [
                [lock.token] * 2 for lock in locks
            ]
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_late_noscript_does_not_run_an_ended_acquire(redis_cluster_factory, make_redlock) -> None:
    """A slow node's script cache was flushed: the acquire script it gets answers NOSCRIPT
    after the acquire ended at the quorum and the lock was released. Sending the script
    again then would take the lock for nobody; the command did not run, so nothing is done."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    node, frozen = rl.nodes[2], cluster[2]
    with node_client(frozen) as client:
        client.script_flush()
    for wire in node._idle:
        wire.vote_marker = None  # as on a new connection: the acquire sends the full script
    frozen.pause()
    try:
        lock = rl.lock("noscript")
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        frozen.resume()
    for _ in range(2):  # reads the late NOSCRIPT, and whatever would be sent after it
        assert rl.locked("noscript") is False
    assert settled_tokens(cluster, "noscript") == [None] * 3


def test_a_release_that_could_not_reach_a_node_goes_out_with_the_next_operation(
    redis_cluster_factory, make_redlock
) -> None:
    """The connection that carried the acquire to a frozen node breaks, and the release finds
    no connection to it (connecting times out while the node is frozen): the release is kept
    and sent ahead of the next operation that reaches the node."""
    cluster, rl, sets_before = _frozen_third_node(redis_cluster_factory, make_redlock)
    node, frozen = rl.nodes[2], cluster[2]
    try:
        lock = rl.lock("unreached", ttl=30)
        assert lock.acquire(blocking=False)
        node._idle.pop().close()  # the acquire's connection breaks (it still runs on the node)
        lock.release()  # no connection to the frozen node: connecting times out
        assert node.later
    finally:
        frozen.resume()
    wait_until(lambda: _sets_run(frozen) > sets_before)
    assert rl.locked("unreached") is False  # reaches the node, the release ahead of it
    assert not node.later
    wait_until(lambda: tokens_on_nodes(cluster, "unreached") == [None] * 3, timeout=2.0)


@contextlib.contextmanager
def _third_node_behind_a_proxy(cluster) -> Iterator[tuple[list[str], Proxy]]:
    """The cluster's URLs with node 2 reached through a :class:`Proxy`, and the proxy."""
    proxy = Proxy((cluster[2].host, cluster[2].port))
    try:
        yield [*cluster.urls[:2], proxy.url], proxy
    finally:
        proxy.close()


def _cut_before_the_node_reads(proxy: Proxy) -> None:
    """What the proxy keeps never reaches the node: the connections are cut (as by
    ``CLIENT KILL``, a load balancer or a failing link) after what came before them ran."""
    proxy.drop_all()
    proxy.let_through()


async def _reach_the_node_until_gone(rl: AsyncRedlock, cluster, name: str) -> None:
    """Operations reach every node (the loop reads them between) until ``name`` is gone from
    every node; at most 2 s."""
    deadline = time.monotonic() + 2.0
    while tokens_on_nodes(cluster, name) != [None] * 3:
        assert time.monotonic() < deadline, f"{name!r} was left on a node"
        assert await rl.locked("other") is False
        await asyncio.sleep(0.02)


def test_a_release_left_on_a_connection_that_is_cut_goes_out_with_the_next_operation(
    redis_cluster_factory, make_redlock
) -> None:
    """The release stopped waiting at the quorum; the third node's connection still owed its
    reply and was cut before the node read the release (the acquire before it had run there).
    It is sent again ahead of the next operation that reaches the node."""
    cluster = redis_cluster_factory(3)
    with _third_node_behind_a_proxy(cluster) as (urls, proxy):
        rl = make_redlock(urls, node_timeout=2.0)
        warm_up(rl)
        lock = rl.lock("cut", ttl=30)
        assert lock.acquire(blocking=False)
        token = lock.token
        wait_until(lambda: tokens_on_nodes(cluster, "cut") == [token] * 3)
        proxy.held = True
        lock.release()
        assert tokens_on_nodes(cluster, "cut") == [None, None, token]
        _cut_before_the_node_reads(proxy)
        assert rl.locked("other") is False  # reaches the node, the release ahead of it
        wait_until(lambda: tokens_on_nodes(cluster, "cut") == [None] * 3, timeout=2.0)


def test_a_release_left_on_a_connection_that_is_cut_goes_out_with_the_next_operation_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)

    async def main(urls: list[str], proxy: Proxy) -> None:
        rl = AsyncRedlock(urls, node_timeout=2.0)
        try:
            await _warm_up_async(rl)
            lock = rl.lock("cut", ttl=30)
            assert await lock.acquire(blocking=False)
            token = lock.token
            wait_until(lambda: tokens_on_nodes(cluster, "cut") == [token] * 3)
            proxy.held = True
            await lock.release()
            assert tokens_on_nodes(cluster, "cut") == [None, None, token]
            _cut_before_the_node_reads(proxy)
            await _reach_the_node_until_gone(rl, cluster, "cut")
        finally:
            await rl.close()

    with _third_node_behind_a_proxy(cluster) as (urls, proxy):
        asyncio.run(main(urls, proxy))


def test_an_overtaken_acquire_whose_connection_is_cut_is_undone_on_another(
    redis_cluster_factory, make_redlock
) -> None:
    """The release went out on another connection (the acquire's was in use elsewhere) and
    overtook the acquire, which the node ran after it; then the acquire's connection was cut
    before anyone read its reply. The acquire's undo goes out on another connection."""
    cluster = redis_cluster_factory(3)
    with _third_node_behind_a_proxy(cluster) as (urls, proxy):
        rl = make_redlock(urls, node_timeout=2.0)
        warm_up(rl)
        busy = _release_overtakes_acquire(rl, cluster, proxy, "overtaken-then-cut")
        _cut_before_the_node_reads(proxy)
        rl.nodes[2].checkin(busy)
        assert rl.locked("other") is False  # reaches the node, the undo ahead of it
        wait_until(lambda: tokens_on_nodes(cluster, "overtaken-then-cut") == [None] * 3)


def test_an_overtaken_acquire_whose_connection_is_cut_is_undone_on_another_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)
    name = "overtaken-then-cut"

    async def main(urls: list[str], proxy: Proxy) -> None:
        rl = AsyncRedlock(urls, node_timeout=2.0)
        try:
            await _warm_up_async(rl)
            state = rl._state()
            proxy.hold_open()
            lock = rl.lock(name, ttl=30)
            assert await lock.acquire(blocking=False)
            token = lock.token
            busy = state.shared[2]  # in use elsewhere: taken out of the pool
            assert busy is not None
            state.shared[2] = None
            assert busy.owed
            await lock.release()
            assert settled_tokens(cluster, name) == [None] * 3
            proxy.let_through()
            wait_until(lambda: tokens_on_nodes(cluster, name)[2] == token)
            _cut_before_the_node_reads(proxy)
            state.checkin(2, busy)
            await _reach_the_node_until_gone(rl, cluster, name)
        finally:
            await rl.close()

    with _third_node_behind_a_proxy(cluster) as (urls, proxy):
        asyncio.run(main(urls, proxy))


def _in_a_forked_child(check) -> bool:
    """``check()`` run in a forked child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"1" if check() else b"0")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        result = answer.read()
    os.waitpid(pid, 0)
    return result == b"1"


def _until_down(rl: Redlock, index: int) -> None:
    """Operations until the detector has its evidence that node ``index`` (frozen) is down:
    consecutive misses over a span (see :mod:`django_redlock.core.detector`)."""
    node = rl.nodes[index]
    wait_until(lambda: rl.locked("other") is False and node.unreachable() is not None, 10.0)


async def _until_down_async(rl: AsyncRedlock, index: int) -> None:
    deadline = time.monotonic() + 10.0
    while rl.nodes[index].unreachable() is None:
        assert time.monotonic() < deadline, "the frozen node was never found down"
        assert await rl.locked("other") is False


def test_a_silent_node_costs_one_node_timeout_not_one_per_operation(
    redis_cluster_factory, make_redlock
) -> None:
    """A node that stays frozen: once it missed an answer, operations leave connecting to
    it to a background thread (trying again in each would cost each ``node_timeout``);
    once the evidence is in (consecutive misses over ``MIN_SPAN``: one late reply is not a
    dead node) it counts as down; when it answers again it is used again."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5)
    warm_up(rl)
    frozen, node = cluster[2], rl.nodes[2]
    names = [f"silent-{i}" for i in range(20)]
    frozen.pause()
    try:
        assert rl.locked("other") is False  # gives the pooled connection up after 0.5 s
        started = time.monotonic()
        for name in names:
            lock = rl.lock(name, ttl=30)
            assert lock.acquire(blocking=False)
            lock.release()
        # No operation waited to connect to it (forty would have taken 20 s).
        assert time.monotonic() - started < 1.0
        # The background attempts time out: the evidence that it is down.
        wait_until(lambda: node.unreachable() is not None, 10.0)
        failure = node.unreachable()
        assert failure is not None and "reconnecting in the background" in str(failure)
        # A forked child has no reconnector thread: it starts over with the node.
        assert _in_a_forked_child(lambda: node.unreachable() is None)
    finally:
        frozen.resume()
    wait_until(lambda: node.unreachable() is None, timeout=3.0)
    lock = rl.lock("back", ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    wait_until(lambda: tokens_on_nodes(cluster, "back") == [token] * 3)
    lock.release()
    wait_until(lambda: all(tokens_on_nodes(cluster, n) == [None] * 3 for n in [*names, "back"]))


def test_a_silent_node_costs_one_node_timeout_not_one_per_operation_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)
    frozen = cluster[2]

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.5)
        node = rl.nodes[2]
        try:
            await _warm_up_async(rl)
            frozen.pause()
            try:
                assert await rl.locked("other") is False  # gives the pooled connection up
                started = time.monotonic()
                for _ in range(10):  # each waits for every node, connecting included
                    assert await rl.locked("other") is False
                # Each waits for every node but connects to none: ten would take 10 s.
                assert time.monotonic() - started < 1.5
                await _until_down_async(rl, 2)
            finally:
                frozen.resume()
            deadline = time.monotonic() + 3.0
            while node.unreachable() is not None:
                assert time.monotonic() < deadline, "the node was not reached again"
                await asyncio.sleep(0.02)
            # An acquire decided by a quorum does not wait for a connection still opening;
            # one that waits for every node opens this loop's connection to it again.
            assert await rl.locked("other") is False
            lock = rl.lock("back", ttl=30)
            assert await lock.acquire(blocking=False)
            token = lock.token
            wait_until(lambda: tokens_on_nodes(cluster, "back") == [token] * 3)
            await lock.release()
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_silent_node_does_not_hold_up_new_subscriptions(
    redis_cluster_factory, make_redlock
) -> None:
    """A waiter subscribes to the lock's release channel on every node and waits for the
    subscriptions to be confirmed before it waits: not by a silent node (its subscriber
    connection dates from before the freeze), which would cost each new name node_timeout."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5)
    warm_up(rl)
    with rl._notices.listening("before"):  # subscriber connections to every node
        pass
    frozen = cluster[2]
    frozen.pause()
    try:
        _until_down(rl, 2)
        started = time.monotonic()
        for i in range(5):
            with rl._notices.listening(f"channel-{i}"):
                pass
        assert time.monotonic() - started < 0.5  # five confirmations waited for: 2.5 s
    finally:
        frozen.resume()


def test_a_silent_node_does_not_hold_up_new_subscriptions_async(redis_cluster_factory) -> None:
    cluster = redis_cluster_factory(3)
    frozen = cluster[2]

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.5)
        try:
            await _warm_up_async(rl)
            notices = rl._state().notices
            async with notices.listening("before"):
                pass
            frozen.pause()
            try:
                await _until_down_async(rl, 2)
                started = time.monotonic()
                for i in range(5):
                    async with notices.listening(f"channel-{i}"):
                        pass
                assert time.monotonic() - started < 0.5
            finally:
                frozen.resume()
        finally:
            await rl.close()

    asyncio.run(main())


def test_the_reconnected_node_gets_the_releases_it_missed_without_another_operation(
    redis_cluster_factory, make_redlock
) -> None:
    """A lock held on every node is released while one of them is silent: the release reaches
    it once it answers again, with no further operation by the application."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5)
    warm_up(rl)
    lock = rl.lock("missed", ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    wait_until(lambda: tokens_on_nodes(cluster, "missed") == [token] * 3)
    frozen, node = cluster[2], rl.nodes[2]
    frozen.pause()
    try:
        _until_down(rl, 2)
        # The silent node cannot answer: the release is kept for it, or already written on a
        # connection opened to it in the background (the kernel accepts for a stopped
        # server), which it reads once it runs again. Either way nothing else is needed.
        lock.release()
    finally:
        frozen.resume()
    wait_until(lambda: tokens_on_nodes(cluster, "missed") == [None] * 3, timeout=3.0)
    wait_until(lambda: node.unreachable() is None)  # the reconnector's attempt is over
    assert not node.later
    # What the connections opened meanwhile owe is read, and the node answers the next
    # operation in time.
    assert rl.locked("missed") is False
    assert node.detector.misses == 0 and not node.detector.down


def test_kept_releases_and_a_connection_closing_under_them_do_not_spin_the_loop(
    redis_cluster_factory,
) -> None:
    """The asyncio client sends the releases kept for a node ahead of an operation on a
    connection the node has just closed (``CLIENT KILL``; the loop has not yet run its
    ``connection_lost``): each fails at once and is kept again, for the next connection,
    instead of being taken and put back forever (an outside test saw the loop spin at 100 %
    CPU, every task hung). Run apart: a spinning loop cannot be interrupted."""
    cluster = redis_cluster_factory(3)
    result = run_python(
        f"""
        import asyncio
        from django_redlock import AsyncRedlock

        async def main():
            rl = AsyncRedlock({cluster.urls!r}, node_timeout=0.5)
            assert await rl.locked("warm-up") is False
            wire = rl._state().shared[2]
            wire.transport.close()  # closing; connection_lost comes at the next loop turn
            rl.nodes[2].later.append(rl.keys.release_command("kept", "t" * 32))
            assert await rl.locked("other") is False
            print("done", len(rl.nodes[2].later))
            await rl.close()

        asyncio.run(main())
        """,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["done", "0"]  # sent on the connection opened instead


def test_a_failed_attempt_sends_its_undo_behind_an_acquire_still_owed() -> None:
    """An acquire a quorum granted ends without the slower node's answer; if the attempt then
    fails (the fence was not written back to a quorum, or no validity was left), its undo
    must go out behind the acquire on the connection that still owes it, as a release does:
    on another connection it could overtake the acquire, which would then take the lock on
    that node for nobody (an outside test: fenced locks, a node frozen with SCRIPT FLUSH
    queued, 5 keys left in 26 runs). The algorithm's steps, driven by hand."""
    rl = Redlock([f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)], restart_guard=False)
    steps = rl.algorithm.attempt(Contender(rl.lock("owed", fencing=True), "holder"))
    acquire = next(steps)
    acquire.left[2] = ("the slow node's connection", "its acquire")  # as a driver fills it
    fence_sync = steps.send([[0, 5, -1, None], [0, 6, -1, None], TIMED_OUT])
    # The write-back waits for a quorum holding the token, not for every node.
    assert fence_sync.enough([1, 1, TIMED_OUT]) and not fence_sync.enough([1, 0, TIMED_OUT])
    undo = steps.send([0, 0, TIMED_OUT])  # the token no longer holds a quorum
    assert undo.idempotent and undo.behind == acquire.left
    # A node the undo could not reach (its connection was cut) gets it with the next
    # operation that reaches it, as a release.
    with pytest.raises(StopIteration):
        steps.send([1, 1, Failure("refused", "connection closed by the node")])
    assert [list(node.later) for node in rl.nodes] == [[], [], [undo.build(rl.nodes[2], None)]]
    rl.close()
