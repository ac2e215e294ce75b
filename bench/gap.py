"""Where a 5-node cycle's time goes: the library against the same commands sent by hand.

    python bench/gap.py              # 4 interleaved rounds of 2,000 cycles per row
    python bench/gap.py --rounds 2 --cycles 1000

One process, five ``redis-server`` nodes started here, rows run in interleaved rounds so a
burst of foreign load touches every row a little. Rows:

``floor``          the bench's raw-socket floor: ``SET NX PX`` then ``DEL``, no Lua
``our commands``   our exact acquire and release commands (restart guard on, holder metadata,
                   fresh token per cycle) written to sockets of their own with one ``poll``
                   loop that waits for every node: the nodes' share of our cycle, with no
                   library code around it
``django-redlock`` ``lock.acquire()`` + ``release()`` through the public API, which stop
                   waiting once a quorum answered (the slower nodes' replies are read by the
                   next operation on their connections)
``redis-py Lock``  one node, for the ratio the speed target is stated against

Per row: p50 of the cycle, and the client's user and system CPU per cycle (``getrusage``),
which separates the Python work from the kernel's (sends that wake the nodes, ``poll``).
Then one node's own time per cycle (``INFO commandstats``) for the full acquire script and
for the plain ``SET`` an uncontended acquire sends. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import peers  # noqa: E402
import redis  # noqa: E402

from django_redlock import Redlock  # noqa: E402
from django_redlock.core import scripts  # noqa: E402
from django_redlock.core.commands import AcquireRequest, lock_value  # noqa: E402
from django_redlock.core.nodes import Incomplete  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402

TTL = 10.0


def measure(cycle: Callable[[], object], n: int) -> tuple[list[float], float, float]:
    """(cycle times in µs, user CPU s, system CPU s) of ``n`` cycles."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        cycle()
        samples.append((time.perf_counter() - t0) * 1e6)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return samples, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime


def by_hand(rl: Redlock, name: str) -> Callable[[], object]:
    """One cycle of our own commands over the Redlock's pooled sockets, with no library code
    but building the commands (a new token and metadata per attempt, as the library does)."""
    handle = rl.lock(name, ttl=TTL)
    handle.acquire()  # opens one connection per node, learns the run ids, arms the markers
    handle.release()
    rl.locked(name)  # waits for every node: no connection still owes a reply
    # Taken out of the pool: the library's own row must not share them.
    wires = [node._idle.pop() for node in rl.nodes]
    poller = select.poll()
    for wire in wires:
        poller.register(wire.fd, select.POLLIN)
    by_fd = {wire.fd: wire for wire in wires}

    def fan_out(payloads: list[bytes], count: int) -> None:
        for wire, payload in zip(wires, payloads, strict=True):
            wire.sock.send(payload)
        left = len(wires)
        taken = dict.fromkeys(by_fd, 0)
        while left:
            for fd, _ in poller.poll(1000):
                wire = by_fd[fd]
                wire.feed()
                try:
                    while taken[fd] < count:
                        wire.take()
                        taken[fd] += 1
                except Incomplete:
                    continue
                left -= 1

    def cycle() -> None:
        request = AcquireRequest(rl, handle)
        acquire = [request.build(node, wire) for node, wire in zip(rl.nodes, wires, strict=True)]
        fan_out([a.data for a in acquire], acquire[0].count)
        fan_out([rl.keys.release_command(name, request.token)] * len(wires), 1)

    return cycle


