"""Trusting a cluster by hand: a brand-new cluster with one node down waits
``max_ttl`` before any lock, because no node can vouch that nothing was held. The error says so,
and ``Redlock.trust_cluster()`` / ``manage.py redlock trust`` let the reachable nodes vote at
once after checking that no lock is held. Real nodes throughout."""

from __future__ import annotations

import asyncio
import threading
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import AsyncRedlock, QuorumError
from django_redlock.core import TrustRefused
from tests.helpers import node_client, settled_tokens


@pytest.fixture
def new_cluster_one_down(redis_cluster_factory):
    """Three brand-new nodes, the last one down."""
    cluster = redis_cluster_factory(3)
    cluster[2].stop()
    return cluster


def _markers(cluster) -> list[dict[bytes, bytes]]:
    found = []
    for node in cluster.nodes[:2]:
        with node_client(node) as c:
            found.append(c.hgetall("redlock:node"))
    return found


def test_new_cluster_with_a_node_down_says_why_and_trust_lets_it_vote(
    new_cluster_one_down, make_redlock
) -> None:
    cluster = new_cluster_one_down
    rl = make_redlock(cluster.urls, node_timeout=0.1)
    lock = rl.lock("trust:me")
    with pytest.raises(QuorumError) as info:
        lock.acquire(blocking=False)
    assert "no node can vouch that nothing was held" in str(info.value)
    assert "redlock trust" in str(info.value)
    assert rl.trust_cluster() == 2  # the reachable nodes
    assert all(m[b"trusted"] != b"0" for m in _markers(cluster))
    assert lock.acquire(blocking=False)
    assert settled_tokens(cluster.nodes[:2], "trust:me") == [lock.token] * 2
    lock.release()


def test_trust_is_refused_while_a_lock_is_held(redis_cluster_factory, make_redlock) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster.urls, node_timeout=0.1)
    lock = rl.lock("trust:held", ttl=10)
    assert lock.acquire(blocking=False)
    with node_client(cluster[0]) as c:
        c.flushall()  # node 0 is now guarded (its data is gone)
    before = _markers(cluster)
    with pytest.raises(TrustRefused, match="trust:held"):
        rl.trust_cluster()
    assert _markers(cluster) == before  # nothing armed
    lock.release()


def test_trust_cluster_async(new_cluster_one_down) -> None:
    cluster = new_cluster_one_down

    async def main() -> None:
        rl = AsyncRedlock(cluster.urls, node_timeout=0.1)
        try:
            lock = rl.lock("trust:async")
            with pytest.raises(QuorumError, match="vouch"):
                await lock.acquire(blocking=False)
            assert await rl.trust_cluster() == 2
            assert await lock.acquire(blocking=False)
            await lock.release()
        finally:
            await rl.close()

    asyncio.run(main())


@pytest.fixture
def trust_settings(settings, new_cluster_one_down):
    settings.REDLOCK = {"NODES": list(new_cluster_one_down.urls), "NODE_TIMEOUT": 0.1}
    yield new_cluster_one_down
    from django_redlock.conf import reset

    reset()


def _call(*args: str) -> str:
    out = StringIO()
    call_command("redlock", *args, stdout=out)
    return out.getvalue()


def test_manage_redlock_trust_yes(trust_settings) -> None:
    from django_redlock import get_redlock

    with pytest.raises(QuorumError):
        get_redlock().lock("trust:cmd").acquire(blocking=False)
    assert "Trusted 2 of 3 node(s)" in _call("trust", "--yes")
    lock = get_redlock().lock("trust:cmd")
    assert lock.acquire(blocking=False)
    lock.release()


def test_manage_redlock_trust_asks_first(trust_settings, monkeypatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "n")
    with pytest.raises(CommandError, match="Not confirmed") as info:
        _call("trust")
    assert info.value.returncode == 3
    assert "no lock is held" in asked[0]
    assert all(b"trusted" not in m or m[b"trusted"] == b"0" for m in _markers(trust_settings))
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert "Trusted 2 of 3" in _call("trust")


