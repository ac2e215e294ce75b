"""The database lock backend on SQLite, PostgreSQL and MariaDB/MySQL.

The cases live in tests/backends/database_cases.py; each database gets a pytest subprocess of
its own with tests/backends/db_settings.py (a file SQLite database, so that the contention
test's child processes share it; a test database of our own name on the servers).
Servers: PostgreSQL at ``REDLOCK_PG_HOST`` (user postgres, db test) and MariaDB at
``REDLOCK_MYSQL_HOST`` (root, no password, db test), both default 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.backends import databases
from tests.backends.cases import dead_pid
from tests.helpers import REPO_ROOT, database_unreachable, run_pytest, wait_until


def child_env(kind: str, tmp_path: Path) -> dict[str, str]:
    """The environment of a child pytest on ``kind`` with tests/backends/db_settings.py."""
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # The cases that do not apply to this database skip by design; the exact pass count
    # below is what catches a case that should have run and did not.
    env.pop("REDLOCK_REQUIRE_ALL", None)
    env.pop("REDLOCK_BACKEND_TEST_DB", None)  # named after the child's pid (databases.py)
    env["REDLOCK_BACKEND_DB"] = kind
    if kind == "sqlite":
        env["REDLOCK_BACKEND_DB_NAME"] = str(tmp_path / "locks.sqlite3")
    return env


#: How long a child run may take; this test's own timeout is longer, so the child's end is
#: reported by run_pytest, not by a pytest-timeout that would leave the child running.
RUN_TIMEOUT = 600

#: The kind of database each child run test of this module is for.
_KIND_OF = {"test_database_backend_on_sqlite": "sqlite"}


@pytest.fixture(scope="module")
def child_runs(request, tmp_path_factory) -> Iterator[dict[str, Future[tuple[int, str]]]]:
    """The child runs of the selected databases, started together: each spends most of its
    time waiting (for its processes, leases, servers), so three at once take about as long as
    the longest, not the sum."""
    kinds = set()
    for item in request.session.items:
        if item.module is request.module and item.originalname in _KIND_OF:
            kinds.add(_KIND_OF[item.originalname])
        elif (
            item.module is request.module
            and item.originalname == "test_database_backend_on_a_server"
        ):
            kinds.add(item.callspec.params["kind"])
    reachable = [k for k in sorted(kinds) if k == "sqlite" or not database_unreachable(k)]
    args = ["tests/backends/database_cases.py", "--ds", "tests.backends.db_settings"]
    with ThreadPoolExecutor(max_workers=max(1, len(reachable))) as pool:
        runs = {
            kind: pool.submit(
                run_pytest, args, child_env(kind, tmp_path_factory.mktemp(kind)), RUN_TIMEOUT
            )
            for kind in reachable
        }
        try:
            yield runs
        finally:
            for run in runs.values():
                run.exception()  # wait for every child before sweeping
            # A child killed with this run (its timeout, Ctrl-C) ran no teardown: its test
            # database goes now (its reaper drops it too; whichever comes first).
            for kind in runs:
                if kind != "sqlite":
                    databases.sweep(kind)


def _run_cases(kind: str, runs: dict[str, Future[tuple[int, str]]], expect: int) -> None:
    reason = None if kind == "sqlite" else database_unreachable(kind)
    if reason:
        pytest.skip(reason)
    code, output = runs[kind].result()
    assert code == 0, output[-6000:]
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) == expect, output[-2000:]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_database_backend_on_sqlite(child_runs) -> None:
    # The pessimistic, NOTIFY and dropped-connection cases skip.
    _run_cases("sqlite", child_runs, expect=27)


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        pytest.param("postgres", 52, marks=pytest.mark.postgres),
        pytest.param("mysql", 51, marks=pytest.mark.mysql),
    ],
)
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_database_backend_on_a_server(kind: str, expect: int, child_runs) -> None:
    _run_cases(kind, child_runs, expect)


SERVERS = [
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]


def _server(kind: str) -> None:
    reason = database_unreachable(kind)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("kind", SERVERS)
# The timeout's ending runs with every suite; a killed and an interrupted run (each a run of
# pytest started and stopped) with the fault scenarios.
@pytest.mark.parametrize(
    "ending",
    [
        "pytest-timeout",
        pytest.param("SIGKILL", marks=pytest.mark.faults),
        pytest.param("Ctrl-C", marks=pytest.mark.faults),
    ],
)
def test_a_run_that_is_killed_leaves_no_test_database(kind: str, ending: str, tmp_path) -> None:
    """A database test killed by pytest-timeout (its thread method ends the process with
    os._exit, no teardown), by SIGKILL or by Ctrl-C leaves no test database behind (two
    such runs left test_redlock_backends_<pid> databases on the servers)."""
    _server(kind)
    report = tmp_path / "database"
    env = {**child_env(kind, tmp_path), "REDLOCK_HANG_REPORT": str(report)}
    args = [sys.executable, "-m", "pytest", "tests/backends/hanging_case.py", "-q"]
    args += ["--ds", "tests.backends.db_settings", "-p", "no:cacheprovider", "-n", "0"]
    if ending == "pytest-timeout":  # the test itself times out, its fixtures' setup does not
        args += ["--timeout", "2", "-o", "timeout_method=thread", "-o", "timeout_func_only=true"]
    else:
        args += ["--timeout", "0"]
    child = subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(report.exists, timeout=60, interval=0.05)
        name = wait_until(report.read_text, timeout=5)
        assert name in databases.ours(kind), "the test database should exist while it runs"
        if ending == "SIGKILL":
            child.kill()
        elif ending == "Ctrl-C":
            child.send_signal(signal.SIGINT)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wait_until(lambda: name not in databases.ours(kind), timeout=30, interval=0.1)


@pytest.mark.parametrize("kind", SERVERS)
def test_the_sweep_drops_only_databases_whose_creator_is_gone(kind: str) -> None:
    """A run's sweep drops the test databases of this host's naming whose creator is not
    running, and leaves alone a running creator's, another host's, and any other name."""
    _server(kind)
    # A running creator of its own: this process may hold a test database of its own name
    # (another file's, run before this one by the same pytest or xdist worker).
    creator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    gone, alive = databases.database_name(dead_pid()), databases.database_name(creator.pid)
    elsewhere = f"{databases.PREFIX}{'0' if databases.host_tag()[0] != '0' else '1'}"
    elsewhere += f"{databases.host_tag()[1:]}_{dead_pid()}"
    names = [gone, alive, elsewhere]
    try:
        for name in names:
            databases.create(kind, name)
        assert set(names) <= set(databases.ours(kind))
        dropped = databases.sweep(kind)
        assert gone in dropped and alive not in dropped and elsewhere not in dropped
        left = databases.ours(kind)
        assert gone not in left and alive in left and elsewhere in left
    finally:
        for name in names:
            databases.drop(kind, name)
        creator.kill()
        creator.wait()
    assert not set(names) & set(databases.ours(kind))
