"""AsyncRedlock on real redis-server nodes: the same contract as the sync client, awaited.

Covered: acquire/release/extend/check/held/validity/token/fence, ``async with``, contention
between tasks (and loops) without overlap, reentrancy per task, auto-renewal and its stop at
release, loss detection, wake-up by a release in another process, minority/majority node
failures, fencing, and one AsyncRedlock used from several event loops. Driven by
``asyncio.run`` (no pytest-asyncio dependency).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from django_redlock import LockLost, LockNotAcquired, LockNotOwned, QuorumError
from django_redlock.core.asyncio import AsyncLock, AsyncRedlock
from django_redlock.core.commands import lock_fields
from django_redlock.testing import RedisCluster
from tests.helpers import (
    REPO_ROOT,
    held_everywhere,
    node_client,
    pttls_on_nodes,
    run_python,
    script_calls,
    settled_lock_keys,
    settled_tokens,
    tokens_on_nodes,
    wait_until,
)


def connected_clients(nodes) -> list[int]:
    return [int(node.info("clients")["connected_clients"]) for node in nodes]


def test_module_does_not_shadow_stdlib_asyncio() -> None:
    import django_redlock.core.asyncio as module
    from django_redlock.core import base, lock, redlock

    assert module is not asyncio and asyncio.__name__ == "asyncio"
    assert lock.asyncio is asyncio and hasattr(lock.asyncio, "current_task")
    assert base.RedlockBase in redlock.Redlock.__mro__
    assert module.AsyncRedlock.lock_class is AsyncLock


def test_acquire_release_extend_check(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes)

    async def main() -> None:
        lock = rl.lock("basic", ttl=5.0)
        assert isinstance(lock, AsyncLock)
        assert not lock.held and lock.validity == 0.0 and lock.token is None
        # A brand-new (flushed) cluster is trusted at once: no idling for max_ttl.
        assert await lock.acquire(blocking=False) is True
        assert lock.held and 4.5 < lock.validity <= 5.0
        assert len(lock.token) == 32 and lock.fence is None
        assert settled_tokens(redis_nodes, "basic") == [lock.token] * 3
        assert await lock.check() is True
        assert await rl.locked("basic") is True
        assert await lock.extend(8.0) is True
        assert 7.5 < lock.validity <= 8.0
        assert all(5000 < p <= 8000 for p in pttls_on_nodes(redis_nodes, "basic"))
        info = await rl.lock_info("basic")
        assert info is not None and info.token == lock.token and info.nodes == 3
        assert [i.name for i in await rl.live_locks()] == ["basic"]
        assert await rl.live_locks("other*") == []
        await lock.release()
        assert not lock.held and await lock.check() is False
        assert await rl.locked("basic") is False
        assert settled_lock_keys(redis_nodes) == [{}, {}, {}]
        with pytest.raises(LockNotOwned):
            await lock.release()
        # force_release: removes whoever holds it; the holder learns it lost the lock.
        assert await lock.acquire(blocking=False)
        held_everywhere(redis_nodes, "basic")
        assert await rl.force_release("basic") == 3
        assert not lock.held and lock.lost
        with pytest.raises(LockLost):
            await lock.release()
        health = await rl.health()
        assert [h.reachable for h in health] == [True] * 3
        assert all(h.version and h.run_id and h.latency is not None for h in health)
        assert all(h.guarded_for == 0.0 for h in health)

    asyncio.run(main())


def test_a_fresh_clients_first_lock_is_on_every_healthy_node(redis_nodes: RedisCluster) -> None:
    # As the sync client's: a connection that opens after a quorum granted still carries its
    # copy (a lock on a bare quorum is lost to one more failure). Many fresh clients: the
    # connections open in any order.
    async def main() -> None:
        for attempt in range(25):
            rl = AsyncRedlock(redis_nodes.urls)
            try:
                lock = rl.lock(f"fresh-first:{attempt}", ttl=30)
                assert await lock.acquire(blocking=False)
                tokens = await asyncio.to_thread(settled_tokens, redis_nodes, lock.name)
                assert tokens == [lock.token] * 3, attempt
                await lock.release()
            finally:
                await rl.close()

    asyncio.run(main())


def test_async_with_and_lock_not_acquired(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, retry_count=1, retry_delay=0.02)
    other = make_async_redlock(redis_nodes)

    async def main() -> None:
        async with rl.lock("ctx", ttl=5.0) as lock:
            assert lock.held
            held_token = lock.token
            with pytest.raises(LockNotAcquired) as caught:
                async with other.lock("ctx", blocking=False):
                    raise AssertionError("entered a lock someone else holds")
            assert caught.value.retry_after is not None and 4 < caught.value.retry_after <= 5
            t0 = time.monotonic()
            assert await other.lock("ctx").acquire(timeout=0.3) is False
            assert 0.25 <= time.monotonic() - t0 < 1.5
        assert not lock.held
        assert settled_tokens(redis_nodes, "ctx") == [None] * 3
        assert held_token

    asyncio.run(main())


def test_tasks_and_loops_contending_never_overlap(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """Three tasks on each of two event loops (two threads) share one AsyncRedlock and pass one
    name around: the critical sections never overlap and all finish promptly."""
    rl = make_async_redlock(redis_nodes, retry_delay=0.05)
    intervals: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    async def worker() -> None:
        for _ in range(4):
            async with rl.lock("shared", ttl=5.0, timeout=10.0):
                begin = time.monotonic()
                await asyncio.sleep(0.003)
                intervals.append((begin, time.monotonic()))

    def run_loop() -> None:
        async def main() -> None:
            await asyncio.gather(*(worker() for _ in range(3)))

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(intervals) == 24
    ordered = sorted(intervals)
    for (_, end), (begin, _) in itertools.pairwise(ordered):
        assert end <= begin, "two holders at once"
    assert time.monotonic() - t0 < 15
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_reentrancy_is_per_task(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, reentrant=True)

    async def main() -> None:
        outer = rl.lock("re", ttl=5.0)
        assert await outer.acquire(blocking=False)
        inner = rl.lock("re", ttl=5.0)
        assert await inner.acquire(blocking=False)
        assert inner.token == outer.token

        async def other_task() -> bool:
            return await rl.lock("re", ttl=5.0).acquire(blocking=False)

        assert await asyncio.create_task(other_task()) is False  # another task: another owner
        await inner.release()
        assert settled_tokens(redis_nodes, "re") == [outer.token] * 3  # still held once
        await outer.release()
        assert settled_tokens(redis_nodes, "re") == [None] * 3

        # An explicit owner is shared across tasks (a job id, say).
        async def as_job(lock: AsyncLock) -> bool:
            return await lock.acquire(blocking=False)

        first, second = rl.lock("job", owner="job-1"), rl.lock("job", owner="job-1")
        assert await asyncio.create_task(as_job(first))
        assert await asyncio.create_task(as_job(second))
        assert first.token == second.token
        await second.release()
        await first.release()
        assert settled_tokens(redis_nodes, "job") == [None] * 3

    asyncio.run(main())


def test_auto_renew_keeps_a_short_lease_and_stops_at_release(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    rl = make_async_redlock(redis_nodes)
    lost = []
    rl.listeners.append(lambda e: lost.append(e) if e.kind == "lost" else None)

    async def main() -> None:
        lock = rl.lock("renewed", ttl=0.3, auto_renew=True)
        assert await lock.acquire(blocking=False)
        start = time.monotonic()
        while time.monotonic() - start < 1.0:  # > 3 x ttl
            await asyncio.sleep(0.1)
            assert lock.held
            assert all(p > 0 for p in pttls_on_nodes(redis_nodes, "renewed"))
        with node_client(redis_nodes[0]) as c:
            assert int(lock_fields(c.get("redlock:lock:renewed"))["renewals"]) >= 2
        await lock.release()
        calls = script_calls(redis_nodes)
        await asyncio.sleep(0.4)  # more than one renewal period
        assert script_calls(redis_nodes) == calls, "a renewal after release"
        assert pttls_on_nodes(redis_nodes, "renewed") == [-2, -2, -2]

    asyncio.run(main())
    assert lost == []


def test_renewal_detects_a_lost_lock(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes)
    events = []
    rl.listeners.append(events.append)

    async def main() -> None:
        lock = rl.lock("lost", ttl=0.3, auto_renew=True)
        assert await lock.acquire(blocking=False)
        for node in redis_nodes:  # someone deletes the keys behind our back
            with node_client(node) as c:
                c.delete("redlock:lock:lost")
        deadline = time.monotonic() + 2
        while lock.held and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not lock.held and lock.lost
        with pytest.raises(LockLost):
            await lock.release()

    asyncio.run(main())
    # a hold ends once: the release of a lost lock raises, and sends no "released"
    assert [e.kind for e in events if e.kind in ("lost", "released")] == ["lost"]


def test_renewal_runs_on_the_loop_so_a_loop_blocked_past_the_lease_loses_the_lock(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """The asyncio client renews from a task on its event loop (documented): a blocking call
    longer than the lease stops renewal with everything else on the loop, and the holder
    learns the loss rather than writing on as if it held the lock."""
    rl = make_async_redlock(redis_nodes)
    other = make_redlock(redis_nodes)

    async def main() -> None:
        lock = rl.lock("blocked", ttl=0.5, auto_renew=True)
        assert await lock.acquire(blocking=False)
        assert any(t.get_name().startswith("redlock-renewer") for t in asyncio.all_tasks())
        time.sleep(1.0)  # the fault under test: a blocking call on the loop, twice the lease
        assert other.lock("blocked").acquire(blocking=False)  # the lease ran out on the nodes
        assert not lock.held
        with pytest.raises(LockLost):
            await lock.release()

    asyncio.run(main())


def test_many_tasks_on_keys_of_their_own_never_lose_a_lock(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """Hundreds of tasks cycling acquire/release on keys nobody else asks for: every release
    finds its lock. A release that could not go out behind its acquire's connection (another
    task's fan-out had it) marked that acquire's command unwanted, so its reader sent the
    undo, which could reach the node first: the release found nothing there and raised
    LockNotOwned, "it was not exclusive the whole time" (98 of 4,000 cycles)."""
    rl = make_async_redlock(redis_nodes, ttl=5.0)
    lost: list[str] = []

    async def cycles(task: int, round: int) -> int:
        done = 0
        for _ in range(20):
            lock = rl.lock(f"own:{round}:{task}")
            try:
                assert await lock.acquire(blocking=False)
                await lock.release()
                done += 1
            except (LockNotOwned, LockLost) as exc:
                lost.append(str(exc))
        return done

    async def main() -> int:
        total = 0
        for round in range(2):
            total += sum(await asyncio.gather(*(cycles(i, round) for i in range(150))))
        return total

    done = asyncio.run(main())
    assert not lost, (len(lost), lost[:2])
    assert done == 2 * 150 * 20


def test_an_auto_renewed_lease_outlives_the_loop_that_took_it(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """An async view under a WSGI server runs in a loop of its own, which ends when the view
    returns; a streaming response goes on after it, and its lock must stay held until the
    stream ends (docs/usage.rst). The lease is renewed from the client's own loop once the
    one that took it ended, until it is released from another loop."""
    rl = make_async_redlock(redis_nodes)
    other = make_redlock(redis_nodes)
    lock = rl.lock("outlives", ttl=0.6, auto_renew=True)
    assert asyncio.run(lock.acquire(blocking=False))  # the loop that took it has ended
    # Five leases' worth of time with nobody on the taking loop: held all along.
    until = time.monotonic() + 3.0
    while time.monotonic() < until:
        assert not other.lock("outlives").acquire(blocking=False)
        assert lock.held and lock.lost is None
        time.sleep(0.1)
    asyncio.run(lock.release())  # from a loop of its own, as async_to_sync runs it
    assert not lock.held and lock.lost is None
    grabbed = other.lock("outlives")
    assert grabbed.acquire(blocking=False)
    grabbed.release()


def test_a_task_queued_behind_a_force_released_holder_moves_up_at_once(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """The asyncio twin of the sync test in test_core_waiting: the tasks of the holder's own
    loop queued behind it do not sleep out the lease it lost."""
    other = make_redlock(redis_nodes, ttl=1.0)
    assert other.lock("forced").acquire(blocking=False)  # ends in 1 s
    rl = make_async_redlock(redis_nodes, ttl=3.0)
    operator = make_redlock(redis_nodes)

    async def main() -> float:
        holding = asyncio.Event()

        async def holder() -> None:
            lock = rl.lock("forced", auto_renew=True)
            if await lock.acquire(timeout=5):  # the queue's front: it waited for the other
                holding.set()

        async def queued() -> float:
            lock = rl.lock("forced")
            assert await lock.acquire(timeout=10)
            at = time.monotonic()
            await lock.release()
            return at

        front = asyncio.create_task(holder())
        await asyncio.sleep(0)  # the holder goes first in the queue
        second = asyncio.create_task(queued())
        await asyncio.wait_for(holding.wait(), 5)
        await front
        forced_at = time.monotonic()
        assert await asyncio.to_thread(operator.force_release, "forced") >= 2  # a quorum
        return await asyncio.wait_for(second, 5) - forced_at

    waited = asyncio.run(main())
    assert waited < 1.0, waited  # not the up to 3 s the lost lease had left


_HOLDER = """
import sys, time
from django_redlock import Redlock
rl = Redlock({urls!r})
lock = rl.lock("wake", ttl=10.0)
assert lock.acquire(blocking=False)
print("held", flush=True)
sys.stdin.readline()
time.sleep(0.2)
releasing = time.monotonic()
lock.release()
print("released", releasing, flush=True)
rl.close()
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the holder process did not answer"
    return proc.stdout.readline().strip()


