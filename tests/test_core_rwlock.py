"""Read/write locks on real nodes: many readers or one writer (a history of every holder's
critical section, many processes), a waiting writer is not starved by a stream of readers,
and the restart guard holds for readers too."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
import traceback

import pytest

from django_redlock import AsyncRedlock, LockLost, LockNotAcquired, QuorumError
from tests.helpers import run_processes, warm_up


def test_readers_share_writer_excludes(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    r1, r2 = rl.read_lock("doc:9", owner=1), rl.read_lock("doc:9", owner=2)
    w = rl.write_lock("doc:9", owner="w")
    assert r1.acquire(blocking=False) and r2.acquire(blocking=False)
    assert r1.held and r2.held and r1.token != r2.token
    assert w.acquire(blocking=False) is False
    assert r1.check() and r1.extend(5.0)
    r1.release()
    assert w.acquire(blocking=False) is False  # r2 still reads
    r2.release()
    assert w.acquire(blocking=False) is True
    # The writer is the lock of the name itself: listed, seen by locked().
    assert [i.name for i in rl.live_locks("doc:*")] == ["doc:9"] and rl.locked("doc:9")
    r3 = rl.read_lock("doc:9", owner=3)
    assert r3.acquire(blocking=False) is False
    assert rl.write_lock("doc:9", owner="w2").acquire(blocking=False) is False
    w.release()
    assert r3.acquire(blocking=False) is True
    r3.release()


def test_reader_renewal_and_fenced_writer(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    with rl.read_lock("renew", ttl=1.0, auto_renew=True) as r:
        assert threading.Event().wait(1.6) is False
        assert r.held and r.check()
        assert rl.write_lock("renew", owner="w").acquire(blocking=False) is False
    fences = []
    for _ in range(2):
        with rl.write_lock("renew", fencing=True) as w:
            fences.append(w.fence)
    assert fences[1] > fences[0]


def test_waiting_writer_is_not_starved_by_readers(redis_nodes, make_redlock) -> None:
    """Readers overlap one another without a gap, so without the writer's waiting mark there
    would never be a moment with no reader; the writer still gets in, and no reader holds the
    lock while it does."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5, retry_delay=0.05)
    stop = threading.Event()
    writer_in = threading.Event()
    overlap: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            r = rl.read_lock("starve")
            if r.acquire(timeout=10.0):
                if writer_in.is_set():
                    overlap.append("a reader held it while the writer did")
                reads[0] += 1
                time.sleep(0.05)
                r.release()

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        while reads[0] < 8:  # the stream is flowing
            time.sleep(0.01)
        w = rl.write_lock("starve")
        assert w.acquire(timeout=20.0), "the writer starved"
        writer_in.set()
        time.sleep(0.2)
        writer_in.clear()
        w.release()
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not overlap
    assert reads[0] > 8  # readers went on after the writer


def test_writer_giving_up_lets_readers_in(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    r = rl.read_lock("giveup", owner="r")
    assert r.acquire(blocking=False)
    assert rl.write_lock("giveup").acquire(timeout=0.3) is False
    # Its waiting mark is gone with it: a new reader is not held back.
    assert rl.read_lock("giveup", owner="r2").acquire(blocking=False) is True


def test_async_read_write(redis_nodes, make_async_redlock) -> None:
    rl = make_async_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)

    async def main() -> None:
        async with rl.read_lock("adoc") as r1, rl.read_lock("adoc") as r2:
            assert r1.held and r2.held
            assert await rl.write_lock("adoc").acquire(blocking=False) is False
        w = rl.write_lock("adoc")
        assert await w.acquire(blocking=False)
        reader = asyncio.ensure_future(rl.read_lock("adoc").acquire(timeout=10.0))
        await asyncio.sleep(0.1)
        assert not reader.done()
        await w.release()
        assert await reader is True

    asyncio.run(main())


@pytest.mark.faults
def test_restarted_node_does_not_let_a_writer_past_readers(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=20.0, node_timeout=0.2)
    warm_up(rl)
    r = rl.read_lock("guarded", owner="r")
    assert r.acquire(blocking=False)
    cluster[0].restart(empty=True)
    cluster[1].flush()
    try:
        got = rl.write_lock("guarded", owner="w").acquire(blocking=False)
    except QuorumError:
        got = False
    assert got is False


# -- many processes: a writer is alone ------------------------------------------------------------

PROCESSES = 4
CYCLES = 25


