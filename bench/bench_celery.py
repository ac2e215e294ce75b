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
def worker(app: Any, pool: str, concurrency: int, env: dict[str, str]) -> Any:
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
        "ok": outcomes["ok"],
        "failed": outcomes["failed"],
        "seconds": elapsed,
        "per_second": outcomes["ok"] / elapsed,
        "messages_per_task": messages / done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per distinct-key batch")
    parser.add_argument("--hot", type=int, default=None, help="tasks per hot-key batch")
    parser.add_argument("--hold", type=float, default=0.02, help="seconds a hot task holds")
    parser.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
    parser.add_argument("--concurrency", type=int, default=4)
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


def print_table(rows: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> None:
    width = max(len(name) for name, _ in rows)
    print()
    print(
        f"LockedTask benchmark: {args.pool} pool, concurrency {args.concurrency}, 3 lock "
        f"nodes + 1 broker (embedded redis-server), Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs"
    )
    header = (
        f"{'scenario':<{width}}  {'tasks':>5}  {'failed':>6}  {'seconds':>7}  "
        f"{'tasks/s':>8}  {'msgs/task':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, row in rows:
        print(
            f"{name:<{width}}  {row['tasks']:>5.0f}  {row['failed']:>6.0f}  "
            f"{row['seconds']:>7.2f}  {row['per_second']:>8.1f}  "
            f"{row['messages_per_task']:>9.2f}"
        )


if __name__ == "__main__":
    main()
    # The nodes are stopped and the worker joined by now. Skip interpreter teardown: results
    # the in-process worker created for retries would try to unsubscribe from the stopped
    # broker in AsyncResult.__del__ and print reconnect noise.
    sys.stdout.flush()
    os._exit(0)
