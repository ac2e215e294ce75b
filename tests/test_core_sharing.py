"""What a process shares with the nodes: waiters of one name line up behind one contender (not
a connection each), auto-renewed holders share one subscription per node, and a release is an
``EVALSHA`` (the body only after a ``NOSCRIPT``). Counted on real nodes: the process's file
descriptors, the nodes' ``CLIENT LIST`` and ``INFO commandstats``."""

from __future__ import annotations

import asyncio
import os

import pytest

from django_redlock import AsyncRedlock


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
