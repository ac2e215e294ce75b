"""What a process shares with the nodes: waiters of one name line up behind one contender (not
a connection each), auto-renewed holders share one subscription per node, and a release is an
``EVALSHA`` (the body only after a ``NOSCRIPT``). Counted on real nodes: the process's file
descriptors, the nodes' ``CLIENT LIST`` and ``INFO commandstats``."""

from __future__ import annotations

import asyncio
import os

from django_redlock import AsyncRedlock
from tests.helpers import wait_until


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _stat(node_calls, cluster, command: str) -> int:
    return sum(calls.get(command, 0) for calls in node_calls(cluster))


def test_async_waiters_on_one_name_share_the_connections_and_are_served_in_turn(
    redis_nodes,
) -> None:
    """500 tasks blocked on one name: the process keeps a handful of sockets (one lock and
    one subscriber connection per node, not one per task and node), and every task is served,
    in the order it asked."""
    tasks = 500

    async def main() -> tuple[int, int, list[int]]:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=1.0)
        before = _fds()
        peak = before
        served: list[int] = []

        async def worker(i: int) -> None:
            nonlocal peak
            async with rl.lock("hot", ttl=30):
                peak = max(peak, _fds())
                served.append(i)
                await asyncio.sleep(0)  # others run while it holds: their fds count too

        try:
            await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(tasks))), 120)
        finally:
            await rl.close()
        return before, peak, served

    before, peak, served = asyncio.run(main())
    assert served == list(range(tasks))  # FIFO: each in turn, nobody skipped
    # Today's cost per node: one lock connection, one subscriber connection; a few to spare.
    assert peak - before <= 4 * len(redis_nodes), (before, peak)


def _net_in(cluster) -> int:
    return sum(int(node.info("stats")["total_net_input_bytes"]) for node in cluster)


def test_a_release_is_an_evalsha_and_costs_the_digest_not_the_body(
    redis_nodes, make_redlock, node_calls
) -> None:
    """Every release is one EVALSHA per node, no EVAL; what the nodes read per release is
    the EVALSHA's size, not the EVAL's (the body is 194 bytes; the digest 40)."""
    from django_redlock.core.nodes import as_eval

    rl = make_redlock(redis_nodes, node_timeout=1.0)
    with rl.lock("warm"):  # connections opened, scripts loaded: not what is counted
        pass
    rl.locked("warm")  # reads what the warm-up left owing (a NOSCRIPT, and its body's answer)
    rl.locked("warm")
    count = 50
    locks = [rl.lock(f"held:{i:03}", ttl=30) for i in range(count)]
    for lock in locks:
        assert lock.acquire()
    calls, read = node_calls(redis_nodes), _net_in(redis_nodes)
    for lock in locks:
        lock.release()
    after, read_after = node_calls(redis_nodes), _net_in(redis_nodes)
    for before, now in zip(calls, after, strict=True):
        assert now.get("evalsha", 0) - before.get("evalsha", 0) == count
        assert now.get("eval", 0) - before.get("eval", 0) == 0
    sha_form = len(rl.keys.release_command("held:000", locks[0].token or "t" * 32))
    body_form = len(as_eval(rl.keys.release_command("held:000", "t" * 32)))
    # The nodes also read the INFO commands that read these counters (tens of bytes each).
    per_release = (read_after - read) / count / len(redis_nodes)
    assert sha_form <= per_release < (sha_form + body_form) / 2, (per_release, sha_form, body_form)


def test_a_node_that_lost_its_scripts_still_releases(redis_nodes, make_redlock, node_calls) -> None:
    """SCRIPT FLUSH on every node while a lock is held: the release's NOSCRIPT is followed by
    the body on the same connection, the key is gone everywhere, and the next release is an
    EVALSHA again."""
    rl = make_redlock(redis_nodes, node_timeout=1.0)
    lock = rl.lock("flushed", ttl=30)
    assert lock.acquire()
    for client in redis_nodes.clients():
        client.script_flush()
    before = node_calls(redis_nodes)
    lock.release()
    clients = redis_nodes.clients()
    assert sum(client.exists("redlock:lock:flushed") for client in clients) <= 1  # a quorum
    # A node the release did not wait for gets the body when its answer is read, by the next
    # operation that uses the connection (the second one reads the body's answer).
    rl.locked("other")
    rl.locked("other")
    assert not any(client.exists("redlock:lock:flushed") for client in clients)
    with rl.lock("flushed", ttl=30):
        pass
    after = node_calls(redis_nodes)
    for was, now in zip(before, after, strict=True):
        # The first release's body, once, and each locked()'s read of the restart guard.
        assert now.get("eval", 0) - was.get("eval", 0) == 1 + 2
        assert now.get("evalsha", 0) - was.get("evalsha", 0) == 2


def test_a_late_node_that_lost_its_scripts_runs_the_release_it_was_left_owing(
    redis_nodes, make_redlock
) -> None:
    """One node paused (CLIENT PAUSE) and without its scripts: the release ends at the
    quorum of the other two, leaving that node's NOSCRIPT unread on the pooled connection;
    the next operation that reads it sends the body there, behind it, and the key goes."""
    rl = make_redlock(redis_nodes, node_timeout=0.3)
    lock = rl.lock("late", ttl=30)
    assert lock.acquire()
    slow = redis_nodes[2].client()
    slow.script_flush()
    slow.execute_command("CLIENT", "PAUSE", 500, "ALL")
    lock.release()  # a quorum removed it; node 2 answers after the pause
    assert slow.exists("redlock:lock:late")  # the pause is over by the time this runs

    def released_there() -> bool:
        # Each call reads what the connection owes (NOSCRIPT, then the body's answer: the
        # body goes out behind the NOSCRIPT once it is read); on a busy machine a call may
        # end at its node timeout before node 2 answered, so the next one reads it.
        rl.locked("other")
        return not slow.exists("redlock:lock:late")

    wait_until(released_there, timeout=10)  # well inside the 30 s lease: not its expiry


