"""Semaphores on real nodes: at most ``limit`` holders, checked by a history of every holder's
critical section (many processes), and kept through node faults while permits are held."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback

import pytest

from django_redlock import LockNotAcquired, LockNotOwned, QuorumError
from tests.helpers import held_everywhere, node_client, run_processes, wait_until, warm_up

INSIDE = "semaphore:inside"  # outside the lock prefix: plain data the permits guard


def max_inside(intervals: list[tuple[float, float]]) -> int:
    """The history checker: the most critical sections open at one moment."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    inside = most = 0
    for _, step in events:  # at equal times an end (-1) sorts first: touching is not overlap
        inside += step
        most = max(most, inside)
    return most


def test_history_checker_sees_overlaps() -> None:
    assert max_inside([(0, 1), (1, 2), (2, 3)]) == 1
    assert max_inside([(0, 2), (1, 3), (1.5, 4)]) == 3


def test_limit_permits_then_refused(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    sems = [rl.semaphore("export:7", limit=3, owner=i) for i in range(4)]
    assert [s.acquire(blocking=False) for s in sems] == [True, True, True, False]
    assert sorted(s.permit for s in sems[:3]) == [0, 1, 2]
    assert sems[3].permit is None and not sems[3].held
    assert all(s.held and 0 < s.validity <= 10.0 and s.token for s in sems[:3])
    assert len({s.token for s in sems[:3]}) == 3
    names = [info.name for info in rl.live_locks("export:7*")]
    assert names == ["export:7#permit:0", "export:7#permit:1", "export:7#permit:2"]
    freed = sems[1].permit
    sems[1].release()
    assert not sems[1].held
    assert sems[3].acquire(blocking=False) is True
    assert sems[3].permit == freed
    for s in (sems[0], sems[2], sems[3]):
        s.release()
    assert list(rl.live_locks("export:7*")) == []


def test_blocking_acquire_woken_by_a_release(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=30.0, node_timeout=0.5, retry_delay=5.0)
    holders = [rl.semaphore("wake", limit=2, owner=i) for i in range(2)]
    assert all(h.acquire(blocking=False) for h in holders)
    waiter = rl.semaphore("wake", limit=2)
    started = threading.Event()
    got: list[bool] = []

    def wait() -> None:
        started.set()
        got.append(waiter.acquire(timeout=20.0))

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait()
    assert not got
    holders[0].release()
    # Woken by the release notice: retry_delay (5 s) and the lease (30 s) are far off, so a
    # waiter that polled would still be waiting when the join below gives up.
    thread.join(4.0)
    assert got == [True]


def test_shared_handle_gives_each_thread_its_own_permit(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    sem = rl.semaphore("shared", limit=2)
    results: list[tuple[bool, int | None]] = []
    barrier = threading.Barrier(3)

    def take() -> None:
        ok = sem.acquire(blocking=False)
        results.append((ok, sem.permit))
        barrier.wait()
        if ok:
            sem.release()

    threads = [threading.Thread(target=take) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ok for ok, _ in results) == [False, True, True]
    assert sorted(p for ok, p in results if ok) == [0, 1]
    with pytest.raises(LockNotOwned):
        sem.release()  # this thread holds no permit of the handle


def test_context_manager_renewal_extend_check_fence(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    with rl.semaphore("ctx", 1, ttl=1.0, auto_renew=True, fencing=True) as sem:
        first = sem.fence
        assert first is not None
        # Renewed by the watchdog: still held after its first lease would have run out.
        assert threading.Event().wait(1.6) is False
        assert sem.held and sem.check()
        assert sem.extend(2.0) and sem.validity > 1.0
    assert not sem.held
    with rl.semaphore("ctx", 1, fencing=True) as again:
        assert again.fence > first  # one slot: its fences keep rising
    taken = rl.semaphore("ctx", 1, owner="a")
    assert taken.acquire(blocking=False)
    with pytest.raises(LockNotAcquired, match="all permits of semaphore 'ctx' are taken"):
        with rl.semaphore("ctx", 1, blocking=False):
            pass
    taken.release()


def test_force_release_of_one_permit(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    a, b = rl.semaphore("ops", 2, owner="a"), rl.semaphore("ops", 2, owner="b")
    assert a.acquire(blocking=False) and b.acquire(blocking=False)
    held_everywhere(redis_nodes, f"ops#permit:{a.permit}")
    assert rl.force_release(f"ops#permit:{a.permit}") == 3
    c = rl.semaphore("ops", 2, owner="c")
    assert c.acquire(blocking=False) and c.permit == a.permit
    with pytest.raises(LockNotOwned):
        a.release()
    b.release()
    c.release()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"limit": 0}, ValueError),
        ({"limit": 1001}, ValueError),
        ({"limit": True}, TypeError),
        ({"limit": 2.0}, TypeError),
        ({"limit": 2, "ttl": -1}, ValueError),
        ({"limit": 2, "renew_for": 5}, ValueError),
    ],
)
def test_bad_arguments_named_before_sending(kwargs, error, make_redlock) -> None:
    rl = make_redlock(["redis://127.0.0.1:1/0"])
    with pytest.raises(error):
        rl.semaphore("x", **kwargs)


