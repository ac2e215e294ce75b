"""Every lock backend side by side, in one run: ``python bench/bench_backends.py``.

Backends: Redlock over 3 embedded Redis nodes (and over 1), the database backend on SQLite,
PostgreSQL and MariaDB (PostgreSQL also ``pessimistic``), ZooKeeper and etcd. The servers are
the ones the tests use (tests/backends/servers.py starts ZooKeeper and etcd; PostgreSQL at
``REDLOCK_PG_HOST`` and MariaDB at ``REDLOCK_MYSQL_HOST``, a bench database of their own); a
backend whose server is missing is left out with the reason.

Measured for each:

* uncontended latency: one ``acquire(blocking=False)`` + ``release()`` pair, median and p99;
* throughput: 8 threads, each taking and releasing its own lock names, for ``--seconds``;
* contended handoff: 4 threads on one name, each holding it 5 ms: the gap between one
  holder's ``release()`` returning and the next holder's ``acquire()`` returning (median), and
  fairness as Jain's index over the threads' acquisition counts (1.0 = equal shares);
* recovery: a child process takes the lock (2 s lease; a 2 s session on ZooKeeper) and is
  SIGKILLed; the time until this process holds it (``pessimistic`` needs no lease).

Prints a table (``--format rst`` for the docs), writes ``bench/results/backends-latest.json``
and the plot ``docs/_static/backends.png`` (matplotlib, when installed).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

THREADS = 8
CONTENDERS = 4
HOLD = 0.005
BENCH_DB = "redlock_bench"

Factory = Callable[[], Any]

CHILD = """
import importlib, json, sys, time
spec = json.loads(sys.argv[1])
if spec.get("django"):
    sys.path.insert(0, spec["root"])
    import bench.bench_backends as b
    b.configure_django()
