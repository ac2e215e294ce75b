"""The watchdog (``auto_renew=True``) on real nodes: it keeps a held lock alive, runs as one
thread per process, stops at release, gives up loudly when the lock is gone or the quorum is out
of reach, notices a holder that was frozen past its lease, and starts afresh after fork.

Synchronisation is on events (a ``lost`` LockEvent, a pipe from a child process); the few
``time.sleep`` calls are the durations being observed (hold for 2 s, stay frozen for 1 s).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from django_redlock import LockLost, LockNotOwned
from django_redlock.core.renewal import renewer
from django_redlock.testing import RedisCluster
from tests.helpers import (
    REPO_ROOT,
    held_everywhere,
    node_client,
    occupy,
    pttls_on_nodes,
    settled_tokens,
    tokens_on_nodes,
    wait_until,
    warm_up,
)

TTL = 0.6
CTX = multiprocessing.get_context("fork")


def _renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "redlock-renewer"]


def test_auto_renew_keeps_a_short_lease_alive(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=TTL)
    lock = rl.lock("renew:alive", auto_renew=True)
    assert lock.acquire(blocking=False)
    start = time.monotonic()
    renewals = []
    max_pttl_late = 0
    while time.monotonic() - start < 2.0:  # more than three leases
        time.sleep(0.1)
        assert lock.held, f"lost after {time.monotonic() - start:.2f}s: {lock.lost}"
        pttls = pttls_on_nodes(redis_nodes, lock.name)
        assert all(0 < p <= TTL * 1000 for p in pttls), pttls
        if time.monotonic() - start > TTL:
            max_pttl_late = max(max_pttl_late, *pttls)
        renewals.append(rl.lock_info(lock.name).renewals)
    # The key outlived its first lease because it was re-armed, by the watchdog, every ttl/3.
    assert max_pttl_late > TTL * 1000 / 3
    assert renewals == sorted(renewals)
    assert renewals[-1] >= 6, renewals  # ~10 expected in 2 s at ttl/3
    assert settled_tokens(redis_nodes, lock.name) == [lock.token] * 3
    assert lock.check()
    lock.release()
    assert settled_tokens(redis_nodes, lock.name) == [None] * 3


def test_one_renewer_thread_serves_every_lock(redis_nodes: RedisCluster, make_redlock) -> None:
    first = make_redlock(redis_nodes, ttl=TTL)
    second = make_redlock(redis_nodes, ttl=TTL, key_prefix="other")
    # Put the flushed nodes in service first (see test_core_guard: concurrent first acquires
    # on a brand-new cluster race with its one-time trust step).
    warm_up(first)
    warm_up(second)
    locks = [first.lock(f"renew:many:{i}", auto_renew=True, owner="test") for i in range(6)]
    locks += [second.lock(f"renew:many:{i}", auto_renew=True) for i in range(3)]
    threads = []

    def take(lock):
        assert lock.acquire(blocking=False)

    # Some acquired from other threads: still the one process-wide watchdog.
    for lock in locks[:4]:
        thread = threading.Thread(target=take, args=(lock,))
        thread.start()
        threads.append(thread)
    for lock in locks[4:]:
        take(lock)
    for thread in threads:
        thread.join()
    assert len(_renewer_threads()) == 1
    time.sleep(TTL * 1.5)  # every lock outlives its first lease
    assert len(_renewer_threads()) == 1
    for lock in locks:
        assert lock.held, lock.lost
        info = lock.redlock.lock_info(lock.name)
        assert info is not None and info.renewals >= 2, (lock.name, info)
    for lock in locks:
        lock.release()


def test_no_renewal_traffic_after_release(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    rl = make_redlock(redis_nodes, ttl=TTL)
    warm_up(rl)
    lock = rl.lock("renew:released", auto_renew=True)
    assert lock.acquire(blocking=False)
    wait_until(lambda: rl.lock_info(lock.name).renewals >= 2, timeout=3)
    lock.release()
    before = node_calls(redis_nodes)
    time.sleep(2 * TTL)  # six renewal periods in which nothing may be sent
    after = node_calls(redis_nodes)
    for b, a in zip(before, after, strict=True):
        for command in ("evalsha", "eval", "pexpire", "hset", "hincrby"):
            assert a.get(command, 0) == b.get(command, 0), (command, b, a)
    assert settled_tokens(redis_nodes, lock.name) == [None] * 3
    assert not lock.held


@pytest.mark.parametrize("how", ["del", "force_release"])
def test_token_gone_behind_our_back_is_lost(
    how: str, redis_nodes: RedisCluster, make_redlock, event_log
) -> None:
    rl = make_redlock(redis_nodes, ttl=TTL)
    log = event_log(rl)
    lock = rl.lock("renew:stolen", auto_renew=True)
    assert lock.acquire(blocking=False)
    if how == "del":  # gone from a quorum (2 of 3), as after an operator's DEL or a flush
        for node in redis_nodes.nodes[:2]:
            with node_client(node) as c:
                c.delete(f"redlock:lock:{lock.name}")
    else:  # an operator (another process) force-releases it from the admin page
        other = make_redlock(redis_nodes, ttl=TTL)
        held_everywhere(redis_nodes, lock.name)
        assert other.force_release(lock.name) == 3
    event = log.wait_for("lost", lock.name, timeout=TTL)
    assert event is not None, "no lost event within one lease"
    # Found by the renewal (the nodes refused) or heard at once on the release channel (a
    # force release), not by the lease running out: the reason says which.
    why = "the nodes refused: the token is gone" if how == "del" else "force-released"
    assert event.token == lock.token and why in event.reason
    assert not lock.held and lock.validity == 0
    assert lock.lost
    # Someone else takes the free lock; our release must not touch it and must say "lost".
    thief = make_redlock(redis_nodes, ttl=5.0).lock(lock.name)
    assert thief.acquire(blocking=False)
    with pytest.raises(LockLost):
        lock.release()
    # The thief's copies are intact; our leftover copy (node 3 in the "del" case) is cleaned up.
    expected = [thief.token] * 3 if how == "force_release" else [thief.token] * 2 + [None]
    assert tokens_on_nodes(redis_nodes, lock.name) == expected
    thief.release()


def test_quorum_unreachable_is_lost_by_the_end_of_validity(
    redis_cluster_factory, make_redlock, event_log
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=TTL, node_timeout=0.05)
    warm_up(rl)
    log = event_log(rl)
    lock = rl.lock("renew:partitioned", auto_renew=True)
    assert lock.acquire(blocking=False)
    cluster[0].pause()
    cluster[1].pause()
    try:
        paused_at = time.monotonic()
        # Validity at this point is at most one ttl (the last renewal could just have happened).
        event = log.wait_for("lost", lock.name, timeout=3 * TTL)
        lost_at = time.monotonic()
    finally:
        cluster[0].resume()
        cluster[1].resume()
    assert event is not None, "the lock was never declared lost"
    assert lost_at - paused_at <= TTL + 0.3, lost_at - paused_at
    # The message names the cause (not "was the process paused?") and the nodes that failed.
    assert "the nodes refused: 1 of 3 nodes renewed it, 2 needed" in event.reason, event.reason
    assert rl.nodes[0].name in event.reason and rl.nodes[1].name in event.reason
    assert not lock.held
    with pytest.raises(LockLost):
        lock.release()


def test_a_loss_names_the_node_that_answered_without_our_copy(
    redis_cluster_factory, make_redlock, event_log
) -> None:
    """One node silent and another answering with someone else's copy: the loss reason names
    both, the second as "not held there", not only the silent one."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, ttl=TTL, node_timeout=0.05)
    warm_up(rl)
    log = event_log(rl)
    lock = rl.lock("renew:taken-there", auto_renew=True)
    assert lock.acquire(blocking=False)
    occupy(cluster[0], lock.name, ms=60_000)  # another holder's copy replaces ours there
    cluster[1].pause()
    try:
        event = log.wait_for("lost", lock.name, timeout=3 * TTL)
    finally:
        cluster[1].resume()
    assert event is not None, "the lock was never declared lost"
    assert "1 of 3 nodes renewed it, 2 needed" in event.reason, event.reason
    assert f"{rl.nodes[0].name}: not held there" in event.reason, event.reason
    assert rl.nodes[1].name in event.reason
    assert not lock.held