def test_asyncio_a_release_is_an_evalsha_and_a_late_noscript_still_releases(
    redis_nodes, node_calls
) -> None:
    """The asyncio client: an EVALSHA per release; after SCRIPT FLUSH, with one node paused
    past the release's quorum, the NOSCRIPT it was left owing is followed by the body on that
    connection once it answers, and the key goes from every node."""

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.3)
        try:
            async with rl.lock("warm"):
                pass
            # Scripts are flushed between tests: the warm-up's NOSCRIPT answers (and their
            # bodies) are read by these, before anything is counted.
            await rl.locked("warm")
            await rl.locked("warm")
            before = node_calls(redis_nodes)
            async with rl.lock("async-cycle", ttl=30):
                pass
            after = node_calls(redis_nodes)
            for was, now in zip(before, after, strict=True):
                assert now.get("evalsha", 0) - was.get("evalsha", 0) == 1
                assert now.get("eval", 0) - was.get("eval", 0) == 0
            lock = rl.lock("async-late", ttl=30)
            assert await lock.acquire()
            for client in redis_nodes.clients():
                client.script_flush()
            slow = redis_nodes[2].client()
            slow.execute_command("CLIENT", "PAUSE", 500, "ALL")
            await lock.release()
            clients = redis_nodes.clients()
            assert slow.exists("redlock:lock:async-late")  # after the pause: NOSCRIPT, kept
            await rl.locked("other")  # the NOSCRIPT answer is read as it comes: body sent
            await rl.locked("other")
            assert not any(client.exists("redlock:lock:async-late") for client in clients)
        finally:
            await rl.close()

    asyncio.run(main())


def _subscribers(cluster) -> list[int]:
    """Per node: the connections in pub/sub mode (CLIENT LIST flag ``P``)."""
    return [
        sum(1 for c in client.client_list() if "P" in c["flags"]) for client in cluster.clients()
    ]


def test_auto_renewed_locks_share_one_subscription_per_node(
    redis_cluster_factory, make_redlock, node_calls
) -> None:
    """200 auto-renewed locks held at once, then 50 taken one after another: each node sees
    one subscriber connection and one SUBSCRIBE in all (not one per lock), nothing is
    unsubscribed per release, and a force release still reaches its holder. Nodes of its own:
    another test's client still subscribed would count."""
    redis_nodes = redis_cluster_factory(3)
    rl = make_redlock(redis_nodes, node_timeout=1.0)
    before = node_calls(redis_nodes)
    locks = [rl.lock(f"renewed:{i:03}", ttl=30, auto_renew=True) for i in range(200)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    assert _subscribers(redis_nodes) == [1] * len(redis_nodes)
    for lock in locks[1:]:
        lock.release()
    for i in range(50):
        with rl.lock(f"one-by-one:{i}", ttl=30, auto_renew=True):
            pass
    after = node_calls(redis_nodes)
    for was, now in zip(before, after, strict=True):
        assert now.get("subscribe", 0) - was.get("subscribe", 0) == 1
        assert now.get("unsubscribe", 0) - was.get("unsubscribe", 0) == 0
    assert _subscribers(redis_nodes) == [1] * len(redis_nodes)
    held = locks[0]
    assert rl.force_release(held.name) == len(redis_nodes)
    wait_until(lambda: not held.held)


def test_asyncio_auto_renewed_locks_share_one_subscription_per_node(
    redis_cluster_factory, node_calls
) -> None:
    """The asyncio client: 200 auto-renewed locks of one loop, one SUBSCRIBE and one
    subscriber connection per node; a force release still reaches its holder (nodes of its
    own)."""
    redis_nodes = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=1.0)
        try:
            before = node_calls(redis_nodes)
            locks = [rl.lock(f"arenewed:{i:03}", ttl=30, auto_renew=True) for i in range(200)]
            for lock in locks:
                assert await lock.acquire(blocking=False)
            for lock in locks[1:]:
                await lock.release()
            after = node_calls(redis_nodes)
            for was, now in zip(before, after, strict=True):
                assert now.get("subscribe", 0) - was.get("subscribe", 0) == 1
                assert now.get("unsubscribe", 0) - was.get("unsubscribe", 0) == 0
            assert _subscribers(redis_nodes) == [1] * len(redis_nodes)
            held = locks[0]
            lost = asyncio.Event()
            rl.listeners.append(lambda event: lost.set() if event.kind == "lost" else None)
            assert await rl.force_release(held.name) == len(redis_nodes)
            await asyncio.wait_for(lost.wait(), 10)
            assert not held.held
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_force_released_auto_renewed_reader_hears_it(redis_nodes, make_redlock) -> None:
    """A reader of a read/write lock, auto-renewed, listens on the holders' channel too: an
    operator's force release of that reader (as listed: ``name#read:token``) turns it lost."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=1.0)
    reader = rl.read_lock("shared", ttl=30, auto_renew=True)
    assert reader.acquire(blocking=False)
    token = reader.token
    assert token is not None
    assert rl.force_release(f"shared#read:{token}") == len(redis_nodes)
    wait_until(lambda: not reader.held)
