"""Test databases of ours on the PostgreSQL and MariaDB/MySQL servers, and their cleanup.

Every database a backend test creates on a server is named ``test_redlock_backends_<host
tag>_<pid>``: the process that created it (its pid, on the host with that tag). Three layers
make sure none outlives its run, however the run ends:

* the creator drops it when it is done (pytest-django's teardown, then :func:`drop` again in
  case that failed, e.g. on a connection still open);
* a **reaper** (a small process of its own, :func:`reap_on_exit`) is told the name before the
  database exists and drops it when the creator's pipe closes without a "done": a creator
  killed by pytest-timeout (``os._exit``), SIGKILL or Ctrl-C runs no teardown, but its pipe
  closes all the same;
* :func:`sweep` drops, at the start of a run, every database of this host's naming whose
  creator is no longer running (a reaper that was killed too, a machine that rebooted).

``python -m tests.backends.databases sweep postgres|mysql`` runs the sweep by hand.
Only the standard library and the database drivers are imported here: the reaper and the
sweep run without Django.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PREFIX = "test_redlock_backends_"
REPO_ROOT = Path(__file__).resolve().parents[2]


def host_tag() -> str:
    """Six hex digits naming this host: a pid only says who created a database on the host
    that created it (another machine may share the database server)."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def database_name(pid: int | None = None) -> str:
    return f"{PREFIX}{host_tag()}_{os.getpid() if pid is None else pid}"


def creator(name: str) -> tuple[str, int] | None:
    """(host tag, pid) of a database of our naming, or None for any other name."""
    match = re.fullmatch(rf"{PREFIX}([0-9a-f]{{6}})_(\d+)", name)
    return (match[1], int(match[2])) if match else None


def running(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _host(kind: str) -> str:
    variable = "REDLOCK_PG_HOST" if kind == "postgres" else "REDLOCK_MYSQL_HOST"
    return os.environ.get(variable, "127.0.0.1")


@contextlib.contextmanager
def server(kind: str) -> Iterator[Any]:
    """An autocommit cursor on the ``kind`` server, outside any test database."""
    if kind == "postgres":
        import psycopg

        with psycopg.connect(
            host=_host(kind), user="postgres", dbname="postgres", autocommit=True, connect_timeout=5
        ) as connection:
            yield connection.cursor()
    elif kind == "mysql":
        import pymysql

        connection = pymysql.connect(
            host=_host(kind), user="root", autocommit=True, connect_timeout=5
        )
        try:
            yield connection.cursor()
        finally:
            connection.close()
    else:
        raise ValueError(f"no database server of kind {kind!r}")


def ours(kind: str) -> list[str]:
    """Every database on the ``kind`` server whose name starts with our prefix."""
    with server(kind) as cursor:
        if kind == "postgres":
            cursor.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", [PREFIX + "%"])
        else:
            cursor.execute("SHOW DATABASES LIKE %s", [PREFIX + "%"])
        return sorted(str(row[0]) for row in cursor.fetchall())


def create(kind: str, name: str) -> None:
    with server(kind) as cursor:
        if kind == "postgres":
            cursor.execute(f'CREATE DATABASE "{name}"')
        else:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")


def drop(kind: str, name: str) -> None:
    """Drop database ``name`` if it exists, ending the sessions still connected to it (a
    killed run's lock connections may not have been noticed as closed yet)."""
    if not name.startswith(PREFIX):
        raise ValueError(f"not a test database of ours: {name!r}")
    with server(kind) as cursor:
        if kind == "postgres":
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        cursor.execute(
            "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()",
            [name],
        )
        for (session,) in cursor.fetchall():
            with contextlib.suppress(Exception):  # it may have ended meanwhile
                cursor.execute(f"KILL {int(session)}")
        cursor.execute("SET SESSION lock_wait_timeout = 30")
        cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")


def sweep(kind: str) -> list[str]:
    """Drop the databases of this host's naming whose creator is not running; their names."""
    dropped = []
    for name in ours(kind):
        made_by = creator(name)
        if made_by is None or made_by[0] != host_tag() or running(made_by[1]):
            continue
        with contextlib.suppress(Exception):  # another sweep may be dropping it right now
            drop(kind, name)
            dropped.append(name)
    return dropped


class Reaper:
    """The process that drops database ``name`` once this process's pipe to it closes,
    unless :meth:`done` told it the database was dropped already."""

    def __init__(self, kind: str, name: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.backends.databases", "reap", kind, name],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C aimed at the test run does not reach it
            close_fds=True,
        )

    def done(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):
            stdin.write(b"done\n")
            stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def reap_on_exit(kind: str, name: str) -> Reaper:
    return Reaper(kind, name)


@contextlib.contextmanager
def own_database(kind: str) -> Iterator[str]:
    """A database of our own on the ``kind`` server for the block (left-overs of dead runs
    swept first); dropped at the end, or by the reaper if this process dies first."""
    sweep(kind)
    name = database_name()
    reaper = reap_on_exit(kind, name)
    try:
        create(kind, name)
        yield name
    finally:
        try:
            drop(kind, name)
        finally:
            reaper.done()


def _reap(kind: str, name: str) -> None:
    told = sys.stdin.buffer.read()  # until the creator's end of the pipe closes
    if b"done" not in told:
        with contextlib.suppress(Exception):
            drop(kind, name)


def main(argv: list[str]) -> None:
    if argv[:1] == ["reap"] and len(argv) == 3:
        import signal

        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # outlive whatever ends the creator
        _reap(argv[1], argv[2])
    elif argv[:1] == ["sweep"] and len(argv) == 2:
        for name in sweep(argv[1]):
            print("dropped", name)
    else:
        raise SystemExit("usage: python -m tests.backends.databases sweep|reap KIND [NAME]")


if __name__ == "__main__":
    main(sys.argv[1:])
