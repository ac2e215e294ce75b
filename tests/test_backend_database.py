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
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

PG_HOST = os.environ.get("REDLOCK_PG_HOST", "127.0.0.1")
MYSQL_HOST = os.environ.get("REDLOCK_MYSQL_HOST", "127.0.0.1")


def _unreachable(kind: str) -> str | None:
    """Why the server cannot be used, or None when it can."""
    try:
        if kind == "postgres":
            import psycopg

            psycopg.connect(host=PG_HOST, user="postgres", dbname="test", connect_timeout=3).close()
        else:
            import pymysql

            pymysql.connect(
                host=MYSQL_HOST, user="root", database="test", connect_timeout=3
            ).close()
    except ImportError as exc:
        return f"no driver for {kind}: {exc}"
    except Exception as exc:
        return f"{kind} at {PG_HOST if kind == 'postgres' else MYSQL_HOST} is not reachable: {exc}"
    return None


def _run_cases(kind: str, tmp_path: Path, expect: int) -> None:
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # The cases that do not apply to this database skip by design; the exact pass count
    # below is what catches a case that should have run and did not.
    env.pop("REDLOCK_REQUIRE_ALL", None)
    env["REDLOCK_BACKEND_DB"] = kind
    env["REDLOCK_BACKEND_TEST_DB"] = f"test_redlock_backends_{uuid.uuid4().hex[:10]}"
    if kind == "sqlite":
        env["REDLOCK_BACKEND_DB_NAME"] = str(tmp_path / "locks.sqlite3")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/backends/database_cases.py",
            "--ds",
            "tests.backends.db_settings",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) == expect, output[-2000:]


def test_database_backend_on_sqlite(tmp_path: Path) -> None:
    _run_cases("sqlite", tmp_path, expect=23)  # the 5 pessimistic cases and the NOTIFY one skip


@pytest.mark.postgres
def test_database_backend_on_postgres(tmp_path: Path) -> None:
    reason = _unreachable("postgres")
    if reason:
        pytest.skip(reason)
    _run_cases("postgres", tmp_path, expect=29)


@pytest.mark.mysql
def test_database_backend_on_mysql(tmp_path: Path) -> None:
    reason = _unreachable("mysql")
    if reason:
        pytest.skip(reason)
    _run_cases("mysql", tmp_path, expect=28)
