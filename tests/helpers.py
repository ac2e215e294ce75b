"""Shared helpers of the core test files (tests/test_core_*.py).

Everything here reads the real redis-server processes directly (redis-py clients opened on the
nodes' ports), so an assertion about "what is on the nodes" never goes through the code under
test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from django_redlock.core.base import glob_escape
from django_redlock.core.commands import lock_fields, lock_value
from django_redlock.testing import RedisCluster, RedisNode
from testproject.databases import server_database

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFIX = "redlock"


def node_client(node: RedisNode) -> redis.Redis:
    """A raw client on one node with a socket timeout, so a mistake never hangs a test."""
    return node.client(socket_timeout=5, socket_connect_timeout=5)


def release_listeners(node: RedisNode, channel: str) -> int:
    """Subscriptions on ``node`` waiting for a lock's releases: to its release channel
    (``channel``), or to a waiter's own (``channel``, ``:``, the waiter's id), where a release
    wakes one waiter by name."""
    with node_client(node) as client:
        names = [channel.encode(), *client.pubsub_channels(glob_escape(channel) + ":*")]
        return sum(int(n) for _, n in client.pubsub_numsub(*names))


def lock_keys(nodes: Iterable[RedisNode], prefix: str = PREFIX) -> list[dict[str, tuple[int, str]]]:
    """Per node: ``{lock key: (pttl ms, token)}`` for every ``<prefix>:lock:*`` key."""
    found: list[dict[str, tuple[int, str]]] = []
    for node in nodes:
        with node_client(node) as c:
            keys: dict[str, tuple[int, str]] = {}
            for raw in c.keys(f"{prefix}:lock:*"):
                value = c.get(raw)
                keys[raw.decode()] = (c.pttl(raw), lock_fields(value)["token"] if value else "")
            found.append(keys)
    return found


def _read_until_agreed(
    read: Callable[[], list[Any]], distinct: Callable[[list[Any]], set[Any]], within: float
) -> list[Any]:
    """``read()`` until the nodes' readings agree (``distinct`` of them has one member at
    most), or as they stand after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        found = read()
        if len(distinct(found)) <= 1 or time.monotonic() >= deadline:
            return found
        time.sleep(0.005)


def settled_lock_keys(
    nodes: Iterable[RedisNode], prefix: str = PREFIX, within: float = 2.0
) -> list[dict[str, tuple[int, str]]]:
    """:func:`lock_keys` once every node holds the same lock keys (or after ``within`` seconds,
    as they stand then): the last node may run a release's copy a moment after the release
    returned (see :func:`settled_tokens`)."""
    nodes = list(nodes)
    return _read_until_agreed(
        lambda: lock_keys(nodes, prefix), lambda found: {frozenset(keys) for keys in found}, within
    )


def all_keys(nodes: Iterable[RedisNode]) -> list[dict[str, int]]:
    """Per node: ``{key: pttl ms}`` for every key in db 0 (-1 = no expiry)."""
    found: list[dict[str, int]] = []
    for node in nodes:
        with node_client(node) as c:
            found.append({raw.decode(): c.pttl(raw) for raw in c.keys("*")})
    return found


def tokens_on_nodes(
    nodes: Iterable[RedisNode], name: str, prefix: str = PREFIX
) -> list[str | None]:
    """The token each node holds for lock ``name`` (None where the node has no such key)."""
    out: list[str | None] = []
    for node in nodes:
        with node_client(node) as c:
            raw = c.get(f"{prefix}:lock:{name}")
            out.append(lock_fields(raw)["token"] if raw is not None else None)
    return out


def settled_tokens(
    nodes: Iterable[RedisNode], name: str, prefix: str = PREFIX, within: float = 2.0
) -> list[str | None]:
    """:func:`tokens_on_nodes` once every node holds the same (or after ``within`` seconds, as
    they stand then).

    An acquire or a release returns once a quorum answered, and the last node may run its copy
    a moment later on a busy host; no event of the client marks that moment (the copy is on
    its way, not owed to the caller). A read right after the call can land in it, so an
    assertion about every node reads until the nodes agree. A node that never catches up still
    fails the assertion, with what it holds."""
    nodes = list(nodes)
    return _read_until_agreed(lambda: tokens_on_nodes(nodes, name, prefix), set, within)


def held_everywhere(nodes: Iterable[RedisNode], name: str, prefix: str = PREFIX) -> str:
    """Wait until every node holds lock ``name`` with one token, and return it: before a count
    of the nodes a later command finds it on (a force release), which would otherwise race the
    acquire's last copy."""
    tokens = settled_tokens(nodes, name, prefix)
    assert len(set(tokens)) == 1 and tokens[0] is not None, tokens
    return tokens[0]


