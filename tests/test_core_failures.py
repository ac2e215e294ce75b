"""Node failures, a crashed holder, and a quorum that answers too late, on real redis-server
processes (SIGSTOP for a paused/partitioned node, SIGKILL for a crash).

Each test gets a private cluster from ``redis_cluster_factory`` and warms it up (one acquire and
release) before injecting a fault, so the fault hits a cluster in service. Nodes are never
restarted here, so the restart guard is not involved.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from django_redlock import AsyncRedlock, LockNotAcquired, QuorumError, Redlock
from django_redlock.testing import RedisCluster
from tests.faults.proxy import Proxy
from tests.helpers import (
    REPO_ROOT,
    lock_keys,
    occupy,
    settled_lock_keys,
    settled_tokens,
    tokens_on_nodes,
    wait_until,
    warm_up,
)

NODE_TIMEOUT = 0.05
OVERHEAD = 0.25  # generous: a shared 2-core machine, and a paused node costs one full timeout


def _fault(cluster: RedisCluster, indexes: list[int], how: str) -> None:
    for i in indexes:
        (cluster[i].kill if how == "kill" else cluster[i].pause)()


@pytest.mark.parametrize("how", ["kill", "pause"])
@pytest.mark.parametrize("n", [3, 5])
def test_minority_down_locks_still_work(
    n: int, how: str, redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(n)
    rl = make_redlock(cluster, node_timeout=NODE_TIMEOUT, ttl=5.0, retry_count=0)
    other = make_redlock(cluster, node_timeout=NODE_TIMEOUT, ttl=5.0, retry_count=0)
    warm_up(rl)
    warm_up(other)
    down = list(range((n - 1) // 2))  # 1 of 3, 2 of 5
    up = [i for i in range(n) if i not in down]
    _fault(cluster, down, how)
    for cycle in range(4):
        lock = rl.lock(f"minority:{cycle % 2}")
        t0 = time.monotonic()
        assert lock.acquire(blocking=False) is True, f"cycle {cycle}"
        elapsed = time.monotonic() - t0
        assert elapsed < NODE_TIMEOUT + OVERHEAD, f"cycle {cycle}: acquire took {elapsed:.3f}s"
        assert lock.held and 0 < lock.validity <= 5.0
        # The survivors hold our token; another client is refused (not a quorum error: the
        # survivors answered, the lock is simply held).
        survivors = [cluster[i] for i in up]
        assert settled_tokens(survivors, lock.name) == [lock.token] * len(up)
        contender = other.lock(lock.name)
        assert contender.acquire(blocking=False) is False
        assert lock.check() is True
        t0 = time.monotonic()
        lock.release()
        assert time.monotonic() - t0 < NODE_TIMEOUT + OVERHEAD
        assert settled_lock_keys(survivors) == [{}] * len(up)


@pytest.mark.parametrize("n", [3, 5])
def test_majority_killed_raises_quorum_error_and_leaves_nothing(
    n: int, redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(n)
    rl = make_redlock(cluster, node_timeout=NODE_TIMEOUT, ttl=5.0, retry_count=0)
    warm_up(rl)
    down = list(range(n // 2 + 1))  # 2 of 3, 3 of 5
    survivors = [cluster[i] for i in range(n) if i not in down]
    _fault(cluster, down, "kill")
    lock = rl.lock("majority-killed")
    t0 = time.monotonic()
    with pytest.raises(QuorumError) as info:
        lock.acquire(blocking=False)
    assert time.monotonic() - t0 < 2 * NODE_TIMEOUT + OVERHEAD
    err = info.value
    assert isinstance(err, LockNotAcquired)
    assert set(err.failures) == {cluster[i].url for i in down}, err.failures
    for i in down:
        assert err.failures[cluster[i].url].startswith("refused"), err.failures
        assert cluster[i].url in str(err)
    assert not lock.held
    # The survivors granted, then the failed attempt was released everywhere.
    assert settled_lock_keys(survivors) == [{}] * len(survivors)
    # Too few nodes to say the lock is free: no answer rather than a False.
    with pytest.raises(QuorumError):
        rl.locked("majority-killed")


@pytest.mark.parametrize("n", [3, 5])
def test_majority_paused_raises_quorum_error_then_leftovers_expire(
    n: int, redis_cluster_factory, make_redlock
) -> None:
    """What can be asserted when the nodes were paused, not dead.

    A paused node keeps its TCP connections: the acquire script reaches its socket buffer and
    runs when the node resumes, after the client gave up. The client's release to that node
    cannot get through while it is paused, so such a node may come back holding a key of the
    failed attempt. What must hold: the nodes that answered are clean at once; whatever the
    resumed nodes hold belongs to that one failed attempt (a token no client holds), carries a
    PTTL no longer than the lock's ttl, and is gone once the ttl has passed; the lock is free
    again afterwards.
    """
    ttl = 0.6
    cluster = redis_cluster_factory(n)
    rl = make_redlock(cluster, node_timeout=NODE_TIMEOUT, ttl=ttl, retry_count=0)
    warm_up(rl)
    down = list(range(n // 2 + 1))
    survivors = [cluster[i] for i in range(n) if i not in down]
    _fault(cluster, down, "pause")
    lock = rl.lock("majority-paused")
    try:
        t0 = time.monotonic()
        with pytest.raises(QuorumError) as info:
            lock.acquire(blocking=False)
        assert time.monotonic() - t0 < 2 * NODE_TIMEOUT + OVERHEAD
        failures = info.value.failures
        assert set(failures) == {cluster[i].url for i in down}, failures
        for i in down:
            assert failures[cluster[i].url].startswith("timeout"), failures
        assert settled_lock_keys(survivors) == [{}] * len(survivors)
    finally:
        for i in down:
            cluster[i].resume()
    gave_up = time.monotonic()
    leftovers = [k for k in lock_keys(cluster) if k]
    tokens = {token for keys in leftovers for _, token in keys.values()}
    assert len(leftovers) <= len(down)
    assert len(tokens) <= 1, tokens  # one failed attempt, one token
    for keys in leftovers:
        assert set(keys) == {"redlock:lock:majority-paused"}
        for pttl, _ in keys.values():
            assert 0 < pttl <= ttl * 1000
    assert lock.token is None and not lock.held
    time.sleep(max(ttl - (time.monotonic() - gave_up), 0) + 0.05)  # let leftovers expire
    assert settled_lock_keys(cluster) == [{}] * n
    again = rl.lock("majority-paused")
    assert again.acquire(blocking=False) is True
    again.release()


def test_mixed_majority_down_names_each_reason(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(5)
    rl = make_redlock(cluster, node_timeout=NODE_TIMEOUT, ttl=5.0, retry_count=0)
    warm_up(rl)
    cluster[0].kill()
    cluster[1].kill()
    cluster[2].pause()
    try:
        with pytest.raises(QuorumError) as info:
            rl.lock("mixed").acquire(blocking=False)
    finally:
        cluster[2].resume()
    failures = info.value.failures
    assert failures[cluster[0].url].startswith("refused")
    assert failures[cluster[1].url].startswith("refused")
    assert failures[cluster[2].url].startswith("timeout")
    assert set(failures) == {cluster[i].url for i in range(3)}
    assert settled_lock_keys([cluster[3], cluster[4]]) == [{}, {}]


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_locked_raises_quorum_error_when_a_quorum_cannot_be_asked(
    how: str, redis_cluster_factory, make_redlock, make_async_redlock
) -> None:
    """locked() answers False only when the nodes that answered rule out a quorum holding
    the name; with 2 of 3 nodes down, a held lock is a QuorumError naming each silent node
    and why (sync and async), as redis-py's locked() raises when it cannot ask."""
    cluster = redis_cluster_factory(3)
    # A node timeout of its own: the faults are for good, and the verdicts with one node down
    # need both others in time, which a busy host's 50 ms does not always give.
    # A lease that outlasts the test on a loaded host (8-10 s beside CPU burners), so that
    # ``held`` below says what the questions did to it, not that its lease ran out.
    rl = make_redlock(cluster, node_timeout=0.25, ttl=60.0, retry_count=0)
    arl = make_async_redlock(cluster, node_timeout=0.25)
    warm_up(rl)
    assert asyncio.run(arl.locked("nightly")) is False
    lock = rl.lock("nightly")
    assert lock.acquire(blocking=False)
    _fault(cluster, [0], how)
    try:
        # One node down: still a verdict either way.
        assert rl.locked("nightly") is True
        assert rl.locked("free-name") is False
        assert asyncio.run(arl.locked("nightly")) is True
        _fault(cluster, [1], how)
        for ask in (
            lambda: rl.locked("nightly"),
            lambda: asyncio.run(arl.locked("nightly")),
            lambda: rl.locked("free-name"),
        ):
            with pytest.raises(QuorumError) as info:
                ask()
            failures = info.value.failures
            assert set(failures) == {cluster[0].url, cluster[1].url}, failures
            reason = "refused" if how == "kill" else "timeout"
            assert all(why.startswith(reason) for why in failures.values()), failures
            assert cluster[0].url in str(info.value)
            assert "could not" in str(info.value)
        # The holder's own questions answer False, and lost tells "could not say" from "gone".
        assert lock.check() is False
        assert lock.extend() is False
        assert lock.held is True
        assert lock.lost is None
    finally:
        if how == "pause":
            cluster[0].resume()
            cluster[1].resume()


