"""``manage.py redlock list|release|check`` via call_command and as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import get_redlock
from django_redlock.signals import lock_force_released

REPO = Path(__file__).resolve().parent.parent


def run(*args):
    out = StringIO()
    call_command("redlock", *args, stdout=out)
    return out.getvalue()


def hold(name, **kwargs):
    lock = get_redlock().lock(name, 10, owner=("other", name), **kwargs)
    assert lock.acquire(blocking=False)
    return lock


@pytest.mark.usefixtures("redlock_settings")
class TestList:
    def test_empty(self):
        assert "No live locks" in run("list")

    def test_table_and_pattern(self):
        hold("order:1", meta={"view": "shop.views.pay", "method": "POST", "path": "/pay/1",
                              "user": 7})
        hold("report:x")
        out = run("list")
        assert "order:1" in out and "report:x" in out and "2 lock(s)" in out
        assert "POST /pay/1" in out and "user 7" in out and "3/3" in out
        only = run("list", "--pattern", "order:*")
        assert "order:1" in only and "report:x" not in only

    def test_json(self):
        hold("order:2", fencing=True)
        data = json.loads(run("list", "--json"))
        assert len(data) == 1
        (item,) = data
        assert item["name"] == "order:2" and item["nodes"] == 3 and item["quorum"] == 2
        assert item["fence"] and 0 < item["ttl"] <= 10 and not item["split"]
        assert item["meta"]["pid"] == os.getpid()

    def test_stuck_flag(self, settings, redlock_settings):
        settings.REDLOCK = {**redlock_settings, "STUCK_AFTER": 0.001}
        hold("old")
        assert "stuck" in run("list")
        assert json.loads(run("list", "--json"))[0]["stuck"] is True


@pytest.mark.usefixtures("redlock_settings")
class TestRelease:
    def test_refuses_without_force_and_explains(self):
        hold("order:3")
        with pytest.raises(CommandError) as info:
            run("release", "order:3")
        assert info.value.returncode == 3
        assert "--force" in str(info.value) and "held by" in str(info.value)
        assert get_redlock().locked("order:3")

    def test_not_held(self):
        with pytest.raises(CommandError) as info:
            run("release", "nothing")
        assert info.value.returncode == 1

    def test_force(self):
        hold("order:4")
        sent = []
        lock_force_released.connect(lambda **kw: sent.append(kw["name"]), weak=False)
        try:
            out = run("release", "order:4", "--force")
        finally:
            lock_force_released.receivers.clear()
        assert "Released 'order:4' on 3 of 3 node(s)" in out
        assert not get_redlock().locked("order:4")
        assert sent == ["order:4"]

    def test_force_nothing_there(self):
        with pytest.raises(CommandError) as info:
            run("release", "ghost", "--force")
        assert info.value.returncode == 1


class TestCheck:
    def test_healthy(self, redlock_settings, redis_nodes):
        out = run("check")
        assert "OK: 3/3 nodes reachable, 3 voting, quorum 2" in out
        for node in redis_nodes:
            assert f"127.0.0.1:{node.port}" in out
        assert out.count("ready") + out.count("fresh (trusted at first lock)") == 3
        assert re.search(r"\s\d+\.\d+\.\d+\s", out)  # server version

    def test_json(self, redlock_settings):
        data = json.loads(run("check", "--json"))
        assert data["status"] == "ok" and data["reachable"] == 3
        assert all(n["reachable"] and n["version"] for n in data["nodes"])
        assert data["clock_spread"] >= 0

    def test_fresh_cluster_is_trusted_at_first_lock(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        out = run("check")
        assert out.count("fresh (trusted at first lock)") == 3 and "OK: 3/3" in out
        with get_redlock().lock("first"):
            pass
        assert run("check").count("ready") == 3

    def test_restarted_node_is_guarded(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        with get_redlock().lock("first"):
            pass
        cluster[2].restart(empty=True)
        out = StringIO()
        with pytest.raises(CommandError) as info:
            call_command("redlock", "check", stdout=out)
        assert info.value.returncode == 1
        assert "guarded" in out.getvalue() and "DEGRADED: 3/3 nodes reachable, 2 voting" in (
            out.getvalue())

    def test_one_down_is_degraded(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        with get_redlock().lock("first"):  # mark the nodes as in use
            pass
        cluster[0].kill()
        out = StringIO()
        with pytest.raises(CommandError) as info:
            call_command("redlock", "check", stdout=out)
        assert info.value.returncode == 1
        assert "DEGRADED: 2/3" in out.getvalue()

    def test_quorum_down_is_critical(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        cluster[0].kill()
        cluster[1].kill()
        with pytest.raises(CommandError) as info:
            run("check")
        assert info.value.returncode == 2
        assert "CRITICAL: 1/3" in str(info.value)


def manage(*args, nodes):
    env = {**os.environ, "REDLOCK_NODES": ",".join(nodes), "PYTHONPATH": str(REPO),
           "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    return subprocess.run([sys.executable, "-m", "django", "redlock", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_exit_codes_of_the_real_process(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    assert manage("check", nodes=cluster.urls).returncode == 0
    assert manage("release", "none", nodes=cluster.urls).returncode == 1
    from django_redlock import Redlock

    redlock = Redlock(cluster.urls)
    with redlock.lock("first"):  # mark the nodes as in use
        pass
    redlock.close()
    cluster[0].kill()
    assert manage("check", nodes=cluster.urls).returncode == 1
    cluster[1].kill()
    result = manage("check", nodes=cluster.urls)
    assert result.returncode == 2 and "CRITICAL" in result.stderr
    assert manage("bogus", nodes=cluster.urls).returncode == 2  # argparse usage error