def test_async_semaphore(redis_nodes, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)

    async def main() -> None:
        sems = [rl.semaphore("aexp", 2) for _ in range(3)]
        assert [await s.acquire(blocking=False) for s in sems] == [True, True, False]
        waiter = asyncio.ensure_future(sems[2].acquire(timeout=10.0))
        await asyncio.sleep(0)
        await sems[0].release()
        assert await waiter is True
        async with rl.semaphore("aexp", 3) as third:
            assert third.held and third.permit is not None
        await sems[1].release()
        await sems[2].release()
        assert await rl.live_locks("aexp*") == []

    asyncio.run(main())


# -- many processes: never more than limit inside ------------------------------------------------

PROCESSES = 5
CYCLES = 20
LIMIT = 2


def _worker(urls, counter_url, gate, results) -> None:
    import time

    import redis

    from django_redlock import Redlock

    intervals, most, error = [], 0, None
    try:
        rl = Redlock(urls, ttl=10.0, node_timeout=0.5, retry_delay=0.02)
        counter = redis.Redis.from_url(counter_url, socket_timeout=5)
        gate.wait(30)
        for _ in range(CYCLES):
            sem = rl.semaphore("history", limit=LIMIT)
            if not sem.acquire(timeout=60.0):
                raise AssertionError("no permit within 60 s")
            begin = time.monotonic()
            most = max(most, counter.incr(INSIDE))
            time.sleep(0.002)
            counter.decr(INSIDE)
            end = time.monotonic()
            still = sem.held
            sem.release()
            if not still:
                raise AssertionError("the permit ran out inside the critical section")
            intervals.append((begin, end))
        rl.close()
    except BaseException:
        error = traceback.format_exc()
    results.put((intervals, most, error))


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the history compares time.monotonic() across processes: system-wide on Linux only",
)
def test_processes_never_exceed_the_limit(redis_nodes, redis_node) -> None:
    outcomes = run_processes(_worker, [(redis_nodes.urls, redis_node.url)] * PROCESSES)
    intervals = [i for got, _, _ in outcomes for i in got]
    assert len(intervals) == PROCESSES * CYCLES
    assert max_inside(intervals) <= LIMIT
    assert max(m for _, m, _ in outcomes) <= LIMIT
    # The limit was reached, or the test would not show it holds.
    assert max(m for _, m, _ in outcomes) == LIMIT


# -- faults while permits are held -----------------------------------------------------------------


