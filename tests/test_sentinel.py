"""Sentinel-managed groups as Redlock nodes (``redis+sentinel://``): URL validation, locks over
three groups, a failover and a killed master while a lock is held, a history of holders across
failovers, and the views (health, listing, CLI, admin) showing each group's current master.

Every server is real: per group a master and a replica (``redis-server --replicaof``), and
two Sentinels (``redis-server --sentinel``) watching all groups (see ``sentinel_support``).
When a Sentinel cannot start here the tests skip, naming why (a failure under
``REDLOCK_REQUIRE_ALL=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import threading
import time
from io import StringIO
from typing import Any

import pytest
import redis
from django.core.management import call_command

from django_redlock import AsyncRedlock, LockNotOwned, QuorumError, Redlock
from django_redlock.checks import check_reachable, check_settings
from django_redlock.core import node_identity, parse_spec, redact
from django_redlock.core.sentinel import GUARD_MARGIN
from django_redlock.probes import probes
from tests.helpers import warm_up
from tests.sentinel_support import SentinelGroups, SentinelUnavailable

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

_prefixes = itertools.count()


def _prefix() -> str:
    """A key prefix of its own per client family: fresh restart-guard markers per test."""
    return f"sent{next(_prefixes)}x{int(time.time() * 1000) % 100000}"


def _start(n: int = 3, **kwargs: Any) -> SentinelGroups:
    try:
        return SentinelGroups(n, **kwargs)
    except SentinelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def groups():
    """Three groups shared by the tests that leave them healthy (a SENTINEL FAILOVER
    leaves the old master as the new one's replica)."""
    made = _start()
    yield made
    made.stop()


@pytest.fixture
def own_groups():
    """Three groups of the test's own (it kills servers)."""
    made = _start()
    yield made
    made.stop()


def _options(**kwargs):
    # A generous node timeout (a shared, loaded machine), and a short guard so a failed-over
    # group votes again within the test.
    return {"node_timeout": 0.5, "ttl": 2.0, "max_ttl": 3.0, **kwargs}


# -- the URL form ------------------------------------------------------------------------------

GOOD = [
    "redis+sentinel://10.0.0.1:26379/mymaster/0",
    "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380,10.0.0.3/mymaster/2",
    "redis+sentinel://:secret@[::1]:26379/orders/0",
    "redis+sentinel://user:secret@s1:26379,s2:26379/orders/1?socket_keepalive=true",
]

BAD = [
    ("redis+sentinel:///mymaster/0", "names no Sentinel"),
    ("redis+sentinel://s1:26379", "names no service"),
    ("redis+sentinel://s1:26379/", "names no service"),
    ("redis+sentinel://s1:port/mymaster/0", "invalid Sentinel port"),
    ("redis+sentinel://s1:70000/mymaster/0", "invalid Sentinel port"),
    ("redis+sentinel://s1:0/mymaster/0", "invalid Sentinel port"),
    ("redis+sentinel://s1:26379,s2:0/mymaster/0", "invalid Sentinel port"),
    ("redis+sentinel://s1:26379,[::1]:65536/mymaster/0", "invalid Sentinel port"),
    # a digit to str.isdigit() and int(), not to a URL (redis:// refuses it as urlsplit does)
    ("redis+sentinel://s1:\u0663/mymaster/0", "invalid Sentinel port"),
    ("redis+sentinel://s1:26379/mymaster/x", "must end in /SERVICE/DB"),
    ("redis+sentinel://s1:26379/mymaster/0/extra", "must end in /SERVICE/DB"),
    ("redis+sentinel://s1:26379,s1:26379/mymaster/0", "names a Sentinel twice"),
    ("redis+sentinel://s1:26379,,s2:26379/mymaster/0", "without a host"),
    ("redis+sentinel://s1:26379/mymaster/0?db=x", "Invalid value for 'db'"),
]


@pytest.mark.parametrize("url", GOOD)
def test_group_urls_are_accepted(url):
    rl = Redlock([url])
    try:
        node = rl.nodes[0]
        assert node.group is not None and node.address is None  # nothing asked yet
        assert "secret" not in node.name and "secret" not in repr(node)
        # A deposed master may grant a little past the switch: the guard covers it.
        assert rl.guard_period == rl.max_ttl + GUARD_MARGIN
    finally:
        rl.close()
    plain = Redlock(["redis://127.0.0.1:6379/0"])
    assert plain.guard_period == plain.max_ttl
    plain.close()


@pytest.mark.parametrize(("url", "why"), BAD)
def test_bad_group_urls_are_refused_naming_the_url(url, why, settings):
    shown = redact(url)
    with pytest.raises(ValueError, match=why) as info:
        Redlock([url])
    assert shown in str(info.value)
    with pytest.raises(ValueError, match=why):
        Redlock([{"URL": url, "OPTIONS": {"password": "x"}}])
    settings.REDLOCK = {"NODES": [url]}
    [error] = [m for m in check_settings() if m.id == "django_redlock.E004"]
    assert shown in error.msg and why.split("'")[0] in error.msg


def test_a_group_password_is_never_shown():
    url = "redis+sentinel://app:hunter2@s1:26379/mymaster/0"
    with pytest.raises(ValueError) as info:
        Redlock([url, url])
    assert "hunter2" not in str(info.value)
    assert redact(url) == "redis+sentinel://***@s1:26379/mymaster/0"


def test_group_options():
    url = "redis+sentinel://s1:26379/mymaster/0"
    spec = {"URL": url, "OPTIONS": {"password": "p", "sentinel_kwargs": {"password": "q"}}}
    assert parse_spec(spec)[1]["sentinel_kwargs"] == {"password": "q"}
    rl = Redlock([spec])
    try:
        group = rl.nodes[0].group
        assert group.sentinel_kwargs["password"] == "q"
        assert (
            group.master_kwargs["password"] == "p" and "sentinel_kwargs" not in group.master_kwargs
        )
    finally:
        rl.close()
    with pytest.raises(TypeError, match="sentinel_kwargs must be a dict"):
        Redlock([{"URL": url, "OPTIONS": {"sentinel_kwargs": "password=q"}}])
    # Only a group has Sentinels.
    with pytest.raises(ValueError, match="'sentinel_kwargs'"):
        Redlock([{"URL": "redis://s1:6379/0", "OPTIONS": {"sentinel_kwargs": {}}}])
    # A name a Sentinel connection does not take: redis-py's bare TypeError named neither
    # the node nor sentinel_kwargs.
    for client in (Redlock, AsyncRedlock):
        with pytest.raises(ValueError, match=re.escape(f"'{url}' OPTIONS sentinel_kwargs 'bogus'")):
            client([{"URL": url, "OPTIONS": {"sentinel_kwargs": {"bogus": 1}}}])


def test_unreachable_sentinels_fail_the_node_at_once_naming_them():
    """No retries with back-off on the lock path (redis-py's default waited ~7 s)."""
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/orders/0"
    rl = Redlock([url], node_timeout=0.1)
    try:
        started = time.monotonic()
        with pytest.raises(QuorumError, match=r"asked 127.0.0.1:1, 127.0.0.1:2: unreachable"):
            rl.lock("x").acquire(blocking=False)
        [health] = rl.health()
        assert time.monotonic() - started < 3.0
        assert (
            not health.reachable
            and "no majority of Sentinels named a master for 'orders'" in health.error
        )
    finally:
        rl.close()


def test_a_service_the_sentinels_do_not_know(groups):
    url = f"redis+sentinel://{groups.sentinel_hosts}/nope/0"
    rl = Redlock([url], node_timeout=0.5)
    try:
        [health] = rl.health()
        assert not health.reachable and "'nope'" in health.error
        assert "no such master" in health.error
    finally:
        rl.close()


class _FakeSentinel:
    """A Sentinel's ``SENTINEL MASTERS`` answer naming ``port`` master at ``epoch``."""

    def __init__(self, port: int, epoch: int) -> None:
        self.state = {
            "ip": "127.0.0.1",
            "port": port,
            "config-epoch": epoch,
            "is_master": True,
            "is_sdown": False,
            "is_odown": False,
            "num-other-sentinels": 2,
        }

    def sentinel_masters(self) -> dict[str, dict[str, object]]:
        return {"mymaster": self.state}

    def close(self) -> None:
        pass


class _Unreachable:
    """A Sentinel that does not answer."""

    def sentinel_masters(self) -> dict[str, dict[str, object]]:
        raise redis.ConnectionError("unreachable")

    def close(self) -> None:
        pass


def test_the_master_is_the_one_a_majority_of_the_sentinels_names_newest():
    """A Sentinel that missed a failover (down during it, or restarted from its config of
    before) names the deposed master at the older epoch. The node asks until a majority of
    its Sentinels answered and follows the newest epoch among them; a minority alone is never
    followed: the master known stays, and a node that knows none is unavailable."""
    from django_redlock.core.sentinel import SentinelGroup
    from django_redlock.core.sentinel import SentinelUnavailable as GroupUnavailable

    url = "redis+sentinel://s1:1,s2:2,s3:3/mymaster/0"
    lagging, current = _FakeSentinel(7001, 3), _FakeSentinel(7002, 4)
    group = SentinelGroup(url, {}, node_timeout=0.5)
    group._sentinel.sentinels = [lagging, current, _Unreachable()]
    assert group.find() == (("127.0.0.1", 7002), 4)  # a fresh node, the lagging one first
    group._sentinel.sentinels = [_Unreachable(), lagging, _Unreachable()]
    assert group.find() == (("127.0.0.1", 7002), 4)  # the lagging one alone: the known one
    fresh = SentinelGroup(url, {}, node_timeout=0.5)
    fresh._sentinel.sentinels = [_Unreachable(), lagging, _Unreachable()]
    with pytest.raises(GroupUnavailable, match="1 of 3 answered, 2 needed"):
        fresh.find()
    # Every Sentinel of a majority names an older epoch than one heard (set up anew): theirs.
    group._sentinel.sentinels = [lagging, _FakeSentinel(7001, 2), _Unreachable()]
    assert group.find() == (("127.0.0.1", 7001), 3)


def test_a_sentinel_restarted_from_its_config_of_before_a_failover_is_not_followed(
    make_redlock,
):
    """Group 0's Sentinel S1 is down while the other two promote the replica R1 (its master
    M1 frozen); a holder Y takes a lock on a bare quorum, R1 and group 2's master. Then the
    two Sentinels freeze, M1 resumes (still a master: nobody told it), and S1 restarts from
    its config file: it names M1, at the epoch M1's marker was armed at, so nothing on M1
    says it missed a lease. A client that follows S1 (a fresh one, or one that knows R1 but
    hears only S1) is granted the lock by M1 and group 1 beside Y. None may be."""
    groups = _start(3, sentinels=3)
    try:
        prefix = _prefix()
        opts = _options(ttl=30.0, max_ttl=30.0)
        holder = make_redlock(groups.urls, key_prefix=prefix, **opts)
        knows = make_redlock(groups.urls, key_prefix=prefix, **opts)
        for rl in (holder, knows):
            warm_up(rl)
        m1, r1 = groups.master(0), groups.replica(0)
        stale, others = groups.sentinels[2], groups.sentinels[:2]
        stale.kill()  # its config file stays: it names M1 when it starts again
        with groups.switch(0):
            m1.pause()
        assert groups.master_address(0) == (r1.host, r1.port)
        assert holder.trust_cluster() == 3  # nothing is held: R1 may vote at once
        warm_up(knows)  # it has used R1, at the new epoch
        name = "ledger"
        with groups.master(1).client() as c:  # the holder's hold is a bare quorum
            c.set(f"{prefix}:lock:{name}", "foreign 0 0 0 60000\n{}", px=60_000)
        held = holder.lock(name)
        assert held.acquire(blocking=False)
        with groups.master(1).client() as c:
            c.delete(f"{prefix}:lock:{name}")
        for sentinel in others:
            sentinel.pause()
        try:
            m1.resume()
            stale.start()
            with redis.Redis(stale.host, stale.port, socket_timeout=5) as c:
                deadline = time.monotonic() + 30
                while True:  # until S1 names M1 as a master it sees up
                    state = c.sentinel_masters().get(groups.services[0]) or {}
                    if (
                        (str(state.get("ip")), int(state.get("port", 0))) == (m1.host, m1.port)
                        and state.get("is_master")
                        and not state.get("is_sdown")
                    ):
                        break
                    assert time.monotonic() < deadline, state
                    time.sleep(0.1)  # nothing announces it
            fresh = make_redlock(groups.urls, key_prefix=prefix, **opts)
            for rl in (fresh, knows):
                try:
                    taken = rl.lock(name).acquire(blocking=False)
                except QuorumError:
                    taken = False
                assert not taken, "granted beside the holder"

            async def fresh_async() -> bool:
                arl = AsyncRedlock(groups.urls, key_prefix=prefix, **opts)
                try:
                    return await arl.lock(name).acquire(blocking=False)
                except QuorumError:
                    return False
                finally:
                    await arl.close()

            assert not asyncio.run(fresh_async()), "granted beside the holder (asyncio)"
            # (S1 also makes R1 a replica of M1 meanwhile, so the holder's copy there goes in
            # the resync, which its next check finds: the group lost it, as a restarted node
            # would. Nobody else may gather a quorum with it, and nobody did.)
            # Told why: no majority of the Sentinels answered.
            assert "1 of 3 answered" in str(fresh.health()[0].error)
        finally:
            for sentinel in others:
                sentinel.resume()
    finally:
        groups.stop()


def test_the_same_group_twice_is_one_node(settings):
    a = "redis+sentinel://s1:26379,s2:26379/mymaster/0"
    b = "redis+sentinel://S2:26379,s1:26379/mymaster/1"
    assert node_identity(a) == node_identity(b)
    assert node_identity(a) != node_identity("redis+sentinel://s1:26379,s2:26379/other/0")
    with pytest.raises(ValueError, match="same Redis server"):
        Redlock([a, b, "redis://127.0.0.1:6379/0"])
    settings.REDLOCK = {"NODES": [a, b, "redis://127.0.0.1:6379/0"]}
    assert "django_redlock.E007" in [m.id for m in check_settings()]
    # localhost, 127.0.0.1 and ::1 are one host for Sentinels as for servers
    here = "redis+sentinel://127.0.0.1:26379/mymaster/0"
    assert node_identity(here) == node_identity("redis+sentinel://localhost:26379/mymaster/0")
    assert node_identity(here) == node_identity("redis+sentinel://[::1]:26379/mymaster/0")


def test_a_group_whose_master_is_also_a_node_of_its_own_does_not_vote(groups, make_redlock):
    # Only the Sentinels know where the master is: found there, it is refused, not counted
    # twice (the server would answer for two of three entries).
    host, port = groups.master_address(0)
    rl = make_redlock(
        [groups.url(0), f"redis://{host}:{port}/0", groups.url(1)],
        key_prefix=_prefix(),
        **_options(),
    )
    assert rl.trust_cluster() == 2  # new keys, one entry refused: the two others may vote
    lock = rl.lock("twice", ttl=3.0)
    assert lock.acquire(blocking=False)  # the plain node and group 1: 2 of 3
    assert lock.check()
    lock.release()
    health = rl.health()
    assert not health[0].voting and "also configured as a node of its own" in str(health[0].error)
    assert health[1].voting and health[2].voting


# -- locks over groups -------------------------------------------------------------------------


def test_a_lock_over_three_groups(groups, make_redlock):
    prefix = _prefix()
    a = make_redlock(groups.urls, key_prefix=prefix, **_options())
    b = make_redlock(groups.urls, key_prefix=prefix, **_options())
    lock = a.lock("invoice:1", ttl=3.0)
    assert lock.acquire(blocking=False)
    assert not b.lock("invoice:1").acquire(blocking=False)
    assert b.locked("invoice:1") and lock.check()
    masters = [f"{h}:{p}" for h, p in map(groups.master_address, range(3))]
    [info] = b.live_locks("invoice:*")
    assert info.nodes == 3 and sorted(s.master for s in info.per_node) == sorted(masters)
    health = b.health()
    assert [h.master for h in health] == masters
    assert all(h.reachable and h.voting for h in health)
    # Each group's key is on its master, and replicated.
    for i in range(3):
        with groups.master(i).client() as c:
            assert c.exists(f"{prefix}:lock:invoice:1")
    lock.release()
    assert b.lock("invoice:1").acquire(blocking=False)


def test_sentinel_failover_while_a_lock_is_held(groups, make_redlock):
    prefix = _prefix()
    a = make_redlock(groups.urls, key_prefix=prefix, **_options(max_ttl=30.0))
    b = make_redlock(groups.urls, key_prefix=prefix, **_options(max_ttl=30.0))
    lock = a.lock("report", ttl=20.0)
    assert lock.acquire(blocking=False)
    # Probed before the failover: a long-lived client's health connections reach the old master.
    assert [h.status for h in b.health()] == ["voting"] * 3
    old = groups.master_address(0)
    new = groups.failover(0)
    assert new != old
    # The promoted replica is guarded: it may lack writes its master acknowledged.
    assert not b.lock("report").acquire(blocking=False)
    health = b.health()
    assert health[0].master == f"{new[0]}:{new[1]}"
    assert health[0].status == "guarded" and health[0].guarded_for > b.max_ttl
    assert [h.status for h in health[1:]] == ["voting", "voting"]
    # The holder still holds it on a quorum, releases it, and its client follows the move.
    assert lock.check()
    lock.release()
    assert b.lock("report").acquire(blocking=False)  # groups 1 and 2
    assert a.health()[0].master == f"{new[0]}:{new[1]}"


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_release_a_master_refused_goes_out_again(groups, make_redlock, client):
    """A master that refuses writes (``NOREPLICAS``, as a deposed one does; ``READONLY`` from
    a demoted one is handled alike) does not keep the key: its connection is dropped, and the
    release goes out again with the node's next connection, to the master the Sentinels
    name."""
    prefix = _prefix()
    key = f"{prefix}:lock:again"
    master = groups.master(0)
    with master.client() as admin:

        def refuse(yes: bool) -> None:
            admin.config_set("min-replicas-to-write", "5" if yes else "0")

        if client == "sync":
            rl = make_redlock(groups.urls, key_prefix=prefix, **_options())
            lock = rl.lock("again", ttl=3.0)
            assert lock.acquire(blocking=False)
            refuse(True)
            try:
                lock.release()  # on groups 1 and 2
                assert admin.exists(key)
            finally:
                refuse(False)
            # The next operations that reach the node (a refusal read late, on the connection's
            # next use, keeps the release for the one after).
            for _ in range(2):
                rl.locked("something else")
        else:

            async def scenario() -> None:
                rl = AsyncRedlock(groups.urls, key_prefix=prefix, **_options())
                try:
                    lock = rl.lock("again", ttl=3.0)
                    assert await lock.acquire(blocking=False)
                    refuse(True)
                    try:
                        await lock.release()
                        assert admin.exists(key)
                    finally:
                        refuse(False)
                    for _ in range(2):
                        await rl.locked("something else")
                finally:
                    await rl.close()

            asyncio.run(scenario())
        assert not admin.exists(key)


def _cut_replication(replica) -> None:
    """Its replication stops: it reconnects as a user its master does not know, and fails."""
    with replica.client(decode_responses=True) as c:
        c.config_set("masteruser", "nobody-here")
        c.config_set("masterauth", "wrong")
        c.client_kill_filter(_type="master")
        deadline = time.monotonic() + 30
        while c.info("replication")["master_link_status"] != "down":
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_a_killed_master_whose_replica_missed_the_lock(own_groups, make_redlock):
    """The promoted replica never got the lock (its replication was cut while the lock was
    taken) and two groups fail over so: only the restart guard stands between a second
    client and the lock. With the guard off, the same history grants it twice."""
    groups = own_groups
    prefix = _prefix()
    opts = _options(max_ttl=60.0)
    a = make_redlock(groups.urls, key_prefix=prefix, **opts)
    # Markers armed and replicated first: the replicas hold the old masters' markers.
    warm_up = a.lock("warm-up")
    assert warm_up.acquire(blocking=False)
    warm_up.release()
    for i in (0, 1):
        with groups.master(i).client() as c:
            assert c.wait(1, 5000) == 1
    masters = [groups.master(i) for i in (0, 1)]
    replicas = [groups.replica(i) for i in (0, 1)]
    for replica in replicas:
        _cut_replication(replica)
    lock = a.lock("payroll", ttl=50.0)
    assert lock.acquire(blocking=False)
    with groups.switch(0), groups.switch(1):
        for master in masters:
            master.kill()
    key = f"{prefix}:lock:payroll"
    for i, replica in zip((0, 1), replicas, strict=True):
        assert groups.master_address(i) == (replica.host, replica.port)
        with replica.client() as c:
            assert not c.exists(key)  # the promoted replica lost the lock
    b = make_redlock(groups.urls, key_prefix=prefix, **opts)
    # Two groups sit out their guard: no quorum can answer, let alone grant.
    with pytest.raises(QuorumError, match=r"guarded for .*failover"):
        b.lock("payroll").acquire(blocking=False)
    health = b.health()
    assert [h.status for h in health] == ["guarded", "guarded", "voting"]
    assert [h.master for h in health[:2]] == [f"{r.host}:{r.port}" for r in replicas]
    assert lock.held and lock.check() is False  # the holder's own quorum view: 1 of 3
    unguarded = make_redlock(groups.urls, key_prefix=prefix, **opts, restart_guard=False)
    assert unguarded.lock("payroll").acquire(blocking=False)  # the hazard the guard closes


def test_a_failover_and_failback_while_a_lock_is_held(own_groups, make_redlock):
    """Group 0's replica R misses A's lock (A holds it on groups 0 and 1 only); a failover
    promotes R, the Sentinels make the old master M R's replica (a full resync: A's key is
    gone, M's marker comes back from R with M's own run id), nobody uses the group
    meanwhile, and a second failover promotes M again. M's new replication id keeps it out
    of every quorum for its guard period: in the history of A's hold and a fresh client's
    attempts, nobody is granted the lock while A holds it."""
    groups = own_groups
    prefix = _prefix()
    opts = _options(max_ttl=120.0)
    a = make_redlock(groups.urls, key_prefix=prefix, **opts)
    # C's pooled connections saw every node vote, and stay open through both failovers.
    c_rl = make_redlock(groups.urls, key_prefix=prefix, **opts)
    for rl in (a, c_rl):
        warm = rl.lock("warm-up")
        assert warm.acquire(blocking=False)
        warm.release()
    m, r = groups.master(0), groups.replica(0)
    with m.client() as c:
        assert c.wait(1, 5000) == 1  # R holds M's marker
    idle = redis.Connection(host=m.host, port=m.port)
    idle.connect()
    idle.send_command("CLIENT", "ID")
    idle_id = idle.read_response()
    _cut_replication(r)
    other = groups.master(2)
    key = f"{prefix}:lock:ledger"
    with other.client() as c:  # A's hold is a bare quorum: groups 0 and 1
        c.set(key, "foreign 0 0 0 60000\n{}", px=60_000)
    lock = a.lock("ledger", ttl=100.0)
    assert lock.acquire(blocking=False)
    held_from = time.monotonic()
    with other.client() as c:
        c.delete(key)
    with groups.switch(0), groups.sentinel_client() as c:
        c.execute_command("SENTINEL", "FAILOVER", groups.services[0])
    assert groups.master_address(0) == (r.host, r.port)
    with r.client() as c:
        assert not c.exists(key)  # the promoted replica never got A's lock
        c.config_set("masteruser", "")
        c.config_set("masterauth", "")
    # The Sentinels make M R's replica; its resync drops A's key.
    deadline = time.monotonic() + 60
    info: dict[str, object] = {}
    while True:
        # The Sentinels close M's client connections as they reconfigure it.
        with contextlib.suppress(redis.ConnectionError), m.client(decode_responses=True) as c:
            info = c.info("replication")
            if info["role"] == "slave" and info["master_link_status"] == "up":
                assert not c.exists(key)
                break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)  # nothing announces the end of a resync: polled
    assert groups.failover(0) == (m.host, m.port)
    with m.client(decode_responses=True) as c:
        assert not c.exists(key)
        assert c.hget(f"{prefix}:node", "run_id") == c.info("server")["run_id"]
        # The Sentinels closed M's client connections when they reconfigured it.
        assert c.client_list(client_id=[idle_id]) == []
    idle.disconnect()
    b = make_redlock(groups.urls, key_prefix=prefix, **opts)
    grants: list[tuple[float, bool]] = []  # (when, whether A still held it)
    # The Sentinels' reconfiguration of M (each REPLICAOF) closes its clients' connections
    # (CLIENT KILL TYPE normal): C's next attempt shakes hands anew and reads the new id.
    for rl in (b, c_rl, b, c_rl):
        attempt = rl.lock("ledger", ttl=2.0)
        if attempt.acquire(blocking=False):
            grants.append((time.monotonic() - held_from, lock.held))
            attempt.release()
    health = b.health()
    a_held = lock.held
    # Group 0 lost A's lock in M's resync, and A's release, on a connection opened at the
    # failback's epoch, hears so: 2 of 3 nodes no longer hold it.
    with pytest.raises(LockNotOwned, match="no longer ours on 2 of 3"):
        lock.release()
    assert a_held
    assert [g for g in grants if g[1]] == [], f"double grants: {grants}"
    assert health[0].status == "guarded" and health[0].guarded_for > 100, health[0]


