"""A client's first contact with a frozen node (SIGSTOP: its kernel accepts TCP, the server
never answers the handshake) costs the caller at most its own budget, not the connect budget
(``CONNECT_AT_LEAST``, 1 s): the other nodes decide the operation at the usual time, and the
connection still being opened finishes (or fails) in the background, carrying no command.
Real redis-server processes; each client under test is fresh, with no pooled connection to
the frozen node (the cluster is in service: a warm-up by another client set its markers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from django_redlock import AsyncRedlock, Redlock
from tests.helpers import occupy, tokens_on_nodes, wait_until, warm_up

pytestmark = pytest.mark.faults

NODE_TIMEOUT = 0.05

#: Ten node timeouts (room for a busy host), half the connect budget each operation paid
#: before.
BOUND = 0.5


def _in_service(cluster) -> None:
    """Every node holds its restart-guard marker, set by a client that is then closed: the
    client under test opens every connection itself."""
    rl = Redlock(cluster.urls, node_timeout=1.0)
    try:
        warm_up(rl)
    finally:
        rl.close()


def _timed(took: list[float], call: Callable[[], object]) -> object:
    started = time.monotonic()
    try:
        return call()
    finally:
        took.append(time.monotonic() - started)


@pytest.mark.parametrize("size", [3, 5])
def test_a_first_operation_against_a_frozen_node_costs_one_node_timeout(
    redis_cluster_factory, size: int
) -> None:
    cluster = redis_cluster_factory(size)
    _in_service(cluster)
    frozen, others = cluster[size - 1], cluster[: size - 1]
    name = "first-contact"
    rl = Redlock(cluster.urls, node_timeout=NODE_TIMEOUT)
    took: list[float] = []
    try:
        frozen.pause()
        try:
            lock = rl.lock(name, ttl=30)
            assert _timed(took, lambda: lock.acquire(blocking=False))
            token = lock.token
            # A quorum granted it (a node still being connected to when it did got no copy).
            assert tokens_on_nodes(others, name).count(token) >= size // 2 + 1
            _timed(took, lock.release)
            wait_until(lambda: tokens_on_nodes(others, name) == [None] * (size - 1))
        finally:
            frozen.resume()
        assert max(took) < BOUND, took
        # Back: it votes again (a lock every node granted), and nothing is left on it.
        wait_until(lambda: _held_everywhere(rl, cluster, "after-thaw"), timeout=5.0)
        wait_until(lambda: tokens_on_nodes(cluster, name) == [None] * size, timeout=3.0)
        assert rl.nodes[size - 1].detector.down is False
    finally:
        rl.close()


def _held_everywhere(rl: Redlock, cluster, name: str) -> bool:
    """A lock on ``name`` taken and given back; whether every node held it meanwhile."""
    lock = rl.lock(name, ttl=30)
    assert lock.acquire(blocking=False)
    try:
        return tokens_on_nodes(cluster, name) == [lock.token] * len(cluster)
    finally:
        lock.release()


def test_a_first_refused_acquire_against_a_frozen_node_costs_one_node_timeout(
    redis_cluster_factory,
) -> None:
    """An acquire the other nodes refuse waits for every node: the frozen one, still being
    connected to, is waited for as a slow node is (one node timeout), not for the connect
    budget; and it is not found silent for that (its connection's budget tells)."""
    cluster = redis_cluster_factory(3)
    _in_service(cluster)
    name = "first-refused"
    for node in cluster[:2]:
        occupy(node, name, ms=30_000)
    rl = Redlock(cluster.urls, node_timeout=NODE_TIMEOUT)
    took: list[float] = []
    try:
        with cluster[2].paused():
            assert _timed(took, lambda: rl.lock(name, ttl=30).acquire(blocking=False)) is False
            assert rl.nodes[2].detector.misses == 0
        assert max(took) < BOUND, took
        wait_until(lambda: _held_everywhere(rl, cluster, "after-thaw"), timeout=5.0)
    finally:
        rl.close()
    assert tokens_on_nodes(cluster, name) == ["stale-lease", "stale-lease", None]


async def _held_everywhere_async(rl: AsyncRedlock, cluster, name: str) -> bool:
    lock = rl.lock(name, ttl=30)
    assert await lock.acquire(blocking=False)
    try:
        return tokens_on_nodes(cluster, name) == [lock.token] * len(cluster)
    finally:
        await lock.release()


async def _until(check: Callable[[], object], timeout: float) -> None:
    """Await ``check()`` (a coroutine function's call) until it is true, at most
    ``timeout`` seconds; the loop runs between tries (it reads the late replies)."""
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[misc]
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.02)


async def _timed_async(took: list[float], call: Callable[[], object]) -> object:
    started = time.monotonic()
    try:
        return await call()  # type: ignore[misc]
    finally:
        took.append(time.monotonic() - started)


@pytest.mark.parametrize("size", [3, 5])
def test_a_first_operation_against_a_frozen_node_costs_one_node_timeout_async(
    redis_cluster_factory, size: int
) -> None:
    cluster = redis_cluster_factory(size)
    _in_service(cluster)
    frozen, others = cluster[size - 1], cluster[: size - 1]
    name = "first-contact"
    took: list[float] = []

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=NODE_TIMEOUT)
        try:
            frozen.pause()
            try:
                lock = rl.lock(name, ttl=30)
                assert await _timed_async(took, lambda: lock.acquire(blocking=False))
                token = lock.token
                assert tokens_on_nodes(others, name).count(token) >= size // 2 + 1
                await _timed_async(took, lock.release)
                wait_until(lambda: tokens_on_nodes(others, name) == [None] * (size - 1))
            finally:
                frozen.resume()
            assert max(took) < BOUND, took

            async def gone() -> bool:
                assert await rl.locked("other") is False
                return tokens_on_nodes(cluster, name) == [None] * size

            await _until(lambda: _held_everywhere_async(rl, cluster, "after-thaw"), 5.0)
            await _until(gone, 3.0)
            assert rl.nodes[size - 1].detector.down is False
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_first_refused_acquire_against_a_frozen_node_costs_one_node_timeout_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)
    _in_service(cluster)
    name = "first-refused"
    for node in cluster[:2]:
        occupy(node, name, ms=30_000)
    took: list[float] = []

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=NODE_TIMEOUT)
        try:
            with cluster[2].paused():
                lock = rl.lock(name, ttl=30)
                assert await _timed_async(took, lambda: lock.acquire(blocking=False)) is False
                assert rl.nodes[2].detector.misses == 0
            assert max(took) < BOUND, took
            await _until(lambda: _held_everywhere_async(rl, cluster, "after-thaw"), 5.0)
        finally:
            await rl.close()

    asyncio.run(main())
    assert tokens_on_nodes(cluster, name) == ["stale-lease", "stale-lease", None]
