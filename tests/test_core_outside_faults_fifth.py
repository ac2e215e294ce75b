"""Faults found by the fifth outside test (scripts written from the README and the docs only,
run against real redis-server processes), each named after the fault and checked to fail
before its fix."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time

import pytest

from django_redlock import AsyncRedlock, QuorumError
from tests.helpers import PREFIX, node_client, wait_until, warm_up

pytestmark = pytest.mark.faults


def _holds(node, token: str) -> bool:
    """Whether ``node`` holds a live copy of the hold whose token is ``token``: a reader's
    entry (scored by when it ends, on the server clock) or a lock key (a permit, a writer)."""
    with node_client(node) as client:
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        for key in client.scan_iter(f"{PREFIX}:readers:*"):
            score = client.zscore(key, token)
            if score is not None and score > now_ms:
                return True
        for key in client.scan_iter(f"{PREFIX}:lock:*"):
            value = client.get(key)
            if value is not None and value.split(b" ", 1)[0] == token.encode():
                return True
    return False


def _pause_past_the_lease(node, seconds: float = 1.6) -> None:
    """Freeze ``node`` long enough for a 1 s lease's copy there to run out (a duration: the
    fault itself)."""
    node.pause()
    try:
        time.sleep(seconds)
    finally:
        node.resume()


# ---- renewal puts a reader (and a permit, a writer) back where a pause let it lapse ----------


def test_renewal_restores_holds_on_a_node_where_they_lapsed_and_survives_the_next_pause(
    redis_cluster_factory, make_redlock
) -> None:
    """Node 2 freezes past the lease (every hold's copy there runs out), then node 0 does:
    never more than one node of three silent, so no hold may be lost. Renewal must put each
    hold back on node 2 once it answers, as a plain lock's does."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.05)
    warm_up(rl)
    holds = [
        rl.read_lock("doc", ttl=1.0, auto_renew=True),
        rl.semaphore("pool", 2, ttl=1.0, auto_renew=True),
        rl.write_lock("page", ttl=1.0, auto_renew=True),
    ]
    for hold in holds:
        assert hold.acquire(blocking=False)
    _pause_past_the_lease(cluster[2])
    for hold in holds:
        wait_until(lambda hold=hold: _holds(cluster[2], hold.token), timeout=4.0)
    _pause_past_the_lease(cluster[0])
    for hold in holds:
        assert hold.held, hold.lost
        hold.release()


def test_renewal_restores_a_reader_on_a_node_where_it_lapsed_async(
    redis_cluster_factory,
) -> None:
    cluster = redis_cluster_factory(3)

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.05)
        try:
            async with rl.lock("warm-up"):
                pass
            reader = rl.read_lock("doc", ttl=1.0, auto_renew=True)
            assert await reader.acquire(blocking=False)
            cluster[2].pause()
            try:
                await asyncio.sleep(1.6)  # the fault: the reader's entry there runs out
            finally:
                cluster[2].resume()
            deadline = time.monotonic() + 4.0
            while not _holds(cluster[2], reader.token):
                assert time.monotonic() < deadline, "the reader was not put back on node 2"
                await asyncio.sleep(0.01)
            cluster[0].pause()
            try:
                await asyncio.sleep(1.6)
            finally:
                cluster[0].resume()
            assert reader.held, reader.lost
            await reader.release()
        finally:
            await rl.close()

    asyncio.run(main())


# ---- a new cluster whose servers started apart is told why it is guarded --------------------


def test_a_new_cluster_started_apart_is_guarded_and_the_error_names_the_start_spread(
    redis_cluster_factory, make_redlock
) -> None:
    """Every node new (never used), but one server started over 3 s after the others: guarded
    (they may have lost their data apart), and the QuorumError says it is the start spread,
    not that some node is not new."""
    cluster = redis_cluster_factory(3)
    time.sleep(3.2)  # the fault: INFO's uptime counts whole seconds, the allowance is 2 s
    cluster[2].restart(empty=True)
    with pytest.raises(QuorumError) as info:
        make_redlock(cluster).lock("first").acquire(blocking=False)
    assert "started more than 2s apart" in str(info.value), info.value
    assert "not every node is new" not in str(info.value)