def _role(server) -> str:
    with server.client(socket_timeout=5, decode_responses=True) as c:
        return c.info("replication")["role"]


def test_a_deposed_master_named_master_again_sits_out(own_groups, make_redlock):
    """Group 0's master A is frozen until the Sentinels promote its replica B, and resumed:
    it is still a master (the Sentinels reconfigure a returning master only seconds later).
    B votes (an operator trusted the cluster while nothing was held) and a holder takes the
    lock on a bare quorum, B and group 1. Then B is frozen until the Sentinels name A master
    again: no REPLICAOF NO ONE changes anything on A (same run id, same replication id, its
    own marker), but A missed the holder's lease. In the history of the holder and three
    clients contending while it holds, no two holds overlap, and A sits out its guard (the
    Sentinels' failover epoch it was armed at is older than the one that named it now)."""
    groups = own_groups
    prefix = _prefix()
    # The holder's lease outlasts the switch back on a loaded machine, which takes seconds.
    opts = _options(ttl=30.0, max_ttl=30.0)
    holder_rl = make_redlock(groups.urls, key_prefix=prefix, **opts)
    clients = [make_redlock(groups.urls, key_prefix=prefix, **opts) for _ in range(3)]
    for rl in (holder_rl, *clients):
        warm = rl.lock("warm-up")
        assert warm.acquire(blocking=False)
        warm.release()
    a, b = groups.master(0), groups.replica(0)
    with a.client() as c:
        assert c.wait(1, 5000) == 1  # B holds A's marker
        a_run_id = c.info("server")["run_id"]
        a_replid = c.info("replication")["master_replid"]
        a_marker = c.hgetall(f"{prefix}:node")
    with groups.switch(0):
        a.pause()
    a.resume()
    assert groups.master_address(0) == (b.host, b.port)
    assert _role(a) == "master"  # deposed, not yet told
    assert holder_rl.trust_cluster() == 3  # nothing is held: B may vote at once
    key = f"{prefix}:lock:ledger"
    other = groups.master(2)
    with other.client() as c:  # the holder's hold is a bare quorum: B and group 1
        c.set(key, "foreign 0 0 0 60000\n{}", px=60_000)
    held = holder_rl.lock("ledger")
    assert held.acquire(blocking=False)
    holds: list[tuple[float, float, str]] = [
        (time.monotonic(), time.monotonic() + held.validity, "holder")
    ]
    with other.client() as c:
        c.delete(key)
    try:
        with groups.switch(0):
            b.pause()
        assert groups.master_address(0) == (a.host, a.port)
        with a.client(decode_responses=False) as c:
            # Named master again without a trace: the guard's other signs see nothing.
            assert c.info("server")["run_id"] == a_run_id
            assert c.info("replication")["master_replid"] == a_replid
            assert c.hgetall(f"{prefix}:node") == a_marker
            assert c.exists(key) == 0  # A missed the holder's lease
        stop_at = time.monotonic() + 3.0
        assert stop_at < holds[0][1]  # the contention falls inside the holder's lease
        attempts = [0]
        errors: list[BaseException] = []

        def contend(rl: Redlock, who: str) -> None:
            try:
                while time.monotonic() < stop_at:
                    lock = rl.lock("ledger", ttl=1.0)
                    attempts[0] += 1
                    try:
                        taken = lock.acquire(blocking=False)
                    except QuorumError:
                        taken = False
                    if not taken:
                        time.sleep(0.05)
                        continue
                    start = time.monotonic()
                    valid_until = start + lock.validity
                    time.sleep(0.002)
                    holds.append((start, min(time.monotonic(), valid_until), who))
                    with contextlib.suppress(Exception):  # lost after the hold: still checked
                        lock.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=contend, args=(rl, f"client{i}"))
            for i, rl in enumerate(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        health = clients[0].health()
    finally:
        b.resume()
    assert not errors, errors
    assert attempts[0] >= 3
    ordered = sorted(holds)
    overlaps = [(x, y) for x, y in itertools.pairwise(ordered) if y[0] < x[1]]
    assert overlaps == [], overlaps
    # A was armed anew when the failover named it: it sits out max_ttl + GUARD_MARGIN.
    assert health[0].master == f"{a.host}:{a.port}"
    assert health[0].status == "guarded", health[0]
    # Armed at the first attempt after the switch, 3 s ago: its guard (35 s) has long to run.
    assert health[0].guarded_for > 20.0, health[0]


def test_history_of_holders_across_failovers(groups, make_redlock):
    """Four clients take one lock in turn while every group fails over; no two holds
    overlap, and every client keeps taking it after each failover. The deposed masters go
    on taking writes for about ten seconds after each switch (until the Sentinels
    reconfigure them): a client that kept using its pooled connections to one would count
    it beside the promoted replica, and two clients would hold the lock at once."""
    prefix = _prefix()
    opts = _options(ttl=1.0, max_ttl=4.0)
    clients = [make_redlock(groups.urls, key_prefix=prefix, **opts) for _ in range(4)]
    holds: list[tuple[float, float, int]] = []  # (start, end, phase)
    phase = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def work(rl: Redlock) -> None:
        try:
            while not stop.is_set():
                lock = rl.lock("history")
                if not lock.acquire(timeout=1.0):
                    continue
                start, at = time.monotonic(), phase[0]
                valid_until = start + lock.validity
                stop.wait(0.002)
                end = min(time.monotonic(), valid_until)
                holds.append((start, end, at))
                with contextlib.suppress(Exception):  # lost after the hold: still checked
                    lock.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(rl,)) for rl in clients]
    for t in threads:
        t.start()
    try:
        for index in range(3):
            groups.failover(index)
            phase[0] += 1
            # The promoted replica's guard passes, so the next failover leaves a quorum.
            deadline = time.monotonic() + 60
            while not any(p == phase[0] for _, _, p in holds):
                assert time.monotonic() < deadline, f"no hold after failover {index}"
                time.sleep(0.05)
            time.sleep(clients[0].guard_period)
        deadline = time.monotonic() + 60
        while len([h for h in holds if h[2] == 3]) < 20:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    ordered = sorted(holds)
    overlaps = sum(1 for x, y in itertools.pairwise(ordered) if y[0] < x[1])
    assert overlaps == 0
    assert len(holds) >= 40 and {p for _, _, p in holds} == {0, 1, 2, 3}
    health = clients[0].health()
    assert [h.master for h in health] == [
        "{}:{}".format(*groups.master_address(i)) for i in range(3)
    ]