def _refused(sem) -> bool:
    try:
        return sem.acquire(blocking=False) is False
    except QuorumError:
        return True


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["pause", "kill", "restart_empty", "flush"])
def test_faults_while_permits_held_never_admit_more(
    fault, redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=20.0, node_timeout=0.2)
    other = make_redlock(cluster, ttl=20.0, node_timeout=0.2)
    warm_up(rl)
    warm_up(other)
    held = [rl.semaphore("faulty", 2, owner=i) for i in range(2)]
    assert all(h.acquire(blocking=False) for h in held)
    # One node loses what it knew (or cannot answer) while both permits are held.
    node = cluster[0]
    if fault == "pause":
        node.pause()
    elif fault == "kill":
        node.kill()
    elif fault == "restart_empty":
        node.restart(empty=True)
    else:
        node.flush()
    for _ in range(3):
        assert _refused(other.semaphore("faulty", 2))
    # A second node forgets too: the restart guard keeps both out of every quorum for their
    # guard period, so still nobody else gets in (a QuorumError, not a third permit).
    if fault in ("restart_empty", "flush"):
        (cluster[1].restart if fault == "restart_empty" else cluster[1].flush)()
        assert _refused(other.semaphore("faulty", 2))
    assert all(h.held for h in held)
    if fault == "pause":
        node.resume()
    for h in held:
        try:
            h.release()
        except LockNotOwned:
            assert fault in ("restart_empty", "flush")


def test_fair_semaphore_serves_waiters_in_arrival_order(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    other = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    holders = [other.semaphore("line", 2, owner=i) for i in range(2)]
    assert all(h.acquire(blocking=False) for h in holders)
    order: list[int] = []
    clients = [node_client(node) for node in redis_nodes]

    def wait(i: int) -> None:
        sem = rl.semaphore("line", 2, fair=True, owner=f"w{i}")
        if sem.acquire(timeout=30.0):
            order.append(i)
            sem.release()

    threads = []
    for i in range(3):
        thread = threading.Thread(target=wait, args=(i,))
        thread.start()
        threads.append(thread)
        # The next waiter arrives once this one stands in the one line of every slot.
        wait_until(lambda n=i + 1: all(c.zcard("redlock:queue:line") == n for c in clients))
    holders[0].release()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2]
    holders[1].release()


@pytest.mark.faults
def test_majority_down_is_a_quorum_error(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=5.0, node_timeout=0.2)
    warm_up(rl)
    cluster[0].kill()
    cluster[1].kill()
    with pytest.raises(QuorumError):
        rl.semaphore("down", 3).acquire(blocking=False)
    with pytest.raises(QuorumError):
        rl.read_lock("down").acquire(blocking=False)
    with pytest.raises(QuorumError):
        rl.write_lock("down").acquire(blocking=False)


def test_cancelled_async_waiter_leaves_no_permit(redis_nodes, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)

    async def main() -> None:
        held = rl.semaphore("cancel", 1, owner="holder")
        assert await held.acquire(blocking=False)
        waiter = asyncio.ensure_future(rl.semaphore("cancel", 1).acquire(timeout=20.0))
        await asyncio.sleep(0.2)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await held.release()
        names = [i.name for i in await rl.live_locks("cancel*")]
        assert names == []
        again = rl.semaphore("cancel", 1)
        assert await again.acquire(blocking=False)
        await again.release()

    asyncio.run(main())


@pytest.mark.faults
def test_renewed_permit_outlives_a_paused_node(redis_cluster_factory, make_redlock) -> None:
    """A permit renewed by the watchdog while one node of three is paused for longer than its
    lease: still held (the other two keep re-arming it), and still exclusive of its slot."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=10.0, node_timeout=0.2)
    other = make_redlock(cluster, ttl=10.0, node_timeout=0.2)
    warm_up(rl)
    warm_up(other)
    sem = rl.semaphore("renewed", 1, ttl=2.0, auto_renew=True)
    assert sem.acquire(blocking=False)
    with cluster[0].paused():
        assert threading.Event().wait(3.0) is False  # longer than the 2 s lease
        assert sem.held and sem.check()
        assert _refused(other.semaphore("renewed", 1))
    sem.release()
    assert other.semaphore("renewed", 1).acquire(blocking=False)
