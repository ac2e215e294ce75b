"""A hot key handed from client to client: what each hand-off costs the nodes.

Each contender is a Redlock client of its own (its own local queue and release notices, as a
process of its own has), in a thread of this test. The cost is counted on the nodes themselves
(``INFO commandstats``), never through the code under test, and bounded per acquisition, so a
busy host changes how long the test takes, not what it asserts.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from django_redlock.testing import RedisCluster
from tests.helpers import node_client, release_listeners, wait_until, warm_up

CLIENTS = 6
ROUNDS = 15  #: acquisitions per client


def _take_turns(clients: list, name: str, fair: bool) -> list[int]:
    """Every client takes ``name`` ROUNDS times, blocking, and releases it at once."""
    counts = [0] * len(clients)
    start = threading.Barrier(len(clients))
    failures: list[str] = []

    def worker(index: int) -> None:
        start.wait()
        for _ in range(ROUNDS):
            lock = clients[index].lock(name, ttl=10.0, fair=fair)
            if not lock.acquire(timeout=30):
                failures.append(f"client {index} timed out")
                return
            counts[index] += 1
            lock.release()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    assert not failures, failures
    return counts


def _clients(nodes: RedisCluster, make_redlock) -> list:
    """CLIENTS Redlock clients, each warmed up (connections open, markers armed)."""
    clients = [make_redlock(nodes, ttl=10.0) for _ in range(CLIENTS)]
    for client in clients:
        warm_up(client)
    return clients


def _hand_offs(
    nodes: RedisCluster, make_redlock, node_calls, name: str, fair: bool, command: str
) -> tuple[list[int], int, list[int]]:
    """Warmed-up clients take turns on ``name``: each client's acquisitions, their total,
    and how many ``command`` calls each node ran meanwhile, fewest first."""
    clients = _clients(nodes, make_redlock)
    before = node_calls(nodes)
    counts = _take_turns(clients, name, fair=fair)
    after = node_calls(nodes)
    spent = [a.get(command, 0) - b.get(command, 0) for b, a in zip(before, after, strict=True)]
    return counts, sum(counts), sorted(spent)


def test_a_release_sets_one_waiter_going_not_every_waiting_client(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    _, taken, sets = _hand_offs(
        redis_nodes, make_redlock, node_calls, "hot:plain", fair=False, command="set"
    )
    assert taken == CLIENTS * ROUNDS
    # A release wakes one waiter by name, which takes the lock; the releaser, back for more,
    # tries once and lines up. About two SETs per acquisition on every node (plus the
    # attempts made before anyone waited), where every waiting client woken by each release
    # sends each node a SET (five per acquisition here, and the undos of split votes).
    for spent in sets:
        assert spent <= 2.5 * taken, (sets, taken)


def test_a_release_wakes_the_fair_line_s_first_alone(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    counts, taken, attempts = _hand_offs(
        redis_nodes, make_redlock, node_calls, "hot:fair", fair=True, command="zrangebyscore"
    )
    # Fair shares: every client got every one of its turns (none timed out meanwhile).
    assert counts == [ROUNDS] * CLIENTS
    # The fair acquire script reads the line's heartbeats once per run: a release wakes the
    # line's first alone, so a node runs it about twice per acquisition (the winner's, and
    # the releaser's as it lines up again), where waiters that all ask every node on every
    # release run it about five times here.
    for spent in attempts:
        assert spent <= 3 * taken, (attempts, taken)


def _waiters(nodes: RedisCluster, name: str, fair: bool = False) -> list[int]:
    """How many waiters each node has in line to be woken for ``name`` (a fair lock's line)."""
    key = f"redlock:{'queue' if fair else 'waiters'}:{name}"
    out = []
    for node in nodes:
        with node_client(node) as c:
            out.append(c.zcard(key))
    return out


def _start_waiters(
    clients: list,
    name: str,
    nodes: RedisCluster,
    timeout: float,
    ahead: int = 0,
    fair: bool = False,
) -> list:
    """Each client waits for ``name`` in a thread of its own, started once the previous one
    joined the name's waiters on every node (so they wait in this order). Returns
    ``(handle, result, thread)`` per client; ``result["ok"]`` appears when acquire returns.
    ``ahead``: waiters on the nodes before them."""
    started = []
    for i, client in enumerate(clients):
        handle, result = client.lock(name, ttl=30.0, owner=f"waiter {i}", fair=fair), {}

        def wait(handle=handle, result=result) -> None:
            result["ok"] = handle.acquire(timeout=timeout)
            result["at"] = time.monotonic()

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        started.append((handle, result, thread))
        joined = ahead + i + 1
        wait_until(
            lambda joined=joined: _waiters(nodes, name, fair) == [joined] * len(nodes), timeout=10
        )
    return started


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_release_wakes_the_longest_waiting_process_alone(
    redis_nodes: RedisCluster, make_redlock, fair: bool
) -> None:
    name = f"hot:one:{int(fair)}"
    # Waiters that are not woken ask the nodes again only after a third of the heartbeat.
    clients = [make_redlock(redis_nodes, ttl=30.0, fair_heartbeat=60.0) for _ in range(4)]
    for client in clients:
        warm_up(client)
    holder = clients[0].lock(name, ttl=30.0, owner="holder", fair=fair)
    assert holder.acquire(blocking=False)
    waiting = _start_waiters(clients[1:], name, redis_nodes, timeout=30, fair=fair)
    channel = f"redlock:released:{name}"
    observers = [node_client(node).pubsub() for node in redis_nodes]
    try:
        for observer in observers:
            observer.psubscribe(f"{channel}*")
            assert observer.get_message(timeout=5)["type"] == "psubscribe"
        last = holder
        woken: set[bytes] = set()
        for turn, (handle, result, thread) in enumerate(waiting):
            last.release()
            thread.join(20)
            assert result.get("ok") is True  # long before any waiter's pause ran out
            # Each node that held the released copy (a quorum at least: a node can have
            # refused that holder) told one waiter, by name, and the same one: the one
            # waiting longest (the fair line's first).
            # (A copy of an earlier wake-up that came late, on a busy host, is not this one.)
            told = [m for m in (o.get_message(timeout=2) for o in observers) if m is not None]
            told = [m for m in told if m["channel"] not in woken]
            assert len(told) >= len(observers) // 2 + 1, told
            assert len({m["channel"] for m in told}) == 1, told
            assert told[0]["channel"].startswith(f"{channel}:".encode()), told
            woken.add(told[0]["channel"])
            # Nobody else was told; the others still wait.
            more = [o.get_message(timeout=0.05) for o in observers]
            assert all(m is None or m["channel"] in woken for m in more), more
            assert all("ok" not in r for _, r, _ in waiting[turn + 1 :])
            last = handle
        last.release()
    finally:
        for observer in observers:
            observer.close()


def _wait_forever(urls: list[str], name: str) -> None:
    from django_redlock import Redlock

    Redlock(urls, ttl=30.0).lock(name).acquire(timeout=60)


def test_a_release_skips_a_waiter_whose_process_died(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    name = "hot:skip"
    clients = [make_redlock(redis_nodes, ttl=30.0, fair_heartbeat=60.0) for _ in range(2)]
    for client in clients:
        warm_up(client)
    holder = clients[0].lock(name, ttl=30.0, owner="holder")
    assert holder.acquire(blocking=False)
    # A process joins the waiters and is killed: its place stays on the nodes, and nobody
    # listens on its channel any more.
    dead = multiprocessing.get_context("spawn").Process(
        target=_wait_forever, args=(list(redis_nodes.urls), name), daemon=True
    )
    dead.start()
    try:
        wait_until(lambda: _waiters(redis_nodes, name) == [1] * len(redis_nodes), timeout=30)
    finally:
        dead.kill()
        dead.join(10)
    channel = f"redlock:released:{name}"
    wait_until(lambda: all(release_listeners(n, channel) == 0 for n in redis_nodes))
    ((_, result, thread),) = _start_waiters(clients[1:], name, redis_nodes, timeout=30, ahead=1)
    released = time.monotonic()
    holder.release()
    thread.join(20)
    assert result.get("ok") is True
    # Woken by the release (its own pause is 20 s), past the dead waiter, whose place the
    # release took away.
    assert result["at"] - released < 10
    # The dead waiter's place is gone from every node: what is left is at most the winner's
    # (a node that the release reached after the winner's attempt took the winner's place).
    assert all(count <= 1 for count in _waiters(redis_nodes, name))


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_process_waiting_again_keeps_its_channel_subscribed(
    redis_nodes: RedisCluster, make_redlock, node_calls, fair: bool
) -> None:
    counts, taken, subscribes = _hand_offs(
        redis_nodes, make_redlock, node_calls, f"hot:again:{int(fair)}", fair, "subscribe"
    )
    assert counts == [ROUNDS] * CLIENTS
    # Each client waits under one id per name, whose channel stays subscribed between its
    # acquires (a fair waiter's place in line is named after it): about one SUBSCRIBE per
    # client on each node (a reconnect sends it again), where a new channel per acquire
    # would send one per wait, most of the acquisitions.
    for spent in subscribes:
        assert spent <= 2 * CLIENTS, (subscribes, taken)


def _wait_once(nodes: RedisCluster, holder, waiter, name: str) -> None:
    """``waiter`` waits for ``name`` while ``holder`` holds it, until ``holder`` releases."""
    held = holder.lock(name, ttl=30.0)
    assert held.acquire(blocking=False)
    got: list[bool] = []
    handle = waiter.lock(name, ttl=30.0, owner="waiter")
    thread = threading.Thread(target=lambda: got.append(handle.acquire(timeout=20)))
    thread.start()
    # Released once the waiter is among the name's waiters (it listens by then).
    wait_until(lambda: all(n >= 1 for n in _waiters(nodes, name)), timeout=10)
    held.release()
    thread.join(30)
    assert got == [True]
    handle.release()


def test_a_lingering_channel_is_unsubscribed_once_nobody_waits(
    redis_nodes: RedisCluster, make_redlock, monkeypatch
) -> None:
    from django_redlock.core import waiting

    monkeypatch.setattr(waiting, "LINGER", 0.2)
    holder, waiter = make_redlock(redis_nodes, ttl=30.0), make_redlock(redis_nodes, ttl=30.0)
    for client in (holder, waiter):
        warm_up(client)
    _wait_once(redis_nodes, holder, waiter, "hot:linger")
    # Nobody of the waiter's process waits for the name any more: its channel goes.
    channel = "redlock:released:hot:linger"
    wait_until(lambda: all(release_listeners(n, channel) == 0 for n in redis_nodes), timeout=10)


def test_an_async_waiter_keeps_its_channel_between_acquires_then_drops_it(
    redis_nodes: RedisCluster, make_async_redlock, node_calls, monkeypatch
) -> None:
    import asyncio

    from django_redlock.core import aiowaiting

    monkeypatch.setattr(aiowaiting, "LINGER", 0.5)
    name = "hot:async"
    channel = f"redlock:released:{name}"
    holder = make_async_redlock(redis_nodes, ttl=30.0)
    waiter = make_async_redlock(redis_nodes, ttl=30.0)

    async def main() -> list[int]:
        for client in (holder, waiter):
            lock = client.lock("warm-up")
            assert await lock.acquire(blocking=False)
            await lock.release()
        before = node_calls(redis_nodes)
        for _ in range(3):
            held = holder.lock(name, ttl=30.0)
            assert await held.acquire(blocking=False)
            handle = waiter.lock(name, ttl=30.0)
            task = asyncio.create_task(handle.acquire(timeout=20))
            while not all(n >= 1 for n in _waiters(redis_nodes, name)):
                assert not task.done()
                await asyncio.sleep(0.01)
            await held.release()
            assert await task
            await handle.release()
        after = node_calls(redis_nodes)
        # Nobody of the waiter's loop waits for the name any more: its channel goes while
        # the loop runs.
        deadline = time.monotonic() + 10
        while any(release_listeners(n, channel) for n in redis_nodes):
            assert time.monotonic() < deadline, "the lingering channel stayed subscribed"
            await asyncio.sleep(0.05)
        return [
            a.get("subscribe", 0) - b.get("subscribe", 0)
            for b, a in zip(before, after, strict=True)
        ]

    subscribes = asyncio.run(main())
    # Three waits, one subscription per node (a new channel per wait: three).
    assert all(spent <= 2 for spent in subscribes), subscribes