def test_async_client_follows_a_failover(groups, make_redlock):
    prefix = _prefix()

    async def scenario():
        rl = AsyncRedlock(groups.urls, key_prefix=prefix, **_options(max_ttl=30.0))
        try:
            lock = rl.lock("async-job", ttl=20.0)
            assert await lock.acquire(blocking=False)
            new = await asyncio.to_thread(groups.failover, 1)
            other = rl.lock("async-job")
            assert not await other.acquire(blocking=False)
            health = await rl.health()
            assert health[1].master == f"{new[0]}:{new[1]}" and health[1].status == "guarded"
            await lock.release()
            assert await other.acquire(blocking=False)
            await other.release()
        finally:
            await rl.close()

    asyncio.run(scenario())


def test_with_every_sentinel_down_health_shows_the_master_it_votes_through(
    own_groups, make_redlock
):
    """A client that cannot reach any Sentinel goes on with the master it knows; health()
    (sync and async) shows each group so, reachable and voting, as the locks find it."""
    prefix = _prefix()
    rl = make_redlock(own_groups.urls, key_prefix=prefix, **_options())
    arl = AsyncRedlock(own_groups.urls, key_prefix=prefix, **_options())
    masters = [f"{h}:{p}" for h, p in map(own_groups.master_address, range(3))]

    async def async_health():
        return await arl.health()

    try:
        warm_up(rl)
        assert [h.master for h in asyncio.run(async_health())] == masters
        for sentinel in own_groups.sentinels:
            sentinel.kill()
        lock = rl.lock("sentinels-down", ttl=3.0)
        assert lock.acquire(blocking=False)
        for health in (rl.health(), asyncio.run(async_health())):
            assert [h.master for h in health] == masters
            assert all(h.reachable and h.voting for h in health), health
        lock.release()
    finally:
        asyncio.run(arl.close())


