"""Overhead of ``@locked`` on a view: the testproject's ``/ping/`` against ``/ping-locked/``
(the same view under ``@locked("ping")``), through Django's test client, in interleaved rounds,
against three embedded redis-server nodes on loopback. Prints a table of median request times.

    python bench/bench_locked.py [--requests 2000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django_redlock.testing import RedisCluster

PATHS = ("/ping/", "/ping-locked/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per path (default 2000)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    args = parser.parse_args()
    per_round = max(1, args.requests // args.rounds)
    with RedisCluster(3) as cluster:
        os.environ["REDLOCK_NODES"] = ",".join(cluster.urls)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
        import django

        django.setup()
        from django.test import Client
        from django.test.utils import setup_test_environment

        setup_test_environment()
        client = Client()
        samples: dict[str, list[float]] = {path: [] for path in PATHS}
        for path in PATHS:  # warm-up: connections, script loading, URL resolver
            for _ in range(min(200, args.requests)):
                client.get(path)
        for _ in range(args.rounds):
            for path, times in samples.items():
                for _ in range(per_round):
                    started = time.perf_counter()
                    response = client.get(path)
                    times.append(time.perf_counter() - started)
                    assert response.status_code == 200, (path, response.status_code)
    medians = {path: statistics.median(times) * 1e6 for path, times in samples.items()}
    print(f"{'path':<16}{'requests':>10}{'median':>12}")
    for path, times in samples.items():
        print(f"{path:<16}{len(times):>10}{medians[path]:>9.0f} µs")
    overhead = medians["/ping-locked/"] - medians["/ping/"]
    print(f"{'overhead':<16}{'':>10}{overhead:>9.0f} µs")


if __name__ == "__main__":
    main()