_FROZEN_HOLDER = """
    import json, sys, threading
    from django_redlock import Redlock, LockLost
    rl = Redlock(sys.argv[1].split(","), ttl={ttl})
    lost = threading.Event()
    rl.listeners.append(lambda e: e.kind == "lost" and lost.set())
    lock = rl.lock("renew:frozen", auto_renew=True)
    assert lock.acquire(blocking=False)
    print(json.dumps({{"token": lock.token}}), flush=True)
    sys.stdin.readline()  # frozen by SIGSTOP somewhere around here; "go" comes after SIGCONT
    report = {{"lost_event": lost.wait(2.0), "held": lock.held, "reason": lock.lost}}
    try:
        lock.release()
        report["release"] = "ok"
    except LockLost:
        report["release"] = "LockLost"
    except Exception as exc:
        report["release"] = type(exc).__name__
    print(json.dumps(report), flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_holder_frozen_past_its_lease_finds_out_when_it_resumes(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_FROZEN_HOLDER.format(ttl=TTL)),
            ",".join(redis_nodes.urls),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Connected before: a fresh client's first lock may leave a node whose handshake a loaded
    # host made slow without its copy (a quorum holds it), and the check below reads every node.
    other_rl = make_redlock(redis_nodes, ttl=5.0)
    warm_up(other_rl)
    try:
        token = json.loads(child.stdout.readline())["token"]
        os.kill(child.pid, signal.SIGSTOP)
        # While it is frozen its watchdog cannot renew: the lease runs out on the nodes and
        # another client takes the lock.
        wait_until(
            lambda: tokens_on_nodes(redis_nodes, "renew:frozen") == [None] * 3, timeout=3 * TTL
        )
        other = other_rl.lock("renew:frozen")
        assert other.acquire(blocking=False)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()
    assert report["lost_event"] is True, report
    assert report["held"] is False, report
    assert "ran out" in report["reason"], report
    assert "the process was paused" in report["reason"], report  # not "fell behind"
    assert report["release"] == "LockLost", report
    # The resumed holder neither renewed nor deleted the new holder's lock.
    assert settled_tokens(redis_nodes, "renew:frozen") == [other.token] * 3
    assert token != other.token
    other.release()


_FROZEN_RELEASES_FIRST = """
    import json, sys, time
    from django_redlock import Redlock, LockLost
    from django_redlock.core.renewal import renewer
    rl = Redlock(sys.argv[1].split(","), ttl={ttl})
    kinds = []
    rl.listeners.append(lambda e: kinds.append(e.kind))
    lock = rl.lock("renew:frozen-first", auto_renew=True)
    assert lock.acquire(blocking=False)
    # Fix one of the two schedules a resumed process can run: the holder's own thread gets
    # the CPU before the watchdog does. Holding the watchdog's condition keeps it from running
    # (it is frozen by SIGSTOP meanwhile anyway) until the holder has released.
    with renewer._cond:
        print("ready", flush=True)
        sys.stdin.readline()  # SIGSTOP, the lease runs out, SIGCONT, "go"
        report = {{"held": lock.held}}
        try:
            lock.release()
            report["release"] = "ok"
        except LockLost:
            report["release"] = "LockLost"
        except Exception as exc:
            report["release"] = type(exc).__name__
    time.sleep(0.3)  # the watchdog runs now: would it still report the loss?
    report["events"] = kinds
    print(json.dumps(report), flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_frozen_holder_that_releases_before_its_watchdog_runs_gets_lock_lost(
    redis_nodes: RedisCluster,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_FROZEN_RELEASES_FIRST.format(ttl=TTL)),
            ",".join(redis_nodes.urls),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(
            lambda: tokens_on_nodes(redis_nodes, "renew:frozen-first") == [None] * 3,
            timeout=3 * TTL,
        )
        child.stdin.write("go\n")
        child.stdin.flush()
        os.kill(child.pid, signal.SIGCONT)
        report = json.loads(child.stdout.readline())
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()
    assert report["held"] is False, report
    assert report["release"] == "LockLost", report
    assert "lost" in report["events"], report


def _forked_child(rl, parent_name, results) -> None:
    try:
        report = {"renewer_threads": len(_renewer_threads())}
        # The parent's lock: not in the child's lease table (not a reentrant hit, although
        # the child's thread has the parent's thread id), and held on the nodes by the parent.
        report["took_parents"] = rl.lock(parent_name).acquire(blocking=False)
        mine = rl.lock("renew:fork:child", auto_renew=True)
        report["acquired"] = mine.acquire(blocking=False)
        time.sleep(TTL * 2)  # past two leases: only the child's own watchdog keeps it
        report["held"] = mine.held
        report["renewals"] = rl.lock_info(mine.name).renewals
        report["renewer_threads_after"] = len(_renewer_threads())
        mine.release()
        report["released"] = True
    except BaseException as exc:
        report["error"] = repr(exc)
    results.put(report)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_renews_only_its_own_locks(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=TTL)
    parent = rl.lock("renew:fork:parent", auto_renew=True)
    assert parent.acquire(blocking=False)
    assert len(_renewer_threads()) == 1
    results = CTX.Queue()
    child = CTX.Process(target=_forked_child, args=(rl, parent.name, results))
    child.start()
    report = results.get(timeout=10)
    child.join(5)
    assert "error" not in report, report
    assert report["renewer_threads"] == 0, report  # the parent's watchdog was not inherited
    assert report["took_parents"] is False, report
    assert report["acquired"] is True and report["held"] is True, report
    assert report["renewals"] >= 3, report
    assert report["renewer_threads_after"] == 1, report
    assert report["released"] is True
    # The parent's lock was renewed by the parent all along, and is untouched by the child.
    assert parent.held, parent.lost
    assert settled_tokens(redis_nodes, parent.name) == [parent.token] * 3
    assert rl.lock_info(parent.name).renewals >= 3
    parent.release()


def test_renew_for_caps_the_total_renewal_time(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes, ttl=TTL)
    lock = rl.lock("renew:capped", auto_renew=True, renew_for=1.0)
    assert lock.acquire(blocking=False)
    start = time.monotonic()
    time.sleep(0.9)  # past the first lease: renewed while within the cap
    assert lock.held and settled_tokens(redis_nodes, lock.name) == [lock.token] * 3
    wait_until(lambda: tokens_on_nodes(redis_nodes, lock.name) == [None] * 3, timeout=3)
    gone_after = time.monotonic() - start
    # Renewed until the cap, then left to run out: gone at most one ttl after the cap.
    assert 1.0 - TTL / 3 <= gone_after <= 1.0 + TTL + 0.25, gone_after
    assert not lock.held
    with pytest.raises(LockNotOwned):
        lock.release()


def test_renew_for_ending_on_a_renewal_stops_both_clients_at_the_same_one(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """ttl 1.5 s (renewed every 0.5 s) and renew_for 2.0 s: the cap falls on a renewal's due
    time. Both clients renew at 0.5, 1.0 and 1.5 s and not at 2.0 s, so the lock is gone near
    3.0 s in both (the sync client renewed once more, up to 3.5 s, as its watchdog wakes a
    little early)."""
    import asyncio

    from django_redlock import AsyncRedlock

    def gone_after(name: str, start: float) -> float:
        wait_until(lambda: tokens_on_nodes(redis_nodes, name) == [None] * 3, timeout=6)
        return time.monotonic() - start

    rl = make_redlock(redis_nodes)
    lock = rl.lock("renew:edge", ttl=1.5, auto_renew=True, renew_for=2.0)
    start = time.monotonic()
    assert lock.acquire(blocking=False)
    sync_gone = gone_after(lock.name, start)

    async def main() -> float:
        arl = AsyncRedlock(redis_nodes.urls)
        try:
            alock = arl.lock("renew:edge:async", ttl=1.5, auto_renew=True, renew_for=2.0)
            start = time.monotonic()
            assert await alock.acquire(blocking=False)
            return await asyncio.to_thread(gone_after, alock.name, start)
        finally:
            await arl.close()

    async_gone = asyncio.run(main())
    # Renewed past 1.0 s (gone no sooner than 2.5 s), and never after renew_for: gone by
    # 2.0 + 1.5 s, plus what a loaded host adds to seeing it (a renewal at 2.0 s is allowed).
    assert 2.6 <= sync_gone <= 4.0 and 2.6 <= async_gone <= 4.0, (sync_gone, async_gone)


def test_renewals_wait_out_busy_nodes_within_the_leases_validity(
    redis_cluster_factory, make_redlock
) -> None:
    """Two of three nodes busy 0.25 s at a time, back to back (``DEBUG SLEEP``: what a
    loaded host does to its nodes): every renewal round's quorum answers later than the node
    timeout, but well within the leases' validity. The watchdog waits for that quorum, so no
    lease is lost. (A round that counted the busy nodes out after one node timeout failed
    round after round, until the leases ran out.)"""
    cluster = redis_cluster_factory(3, extra_args=["--enable-debug-command", "yes"])
    rl = make_redlock(cluster, ttl=1.5, node_timeout=0.05)  # renewed every 0.5 s
    warm_up(rl)
    locks = [rl.lock(f"renew:busy:{i}", auto_renew=True, owner="test") for i in range(50)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    stop = threading.Event()
    # In step: out of step, one of the two was free for a while in every 0.25 s, and a
    # round that fell there had its quorum at once (a run on Python 3.12 saw no slow round).
    in_step = threading.Barrier(2)

    def busy(node) -> None:
        with node_client(node) as client:
            while not stop.is_set():
                try:
                    in_step.wait(timeout=5)
                except threading.BrokenBarrierError:
                    return
                client.execute_command("DEBUG", "SLEEP", "0.25")

    threads = [threading.Thread(target=busy, args=(cluster[i],)) for i in (1, 2)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)  # the duration observed: four renewals of every lease
        # And on until a round met the busy nodes: on a loaded host the threads' turns between
        # two sleeps are long enough for a round to fall in them now and then.
        wait_until(
            lambda: any(r.took > rl.node_timeout for r in renewer.rounds if r.started >= started),
            timeout=10.0,
        )
    finally:
        stop.set()
        in_step.abort()
        for thread in threads:
            thread.join()
    lost = [lock.lost for lock in locks if lock.lost is not None]
    assert not lost, f"{len(lost)} lost, first: {lost[0]}"
    assert all(lock.held for lock in locks)
    rounds = [r for r in renewer.rounds if r.started >= started]
    assert max(r.took for r in rounds) > rl.node_timeout, rounds  # the nodes were slow
    for lock in locks:
        lock.release()


def test_a_quorum_that_answers_after_the_lease_ran_out_does_not_revive_it(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """A renewal answered in time is renewed again a third of the lease after its round went
    out. Every node extended the lease, but their answers came in after its validity had run
    out here: it stays run out (``held`` never turns True again), and the watchdog reports
    it lost because renewal fell behind, with how long its round took."""
    rl = make_redlock(redis_nodes, ttl=5.0)
    lock = rl.lock("renew:late-quorum", auto_renew=True)
    assert lock.acquire(blocking=False)
    lease = lock._lease
    assert lease is not None
    start = time.monotonic()
    on_time = rl.leases.judge_renewals([lease], [[1, 1, 1]], start, [lease.valid_until - 0.01])
    assert lock.held
    # The next renewal is a third of the lease after the round went out (as the new
    # validity counts), however long the round took.
    assert on_time == [start + lease.ttl / 3]
    lease.valid_until = time.monotonic() - 0.2  # the round took the rest of the lease
    late = rl.leases.judge_renewals([lease], [[1, 1, 1]], start, [lease.valid_until + 0.1])
    assert late == [None]
    assert not lock.held
    assert lock.lost is not None
    assert "renewal fell behind" in lock.lost and "its round took" in lock.lost, lock.lost
    with pytest.raises(LockLost):
        lock.release()


def test_a_renewed_lock_whose_thread_ended_stays_held_and_is_released_through_its_handle(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """A thread that ends holding an auto-renewed lock passes it on with its handle (a stream
    that goes on after the view that locked it): still renewed while the handle is kept, and
    its owner being gone bars nobody from releasing it through the handle."""
    rl = make_redlock(redis_nodes, ttl=TTL)
    other = make_redlock(redis_nodes)
    box = []

    def take() -> None:
        lock = rl.lock("renew:thread-ended", auto_renew=True)
        assert lock.acquire(blocking=False)
        box.append(lock)

    worker = threading.Thread(target=take, name="ended-holder")
    worker.start()
    worker.join()
    [lock] = box
    time.sleep(3 * TTL)  # three leases after its thread ended: renewed all along
    assert lock.held and lock.lost is None
    assert not other.lock("renew:thread-ended").acquire(blocking=False)
    lock.release()  # from the main thread
    assert not lock.held and lock.lost is None
    assert settled_tokens(redis_nodes, "renew:thread-ended") == [None] * 3
    # A live owner still bars everyone else, as before.
    mine = rl.lock("renew:thread-live", auto_renew=True)
    assert mine.acquire(blocking=False)
    refused = []

    def release_from_another_thread() -> None:
        try:
            mine.release()
        except LockNotOwned as exc:
            refused.append(exc)

    thief = threading.Thread(target=release_from_another_thread)
    thief.start()
    thief.join()
    assert refused and mine.held
    mine.release()


def test_a_renewed_lock_its_ended_thread_left_without_a_handle_runs_out(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """Nobody can release a lock whose thread ended and whose handle is gone: the watchdog
    stops renewing it and it is free once its lease ran out, as a crashed process's is (it is
    not renewed for ever)."""
    rl = make_redlock(redis_nodes, ttl=TTL)
    other = make_redlock(redis_nodes)

    def take_and_drop() -> None:
        assert rl.lock("renew:abandoned", auto_renew=True).acquire(blocking=False)

    worker = threading.Thread(target=take_and_drop)
    worker.start()
    worker.join()
    assert other.locked("renew:abandoned")
    started = time.monotonic()

    def gone() -> bool:
        return tokens_on_nodes(redis_nodes, "renew:abandoned") == [None] * 3

    wait_until(gone, timeout=3 * TTL + 2, interval=0.02)
    assert time.monotonic() - started <= TTL + TTL / 3 + 1.0
    assert other.lock("renew:abandoned").acquire(blocking=False)


@pytest.mark.parametrize("fault", ["script cache flushed", "one node refuses writes"])
def test_renewal_rounds_go_on_through_a_flushed_script_cache_or_an_error_reply(
    fault: str, redis_nodes: RedisCluster, make_redlock, event_log
) -> None:
    # A round pipelines every due lease to a node at once: a node that lost its scripts (a
    # restart, SCRIPT FLUSH) still runs them all, and one node's error replies (NOREPLICAS
    # here) leave the others' quorum to renew every lease.
    rl = make_redlock(redis_nodes, ttl=TTL)
    log = event_log(rl)
    locks = [rl.lock(f"renew:batch:{i}", auto_renew=True) for i in range(5)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    refusing = redis_nodes.nodes[0]
    try:
        if fault == "script cache flushed":
            for node in redis_nodes:
                with node_client(node) as c:
                    c.script_flush()
        else:
            with node_client(refusing) as c:
                c.config_set("min-replicas-to-write", 1)
        before = [rl.lock_info(lock.name).renewals for lock in locks]
        # Several leases' worth of renewal rounds after the fault.
        wait_until(
            lambda: all(
                rl.lock_info(lock.name).renewals >= b + 4
                for lock, b in zip(locks, before, strict=True)
            ),
            timeout=10 * TTL + 5,
        )
        assert all(lock.held for lock in locks)
        assert log.wait_for("lost", timeout=0) is None
        if fault == "script cache flushed":
            # Every node renewed every lease: the keys still carry their tokens everywhere.
            for lock in locks:
                assert settled_tokens(redis_nodes, lock.name) == [lock.token] * 3
    finally:
        if fault != "script cache flushed":
            with node_client(refusing) as c:
                c.config_set("min-replicas-to-write", 0)
    for lock in locks:
        lock.release()