# --------------------------------------------------------------------------- holder crash
# --------------------------------------------------------------------------- holder crash

_HOLDER = """
import sys, time
from django_redlock import Redlock
rl = Redlock({urls!r}, ttl=1.5)
lock = rl.lock("crash", ttl=1.5)
assert lock.acquire(blocking=False)
print(lock.token, flush=True)
time.sleep(600)
"""


@pytest.mark.faults
def test_holder_killed_lock_free_after_ttl(redis_nodes: RedisCluster, make_redlock) -> None:
    ttl = 1.5
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER.format(urls=redis_nodes.urls))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        token = holder.stdout.readline().strip()  # the holder reports once it holds the lock
        reported = time.monotonic()
        assert len(token) == 32, holder.stderr.read() if holder.poll() is not None else token
        assert settled_tokens(redis_nodes, "crash") == [token] * 3
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        holder.stdout.close()
        holder.stderr.close()
    assert holder.returncode == -signal.SIGKILL
    rl = make_redlock(redis_nodes, retry_delay=0.05)
    # Before the TTL: still taken (nobody released it; the dead holder's lease stands).
    early = rl.lock("crash")
    assert early.acquire(blocking=False) is False
    assert 0 < early.retry_after <= ttl
    # After the TTL: ours, within ttl + 1 s of the holder reporting.
    waiter = rl.lock("crash")
    assert waiter.acquire(timeout=ttl + 1.0) is True
    got = time.monotonic() - reported
    assert got <= ttl + 1.0
    assert got >= ttl - 0.3, f"acquired {got:.2f}s after the holder, before its lease ran out"
    assert waiter.token != token
    assert settled_tokens(redis_nodes, "crash") == [waiter.token] * 3
    waiter.release()