def server_cost(port: int, cycles: int) -> dict[str, float]:
    """µs of the node's own time per cycle (``INFO commandstats``): the full acquire script
    (a connection's first acquire on a node, fencing, a changed marker) and the plain ``SET``
    of every other uncontended acquire, each with the release script."""
    client = redis.Redis(port=port)
    run_id = client.info("server")["run_id"]
    meta = '{"host": "bench", "pid": 1, "thread": "MainThread", "acquired_at": 1.0}'
    token = os.urandom(16).hex()
    keys = ["gap:lock:k", "gap:fence:k", "gap:node"]
    guard = 60_000
    client.evalsha(scripts.ACQUIRE.sha, 3, *keys, token, 10_000, meta, "0", run_id, guard)
    client.hset("gap:node", "trusted", 1)  # votes from now on
    client.delete(keys[0])

    def total(send: Callable[[], object]) -> float:
        client.config_resetstat()
        for _ in range(cycles):
            send()
        stats = client.info("commandstats")
        return (
            sum(v["usec"] for k, v in stats.items() if k not in ("cmdstat_config|resetstat",))
            / cycles
        )

    release = (
        scripts.RELEASE.sha,
        3,
        keys[0],
        "gap:waiters:k",
        "gap:queue:k",
        token,
        "gap:released:k",
    )
    script = total(
        lambda: (
            client.evalsha(scripts.ACQUIRE.sha, 3, *keys, token, 10_000, meta, "0", run_id, guard),
            client.evalsha(*release),
        )
    )
    value = lock_value(token, ttl_ms=10_000, meta_json=meta)
    plain = total(
        lambda: (
            client.set(keys[0], value, nx=True, px=10_000),
            client.pttl(keys[0]),
            client.hmget(keys[2], "run_id", "id"),
            client.evalsha(*release),
        )
    )
    client.close()
    return {"full acquire script + release": script, "SET NX PX + PTTL + HMGET + release": plain}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=2000, help="per row per round")
    args = parser.parse_args(argv)
    with RedisCluster(5) as cluster:
        rl = Redlock(cluster.urls, key_prefix="gap-ours", ttl=TTL)
        hand_rl = Redlock(cluster.urls, key_prefix="gap-hand", ttl=TTL)
        floor = peers.RawFloor(cluster.urls, "gap-floor")
        floor_handle = floor.handle("k")
        redis_py = peers.RedisPyLock(cluster.urls[:1], "gap-redis-py")
        redis_py_handle = redis_py.handle("k")
        ours_handle = rl.lock("k", ttl=TTL)
        rows: dict[str, Callable[[], object]] = {
            "floor: raw sockets (5 nodes)": lambda: (
                floor.acquire(floor_handle, 1.0),
                floor.release(floor_handle),
            ),
            "our commands by hand (5 nodes)": by_hand(hand_rl, "by-hand"),
            "django-redlock (5 nodes)": lambda: (
                ours_handle.acquire(),
                ours_handle.release(),
            ),
            "redis-py Lock (1 node)": lambda: (
                redis_py.acquire(redis_py_handle, 1.0),
                redis_py.release(redis_py_handle),
            ),
        }
        for cycle in rows.values():
            for _ in range(200):
                cycle()
        results: dict[str, tuple[list[float], float, float]] = {k: ([], 0.0, 0.0) for k in rows}
        for i in range(args.rounds):
            print(f"  .. round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for label, cycle in rows.items():
                s, u, k = measure(cycle, args.cycles)
                old = results[label]
                results[label] = (old[0] + s, old[1] + u, old[2] + k)
        redis_py_p50 = sorted(results["redis-py Lock (1 node)"][0])[
            len(results["redis-py Lock (1 node)"][0]) // 2
        ]
        print()
        print(f"{'row':32} {'p50 µs':>7} {'user µs':>8} {'sys µs':>7} {'vs redis-py':>12}")
        for label, (samples, user, system) in results.items():
            n = len(samples)
            p50 = sorted(samples)[n // 2]
            print(
                f"{label:32} {p50:7.0f} {user / n * 1e6:8.0f} {system / n * 1e6:7.0f} "
                f"{p50 / redis_py_p50:11.2f}x"
            )
        print()
        print("node time per cycle, one node, one command per round trip (INFO commandstats):")
        for label, usec in server_cost(cluster[0].port, 5000).items():
            print(f"  {label:44} {usec:6.2f} µs")
        rl.close()
        hand_rl.close()
        floor.close()
        redis_py.close()


if __name__ == "__main__":
    main()
