"""LockedTask throughput against a plain Celery task, on real workers and real Redis nodes.

    python bench/bench_celery.py            # about a minute
    python bench/bench_celery.py --quick    # about 20 seconds
    python bench/bench_celery.py --pool prefork --concurrency 4

Three embedded lock nodes and one broker node (``django_redlock.testing``) are started here; a
worker runs in this process (``celery.contrib.testing.worker.start_worker``, threads pool by
default) or, with ``--pool prefork``, as a ``celery worker`` subprocess. Scenarios:

``distinct``  N tasks, each with its own key: the cost of the lock (two Redlock round trips on
              three nodes, plus the watchdog) against the same task without one
``hot``       M tasks on ONE key, each holding it ``--hold`` seconds, once per ``on_locked``
              policy: how long the batch takes and how many broker messages each completed task
              cost (1.0 = never sent back; every lock retry is one more message)

``burst``     (``--burst``) the issue's scenario on a prefork worker with 4 processes: 20 tasks
              on one key, each holding it 100 ms, against the serial ideal (20 x 100 ms),
              with the default ``on_locked="retry"`` on a fresh worker (no process has
              finished a hold, so no holder knows its typical hold) and once every process
              has, and with ``"wait"``; the same burst
              while 20 tasks on other keys are sent (those must not wait for the burst);
              and the peers celery-once and celery-singleton, which do not serialize a
              burst at all: they drop (celery-once) or merge (celery-singleton) the
              duplicates at enqueue, so only one of the 20 runs

Broker messages are counted on the broker itself (``LPUSH`` calls in ``INFO commandstats``:
the Redis transport publishes every message, retries included, with one LPUSH). Nothing here is
a test; it only measures and prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from django_redlock.testing import RedisCluster, RedisNode  # noqa: E402


def lpushes(node: RedisNode) -> int:
    stats = node.info("commandstats")
    return int(stats.get("cmdstat_lpush", {}).get("calls", 0))


@contextmanager
def worker(
    app: Any, pool: str, concurrency: int, env: dict[str, str], include: str | None = None
) -> Any:
    if pool == "threads":
        from celery.contrib.testing.worker import start_worker

        with start_worker(
            app,
            pool="threads",
            concurrency=concurrency,
            perform_ping_check=False,
            shutdown_timeout=120,
            loglevel="ERROR",
        ):
            yield
        return
    log = open(os.devnull, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject.celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-l",
            "ERROR",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            *(["--include", include] if include else []),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
        yield
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def run_batch(broker: RedisNode, sends: list[Any], timeout: float) -> dict[str, float]:
    """Send every message (callables returning AsyncResults), wait for all; time and count."""
    before = lpushes(broker)
    start = time.perf_counter()
    results = [send() for send in sends]
    # A peer that drops or merges duplicates returns no new task for them.
    ran = len({r.id for r in results if r.id and r.state != "REJECTED"})
    outcomes = {"ok": 0, "failed": 0}
    for result in results:
        try:
            result.get(timeout=timeout)
            outcomes["ok"] += 1
        except Exception:
            outcomes["failed"] += 1
    elapsed = time.perf_counter() - start
    messages = lpushes(broker) - before
    done = max(outcomes["ok"], 1)
    return {
        "tasks": len(sends),
        "ran": ran,
        "ok": outcomes["ok"],
        "failed": outcomes["failed"],
        "seconds": elapsed,
        "per_second": outcomes["ok"] / elapsed,
        "messages_per_task": messages / done,
    }


def burst(
    broker: RedisNode, env: dict[str, str], n: int, hold: float
) -> list[tuple[str, dict[str, float]]]:
    """The burst table (prefork, 4 processes); see the module docstring."""
    from testproject import bench_tasks, tasks
    from testproject.celery_app import app

    rows: list[tuple[str, dict[str, float]]] = []

    def one_key(options: dict[str, Any]) -> list[Callable[[], Any]]:
        key = f"burst-{uuid.uuid4().hex[:6]}"
        return [lambda: tasks.bench_locked.apply_async((key, hold), **options)] * n

    with worker(app, "prefork", 4, env, include="testproject.bench_tasks"):
        # A fresh worker first: no process has held a key, so no holder knows its typical hold.
        rows.append(
            (
                "LockedTask retry (default), one key, cold worker",
                run_batch(broker, one_key({}), 300),
            )
        )
        warm = [lambda i=i: tasks.bench_locked.delay(f"warm{i}", hold) for i in range(8)]
        run_batch(broker, warm, 120)
        # Every process has held a key once, so holders publish their typical hold.
        run_batch(broker, [lambda: tasks.bench_locked.delay("warm-hot", hold)] * 8, 120)
        policies: list[tuple[str, dict[str, Any]]] = [
            ("LockedTask retry (default)", {}),
            ("LockedTask wait", {"on_locked": "wait", "lock_wait": 60}),
        ]
        for label, options in policies:
            rows.append((f"{label}, one key", run_batch(broker, one_key(options), 300)))
        others = [
            lambda i=i: tasks.bench_locked.delay(f"other-{uuid.uuid4().hex[:6]}-{i}", hold)
            for i in range(n)
        ]
        rows.append(("LockedTask, 20 other keys alone", run_batch(broker, others, 300)))
        key = f"burst-{uuid.uuid4().hex[:6]}"
        hot = [lambda: tasks.bench_locked.delay(key, hold)] * n
        mixed = run_mixed(broker, hot, others, 300)
        rows.append(("LockedTask retry, one key + other keys", mixed["hot"]))
        rows.append(("  ... the 20 other keys meanwhile", mixed["others"]))
        for label, task in (
            ("celery-once (drops duplicates)", bench_tasks.bench_once),
            ("celery-singleton (merges duplicates)", bench_tasks.bench_singleton),
        ):
            key = f"burst-{uuid.uuid4().hex[:6]}"
            sends = [lambda task=task, key=key: task.delay(key, hold)] * n
            rows.append((label, run_batch(broker, sends, 300)))
    return rows


def run_mixed(
    broker: RedisNode, hot: list[Any], others: list[Any], timeout: float
) -> dict[str, dict[str, float]]:
    """Send a one-key burst and then tasks on other keys; time each group to its last
    result (both timed from the first send)."""
    start = time.perf_counter()
    hot_results = [send() for send in hot]
    other_results = [send() for send in others]
    out = {}
    for label, results in (("others", other_results), ("hot", hot_results)):
        ok = sum(1 for r in results if _ok(r, timeout))
        elapsed = time.perf_counter() - start
        out[label] = {
            "tasks": len(results),
            "ran": ok,
            "ok": ok,
            "failed": len(results) - ok,
            "seconds": elapsed,
            "per_second": ok / elapsed,
            "messages_per_task": float("nan"),
        }
    return out


def _ok(result: Any, timeout: float) -> bool:
    try:
        result.get(timeout=timeout)
    except Exception:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per distinct-key batch")
    parser.add_argument("--hot", type=int, default=None, help="tasks per hot-key batch")
    parser.add_argument("--hold", type=float, default=0.02, help="seconds a hot task holds")
    parser.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--burst", action="store_true", help="only the burst table (prefork, 4 processes)"
    )
    args = parser.parse_args()
    n = args.tasks or (200 if args.quick else 600)
    hot = args.hot or (20 if args.quick else 40)

    with ExitStack() as stack:
        cluster = stack.enter_context(RedisCluster(3))
        broker = stack.enter_context(RedisNode())
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "REDLOCK_NODES": ",".join(cluster.urls),
            "REDLOCK_CELERY_BROKER": broker.url,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        os.environ.update(
            {
                k: env[k]
                for k in ("DJANGO_SETTINGS_MODULE", "REDLOCK_NODES", "REDLOCK_CELERY_BROKER")
            }
        )
        import django

        django.setup()
        from testproject import tasks
        from testproject.celery_app import app

        if args.burst:
            hold = 0.1
            rows = burst(broker, env, 20, hold)
            print_burst(rows, hold, 20)
            app.backend.result_consumer.stop()
            return

        stack.enter_context(worker(app, args.pool, args.concurrency, env))
        # Warm up connections, scripts and the restart-guard markers.
        run_batch(broker, [lambda i=i: tasks.bench_locked.delay(f"warm{i}") for i in range(8)], 120)
        run_batch(broker, [lambda: tasks.bench_plain.delay("warm")], 120)

        rows: list[tuple[str, dict[str, float]]] = []
        tag = uuid.uuid4().hex[:6]
        rows.append(
            (
                "plain task, distinct keys",
                run_batch(
                    broker,
                    [lambda i=i: tasks.bench_plain.delay(f"{tag}:{i}") for i in range(n)],
                    300,
                ),
            )
        )
        rows.append(
            (
                "LockedTask, distinct keys",
                run_batch(
                    broker,
                    [lambda i=i: tasks.bench_locked.delay(f"{tag}:{i}") for i in range(n)],
                    300,
                ),
            )
        )
        rows.append(
            (
                f"plain task, one key, hold {args.hold * 1000:.0f} ms",
                run_batch(broker, [lambda: tasks.bench_plain.delay("hot", args.hold)] * hot, 300),
            )
        )
        policies: list[tuple[str, dict[str, Any]]] = [
            ("retry (default)", {}),
            ("retry, lock_wait=2", {"lock_wait": 2}),
            ("wait, lock_wait=60", {"on_locked": "wait", "lock_wait": 60}),
        ]
        for label, options in policies:
            key = f"hot-{uuid.uuid4().hex[:6]}"
            rows.append(
                (
                    f"LockedTask, one key: {label}",
                    run_batch(
                        broker,
                        [
                            lambda key=key, options=options: tasks.bench_locked.apply_async(
                                (key, args.hold), **options
                            )
                        ]
                        * hot,
                        600,
                    ),
                )
            )

        print_table(rows, args)
        # Stop listening for results while the broker still runs (AsyncResult.__del__ would
        # otherwise try to reconnect to it at exit).
        consumer = app.backend.result_consumer
        consumer.stop()
        consumer.subscribed_to.clear()


def print_burst(rows: list[tuple[str, dict[str, float]]], hold: float, n: int) -> None:
    ideal = n * hold
    title = (
        f"Burst on one key: {n} tasks x {hold * 1000:.0f} ms, prefork pool, 4 processes, "
        f"3 lock nodes + Redis broker, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs; serial ideal {ideal:.2f} s"
    )
    columns = [("sent", "tasks", ".0f"), ("ran", "ran", ".0f"), ("failed", "failed", ".0f")]
    columns += [("seconds", "seconds", ".2f"), ("x ideal", "ratio", ".2f")]
    columns += [("msgs/task", "messages_per_task", ".2f")]
    for name, row in rows:
        row["ratio"] = row["seconds"] / ideal if "one key" in name else float("nan")
    print_rows(title, columns, rows)


def print_table(rows: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> None:
    title = (
        f"LockedTask benchmark: {args.pool} pool, concurrency {args.concurrency}, 3 lock "
        f"nodes + 1 broker (embedded redis-server), Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs"
    )
    columns = [("tasks", "tasks", ".0f"), ("failed", "failed", ".0f")]
    columns += [("seconds", "seconds", ".2f"), ("tasks/s", "per_second", ".1f")]
    columns += [("msgs/task", "messages_per_task", ".2f")]
    print_rows(title, columns, rows)


def print_rows(
    title: str, columns: list[tuple[str, str, str]], rows: list[tuple[str, dict[str, float]]]
) -> None:
    """A plain-text table: one row per scenario, ``columns`` = (heading, field, format)."""
    width = max(len(name) for name, _ in rows)
    widths = [max(len(heading), 5) for heading, _, _ in columns]
    print()
    print(title)
    header = f"{'scenario':<{width}}" + "".join(
        f"  {heading:>{w}}" for (heading, _, _), w in zip(columns, widths, strict=True)
    )
    print(header)
    print("-" * len(header))
    for name, row in rows:
        cells = "".join(
            f"  {row[field]:>{w}{fmt}}" for (_, field, fmt), w in zip(columns, widths, strict=True)
        )
        print(f"{name:<{width}}{cells}")


if __name__ == "__main__":
    main()
    # The nodes are stopped and the worker joined by now. Skip interpreter teardown: results
    # the in-process worker created for retries would try to unsubscribe from the stopped
    # broker in AsyncResult.__del__ and print reconnect noise.
    sys.stdout.flush()
    os._exit(0)
