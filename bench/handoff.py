"""Where one hand-off of a hot key goes: release -> publish -> waiter wakes -> attempt -> granted.

    python bench/handoff.py                      # 16 processes, fair=False and fair=True, 6 s
    python bench/handoff.py --processes 4 --seconds 3 --fair 1

Each process takes one key on three ``redis-server`` nodes started here, releases it at once
and takes it again, as scenario f of ``bench/load.py`` does, with timestamps (the shared
``CLOCK_MONOTONIC``) taken around the client's steps: the release, each release notice the
listener thread hears, the waiting thread's return from its wait, every fan-out, the end of the
acquire. For each hand-off (a release, then the next acquisition by another process) it prints
the p50 of each step of the winner, how many processes heard that release, how many fan-outs
all processes sent meanwhile, the client CPU (user + system, every process) and context
switches per acquisition, and the nodes' CPU per acquisition (``/proc/<pid>/stat`` of each
``redis-server``). The hooks wrap the client's methods; they change no decision. Nothing here
is a test.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import resource
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from django_redlock import Redlock  # noqa: E402
from django_redlock.core import fanout, lock, waiting  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402

TTL = 10.0


def _trace(events: list[tuple[float, str]]) -> None:
    """Wrap the client's steps so each appends ``(monotonic time, what)`` to ``events``."""
    now = time.monotonic

    def around(cls: Any, name: str, before: str, after: str) -> None:
        inner = getattr(cls, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            events.append((now(), before))
            try:
                return inner(*args, **kwargs)
            finally:
                events.append((now(), after))

        setattr(cls, name, wrapped)

    around(lock.Lock, "acquire", "acquire", "acquired")
    around(lock.Lock, "release", "release", "released")
    around(fanout.Rounds, "fan_out", "send", "answered")
    around(waiting.ReleaseNotice, "wait", "wait", "woke")
    hear = waiting.ReleaseNotice.hear

    def heard(self: Any, node: int, token: bytes) -> None:
        events.append((now(), "heard"))
        hear(self, node, token)

    waiting.ReleaseNotice.hear = heard  # type: ignore[method-assign]


def _worker(urls: list[str], key: str, fair: bool, seconds: float, barrier: Any, out: Any) -> None:
    events: list[tuple[float, str]] = []
    rl = Redlock(urls, key_prefix="handoff")
    warm = rl.lock(f"warm-{os.getpid()}", ttl=TTL)
    warm.acquire()
    warm.release()
    _trace(events)
    barrier.wait()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        handle = rl.lock(key, ttl=TTL, fair=fair)
        if handle.acquire(timeout=10):
            handle.release()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    switches = r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw
    rl.close()
    out.put((os.getpid(), events, cpu, switches))


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def _p50(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def run(urls: list[str], fair: bool, processes: int, seconds: float, pids: list[int]) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes + 1)
    out = ctx.Queue()
    key = f"hot-{int(fair)}-{os.urandom(3).hex()}"
    procs = [
        ctx.Process(target=_worker, args=(urls, key, fair, seconds, barrier, out), daemon=True)
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=120)
    node_cpu = _cpu_of(pids)
    results = [out.get(timeout=seconds + 60) for _ in procs]
    node_cpu = _cpu_of(pids) - node_cpu
    for p in procs:
        p.join(10)
    cpu = sum(r[2] for r in results)
    voluntary = sum(r[3][0] for r in results)
    involuntary = sum(r[3][1] for r in results)
    merged = sorted((t, pid, what) for pid, events, _, _ in results for t, what in events)
    # Hold i: (pid, acquired at, release started, release returned).
    holds: list[tuple[int, float, float, float]] = []
    open_at: dict[int, float] = {}
    released_at: dict[int, float] = {}
    for t, pid, what in merged:
        if what == "acquired":
            open_at[pid] = t
        elif what == "release" and pid in open_at:
            released_at[pid] = t
        elif what == "released" and pid in released_at:
            holds.append((pid, open_at.pop(pid), released_at.pop(pid), t))
    holds.sort(key=lambda h: h[1])
    steps: dict[str, list[float]] = {
        k: []
        for k in (
            "release (to its return)",
            "release -> first notice heard by the winner",
            "first notice -> waiter awake",
            "waiter awake -> first send",
            "sends by the winner after waking",
            "waiter awake -> granted",
            "release -> granted (gap)",
            "processes that heard the release",
            "fan-outs sent by all (release -> granted)",
        )
    }
    by_pid: dict[int, list[tuple[float, str]]] = {}
    for t, pid, what in merged:
        by_pid.setdefault(pid, []).append((t, what))
    handoffs = 0
    for (a_pid, _, a_rel, a_done), (b_pid, b_acq, _, _) in itertools.pairwise(holds):
        if a_pid == b_pid:
            continue
        handoffs += 1
        window = [(t, pid, w) for t, pid, w in merged if a_rel <= t <= b_acq]
        mine = [(t, w) for t, w in by_pid[b_pid] if a_rel <= t <= b_acq]
        heard = [t for t, w in mine if w == "heard"]
        woke = [t for t, w in mine if w == "woke"]
        steps["release (to its return)"].append((a_done - a_rel) * 1000)
        steps["release -> granted (gap)"].append((b_acq - a_done) * 1000)
        steps["processes that heard the release"].append(
            len({pid for _, pid, w in window if w == "heard"})
        )
        steps["fan-outs sent by all (release -> granted)"].append(
            sum(1 for _, _, w in window if w == "send")
        )
        if heard and woke:
            steps["release -> first notice heard by the winner"].append((heard[0] - a_rel) * 1000)
            steps["first notice -> waiter awake"].append((woke[-1] - heard[0]) * 1000)
            sends = [t for t, w in mine if w == "send" and t >= woke[-1]]
            steps["sends by the winner after waking"].append(len(sends))
            if sends:
                steps["waiter awake -> first send"].append((sends[0] - woke[-1]) * 1000)
            steps["waiter awake -> granted"].append((b_acq - woke[-1]) * 1000)
    n = max(len(holds), 1)
    print(
        f"fair={fair}, {processes} processes, {seconds:.0f} s: {len(holds)} acquisitions "
        f"({len(holds) / seconds:.0f}/s), {handoffs} hand-offs to another process; per "
        f"acquisition: client CPU {cpu / n * 1000:.2f} ms, nodes' CPU {node_cpu / n * 1000:.2f} "
        f"ms (the whole run), context switches {voluntary / n:.1f} voluntary and "
        f"{involuntary / n:.1f} involuntary"
    )
    for name, values in steps.items():
        unit = "" if name.startswith(("processes", "fan-outs", "sends")) else " ms"
        print(f"  {name:<46} p50 {_p50(values):7.2f}{unit}  (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--fair", type=int, choices=(0, 1), default=None)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with RedisCluster(3) as cluster:
        for fair in (False, True) if args.fair is None else (bool(args.fair),):
            pids = [node.pid for node in cluster.nodes if node.pid is not None]
            run(cluster.urls, fair, args.processes, args.seconds, pids)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
