"""The package functions one uncontended ``acquire()`` runs: a size check of the core's hot path.

    python bench/acquire_path.py [--times 10]   # the counts, the files and the functions

A ``sys.setprofile`` hook records the distinct (file, function) pairs of ``django_redlock``
code called during ONE ``rl.lock("k", ttl=10).acquire(blocking=False)`` on a 5-node
``Redlock`` that has already done one full acquire/release cycle (connections open, scripts
loaded). ``release()`` is not traced. Comprehensions, generator expressions and lambdas count
as the function they sit in (code objects named ``<...>`` are skipped). Threads the call
wakes (the transport's readers) are traced too, through ``threading.setprofile``.
Which functions run depends a little on timing (a quorum may answer before the last node),
so it traces ``--times`` acquires one by one and reports the range and the worst. Nothing here
is a test; tests/test_core_shape.py asserts the same numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from types import FrameType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def acquire_paths(urls: list[str], times: int = 1, warm: int = 1) -> list[set[tuple[str, str]]]:
    """For each of ``times`` warm uncontended acquires (each on a name of its own), the
    (file, function) pairs of package code it called. Which functions run depends a little on
    timing (whether a quorum answered before the last node did), so a caller that wants the
    worst case asks for several. ``warm`` full cycles go first: a connection's first acquire
    sends the whole script (it has not seen its node vote yet), and a release that ended at a
    quorum may leave a slow node's connection owing its reply, so the next acquire opens
    another; a few cycles leave every node with connections that have voted."""
    import django_redlock
    from django_redlock import Redlock

    package = os.path.dirname(os.path.abspath(django_redlock.__file__)) + os.sep
    rl = Redlock(urls, node_timeout=1.0)
    paths: list[set[tuple[str, str]]] = []
    try:
        for _ in range(warm):
            first = rl.lock("shape-warm", ttl=10)
            assert first.acquire(blocking=False)
            first.release()
        for i in range(times):
            seen: set[tuple[str, str]] = set()

            def hook(frame: FrameType, event: str, arg: Any, seen: set[Any] = seen) -> None:
                if event != "call":
                    return
                code = frame.f_code
                if code.co_filename.startswith(package) and not code.co_name.startswith("<"):
                    seen.add((code.co_filename[len(package) :], code.co_qualname))

            lock = rl.lock(f"shape-{i}", ttl=10)
            threading.setprofile(hook)
            sys.setprofile(hook)
            try:
                acquired = lock.acquire(blocking=False)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            assert acquired
            lock.release()
            paths.append(seen)
        return paths
    finally:
        rl.close()


def files_of(path: set[tuple[str, str]]) -> set[str]:
    return {file for file, _ in path}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--times", type=int, default=10, help="acquires traced, one by one")
    args = parser.parse_args()
    from django_redlock.testing import RedisCluster

    with RedisCluster(5) as cluster:
        paths = acquire_paths(list(cluster.urls), args.times)
    worst = max(paths, key=len)
    counts = sorted(len(p) for p in paths)
    print(f"one acquire: {counts[0]}-{counts[-1]} functions, {len(files_of(worst))} files (worst)")
    union = set().union(*paths)
    print(f"union of {len(paths)}: {len(union)} functions in {len(files_of(union))} files")
    for file in sorted(files_of(union)):
        names = sorted(
            name + ("" if (file, name) in worst else "*") for f, name in union if f == file
        )
        print(f"  {file} ({len(names)}): {', '.join(names)}")
    print("(* not in the worst single acquire)")


if __name__ == "__main__":
    main()