# ---- one server listed twice (a TCP port and its unix socket) votes once ---------------------


def _second_node_never_votes(urls, other, why: str, make_redlock) -> None:
    """Of ``urls``, the second never votes, and says ``why`` (a regex) in health() and in the
    QuorumError that the sync and the asyncio client raise once ``other`` (the third) is
    frozen: the first alone is no quorum."""
    rl = make_redlock(urls, node_timeout=0.2, restart_guard=False)
    warm_up(rl)
    health = rl.health()
    assert [h.voting for h in health] == [True, False, True], health
    assert re.search(why, health[1].error or ""), health[1]
    with other.paused():
        with pytest.raises(QuorumError, match=why):
            rl.lock("once").acquire(blocking=False)

    async def main() -> None:
        arl = AsyncRedlock(urls, node_timeout=0.2, restart_guard=False)
        try:
            async with arl.lock("warm-up"):
                pass
            with other.paused():
                with pytest.raises(QuorumError, match=why):
                    await arl.lock("once").acquire(blocking=False)
        finally:
            await arl.close()

    asyncio.run(main())


@pytest.fixture
def server_with_a_socket():
    """A server on a TCP port and a unix socket, and another server."""
    from django_redlock.testing import RedisNode

    folder = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: a socket path is limited
    sock = os.path.join(folder, "s.sock")
    with RedisNode(extra_args=["--unixsocket", sock, "--unixsocketperm", "700"]) as a:
        with RedisNode() as b:
            yield [f"redis://127.0.0.1:{a.port}/0", f"unix://{sock}?db=1", b.url], b
    shutil.rmtree(folder, ignore_errors=True)


def test_one_server_by_tcp_and_by_unix_socket_votes_once(server_with_a_socket, make_redlock):
    """Config cannot tell a unix socket and a TCP port apart; the server's run id can: the
    node reached second is refused (it must not vote), and health() names it. With the only
    other server frozen, the one server alone grants nothing."""
    urls, other = server_with_a_socket
    _second_node_never_votes(urls, other, "same Redis server", make_redlock)


def test_check_deploy_names_one_server_listed_twice(server_with_a_socket, settings) -> None:
    from django_redlock.checks import check_reachable

    urls, _ = server_with_a_socket
    settings.REDLOCK = {"NODES": urls}
    found = [m for m in check_reachable() if m.id == "django_redlock.E014"]
    assert len(found) == 1 and "[0]" in found[0].msg and "[1]" in found[0].msg, found


# ---- a primary and its replica listed as two nodes: the replica never votes, and says why ----


@pytest.fixture
def primary_and_replica():
    """A primary, its replica (replicating, or still syncing: a replica says it is one from
    its start) and another server."""
    from django_redlock.testing import RedisNode

    with RedisNode() as primary, RedisNode() as other:
        with RedisNode(extra_args=["--replicaof", primary.host, str(primary.port)]) as replica:
            with replica.client(decode_responses=True) as c:
                assert c.info("replication")["role"] == "slave"
            yield [primary.url, replica.url, other.url], primary, other


def test_a_replica_listed_beside_its_primary_never_votes_and_says_why(
    primary_and_replica, make_redlock
):
    """A replica is not an independent node: its connections are refused at the handshake
    (sync and asyncio), health() names it a replica of its primary, and with the only other
    server frozen nothing is granted (the primary and its replica never make a quorum)."""
    urls, primary, other = primary_and_replica
    why = f"a replica (of {primary.host}:{primary.port})"
    _second_node_never_votes(urls, other, re.escape(why), make_redlock)


def test_check_deploy_names_a_replica(primary_and_replica, settings) -> None:
    from django_redlock.checks import check_reachable

    urls, primary, _ = primary_and_replica
    settings.REDLOCK = {"NODES": urls}
    found = [m for m in check_reachable() if m.id == "django_redlock.E015"]
    assert len(found) == 1 and "[1]" in found[0].msg, found
    assert f"replica of {primary.host}:{primary.port}" in found[0].msg