module, _, cls = spec["backend"].rpartition(".")
locks = getattr(importlib.import_module(module), cls)(*spec.get("args", []), **spec["options"])
lock = locks.lock(spec["name"], ttl=2.0)
assert lock.acquire(timeout=30)
print("held", flush=True)
time.sleep(3600)
"""


# -- the servers -----------------------------------------------------------------------------


def configure_django() -> None:
    """Django with one alias per database server (bench databases created if missing)."""
    import django
    from django.conf import settings

    from testproject.databases import server_database

    if settings.configured:
        return
    sqlite = os.environ.get("REDLOCK_BENCH_SQLITE") or str(
        Path(tempfile.gettempdir()) / "redlock-bench.sqlite3"
    )
    databases: dict[str, Any] = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sqlite,
            "OPTIONS": {"timeout": 30},
        },
        "postgres": server_database("postgres", BENCH_DB),
        "mysql": server_database("mysql", BENCH_DB),
    }
    settings.configure(
        DATABASES=databases,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_redlock"],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()


def prepare_databases() -> dict[str, str | None]:
    """Create the bench databases and migrate; alias -> None, or why it cannot be used."""
    from django.core.management import call_command
    from django.db import connections

    why: dict[str, str | None] = {}
    for alias in ("default", "postgres", "mysql"):
        try:
            if alias == "postgres":
                import psycopg

                params = connections[alias].settings_dict
                with psycopg.connect(
                    host=params["HOST"], user="postgres", dbname="test", autocommit=True
                ) as c:
                    if not c.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", [BENCH_DB]
                    ).fetchone():
                        c.execute(f"CREATE DATABASE {BENCH_DB}")
            elif alias == "mysql":
                import pymysql

                params = connections[alias].settings_dict
                c = pymysql.connect(host=params["HOST"], user="root")
                c.cursor().execute(f"CREATE DATABASE IF NOT EXISTS {BENCH_DB}")
                c.close()
            call_command("migrate", "django_redlock", database=alias, verbosity=0)
            why[alias] = None
        except Exception as exc:
            why[alias] = f"{alias}: {exc}"
    return why


@contextlib.contextmanager
def services() -> Iterator[tuple[dict[str, tuple[Factory, dict[str, Any] | None]], dict[str, str]]]:
    """name -> (factory, child spec for the crash test or None), and the skipped ones."""
    from django_redlock import Redlock
    from django_redlock.testing import RedisCluster
    from tests.backends import servers

    found: dict[str, tuple[Factory, dict[str, Any] | None]] = {}
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for n in (3, 1):
            cluster = stack.enter_context(RedisCluster(n))
            urls = list(cluster.urls)
            found[f"redlock ({n} node{'s' if n > 1 else ''})"] = (
                lambda urls=urls: Redlock(urls),
                {"backend": "django_redlock.Redlock", "args": [urls], "options": {}},
            )
        configure_django()
        unusable = prepare_databases()
        for label, alias, options in [
            ("database: SQLite", "default", {}),
            ("database: PostgreSQL", "postgres", {}),
            ("database: PostgreSQL, pessimistic", "postgres", {"pessimistic": True}),
            ("database: MariaDB", "mysql", {}),
        ]:
            if unusable[alias]:
                skipped[label] = unusable[alias] or ""
                continue
            from django_redlock.backends.database import DatabaseLocks

            opts = {"using": alias, **options}
            found[label] = (
                lambda opts=opts: DatabaseLocks(**opts),
                {
                    "backend": "django_redlock.backends.database.DatabaseLocks",
                    "options": opts,
                    "django": True,
                },
            )
        for label, start in [("zookeeper", servers.zookeeper), ("etcd", servers.etcd)]:
            try:
                server = stack.enter_context(start())
            except BaseException as exc:  # pytest.skip(): the package is not installed
                skipped[label] = str(exc)
                continue
            if label == "zookeeper":
                from django_redlock.backends.zookeeper import ZooKeeperLocks

                opts = {"hosts": server.address, "session_timeout": 2.0}
                found[label] = (
                    lambda opts=opts: ZooKeeperLocks(**opts),
                    {
                        "backend": "django_redlock.backends.zookeeper.ZooKeeperLocks",
                        "options": opts,
                    },
                )
            else:
                from django_redlock.backends.etcd import EtcdLocks

                opts = {"endpoints": [server.address]}
                found[label] = (
                    lambda opts=opts: EtcdLocks(**opts),
                    {"backend": "django_redlock.backends.etcd.EtcdLocks", "options": opts},
                )
        yield found, skipped


# -- the measurements ------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def latency(locks: Any, rounds: int) -> dict[str, float]:
    name = f"bench:lat:{uuid.uuid4().hex[:6]}"
    times = []
    for _ in range(rounds):
        lock = locks.lock(name, ttl=10)
        started = time.perf_counter()
        assert lock.acquire(blocking=False)
        lock.release()
        times.append(time.perf_counter() - started)
    return {"p50_ms": percentile(times, 0.5) * 1000, "p99_ms": percentile(times, 0.99) * 1000}


def throughput(locks: Any, seconds: float) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * THREADS

    def work(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            lock = locks.lock(f"bench:tp:{i}:{n % 16}", ttl=10)
            if lock.acquire(blocking=False):
                lock.release()
                counts[i] += 1
            n += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def handoff(locks: Any, seconds: float) -> dict[str, float]:
    name = f"bench:handoff:{uuid.uuid4().hex[:6]}"
    stop = time.monotonic() + seconds
    events: list[tuple[float, str, int]] = []  # (time, "acq"/"rel", thread)
    guard = threading.Lock()
    counts = [0] * CONTENDERS

    def work(i: int) -> None:
        while time.monotonic() < stop:
            lock = locks.lock(name, ttl=10)
            if not lock.acquire(timeout=10):
                continue
            with guard:
                events.append((time.perf_counter(), "acq", i))
            counts[i] += 1
            time.sleep(HOLD)
            lock.release()
            with guard:
                events.append((time.perf_counter(), "rel", i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(CONTENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events.sort()
    gaps = [
        b[0] - a[0]
        for a, b in itertools.pairwise(events)
        if a[1] == "rel" and b[1] == "acq" and a[2] != b[2]
    ]
    jain = sum(counts) ** 2 / (len(counts) * sum(c * c for c in counts)) if any(counts) else 0.0
    return {
        "handoff_ms": statistics.median(gaps) * 1000 if gaps else float("nan"),
        "fairness": jain,
        "handoffs": len(gaps),
    }


def recovery(factory: Factory, spec: dict[str, Any]) -> float:
    name = f"bench:crash:{uuid.uuid4().hex[:6]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps({**spec, "name": name, "root": str(ROOT)})],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        locks = factory()
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        lock = locks.lock(name, ttl=10)
        assert lock.acquire(timeout=60)
        took = time.monotonic() - killed
        lock.release()
        locks.close()
        return took
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


# -- output ----------------------------------------------------------------------------------

COLUMNS = [
    ("backend", "Backend", "{}"),
    ("p50_ms", "Latency p50 (ms)", "{:.2f}"),
    ("p99_ms", "p99 (ms)", "{:.2f}"),
    ("throughput", "8 threads (locks/s)", "{:.0f}"),
    ("handoff_ms", "Handoff gap (ms)", "{:.1f}"),
    ("fairness", "Fairness (Jain)", "{:.2f}"),
    ("recovery_s", "Crash recovery (s)", "{:.2f}"),
]


def table(rows: list[dict[str, Any]], fmt: str) -> str:
    cells = [[c[1] for c in COLUMNS]] + [
        [c[2].format(r[c[0]]) if r.get(c[0]) is not None else "-" for c in COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    if fmt == "rst":
        rule = "  ".join("=" * w for w in widths)
        lines = [rule, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True)), rule]
        lines += [
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells[1:]
        ]
        return "\n".join([*lines, rule])
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |"
        for row in cells[1:]
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("p50_ms", "uncontended acquire+release, ms (median)"),
        ("throughput", "8 threads, locks/s"),
        ("handoff_ms", "contended handoff gap, ms (median)"),
        ("recovery_s", "recovery after a holder SIGKILL, s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 4.2), sharey=True)
    labels = [r["backend"] for r in rows]
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [r.get(key) or 0 for r in rows]
        ax.barh(labels, values, color="#417690")
        ax.set_title(title, fontsize=9)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    axes[0].invert_yaxis()  # shared y axis: once, so the first backend is on top
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=300, help="latency samples per backend")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput/handoff run time")
    parser.add_argument("--format", choices=["md", "rst"], default="md")
    parser.add_argument("--only", default="", help="comma-separated substrings of backend names")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the plot from backends-latest.json"
    )
    args = parser.parse_args()
    out = ROOT / "bench" / "results" / "backends-latest.json"
    if args.plot_only:
        plot(json.loads(out.read_text())["rows"], ROOT / "docs" / "_static" / "backends.png")
        return
    rows: list[dict[str, Any]] = []
    with services() as (found, skipped):
        for label, (factory, spec) in found.items():
            if args.only and not any(s in label for s in args.only.split(",")):
                continue
            print(f"... {label}", file=sys.stderr, flush=True)
            locks = factory()
            row: dict[str, Any] = {"backend": label}
            row.update(latency(locks, args.rounds))
            row["throughput"] = throughput(locks, args.seconds)
            row.update(handoff(locks, args.seconds))
            locks.close()
            row["recovery_s"] = recovery(factory, spec) if spec is not None else None
            rows.append(row)
    print(table(rows, args.format))
    for label, why in skipped.items():
        print(f"skipped {label}: {why}")
    meta = {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=2) + "\n")
    if not args.no_plot and plot(rows, ROOT / "docs" / "_static" / "backends.png"):
        print("plot: docs/_static/backends.png", file=sys.stderr)


if __name__ == "__main__":
    main()