def _worker(urls, seed, gate, results) -> None:
    from django_redlock import Redlock

    history, error = [], None
    try:
        rng = random.Random(seed)
        rl = Redlock(urls, ttl=10.0, node_timeout=0.5, retry_delay=0.02)
        gate.wait(30)
        for _ in range(CYCLES):
            write = rng.random() < 0.3
            hold = rl.write_lock("rw-history") if write else rl.read_lock("rw-history")
            if not hold.acquire(timeout=60.0):
                raise AssertionError("not acquired within 60 s")
            begin = time.monotonic()
            time.sleep(0.003)
            end = time.monotonic()
            still = hold.held
            hold.release()
            if not still:
                raise AssertionError("the hold ran out inside the critical section")
            history.append((write, begin, end))
        rl.close()
    except BaseException:
        error = traceback.format_exc()
    results.put((history, error))


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the history compares time.monotonic() across processes: system-wide on Linux only",
)
def test_processes_writer_alone(redis_nodes) -> None:
    outcomes = run_processes(_worker, [(redis_nodes.urls, seed) for seed in range(PROCESSES)])
    history = [h for got, _ in outcomes for h in got]
    writes = [(b, e) for w, b, e in history if w]
    assert writes and len(writes) < len(history)
    for wb, we in writes:
        others = [(b, e) for _, b, e in history if (b, e) != (wb, we)]
        assert not [o for o in others if o[0] < we and wb < o[1]], "a writer was not alone"


def test_a_same_client_force_release_turns_a_read_or_write_hold_lost_at_once(
    redis_nodes, make_redlock
) -> None:
    """As for a plain lock or a permit (docs/guarantees.rst, "at once if the same client
    force-released it"): no renewal, no check() needed; with two readers in this process,
    only the one released is lost."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    # An acquire returns at a quorum; on a loaded host its write to the slowest node may
    # still be on the wire when the force release (another connection) gets there: a quorum
    # of removals, or all of them.
    every = range(rl.quorum, len(redis_nodes) + 1)
    r1, r2 = rl.read_lock("doc:f", owner=1), rl.read_lock("doc:f", owner=2)
    assert r1.acquire(blocking=False) and r2.acquire(blocking=False)
    assert rl.force_release(f"doc:f#read:{r1.token}") in every
    assert r1.held is False and r2.held is True
    assert rl.force_release(f"doc:f#read:{r2.token}") in every
    assert r2.held is False
    w = rl.write_lock("doc:f")
    assert w.acquire(blocking=False)
    assert rl.force_release("doc:f") in every
    assert w.held is False

    async def main() -> None:
        arl = AsyncRedlock(redis_nodes.urls, ttl=10.0, node_timeout=0.5)
        try:
            reader, writer = arl.read_lock("doc:g"), arl.write_lock("doc:h")
            assert await reader.acquire(blocking=False) and await writer.acquire(blocking=False)
            assert await arl.force_release(f"doc:g#read:{reader.token}") in every
            assert await arl.force_release("doc:h") in every
            assert reader.held is False and writer.held is False
        finally:
            await arl.close()

    asyncio.run(main())


def test_lock_info_and_force_release_of_a_listed_reader(redis_nodes, make_redlock) -> None:
    """A listed reader's name is the reader's, never a plain lock's (such names are refused):
    lock_info shows that reader alone, force_release removes it."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    r1, r2 = rl.read_lock("doc:i", owner=1), rl.read_lock("doc:i", owner=2)
    assert r1.acquire(blocking=False) and r2.acquire(blocking=False)
    entry = f"doc:i#read:{r1.token}"
    with pytest.raises(ValueError, match="reserved"):
        rl.lock(entry)
    info = rl.lock_info(entry)
    assert info is not None and info.reader_of == "doc:i" and info.token == r1.token
    assert info.nodes == len(redis_nodes)
    assert rl.force_release(entry) == len(redis_nodes)
    assert rl.lock_info(entry) is None
    assert [i.name for i in rl.live_locks("doc:i*")] == [f"doc:i#read:{r2.token}"]
    r2.release()


def test_the_by_name_calls_take_a_listed_reader(redis_nodes, make_redlock) -> None:
    """locked, extend_token and release_token act on a reader by its listed name, as on a
    permit: the reader alone, and only with its own token."""
    # A generous node timeout: every node's answer is counted on a busy machine.
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    operator = make_redlock(redis_nodes, node_timeout=0.5)
    r1, r2 = rl.read_lock("doc:t", owner=1), rl.read_lock("doc:t", owner=2)
    assert r1.acquire(blocking=False) and r2.acquire(blocking=False)
    entry, other = f"doc:t#read:{r1.token}", f"doc:t#read:{r2.token}"
    assert operator.locked(entry) is True
    assert operator.locked(f"doc:t#read:{'0' * 32}") is False
    assert operator.extend_token(entry, r1.token, 30.0) is True
    info = operator.lock_info(entry)
    assert info is not None and info.ttl is not None and info.ttl > 20
    # Another reader's token under this name: that reader's hold is never touched.
    assert operator.extend_token(entry, r2.token, 30.0) is False
    assert operator.release_token(entry, r2.token) == 0
    assert operator.release_token(entry, r1.token) >= 2
    assert operator.locked(entry) is False
    assert operator.locked(other) is True
    assert r2.check() is True
    r2.release()


