"""AsyncRedlock with many tasks on distinct keys: throughput, client CPU and one task's latency.

    python bench/async_tasks.py                          # this tree, 3 rounds
    python bench/async_tasks.py --before /path/to/tree   # also another tree, interleaved
    python bench/async_tasks.py --profile                # cProfile of 100 tasks x 20 cycles

Each round runs, in a fresh process each, on one 3-node cluster: our client on 3 nodes (100
tasks x 20 acquire+release cycles, 2 rounds after a warm one: cycles per second and client
CPU per cycle; then one task alone, 3,000 cycles: p50 and p99 of a cycle), and
``redis.asyncio``'s ``Lock`` on one node with the same tasks. ``--before`` adds the same
measurement of another tree's ``django_redlock`` (a checkout of an older commit), in the same
round, so a busy host's noise hits both alike. Client CPU per cycle (``time.process_time``)
is the steadier number on a loaded host: the rates swing with what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import asyncio, json, sys, time

urls, mode = json.loads(sys.argv[1]), sys.argv[2]
TASKS, CYCLES = 100, 20


async def tasks(make_lock, acquire):
    async def worker(r, i):
        lock = make_lock(f"{mode}:{r}:{i}")
        for _ in range(CYCLES):
            assert await acquire(lock)
            await lock.release()

    await asyncio.gather(*(worker(0, i) for i in range(TASKS)))  # warm
    t, c = time.perf_counter(), time.process_time()
    for r in (1, 2):
        await asyncio.gather(*(worker(r, i) for i in range(TASKS)))
    n = 2 * TASKS * CYCLES
    return {"rate": n / (time.perf_counter() - t), "cpu_us": (time.process_time() - c) / n * 1e6}


async def alone(rl):
    lock = rl.lock("alone", ttl=10)
    for _ in range(300):
        assert await lock.acquire()
        await lock.release()
    times = []
    for _ in range(3000):
        t = time.perf_counter()
        assert await lock.acquire()
        await lock.release()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[len(times) * 99 // 100] * 1e6}


async def main():
    if mode == "peer":
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(urls[0])
        out = await tasks(
            lambda k: client.lock(k, timeout=10),
            lambda lock: lock.acquire(blocking=True, blocking_timeout=10),
        )
        await client.aclose()
    else:
        from django_redlock import AsyncRedlock

        rl = AsyncRedlock(urls)
        out = await tasks(lambda k: rl.lock(k, ttl=10), lambda lock: lock.acquire())
        out.update(await alone(rl))
        await rl.close()
    print(json.dumps(out))


asyncio.run(main())
"""


def measure(urls: list[str], mode: str, tree: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(urls), mode],
        env=env,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=300,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def profile(urls: list[str]) -> None:
    import asyncio
    import cProfile
    import pstats

    from django_redlock import AsyncRedlock

    async def run() -> None:
        rl = AsyncRedlock(urls)

        async def worker(i: int) -> None:
            lock = rl.lock(f"profile:{i}", ttl=10)
            for _ in range(20):
                assert await lock.acquire()
                await lock.release()

        for _ in range(2):
            await asyncio.gather(*(worker(i) for i in range(100)))
        await rl.close()

    profiler = cProfile.Profile()
    profiler.runcall(asyncio.run, run())
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="another tree whose django_redlock to measure too")
    parser.add_argument("--profile", action="store_true", help="cProfile this tree's run")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from django_redlock.testing import RedisCluster

    with RedisCluster(3) as cluster:
        urls = list(cluster.urls)
        if args.profile:
            profile(urls)
            return 0
        trees = [("before", args.before)] if args.before else []
        trees.append(("ours", ROOT))
        for r in range(args.rounds):
            peer = measure(urls, "peer", ROOT)
            cells = []
            for label, tree in trees:
                got = measure(urls, label, tree)
                cells.append(
                    f"{label} {got['rate']:,.0f}/s ({got['rate'] / peer['rate']:.2f}x), "
                    f"CPU {got['cpu_us']:.0f} us/cycle, alone p50 {got['p50_us']:.0f} us "
                    f"p99 {got['p99_us']:.0f} us"
                )
            cells.append(f"redis.asyncio {peer['rate']:,.0f}/s, CPU {peer['cpu_us']:.0f} us/cycle")
            print(f"round {r} (load {os.getloadavg()[0]:.1f}): " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
