"""The restart guard after a node's dataset was replaced under its own run id: a master that
became a replica, resynced (losing the leases it granted) and was promoted again holds a copy
of its own old marker, so the run id alone does not tell. Redis draws a new replication id
(``master_replid``) at every promotion, which the guard compares too (docs/guarantees,
"Restart guard"). The Sentinel failover-and-failback form is in tests/test_sentinel.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from django_redlock import LockNotOwned
from django_redlock.testing import RedisNode
from tests.helpers import PREFIX, node_client, occupy, vacate, wait_until, warm_up

MARKER = f"{PREFIX}:node"


def _replication(node: RedisNode) -> dict:
    with node_client(node) as c:
        return c.info("replication")


def _in_sync(replica: RedisNode, master: RedisNode) -> bool:
    info = _replication(replica)
    return (
        info.get("master_link_status") == "up"
        and info.get("master_repl_offset") == _replication(master)["master_repl_offset"]
    )


@pytest.fixture
def failed_back():
    """Yields ``(nodes, resync)``: M, P1, P2 as the client's nodes (R replicating M, in
    sync, and promoted: REPLICAOF NO ONE). ``resync()`` makes M R's replica until it has
    resynced (its keys are R's), then promotes M again."""
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(RedisNode())
        r = stack.enter_context(RedisNode(extra_args=["--replicaof", m.host, str(m.port)]))
        p1, p2 = stack.enter_context(RedisNode()), stack.enter_context(RedisNode())
        wait_until(lambda: _in_sync(r, m), timeout=30, interval=0.05)

        def promote_replica() -> None:
            wait_until(lambda: _in_sync(r, m), timeout=30, interval=0.05)
            with node_client(r) as c:
                c.execute_command("REPLICAOF", "NO", "ONE")

        def resync() -> None:
            with node_client(m) as c:
                c.execute_command("REPLICAOF", r.host, str(r.port))
            wait_until(lambda: _in_sync(m, r), timeout=30, interval=0.05)
            with node_client(m) as c:
                c.execute_command("REPLICAOF", "NO", "ONE")

        yield (m, r, p1, p2), promote_replica, resync


def _hold_on_m_and_p1(nodes, rl, name: str):
    """A holds ``name`` on exactly M and P1 (P2 is taken by a stale lease meanwhile)."""
    p2 = nodes[3]
    occupy(p2, name, ms=60_000)
    a = rl.lock(name, ttl=30.0)
    assert a.acquire(blocking=False)
    vacate(p2, name)
    return a


def _marker_is_ms_own(m: RedisNode) -> bool:
    with node_client(m) as c:
        return c.hget(MARKER, "run_id").decode() == c.info("server")["run_id"]


@pytest.mark.faults
@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_master_that_resynced_from_its_promoted_replica_is_guarded(
    client, failed_back, make_redlock, make_async_redlock
) -> None:
    """M and its in-sync replica R; R is promoted; A locks on M and P1 (R never gets the
    key); M becomes R's replica (a full resync: A's key is gone, the marker back with M's own
    run id) and is promoted again. A fresh client B is refused while A's lease runs: M sits
    out (new replication id), P1 is A's, P2 alone is no quorum. A client whose connections
    stayed open through it all is not refused until they are closed."""
    nodes, promote_replica, resync = failed_back
    m, _, p1, p2 = nodes
    urls = [m.url, p1.url, p2.url]
    a_rl = make_redlock(urls, max_ttl=30.0, node_timeout=0.2)
    c_rl = make_redlock(urls, max_ttl=30.0, node_timeout=0.2)
    warm_up(a_rl)
    warm_up(c_rl)  # C's pooled connections saw every node vote
    promote_replica()
    a = _hold_on_m_and_p1(nodes, a_rl, "failback")
    resync()
    with node_client(m) as c:
        assert c.get(f"{PREFIX}:lock:failback") is None  # A's copy was lost with the resync
    assert _marker_is_ms_own(m)  # what the run id alone could not tell apart
    # Before any acquire arms it again, health() already says M would sit out a whole period.
    seen = make_redlock(urls, max_ttl=30.0, node_timeout=0.2).health()[0]
    assert seen.armed is False and seen.guarded_for == 30.0, seen
    # Not detected: REPLICAOF closes no client's connection, and C's, which saw M vote, takes
    # M's answer to a plain SET with the same marker as before (docs/guarantees).
    c = c_rl.lock("failback", ttl=2.0)
    assert c.acquire(blocking=False) and a.held
    c.release()
    # Closing them (as the Sentinels do when they reconfigure a server) makes C shake hands
    # again, read M's new replication id, and be refused.
    with node_client(m) as conn:
        conn.execute_command("CLIENT", "KILL", "TYPE", "normal")
    assert not c_rl.lock("failback", ttl=2.0).acquire(blocking=False)

    if client == "sync":
        b_rl = make_redlock(urls, max_ttl=30.0, node_timeout=0.2)
        b = b_rl.lock("failback", ttl=5.0)
        granted = b.acquire(blocking=False)
        health = b_rl.health()
    else:
        b_rl = make_async_redlock(urls, max_ttl=30.0, node_timeout=0.2)

        async def attempt():
            b = b_rl.lock("failback", ttl=5.0)
            return b, await b.acquire(blocking=False), await b_rl.health()

        b, granted, health = asyncio.run(attempt())
    held = a.held
    with contextlib.suppress(LockNotOwned):
        a.release()
    assert not (granted and held), "double grant: M lost A's key in a resync and voted for B"
    assert not granted
    assert health[0].guarded_for > 20, health[0]


def test_a_marker_without_the_replication_id_is_completed_not_guarded(
    redis_cluster_factory, make_redlock
) -> None:
    """Markers written before the field existed (or armed again by such a client, which
    leaves another marker's field behind) are completed by the next acquire: no node of a
    running fleet sits out on upgrade, and the completed marker guards a later promotion."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, max_ttl=30.0, node_timeout=0.2)
    warm_up(rl)
    before = []
    for i, node in enumerate(cluster.nodes):
        with node_client(node) as c:
            if i == 0:
                c.hdel(MARKER, "replid")  # written by a client before the field
            else:
                c.hset(MARKER, "replid", "1 stale")  # paired with another marker's id
            before.append(c.hgetall(MARKER))
    # A fresh client (new connections: the full acquire script everywhere).
    fresh = make_redlock(cluster, max_ttl=30.0, node_timeout=0.2)
    lock = fresh.lock("upgrade")
    assert lock.acquire(blocking=False)
    lock.release()
    assert all(h.guarded_for == 0 for h in fresh.health())
    for node, was in zip(cluster.nodes, before, strict=True):
        with node_client(node) as c:
            now = c.hgetall(MARKER)
            replid = c.info("replication")["master_replid"]
        # Not armed again: the same marker, now with this server's replication id.
        assert {k: v for k, v in now.items() if k != b"replid"} == {
            k: v for k, v in was.items() if k != b"replid"
        }
        assert now[b"replid"] == now[b"id"] + b" " + replid.encode()
