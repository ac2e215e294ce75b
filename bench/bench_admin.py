"""How fast is the admin lock list with many live locks?

Starts 3 embedded redis-server nodes, fills them with N live locks (default 10,000) written
with pipelined HSET + PEXPIRE in exactly the core's key layout (``<prefix>:lock:<name>`` hash
with ``token``, ``meta``, ``fence``, ``renewals``, ``acquired``, ``ttl``; see
``django_redlock/core/scripts.py``; acquiring 10,000 locks through ``rl.lock()`` would measure
the acquire path, not the page), then times, with Django's test client logged in as a
superuser, the median of 5 GETs of:

* the list page (default sort: oldest first), the same sorted by time left, filtered to stuck
  locks, a search that matches 1% of the keys, and page 50;
* one lock's detail page and the node health panel;

and, for the breakdown, ``rl.live_locks()`` and ``rl.health()`` alone.

    python bench/bench_admin.py [--locks 10000] [--repeat 5]

Target: the list page under 1 s with 10,000 live locks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fill(
    clients: list, n: int, prefix: str = "redlock", stuck_every: int = 100, renewed: float = 1.0
) -> None:
    """N locks on every node with one token each; every ``stuck_every``-th one is an hour old,
    the first ``renewed`` fraction were renewed once. Leases are 15 min with 10 min left, so
    nothing expires during the bench and the "not renewing" rule must read every renewed
    lock's lease length (its worst case with a core whose LockInfo lacks it)."""
    from django_redlock.core.commands import lock_value

    now_ms = int(time.time() * 1000)
    for client in clients:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            name = f"bench:{i:05d}"
            token = f"{i:032x}"
            acquired = now_ms - (3_600_000 if i % stuck_every == 0 else i)
            meta = {
                "host": "bench-host",
                "pid": 1000 + i % 50,
                "thread": "MainThread",
                "acquired_at": acquired / 1000,
                "view": "shop.views.pay",
                "user": "alice",
            }
            key = f"{prefix}:lock:{name}"
            value = lock_value(
                token,
                ttl_ms=600_000,
                meta_json=json.dumps(meta, separators=(",", ":")),
                fence=i,
                renewals=i % 3,
                acquired_ms=acquired,
            )
            pipe.set(key, value, px=600_000)
            if len(pipe) >= 2000:
                pipe.execute()
        pipe.execute()


def median_time(fn, repeat: int) -> tuple[float, float, float]:
    """(median wall time, best wall time, median CPU time of this process), seconds.

    CPU time leaves out the time the nodes spend and the waiting on a busy machine, so it
    shows what the Django process itself costs."""
    walls, cpus = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--renewed",
        type=float,
        default=1.0,
        help="fraction of locks that were renewed (the 'not renewing' rule "
        "reads their lease length)",
    )
    args = parser.parse_args()

    from django_redlock.testing import RedisCluster

    with RedisCluster(3) as cluster, tempfile.TemporaryDirectory() as tmp:
        os.environ["REDLOCK_NODES"] = ",".join(cluster.urls)
        os.environ["REDLOCK_SQLITE"] = str(Path(tmp) / "bench.sqlite3")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
        import django

        django.setup()
        from django.conf import settings
        from django.core.management import call_command
        from django.test import Client
        from django.test.utils import setup_test_environment

        setup_test_environment()
        settings.ALLOWED_HOSTS = ["*"]
        call_command("migrate", verbosity=0)
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.create_superuser("bench", "b@example.com", "bench")
        client = Client()
        client.force_login(user)

        t0 = time.perf_counter()
        fill(cluster.clients(), args.locks, renewed=args.renewed)
        from django.test import override_settings

        # Leases up to an hour (the bench's are 15 min), so the listing treats them as valid.
        override_settings(REDLOCK={**settings.REDLOCK, "MAX_TTL": 3600.0}).enable()
        fill_s = time.perf_counter() - t0

        from django_redlock.conf import get_redlock

        rl = get_redlock()
        base = "/admin/django_redlock/lock/"

        def get(url: str):
            def run() -> None:
                response = client.get(url)
                assert response.status_code == 200, (url, response.status_code)

            return run

        from django_redlock import admin_views as av

        infos = list(rl.live_locks("*"))

        def admin_only() -> None:
            rows = av.build_rows(infos, 300.0)
            av.sort_rows(rows, av.DEFAULT_SORT)

        cases = [
            ("rl.live_locks('*') (core only)", lambda: sum(1 for _ in rl.live_locks("*"))),
            ("rows + stuck rules + sort (admin only)", admin_only),
            ("rl.health() (core only)", rl.health),
            ("list page (oldest first)", get(base)),
            ("list page, sorted by time left", get(base + "?o=ttl")),
            ("list page, stuck filter", get(base + "?stuck=any")),
            ("list page, search 1% of keys", get(base + "?q=bench:0001")),
            ("list page 50", get(base + "?p=50")),
            ("lock detail", get(base + "detail/?name=bench:00042")),
            ("node health panel", get(base + "nodes/")),
        ]
        count = sum(1 for _ in rl.live_locks("*"))
        print(
            f"# admin pages with {count} live locks on {len(cluster)} embedded nodes "
            f"(filled in {fill_s:.2f} s), median of {args.repeat} "
            f"[{sys.implementation.name} {sys.version.split()[0]}, redis-py "
            f"{__import__('redis').__version__}]"
        )
        print(f"# load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"{'case':<40} {'median':>9} {'best':>9} {'cpu':>9}")
        for label, fn in cases:
            fn()  # warm up (connections, templates)
            med, best, cpu = median_time(fn, args.repeat)
            print(f"{label:<40} {med * 1000:>7.0f}ms {best * 1000:>7.0f}ms {cpu * 1000:>7.0f}ms")


if __name__ == "__main__":
    main()
