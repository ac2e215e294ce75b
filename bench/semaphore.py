"""What a semaphore permit and a read/write hold cost next to the mutex.

    python bench/semaphore.py                 # 3 nodes, 4 interleaved rounds of 500 cycles
    python bench/semaphore.py --nodes 5 --rounds 2 --cycles 300

One process, ``--nodes`` local ``redis-server`` nodes started here; rows run in interleaved
rounds so a burst of foreign load touches every row a little. A cycle is acquire + release
through the public API. Rows:

``mutex``                ``rl.lock(name)``: the reference
``permit, free``         ``rl.semaphore(name, limit=8)`` with no other permit held (the first
                         slot tried is free: one acquire round, as the mutex)
``permit, limit-1 held`` limit 8 with 7 permits held by another owner: the first slot tried is
                         taken 7 times in 8, then the slots' lease times are read and the free
                         one taken (three rounds)
``read lock``            ``rl.read_lock(name)`` (a script per node: the readers' set)
``write lock``           ``rl.write_lock(name)`` (a script per node: the readers are checked)
``single-node ZSET``     a Redisson-style semaphore on one node (a sorted set of permits by
                         expiry, one Lua script to acquire, ``ZREM`` to release): no quorum,
                         no fault tolerance; what the quorum costs on top

Per row: p50 and p99 of the cycle in microseconds and the ratio to the mutex's p50. Nothing
here is a test; the numbers are this machine's (a shared 2-core box: compare rows, not runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import redis  # noqa: E402

from django_redlock import Redlock  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402

LIMIT = 8

# A single-node semaphore as Redisson's RPermitExpirableSemaphore keeps it: permits in a sorted
# set scored by their expiry. KEYS[1] the set; ARGV[1] permit id, ARGV[2] ttl ms, ARGV[3] limit.
# Returns 1 when taken, 0 when every permit is held.
_ZSET_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


def rows(rl: Redlock, other: Redlock, single: redis.Redis) -> dict[str, Callable[[], None]]:
    zset_acquire = single.register_script(_ZSET_ACQUIRE)
    # Held through another client: this one cannot skip the taken slots by its own records.
    held = [other.semaphore("bench:crowded", LIMIT, 30.0, owner=f"o{i}") for i in range(LIMIT - 1)]
    for hold in held:
        assert hold.acquire(blocking=False)

    def mutex() -> None:
        lock = rl.lock("bench:mutex", 10.0)
        assert lock.acquire(blocking=False)
        lock.release()

    def permit(name: str) -> Callable[[], None]:
        def cycle() -> None:
            sem = rl.semaphore(name, LIMIT, 10.0)
            assert sem.acquire(blocking=False)
            sem.release()

        return cycle

    def read() -> None:
        hold = rl.read_lock("bench:rw", 10.0)
        assert hold.acquire(blocking=False)
        hold.release()

    def write() -> None:
        hold = rl.write_lock("bench:rw", 10.0)
        assert hold.acquire(blocking=False)
        hold.release()

    def zset() -> None:
        token = uuid.uuid4().hex
        assert zset_acquire(keys=["bench:zset"], args=[token, 10000, LIMIT]) == 1
        single.zrem("bench:zset", token)

    return {
        "mutex": mutex,
        "permit, free": permit("bench:free"),
        f"permit, {LIMIT - 1} of {LIMIT} held": permit("bench:crowded"),
        "read lock": read,
        "write lock": write,
        "single-node ZSET": zset,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=500)
    args = parser.parse_args()
    cluster = RedisCluster(args.nodes)
    try:
        rl, other = Redlock(cluster.urls, ttl=30.0), Redlock(cluster.urls, ttl=30.0)
        single = redis.Redis.from_url(cluster.urls[0])
        table = rows(rl, other, single)
        samples: dict[str, list[float]] = {name: [] for name in table}
        for cycle in table.values():  # warm connections and script caches
            for _ in range(20):
                cycle()
        for _ in range(args.rounds):
            for name, cycle in table.items():
                for _ in range(args.cycles):
                    t0 = time.perf_counter()
                    cycle()
                    samples[name].append(time.perf_counter() - t0)
        base = statistics.median(samples["mutex"])
        print(f"{args.nodes} nodes, {args.rounds} rounds x {args.cycles} cycles, limit {LIMIT}")
        print(f"{'row':<24} {'p50 us':>8} {'p99 us':>8} {'x mutex':>8}")
        for name, got in samples.items():
            got.sort()
            p50, p99 = statistics.median(got), got[int(len(got) * 0.99) - 1]
            print(f"{name:<24} {p50 * 1e6:>8.0f} {p99 * 1e6:>8.0f} {p50 / base:>8.2f}")
        rl.close()
        other.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