# --------------------------------------------------------------------------- validity


def test_a_quorum_that_answers_after_the_validity_is_gone_gives_no_lock(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """Two of three nodes answer only after 0.8 s: within node_timeout (0.95 s), so they do
    grant, but validity = ttl - elapsed - drift = 1.0 - 0.8 - 0.302 < 0 by then.

    (node_timeout must stay below ttl: the core rejects node_timeout >= ttl, so the late
    quorum is built with a large drift_factor instead: validity runs out after 0.698 s.)
    """
    rl = make_redlock(redis_nodes, ttl=1.0, node_timeout=0.95, drift_factor=0.3, retry_count=0)
    warm_up(rl)
    redis_nodes[0].pause()
    redis_nodes[1].pause()
    resumer = threading.Timer(0.8, lambda: (redis_nodes[0].resume(), redis_nodes[1].resume()))
    resumer.start()
    lock = rl.lock("late-quorum")
    outcome: object
    t0 = time.monotonic()
    try:
        outcome = lock.acquire(blocking=False, retries=0)  # one attempt
    except QuorumError as exc:  # only if the timer fired later than node_timeout
        outcome = exc
    elapsed = time.monotonic() - t0
    resumer.join()
    assert outcome is False or isinstance(outcome, QuorumError), outcome
    assert not lock.held and lock.validity == 0.0 and lock.token is None
    assert rl.locked("late-quorum") is False
    if outcome is False:
        # The replies came late but in time (the path under test), and the granted keys were
        # released everywhere: nothing is left.
        assert 0.69 < elapsed < 0.95 + OVERHEAD, elapsed
        assert settled_lock_keys(redis_nodes) == [{}, {}, {}]
    else:  # pragma: no cover - a badly delayed timer; still no usable lock may remain
        for keys in lock_keys(redis_nodes):
            assert all(0 < pttl <= 1000 for pttl, _ in keys.values())


def test_validity_of_a_granted_lock_accounts_for_elapsed_time_and_drift(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """A slow (but not too slow) quorum yields a lock whose validity is already reduced by
    the time the quorum took, plus the drift allowance."""
    rl = make_redlock(redis_nodes, ttl=2.0, node_timeout=0.9, drift_factor=0.1, retry_count=0)
    warm_up(rl)
    redis_nodes[0].pause()
    redis_nodes[1].pause()
    resumer = threading.Timer(0.3, lambda: (redis_nodes[0].resume(), redis_nodes[1].resume()))
    resumer.start()
    lock = rl.lock("slow-quorum")
    assert lock.acquire(blocking=False) is True
    resumer.join()
    # ttl 2.0 - at least 0.3 s waiting - 0.202 s drift allowance.
    assert 0 < lock.validity <= 2.0 - 0.3 - 0.2
    lock.release()


def test_a_master_that_may_not_write_is_reported_down_not_voting(redis_cluster_factory) -> None:
    # min-replicas-to-write unmet: the server answers PING and reads but refuses every lock
    # write (NOREPLICAS). Calling it voting would make readiness and `redlock check` say a
    # quorum votes while no lock can be taken.
    from django_redlock.core.asyncio import AsyncRedlock

    cluster = redis_cluster_factory(3)
    with cluster[0].client() as c:
        c.config_set("min-replicas-to-write", 1)
    rl = Redlock(cluster.urls, node_timeout=1.0)
    try:
        health = rl.health()
    finally:
        rl.close()
    # (the others are reachable; guarded, since one node that cannot vote keeps a new cluster
    # from being trusted at once)
    assert [h.status == "down" for h in health] == [True, False, False], health
    assert "NOREPLICAS" in str(health[0].error)

    async def probe() -> list:
        arl = AsyncRedlock(cluster.urls, node_timeout=1.0)
        try:
            return await arl.health()
        finally:
            await arl.close()

    health = asyncio.run(probe())
    assert [h.status == "down" for h in health] == [True, False, False], health


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_non_blocking_acquire_is_not_refused_for_a_late_answer_alone(
    redis_cluster_factory, client
) -> None:
    """Nobody holds the lock: a stale copy sits on one node, and the third node's answer is
    held up (its open connections stall, as behind a retransmitted packet). The first attempt
    has no verdict; a caller that will not wait for a holder still gets the lock, from one
    more attempt on another connection (a spurious 423 from a ``@locked`` view otherwise)."""
    cluster = redis_cluster_factory(3)
    # The held-up connections never answer until let through, so the budget only has to
    # cover the second attempt's new connection, which a loaded host makes slow (0.2 s
    # failed now and then at load 10, 1 s once beside four other test runs).
    occupy(cluster[1], "late-once", ms=20_000, token="stale-copy")
    proxy = Proxy((cluster[2].host, cluster[2].port))
    urls = [*cluster.urls[:2], proxy.url]
    try:
        if client == "sync":
            rl = Redlock(urls, node_timeout=2.0)
            try:
                warm_up(rl)
                proxy.hold_open()
                lock = rl.lock("late-once", ttl=20.0)
                assert lock.acquire(blocking=False)
                proxy.let_through()
                token = lock.token
                lock.release()
            finally:
                rl.close()
        else:

            async def main() -> str:
                arl = AsyncRedlock(urls, node_timeout=2.0)
                try:
                    async with arl.lock("warm-up"):
                        pass
                    proxy.hold_open()
                    lock = arl.lock("late-once", ttl=20.0)
                    assert await lock.acquire(blocking=False)
                    proxy.let_through()
                    token = lock.token
                    await lock.release()
                    return token
                finally:
                    await arl.close()

            token = asyncio.run(main())
        assert token
        # The held first attempt ran on the third node after all, and its undo behind it:
        # nothing of ours is left anywhere, the stale copy is untouched.
        wait_until(
            lambda: tokens_on_nodes(cluster, "late-once") == [None, "stale-copy", None],
            timeout=5.0,
        )
    finally:
        proxy.close()