def test_a_detached_reader_is_released_by_token(
    redis_nodes, make_redlock, make_async_redlock
) -> None:
    """read_lock().detach() hands over a token that release_token takes, under the reader's
    listed name (sync and async)."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    reader = rl.read_lock("doc:d")
    assert reader.acquire(blocking=False)
    token = reader.detach()
    # A quorum at least: a node that answered the acquire late may have had it undone.
    assert rl.release_token(f"doc:d#read:{token}", token) >= 2
    assert rl.locked(f"doc:d#read:{token}") is False
    arl = make_async_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)

    async def detached() -> None:
        reader = arl.read_lock("doc:d")
        assert await reader.acquire(blocking=False)
        token = reader.detach()
        assert await arl.locked(f"doc:d#read:{token}") is True
        assert await arl.extend_token(f"doc:d#read:{token}", token, 20.0) is True
        assert await arl.release_token(f"doc:d#read:{token}", token) >= 2
        assert await arl.locked(f"doc:d#read:{token}") is False

    asyncio.run(detached())


def test_a_refusal_names_what_is_in_the_way(redis_nodes, make_redlock) -> None:
    """A writer kept out by readers alone is told so (no writer exists: ``locked()`` says
    False, the listing shows only readers), not "held" as if another writer were in."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    readers = [rl.read_lock("doc:why", owner=i) for i in range(2)]
    assert all(r.acquire(blocking=False) for r in readers)
    assert rl.locked("doc:why") is False
    for wait in ({"blocking": False}, {"timeout": 0.2}):
        with pytest.raises(LockNotAcquired, match=r"^write lock 'doc:why' is held by 2 readers$"):
            with rl.write_lock("doc:why", **wait):
                raise AssertionError("a writer beside readers")
    for reader in readers:
        reader.release()
    writer = rl.write_lock("doc:why")
    assert writer.acquire(blocking=False)
    other = rl.write_lock("doc:why", blocking=False)
    with pytest.raises(LockNotAcquired, match="write lock 'doc:why' is held by another writer"):
        with other:
            pass
    with pytest.raises(LockNotAcquired, match="read lock 'doc:why' is held by a writer"):
        with rl.read_lock("doc:why", blocking=False):
            pass
    writer.release()


def test_a_lost_reader_is_named_as_it_is_listed(redis_nodes, make_redlock) -> None:
    """``LockLost`` names a reader by its listed name (``lock_info`` and ``force_release``
    take it) and its read/write lock's, never by the internal ``"doc#read"``."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    reader = rl.read_lock("doc:lost")
    assert reader.acquire(blocking=False)
    listed = f"doc:lost#read:{reader.token}"
    assert [i.name for i in rl.live_locks("doc:lost*")] == [listed]
    assert rl.lock_info(listed) is not None
    rl.force_release(listed)
    with pytest.raises(LockLost) as lost:
        reader.release()
    assert lost.value.name == listed
    assert str(lost.value).startswith(f"read lock 'doc:lost' (reader {listed!r}) was lost")
    assert "'doc:lost#read'" not in str(lost.value)


def test_an_owner_waiting_for_the_other_side_of_its_own_hold_is_told(
    redis_nodes, make_redlock
) -> None:
    """No upgrade: an owner holding a read hold that asks for the write lock of the same name
    (or the reverse) with no bound would wait for itself for ever: ``RuntimeError``, as for
    its own handle again; with a timeout, False after it; another owner's hold is waited for
    as usual."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    reader = rl.read_lock("doc:up")
    assert reader.acquire(blocking=False)
    with pytest.raises(RuntimeError, match=r"read lock 'doc:up'.*wait for itself"):
        rl.write_lock("doc:up").acquire()
    with pytest.raises(RuntimeError, match="wait for itself"):
        rl.write_lock("doc:up").acquire(timeout=float("inf"))
    assert rl.write_lock("doc:up").acquire(timeout=0.2) is False
    assert rl.write_lock("doc:up").acquire(blocking=False) is False
    reader.release()
    writer = rl.write_lock("doc:up")
    assert writer.acquire(blocking=False)
    with pytest.raises(RuntimeError, match=r"write lock 'doc:up'.*wait for itself"):
        rl.read_lock("doc:up").acquire()
    assert rl.read_lock("doc:up").acquire(timeout=0.2) is False
    # Another owner's read hold is not this owner's: its writer waits for it as usual.
    assert rl.read_lock("doc:up", owner="job").acquire(timeout=0.05) is False
    writer.release()
    other = rl.read_lock("doc:other", owner="job")
    assert other.acquire(blocking=False)
    waiting = threading.Thread(target=lambda: rl.write_lock("doc:other").acquire())
    waiting.start()
    other.release()
    waiting.join(5.0)
    assert not waiting.is_alive()
    rl.force_release("doc:other")

    async def main() -> None:  # the asyncio client, by the asking task
        arl = AsyncRedlock(redis_nodes.urls, ttl=10.0, node_timeout=0.5)
        try:
            async with arl.read_lock("doc:aup"):
                with pytest.raises(RuntimeError, match="wait for itself"):
                    await arl.write_lock("doc:aup").acquire()
                assert await arl.write_lock("doc:aup").acquire(timeout=0.2) is False
        finally:
            await arl.close()

    asyncio.run(main())