def occupy(node: RedisNode, name: str, ms: int = 5000, token: str = "stale-lease") -> None:
    """Another holder's copy of lock ``name`` on one node, for ``ms`` milliseconds."""
    with node_client(node) as c:
        c.set(f"{PREFIX}:lock:{name}", lock_value(token, ttl_ms=ms), px=ms)


def vacate(node: RedisNode, name: str) -> None:
    with node_client(node) as c:
        c.delete(f"{PREFIX}:lock:{name}")


def pttls_on_nodes(nodes: Iterable[RedisNode], name: str, prefix: str = PREFIX) -> list[int]:
    out = []
    for node in nodes:
        with node_client(node) as c:
            out.append(c.pttl(f"{prefix}:lock:{name}"))
    return out


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.005) -> Any:
    """Poll ``predicate`` until it returns something truthy (a condition, not a sleep-as-sync:
    used only where no event exists to wait on). Returns the value or raises AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def warm_up(redlock: Any, name: str = "warm-up") -> None:
    """One acquire/release so every node holds its restart-guard marker and the client holds
    idle connections: faults injected afterwards hit a cluster that is in service, not a
    brand-new one (which the restart guard treats specially)."""
    lock = redlock.lock(name)
    assert lock.acquire(blocking=False), "warm-up acquire failed on a healthy cluster"
    lock.release()
    # An acquire and a release end once a quorum answered; this asks every node and waits for
    # all of them, so none is still working through the warm-up when a fault is injected.
    redlock.locked(name)


def commands_processed(nodes: Iterable[RedisNode]) -> list[int]:
    """``total_commands_processed`` of each node (the INFO call itself is not yet counted)."""
    out = []
    for node in nodes:
        out.append(int(node.info("stats")["total_commands_processed"]))
    return out


def run_python(
    code: str, timeout: float = 60, flags: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports django_redlock from this checkout
    (``flags``: the interpreter's, such as ``-X dev``)."""
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cluster_urls(cluster: RedisCluster) -> list[str]:
    return list(cluster.urls)


# ---- the database servers (PostgreSQL, MariaDB/MySQL) of the database tests -------------------


def database_unreachable(kind: str) -> str | None:
    """Why the ``kind`` ("postgres" or "mysql") server of testproject/databases.py cannot be
    used, or None when it can."""
    host = server_database(kind, "test")["HOST"]
    try:
        if kind == "postgres":
            import psycopg

            psycopg.connect(host=host, user="postgres", dbname="test", connect_timeout=3).close()
        else:
            import pymysql

            pymysql.connect(host=host, user="root", database="test", connect_timeout=3).close()
    except ImportError as exc:
        return f"no driver for {kind}: {exc}"
    except Exception as exc:
        return f"{kind} at {host} is not reachable: {exc}"
    return None


def run_pytest(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """pytest in a child process from the repository root (without the cache and the
    hypothesis plugin, which alone takes seconds to import), one test at a time (not three
    files at once, as setup.cfg's addopts ask): its exit code and its output."""
    plugins_off = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-n", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", *plugins_off],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr


def run_processes(target: Callable[..., None], args: list[tuple[Any, ...]]) -> list[Any]:
    """Start one spawned process per ``args`` entry, each calling ``target(*entry, gate,
    results)`` (``gate``: a barrier all of them pass at once, ``results``: a queue each puts one
    outcome on); returns the outcomes. Each outcome's last item is an error text or None."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    gate = ctx.Barrier(len(args))
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*entry, gate, results)) for entry in args]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [o[-1] for o in outcomes if o[-1]]
    assert not errors, errors[0]
    return outcomes


@contextlib.contextmanager
def held_by_someone_else(name: str, ttl: float = 10.0) -> Iterator[Any]:
    """The shared Redlock's lock ``name`` held by another owner for the block."""
    from django_redlock import get_redlock

    lock = get_redlock().lock(name, ttl, owner="someone-else")
    assert lock.acquire(blocking=False)
    try:
        yield lock
    finally:
        lock.release()


def script_calls(nodes: Iterable[RedisNode]) -> list[int]:
    """EVAL + EVALSHA calls each node has served (INFO commandstats)."""
    out = []
    for node in nodes:
        stats = node.info("commandstats")
        out.append(
            sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))
        )
    return out