def test_release_in_another_process_wakes_the_waiter(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """The holder's lease is 10 s; it releases after ~0.2 s and the async waiter has the lock
    well within 1 s: woken by the release notice, not by the lease's end or polling."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    code = textwrap.dedent(_HOLDER.format(urls=list(redis_nodes.urls)))
    with subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            assert _read_line(proc, 30) == "held"
            rl = make_async_redlock(redis_nodes)

            async def main() -> tuple[float, float]:
                lock = rl.lock("wake", ttl=5.0)
                t0 = time.monotonic()
                proc.stdin.write("go\n")
                proc.stdin.flush()
                assert await lock.acquire(timeout=5.0)
                got = time.monotonic()
                await lock.release()
                return t0, got

            t0, got = asyncio.run(main())
            words = _read_line(proc, 10).split()
        finally:
            proc.kill()
    assert words[0] == "released"
    releasing = float(words[1])  # when the holder started its release
    assert 0.15 < got - t0 < 1.0, got - t0
    assert releasing <= got < releasing + 0.5, got - releasing


def test_a_cancelled_waiter_leaves_no_trace(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes)

    async def main() -> None:
        holder = rl.lock("cancel", ttl=5.0)
        assert await holder.acquire(blocking=False)

        async def wait_for_it() -> bool:
            return await rl.lock("cancel", ttl=5.0).acquire(timeout=5.0)

        waiter = asyncio.create_task(wait_for_it())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await holder.release()
        again = rl.lock("cancel", ttl=5.0)
        assert await again.acquire(timeout=1.0)  # the local queue was left
        await again.release()
        assert rl._state().queues == {}

    asyncio.run(main())
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


@pytest.mark.faults
def test_minority_paused_still_works_within_the_node_timeout(
    redis_nodes5: RedisCluster, make_async_redlock
) -> None:
    rl = make_async_redlock(redis_nodes5, node_timeout=0.05)

    async def main() -> None:
        warm = rl.lock("warm")
        assert await warm.acquire(blocking=False)  # pooled connections to every node
        await warm.release()
        with redis_nodes5[0].paused(), redis_nodes5[1].paused():
            for _ in range(2):  # pooled connections, then fresh ones to the paused nodes
                lock = rl.lock("minority", ttl=5.0)
                t0 = time.monotonic()
                assert await lock.acquire(blocking=False)
                elapsed = time.monotonic() - t0
                assert elapsed < 2 * 0.05 + 0.25, elapsed
                assert settled_tokens(redis_nodes5[2:], "minority") == [lock.token] * 3
                await lock.release()

    asyncio.run(main())


@pytest.mark.faults
def test_majority_down_raises_quorum_error(redis_nodes: RedisCluster, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, node_timeout=0.05)

    async def main() -> None:
        warm = rl.lock("warm")
        assert await warm.acquire(blocking=False)
        await warm.release()
        redis_nodes[1].kill()
        redis_nodes[2].kill()
        lock = rl.lock("majority", ttl=5.0)
        with pytest.raises(QuorumError) as caught:
            await lock.acquire(blocking=False)
        assert len(caught.value.failures) == 2
        assert all("refused" in why for why in caught.value.failures.values())
        assert not lock.held
        with pytest.raises(QuorumError):
            await lock.acquire(timeout=0.3)

    asyncio.run(main())
    assert settled_lock_keys(redis_nodes[:1]) == [{}]  # the one granted SET was taken back


def test_fencing_tokens_strictly_increase(redis_nodes: RedisCluster, make_async_redlock) -> None:
    one, two = make_async_redlock(redis_nodes), make_async_redlock(redis_nodes)

    async def main() -> list[int]:
        fences = []
        for i in range(6):
            client = one if i % 2 == 0 else two
            lock = client.lock("fenced", ttl=5.0, fencing=True)
            assert await lock.acquire(blocking=False)
            assert isinstance(lock.fence, int)
            info = await client.lock_info("fenced")
            assert info is not None and info.fence == lock.fence
            fences.append(lock.fence)
            await lock.release()
        return fences

    fences = asyncio.run(main())
    assert all(a < b for a, b in itertools.pairwise(fences)), fences


def test_one_redlock_serves_successive_event_loops(
    redis_cluster_factory, make_async_redlock
) -> None:
    """Built outside any loop, used from two ``asyncio.run`` calls (Django's async_to_sync does
    the same): each loop gets its own connections; when it shuts down its idle ones are parked
    for the next loop (one per node here), and closed with the client. Nodes of its own: it
    counts their clients."""
    redis_nodes: RedisCluster = redis_cluster_factory(3)
    baseline = connected_clients(redis_nodes)
    rl: AsyncRedlock = make_async_redlock(redis_nodes)
    lock = rl.lock("loops", ttl=5.0, auto_renew=True)

    async def cycle() -> str:
        assert await lock.acquire(blocking=False)
        assert await rl.locked("loops")
        token = lock.token
        await lock.release()
        return token

    first = asyncio.run(cycle())
    second = asyncio.run(cycle())
    assert first != second
    assert rl._states == {}
    assert [len(node.parked) for node in rl.nodes] == [1] * len(rl.nodes)
    asyncio.run(rl.close())
    wait_until(lambda: connected_clients(redis_nodes) == baseline)


def test_unix_sockets_password_db_and_noscript(redis_cluster_factory, make_async_redlock) -> None:
    """The handshake (AUTH, SELECT) over unix sockets, the EVAL fallback after the nodes lost
    their script cache, and a wrong password reported as ``auth``."""
    cluster = redis_cluster_factory(3, unix_socket=True, password="s3cret")
    rl = make_async_redlock([url.replace("db=0", "db=2") for url in cluster.urls])
    wrong = make_async_redlock([url.replace("s3cret", "nope") for url in cluster.urls])

    async def main() -> None:
        lock = rl.lock("unix", ttl=5.0)
        assert await lock.acquire(blocking=False)
        for node in cluster:
            with node.client(db=2, socket_timeout=5) as c:
                assert lock_fields(c.get("redlock:lock:unix"))["token"] == lock.token
        await lock.release()
        for node in cluster:
            with node.client(socket_timeout=5) as c:
                c.script_flush()
        assert await lock.acquire(blocking=False)  # NOSCRIPT -> EVAL, on pooled connections
        await lock.release()
        with pytest.raises(QuorumError) as caught:
            await wrong.lock("unix").acquire(blocking=False)
        assert all(why.startswith("auth") for why in caught.value.failures.values())

    asyncio.run(main())


def test_concurrent_first_use_of_a_fresh_cluster(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """Eight tasks take eight different names at once on a cluster nobody used yet: every
    non-blocking attempt must succeed (the trust round of one task may still be landing when
    another's acquire arrives). Repeated because the failure is a race. The node timeout is
    roomier than the default: all 24 first connections are opened by one event loop at once,
    which under asyncio debug mode (``-X dev``) alone can take longer than 2 x 50 ms."""
    for round_ in range(8):
        for node in redis_nodes:
            node.flush()
        rl = make_async_redlock(redis_nodes, node_timeout=0.25)

        async def take(i: int, rl: AsyncRedlock = rl) -> bool:
            lock = rl.lock(f"fresh:{i}")
            got = await lock.acquire(blocking=False)
            await lock.release()
            return got

        async def main(rl: AsyncRedlock = rl) -> list[bool]:
            return await asyncio.gather(*(take(i) for i in range(8)))

        assert asyncio.run(main()) == [True] * 8, f"round {round_}"


def test_a_listener_that_unwatches_while_hearing_does_not_hide_the_next_one() -> None:
    """A holder's watch that hears its own force release unwatches itself from inside the
    notice; the next listener on the channel (a waiter) must still hear it (the notice loop
    once iterated the live list and skipped it)."""
    from django_redlock.core.aiowaiting import AsyncReleaseNotices

    loop = asyncio.new_event_loop()
    try:
        notices = AsyncReleaseNotices([], 0.05, loop)
        heard: list[str] = []

        class Watch:
            def __init__(self, label: str, leave: bool) -> None:
                self.label, self.leave = label, leave

            def hear(self, node: int, token: bytes) -> None:
                heard.append(self.label)
                if self.leave:
                    notices.unwatch(b"chan", self)

        notices.watch(b"chan", Watch("holder", leave=True))
        notices.watch(b"chan", Watch("waiter", leave=False))
        notices._on_message(0, [b"message", b"chan", b"token"])
        assert heard == ["holder", "waiter"]
    finally:
        loop.close()


def test_an_async_redlock_left_unclosed_in_asyncio_run_exits_quietly(redis_cluster_factory):
    """``asyncio.run`` cancels every task at the end, then closes the loop: an acquire
    cancelled then (it had won: the lease is given back in the background) must not start a
    task the loop never runs ("Task was destroyed but it is pending") nor touch the closed
    loop. The renewed lease and the given-back one end with their TTL."""
    cluster = redis_cluster_factory(3)
    result = run_python(
        f"""
        import asyncio
        from django_redlock import AsyncRedlock

        async def main():
            rl = AsyncRedlock({cluster.urls!r})
            held = rl.lock("held", ttl=5, auto_renew=True)
            assert await held.acquire()
            async with rl.lock("cycled"):
                pass
            waiter = rl.lock("held")
            asyncio.ensure_future(waiter.acquire(timeout=0.5))  # still waiting at the end
            racer = rl.lock("raced", ttl=5)
            asyncio.ensure_future(racer.acquire())  # on the wire at the end
            await asyncio.sleep(0.05)

        asyncio.run(main())
        print("done")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert "destroyed" not in result.stderr and "Event loop is closed" not in result.stderr
    assert result.stderr == "", result.stderr


_LEFT_BEHIND_WORK = """
import asyncio
from django_redlock import AsyncRedlock

rl = AsyncRedlock(URLS)

async def work():
    async with rl.lock("cycled"):
        pass
    held = rl.lock("held", ttl=5, auto_renew=True)
    assert await held.acquire()
    blocker = rl.lock("waited", ttl=5)
    assert await blocker.acquire()
    waiter = rl.lock("waited")
    waiting = asyncio.ensure_future(waiter.acquire(timeout=5))
    await asyncio.sleep(0.05)  # the waiter subscribes to the release
    await blocker.release()
    assert await waiting
    await waiter.release()

async def cycle():
    async with rl.lock("cycled"):
        pass
"""

_LEFT_BEHIND = {
    # asyncio.run cancels the tasks, then closes the loop; the idle connections are parked
    # for a next loop that never comes.
    "asyncio.run": "asyncio.run(work())",
    "asyncio.run, idle": "asyncio.run(cycle())",
    # A loop closed without its tasks cancelled (no asyncio.run): the client's keeper never
    # runs; the client used again from another loop finds the closed one.
    "closed loop": """
loop = asyncio.new_event_loop()
loop.run_until_complete(work())
loop.close()
asyncio.run(rl.locked("held"))
""",
    # The same, the client never used again: what is left is closed at exit.
    "closed loop, exit": """
loop = asyncio.new_event_loop()
loop.run_until_complete(work())
loop.close()
""",
    # The loop never closed: asyncio itself reports the unclosed loop (the user's), nothing
    # of the client's.
    "open loop at exit": """
loop = asyncio.new_event_loop()
loop.run_until_complete(work())
""",
}


@pytest.mark.parametrize("ending", list(_LEFT_BEHIND))
def test_an_async_redlock_left_unclosed_leaves_nothing_behind(redis_cluster_factory, ending):
    """However its loop ends, an unclosed AsyncRedlock that took and released a lock, holds
    an auto-renewed one and had a waiter leaves no task "destroyed but pending", no "Event
    loop is closed" traceback, no unclosed socket or transport (``-W default`` shows the
    resource warnings; ``-X dev`` would add asyncio's reports of slow callbacks, which a
    loaded host makes), and the process exits (a collected keeper once
    started the renewal thread at interpreter shutdown, which hung forever)."""
    cluster = redis_cluster_factory(3)
    code = _LEFT_BEHIND_WORK.replace("URLS", repr(cluster.urls)) + _LEFT_BEHIND[ending]
    result = run_python(code + "\nprint('done')\n", flags=["-W", "default"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if ending == "open loop at exit":
        assert len(lines) == 1 and "unclosed event loop" in lines[0], result.stderr
    else:
        assert lines == [], result.stderr


def test_a_closed_loops_auto_renewed_lease_is_still_renewed(redis_cluster_factory):
    """A loop closed without its tasks cancelled ends its renewals too: the client, used
    again, renews the auto-renewed lease it still holds from its own loop (as when a loop
    ends through asyncio.run), until it is released."""
    cluster = redis_cluster_factory(3)
    rl = AsyncRedlock(cluster.urls)
    held = rl.lock("renewed", ttl=0.6, auto_renew=True)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(held.acquire())
    finally:
        loop.close()
    try:
        assert asyncio.run(rl.locked("renewed"))  # finds the closed loop
        # Three ttls: the lease would have ended twice over unrenewed.
        time.sleep(1.8)
        assert asyncio.run(rl.locked("renewed"))
        assert asyncio.run(held.check())
        asyncio.run(held.release())
        assert not asyncio.run(rl.locked("renewed"))
    finally:
        asyncio.run(rl.close())


def _connections_received(nodes) -> list[int]:
    return [node_client(node).info("stats")["total_connections_received"] for node in nodes]


def test_a_fresh_event_loop_per_call_reuses_the_connections_of_the_last_one(
    redis_cluster_factory,
):
    """An async view under a WSGI server runs in a fresh event loop per request (asgiref's
    ``async_to_sync``): the loop that ends leaves its idle lock connections to the next, so
    a request connects nothing (connecting inside each request's node timeout made a busy
    host answer 503), and what one loop did is seen by the next."""
    from asgiref.sync import async_to_sync

    cluster = redis_cluster_factory(3)
    # A budget no reply misses on a loaded host: a late reply sets its connection aside and
    # opens another, which this count would take for a connection per loop.
    rl = AsyncRedlock(cluster.urls, node_timeout=2.0)

    async def request(i: int) -> bool:
        lock = rl.lock(f"view-{i % 3}", ttl=10)
        got = await lock.acquire(blocking=False)
        if got:
            await lock.release()
        return got

    try:
        assert async_to_sync(request)(0)  # the first loop connects
        before = _connections_received(cluster)
        results = [async_to_sync(request)(i) for i in range(1, 41)]
        after = _connections_received(cluster)
        assert results == [True] * 40
        # Forty loops, no new lock connection (one per node per loop before): the one
        # connection counted is the stats client reading these numbers.
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]  # ours
        assert all(len(node.parked) >= 1 for node in rl.nodes)
    finally:
        asyncio.run(rl.close())
    assert [len(node.parked) for node in rl.nodes] == [0, 0, 0]


def test_a_parked_connection_the_node_closed_meanwhile_gets_a_fresh_one(
    redis_cluster_factory,
):
    """The node closes idle connections (restart, ``timeout``): the next loop's adopted one
    is found closed when used, and the operation connects anew within its one fresh try."""
    cluster = redis_cluster_factory(3)
    rl = AsyncRedlock(cluster.urls, node_timeout=0.25)

    async def cycle() -> bool:
        lock = rl.lock("parked", ttl=10)
        got = await lock.acquire(blocking=False)
        if got:
            await lock.release()
        return got

    try:
        assert asyncio.run(cycle())
        for node in cluster:
            node_client(node).client_kill_filter(_type="normal", skipme=True)
        assert asyncio.run(cycle())
        assert asyncio.run(cycle())
    finally:
        asyncio.run(rl.close())


def test_an_async_holder_without_auto_renew_learns_of_a_force_release_at_its_next_call(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """As the Redlock's (docs/backends.rst): only auto_renew holders listen; another's
    force release is found by ``check()`` (then LockLost) or by ``release()``
    (LockNotOwned); one through the holder's own AsyncRedlock is heard at once."""
    operator = make_redlock(redis_nodes, node_timeout=0.5)

    async def main() -> None:
        rl = AsyncRedlock(redis_nodes.urls, node_timeout=0.5)
        try:
            checked, released = rl.lock("aforced-plain-0", ttl=30), rl.lock("aforced-plain-1")
            for lock in (checked, released):
                assert await lock.acquire(blocking=False)
                # The acquire ends once a quorum granted; on a busy host the third node may
                # run the operator's delete before the acquire's copy (another connection).
                assert operator.force_release(lock.name) >= 2
            assert checked.lost is None and released.lost is None and checked.held
            assert await checked.check() is False and checked.lost and not checked.held
            with pytest.raises(LockLost):
                await checked.release()
            with pytest.raises(LockNotOwned) as raised:
                await released.release()
            assert type(raised.value) is LockNotOwned, raised.value
            own = rl.lock("aforced-plain-own", ttl=30)
            assert await own.acquire(blocking=False)
            held_everywhere(redis_nodes, own.name)
            assert await rl.force_release(own.name) == 3
            assert own.lost and not own.held  # through its own AsyncRedlock: at once
        finally:
            await rl.close()

    asyncio.run(main())


def test_a_renewed_lease_taken_by_a_loop_s_task_is_released_from_a_later_loop(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """Taken inside ``asyncio.run`` with no ``owner=`` (the owner is that run's task), the lease
    outlives its loop and is renewed; the task that owned it is gone, so a later loop releases
    it through the handle (a task or thread that still runs is still the only one that may)."""
    rl = make_async_redlock(redis_nodes)
    other = make_redlock(redis_nodes)

    async def take() -> AsyncLock:
        lock = rl.lock("task-gone", ttl=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)  # owned by this run's task
        return lock

    lock = asyncio.run(take())
    time.sleep(1.8)  # three leases after its loop ended: renewed all along
    assert lock.held and lock.lost is None
    assert not other.lock("task-gone").acquire(blocking=False)
    asyncio.run(lock.release())  # another loop, another task
    assert not lock.held and lock.lost is None
    assert other.lock("task-gone").acquire(blocking=False)

    async def still_running_owner() -> None:
        held, done = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with shared:
                held.set()
                await done.wait()

        task = asyncio.create_task(holder())
        await held.wait()
        with pytest.raises(LockNotOwned):
            await shared.release()
        done.set()
        await task

    shared = rl.lock("task-live", ttl=0.6, auto_renew=True)
    asyncio.run(still_running_owner())
    assert not shared.held


def test_a_renewed_lease_its_ended_task_left_without_a_handle_runs_out(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """A task that ends holding an auto-renewed lock and leaves no handle to it: nobody can
    release it, so it is not renewed for ever; it is free once its lease ran out, whether its
    loop goes on or ended."""
    rl = make_async_redlock(redis_nodes)
    other = make_redlock(redis_nodes)

    async def take_and_drop(name: str) -> None:
        assert await rl.lock(name, ttl=0.6, auto_renew=True).acquire(blocking=False)

    def gone(name: str) -> bool:
        return tokens_on_nodes(redis_nodes, name) == [None] * 3

    async def loop_goes_on() -> float:
        await asyncio.create_task(take_and_drop("task-abandoned"))
        started = time.monotonic()
        while not gone("task-abandoned"):
            assert time.monotonic() - started < 4.0, "still renewed"
            await asyncio.sleep(0.02)
        return time.monotonic() - started

    assert asyncio.run(loop_goes_on()) <= 0.6 + 0.2 + 1.0
    assert other.lock("task-abandoned").acquire(blocking=False)
    asyncio.run(take_and_drop("loop-abandoned"))  # its loop ended: adopted, then let go
    wait_until(lambda: gone("loop-abandoned"), timeout=4.0)
    assert other.lock("loop-abandoned").acquire(blocking=False)


def test_retry_after_is_the_lease_left_of_a_holder_in_the_same_client(
    redis_nodes: RedisCluster, make_async_redlock
) -> None:
    """Another task of the same AsyncRedlock holds the lock: the refused ``async with`` says
    how long its lease has left, as the sync client does for another thread."""
    rl = make_async_redlock(redis_nodes)

    async def main() -> list[float | None]:
        held, done = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with rl.lock("busy-here", ttl=10):
                held.set()
                await done.wait()

        task = asyncio.create_task(holder())
        await held.wait()
        found = []
        for timeout in (0, 0.2):
            with pytest.raises(LockNotAcquired) as caught:
                async with rl.lock("busy-here", ttl=5, timeout=timeout):
                    pass
            found.append(caught.value.retry_after)
        done.set()
        await task
        return found

    for retry_after in asyncio.run(main()):
        assert retry_after is not None and 8.0 < retry_after <= 10.0, retry_after


def test_close_keeps_renewing_held_locks_as_the_sync_client_does(
    redis_nodes: RedisCluster, make_async_redlock, make_redlock
) -> None:
    """``close()`` closes connections; an auto-renewed lock stays held (renewed over new
    connections) until it is released, in the loop that holds it and in one that ended."""
    rl = make_async_redlock(redis_nodes)
    sync = make_redlock(redis_nodes, ttl=0.6)
    lost: list[str | None] = []
    rl.listeners.append(lambda event: lost.append(event.reason) if event.kind == "lost" else None)
    sync.listeners.append(lambda event: lost.append(event.reason) if event.kind == "lost" else None)

    async def take(name: str) -> AsyncLock:
        lock = rl.lock(name, ttl=0.6, auto_renew=True, owner="job")
        assert await lock.acquire(blocking=False)
        return lock

    adopted = asyncio.run(take("closed-adopted"))  # renewed from the client's own loop

    async def main() -> None:
        lock = await take("closed-here")
        await rl.close()
        await asyncio.sleep(1.8)  # three leases
        assert lock.held and adopted.held, (lock.lost, adopted.lost)
        await lock.release()
        await adopted.release()

    asyncio.run(main())
    held = sync.lock("closed-sync", auto_renew=True)
    assert held.acquire(blocking=False)
    sync.close()
    time.sleep(1.8)
    assert held.held
    held.release()
    assert lost == []
