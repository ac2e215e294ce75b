"""AsyncRedlock's fan-outs share one connection per node and event loop, pipelined.

The commands that the tasks of a loop send in one loop tick leave in one write per node, and
the node reads them in one read (the node's own counters say so); a cancelled task among them
leaves no key behind and takes no other task's command down; a node that stops answering
gets each fan-out's undo behind its own command, so it holds no key once it answers again.
"""

from __future__ import annotations

import asyncio

import pytest

from django_redlock.testing import RedisCluster
from tests.helpers import lock_keys, node_client, settled_lock_keys, wait_until

TASKS = 100


def _stats(nodes: RedisCluster) -> list[dict[str, int]]:
    out = []
    for node in nodes:
        with node_client(node) as client:
            stats = client.info("stats")
        out.append(
            {
                key: int(stats[key])
                for key in (
                    "total_commands_processed",
                    "total_reads_processed",
                    "total_connections_received",
                )
            }
        )
    return out


def _delta(after: list[dict[str, int]], before: list[dict[str, int]], key: str) -> list[int]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]


def test_the_commands_of_a_loop_tick_reach_a_node_in_one_read_on_one_connection(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    # A generous node timeout: a reply that a loaded host delays must not make a fan-out
    # give the shared connection up (a fresh one would be counted).
    rl = make_async_redlock(redis_nodes, node_timeout=2.0)
    cycles = 5
    before: list[dict[str, int]] = []

    async def main() -> None:
        warm = rl.lock("pipelined:warm")
        assert await warm.acquire(blocking=False)  # one connection to every node
        await warm.release()
        # Every node has answered the warm-up (the release's quorum exit may leave one
        # reply owed): the counters then count the tasks' commands alone.
        await rl._drive(rl._locked_steps("pipelined:warm"))
        before.extend(_stats(redis_nodes))

        async def worker(i: int) -> int:
            lock = rl.lock(f"pipelined:{i}", ttl=10)
            won = 0
            for _ in range(cycles):
                if await lock.acquire(blocking=False):
                    won += 1
                    await lock.release()
            return won

        assert await asyncio.gather(*(worker(i) for i in range(TASKS))) == [cycles] * TASKS

    asyncio.run(main())
    after = _stats(redis_nodes)
    # Our stats client's INFO is one command and one read, its connection one connection.
    commands = [d - 1 for d in _delta(after, before, "total_commands_processed")]
    reads = [d - 1 for d in _delta(after, before, "total_reads_processed")]
    connections = [d - 1 for d in _delta(after, before, "total_connections_received")]
    # 100 tasks share the loop's connection to each node (a connection per task before). A
    # loaded host makes some replies late, and a node late to answer gets spare connections
    # and hedged copies, bounded per node: far fewer than one per task.
    assert all(c < TASKS // 4 for c in connections), connections
    # Each node ran every acquire and release (a quorum exit does not stop the third one).
    assert all(c >= TASKS * cycles * 2 for c in commands), commands
    # One read per command before; now the commands of a tick arrive together. The first
    # write of each tick goes alone, so a tick costs at most two reads however many tasks
    # sent in it: at 100 tasks, far fewer reads than commands.
    assert all(r * 4 <= c for r, c in zip(reads, commands, strict=True)), (reads, commands)
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_cancelled_tasks_in_a_batch_leave_no_key_and_the_others_go_on(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    rl = make_async_redlock(redis_nodes, node_timeout=2.0)
    held: dict[int, str] = {}

    async def main() -> None:
        warm = rl.lock("batch:warm")
        assert await warm.acquire(blocking=False)
        await warm.release()
        await rl._drive(rl._locked_steps("batch:warm"))
        before = _stats(redis_nodes)
        gate = asyncio.Event()
        acquired = asyncio.Event()
        holders_in = 0

        async def worker(i: int) -> None:
            nonlocal holders_in
            lock = rl.lock(f"batch:{i}", ttl=30)
            async with lock:
                held[i] = lock.token
                if i % 2 == 0:
                    holders_in += 1
                    if holders_in == TASKS // 2:
                        acquired.set()
                await gate.wait()

        tasks = [asyncio.create_task(worker(i)) for i in range(TASKS)]
        # The odd tasks are cancelled at every stage of their acquire: before it is sent,
        # with it written in the tick's batch, waiting for the replies, and holding.
        for turn in range(12):
            for i in range(1 + 2 * turn, TASKS, 24):
                tasks[i].cancel()
            await asyncio.sleep(0)
        await asyncio.wait_for(acquired.wait(), 30)
        for i in range(1, TASKS, 2):
            with pytest.raises(asyncio.CancelledError):
                await tasks[i]

        # The undo of a cancelled acquire is sent in the background (a quorum exit may
        # leave the third node's reply owed: checked below).
        await asyncio.gather(*rl._state().background)
        # No cancellation gave the shared connections up (counted before lock_keys' own).
        after = _stats(redis_nodes)
        assert [d - 1 for d in _delta(after, before, "total_connections_received")] == [0] * 3

        def only_the_holders() -> bool:
            expected = {f"redlock:lock:batch:{i}" for i in range(0, TASKS, 2)}
            return all(set(keys) == expected for keys in lock_keys(redis_nodes))

        await asyncio.to_thread(wait_until, only_the_holders, 10.0)
        tokens = [{k: t for k, (_, t) in keys.items()} for keys in lock_keys(redis_nodes)]
        for i in range(0, TASKS, 2):
            assert all(t[f"redlock:lock:batch:{i}"] == held[i] for t in tokens)
        gate.set()
        await asyncio.gather(*(tasks[i] for i in range(0, TASKS, 2)))

    asyncio.run(main())
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


@pytest.mark.faults
def test_a_node_that_stops_answering_gets_each_fan_outs_undo_behind_its_command(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """Many tasks' acquires and releases queue on the shared connection of a paused node;
    each fan-out ends on its own deadline at quorum, and whatever the node runs when it
    wakes (acquires the others released meanwhile) is undone behind it on that connection."""
    rl = make_async_redlock(redis_nodes, node_timeout=0.25)
    tasks = 30

    async def main() -> None:
        warm = rl.lock("late:warm")
        assert await warm.acquire(blocking=False)
        await warm.release()

        async def worker(i: int) -> int:
            lock = rl.lock(f"late:{i}", ttl=30)
            won = 0
            for _ in range(3):
                if await lock.acquire(timeout=20):
                    won += 1
                    await lock.release()
            return won

        with redis_nodes[2].paused():
            assert await asyncio.gather(*(worker(i) for i in range(tasks))) == [3] * tasks
            assert settled_lock_keys(redis_nodes[:2]) == [{}, {}]
        # The paused node now runs what it was sent, undos included.
        await asyncio.to_thread(wait_until, lambda: lock_keys(redis_nodes) == [{}, {}, {}], 10.0)

    asyncio.run(main())


def test_closing_the_client_lets_operations_on_the_shared_connection_finish(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """``close()`` while other tasks' acquires are on the shared connections: they get their
    replies (the connections close once those are in), and the client reconnects after."""
    rl = make_async_redlock(redis_nodes, node_timeout=2.0)

    async def main() -> None:
        warm = rl.lock("closing:warm")
        assert await warm.acquire(blocking=False)
        await warm.release()
        await rl._drive(rl._locked_steps("closing:warm"))
        locks = [rl.lock(f"closing:{i}", ttl=30) for i in range(20)]
        acquiring = [asyncio.create_task(lock.acquire(blocking=False)) for lock in locks]
        await asyncio.sleep(0)  # every acquire written
        await asyncio.sleep(0)  # and flushed
        await rl.close()
        assert await asyncio.gather(*acquiring) == [True] * 20
        for lock in locks:
            await lock.release()

    asyncio.run(main())
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]
