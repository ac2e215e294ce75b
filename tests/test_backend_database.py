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
import uuid
from pathlib import Path

import pytest

from tests.helpers import database_unreachable, run_pytest


def _run_cases(kind: str, tmp_path: Path, expect: int) -> None:
    reason = None if kind == "sqlite" else database_unreachable(kind)
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # The cases that do not apply to this database skip by design; the exact pass count
    # below is what catches a case that should have run and did not.
    env.pop("REDLOCK_REQUIRE_ALL", None)
    env["REDLOCK_BACKEND_DB"] = kind
    env["REDLOCK_BACKEND_TEST_DB"] = f"test_redlock_backends_{uuid.uuid4().hex[:10]}"
    if kind == "sqlite":
        env["REDLOCK_BACKEND_DB_NAME"] = str(tmp_path / "locks.sqlite3")
    code, output = run_pytest(
        ["tests/backends/database_cases.py", "--ds", "tests.backends.db_settings"], env, 600
    )
    assert code == 0, output[-6000:]
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) == expect, output[-2000:]


def test_database_backend_on_sqlite(tmp_path: Path) -> None:
    # The pessimistic, NOTIFY and dropped-connection cases skip.
    _run_cases("sqlite", tmp_path, expect=24)


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        pytest.param("postgres", 39, marks=pytest.mark.postgres),
        pytest.param("mysql", 38, marks=pytest.mark.mysql),
    ],
)
def test_database_backend_on_a_server(kind: str, expect: int, tmp_path: Path) -> None:
    _run_cases(kind, tmp_path, expect)