def test_manage_redlock_trust_without_a_terminal_is_refused_not_a_traceback(
    trust_settings, monkeypatch
) -> None:
    def closed_stdin(prompt: str) -> str:
        raise EOFError  # what input() does when stdin is /dev/null or closed

    monkeypatch.setattr("builtins.input", closed_stdin)
    with pytest.raises(CommandError, match="--yes") as info:
        _call("trust")
    assert info.value.returncode == 3
    assert all(b"trusted" not in m or m[b"trusted"] == b"0" for m in _markers(trust_settings))


def test_manage_redlock_trust_refuses_while_a_lock_is_held(trust_settings) -> None:
    from django_redlock import get_redlock

    _call("trust", "--yes")
    lock = get_redlock().lock("trust:busy", ttl=10)
    assert lock.acquire(blocking=False)
    with pytest.raises(CommandError, match="trust:busy") as info:
        _call("trust", "--yes")
    assert info.value.returncode == 3
    lock.release()


def test_manage_redlock_trust_without_a_restart_guard_is_a_usage_error(
    settings, redis_cluster_factory
) -> None:
    """Trust is the restart guard's: on a service without one it is a usage error (exit 2),
    and nothing is written on the nodes."""
    from django_redlock.conf import reset

    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": list(cluster.urls), "RESTART_GUARD": False}
    try:
        with pytest.raises(CommandError, match="no restart guard") as info:
            _call("trust", "--yes")
        assert info.value.returncode == 2
        assert _markers(cluster) == [{}, {}]
    finally:
        reset()


def test_check_command_and_health_agree_on_a_new_cluster(settings, redis_cluster_factory) -> None:
    """``redlock check`` and the admin page (``health()``) use the core's
    one judgement: a brand-new cluster's nodes vote (trusted at the first lock)."""
    import json

    from django_redlock import get_redlock
    from django_redlock.conf import reset

    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": list(cluster.urls), "NODE_TIMEOUT": 0.5}
    try:
        report = json.loads(_call("check", "--json"))
        assert report["voting"] == 3 and report["fresh_cluster"] is True
        assert [h.status for h in get_redlock().health()] == ["voting"] * 3
    finally:
        reset()


def test_a_late_trust_does_not_trust_a_node_flushed_since(
    redis_cluster_factory, make_redlock
) -> None:
    """A client saw a brand-new cluster and was delayed before its TRUST went out (a process
    pause, a slow link). Meanwhile the cluster was trusted by another client, a lock was taken
    on a bare quorum {A, B}, and A was flushed and re-armed (guarded again). The late TRUST
    must not make A vote: it trusts only the marker the attempt saw fresh, not whatever
    marker A has now (a FLUSHALL keeps the server's run id)."""
    cluster = redis_cluster_factory(3)
    a, _, c = cluster.nodes
    late, holder, other = (make_redlock(cluster, ttl=10, max_ttl=10) for _ in range(3))
    at_trust, go = threading.Event(), threading.Event()
    build_trust = late.keys.trust_command

    def delayed(*args):
        at_trust.set()
        go.wait(10)
        return build_trust(*args)

    late.keys.trust_command = delayed  # type: ignore[method-assign]
    outcome: list[object] = []

    def take() -> None:
        try:
            outcome.append(late.lock("k").acquire(blocking=False))
        except QuorumError as exc:
            outcome.append(exc)

    t = threading.Thread(target=take)
    t.start()
    assert at_trust.wait(5), "the late client never saw a brand-new cluster"
    with holder.lock("warm-up"):  # trusts the new cluster itself
        pass
    c.pause()
    try:
        held = holder.lock("k", ttl=10)
        assert held.acquire(blocking=False)  # on A and B only
    finally:
        c.resume()
    a.flush()
    with other.lock("other"):  # on B and C; A's marker is armed again (guarded, fresh)
        pass
    with node_client(a) as client:
        assert client.hget("redlock:node", "fresh") == b"1"
    go.set()
    t.join(10)
    # Refused while the holder's lease still runs (A lost its copy: the holder keeps only B,
    # a bare-quorum limit the guard cannot fix, but nobody else may get the lock either).
    assert outcome == [False], "a late TRUST made a flushed node vote: double grant"
    assert held.validity > 0