def test_a_group_with_a_password(make_redlock):
    """The URL's password is the master's (the Sentinels here have none)."""
    groups = _start(password="s3cret")
    try:
        rl = make_redlock(groups.urls, key_prefix=_prefix(), **_options())
        lock = rl.lock("secret-job")
        assert lock.acquire(blocking=False)
        assert all(h.reachable and h.voting for h in rl.health())
        lock.release()
        wrong = [u.replace("s3cret", "wrong") for u in groups.urls]
        bad = make_redlock(wrong, key_prefix=_prefix(), **_options())
        health = bad.health()[0]
        assert not health.reachable and "s3cret" not in str(health)
        assert health.master == "{}:{}".format(*groups.master_address(0))
    finally:
        groups.stop()


# -- the views ---------------------------------------------------------------------------------


@pytest.fixture
def group_settings(settings, groups):
    settings.REDLOCK = {
        "NODES": groups.urls,
        "KEY_PREFIX": _prefix(),
        "NODE_TIMEOUT": 0.5,
        "TTL": 10.0,
    }
    yield settings.REDLOCK
    from django_redlock.conf import reset

    reset()


def test_cli_check_shows_each_groups_master(group_settings, groups):
    assert check_reachable() == []  # the deploy check's probe finds each group's master
    out = StringIO()
    call_command("redlock", "check", stdout=out)
    text = out.getvalue()
    for i in range(3):
        host, port = groups.master_address(i)
        assert f"{redact(groups.url(i))} (master {host}:{port})" in text


@pytest.mark.django_db
def test_admin_pages_show_each_groups_master(group_settings, groups, admin_client):
    from django_redlock import get_redlock

    lock = get_redlock().lock("admin:seen", ttl=10.0)
    assert lock.acquire(blocking=False)
    try:
        masters = ["{}:{}".format(*groups.master_address(i)) for i in range(3)]
        html = admin_client.get("/admin/django_redlock/lock/nodes/").content.decode()
        assert all(f"master {m}" in html for m in masters)
        html = admin_client.get("/admin/django_redlock/lock/").content.decode()
        assert all(f"(master {m})" in html for m in masters)
        detail = admin_client.get("/admin/django_redlock/lock/detail/?name=admin:seen")
        assert all(f"master {m}" in detail.content.decode() for m in masters)
        probes.forget()  # a probe of another test's nodes may be cached
        ready = admin_client.get("/redlock/ready/").json()
        assert [n["master"] for n in ready["nodes"]] == masters
    finally:
        lock.release()
