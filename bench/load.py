"""Does django-redlock stay dependable on a busy host and a lossy network? Measure it.

    python bench/load.py                     # every scenario, full size (about 20 minutes)
    python bench/load.py --quick             # smaller sizes (about 5 minutes)
    python bench/load.py --scenarios a,e     # some of them
    python bench/load.py --markdown          # also writes bench/results/load-*.md

Only the package's public API is used (``Redlock``, ``AsyncRedlock``, ``lock()``, ``acquire``,
``release``, ``auto_renew``, ``held``/``lost``; ``django_redlock.testing``'s ``RedisCluster``
and ``RedisNode`` with ``pause``/``resume``/``kill``), plus the peers' own APIs, so the same
script measures the core before and after a rewrite; and, for c and d, the watchdog's log of
its latest rounds (``django_redlock.core.renewal.renewer.rounds``: how late each began, how
long it took) and the ``lost`` events' reasons, counted by cause. Every node is a real ``redis-server``
started here; every process and server the script starts is stopped when it ends, on Ctrl-C
and on SIGTERM too. Should it be killed outright, what it started still goes: the nodes have
``django_redlock.testing``'s reaper, the CPU burners and the proxy process watch for their
parent, and gunicorn is asked to stop by the kernel when its parent dies (Linux).

Scenarios (``--scenarios``, default all):

``a``     uncontended acquire+release cycles on 3 and 5 nodes, under CPU burners
``b``     AsyncRedlock, 100 tasks on distinct keys, against redis.asyncio's ``Lock`` on 1 node
``c``     10,000 ``auto_renew`` locks (ttl 5-6 s) held 30 s in one process, burners on
``d``     2,000 renewed locks held while one of 3 nodes is SIGSTOPped 60 s, then released
``e``     15 % and 30 % emulated packet loss on every node (``bench/lossy_proxy.py``)
``f``     one hot key across 16 processes, fair=False and fair=True, against redis-py's Lock
``g``     1,000 asyncio tasks, then 1,000 threads, waiting on one key: peak open fds
``h``     Django ``@locked`` views (async and sync) under gunicorn (gthread and sync workers),
          30 clients on one key and on distinct keys, burners on
``down``  one of 3 nodes killed (connection refused) or frozen (no answer at all): the extra
          latency per operation the caller pays (goal: one node timeout once, then nothing)

Columns of the table (one row per scenario, variant and condition):

``spurious``  errors while a quorum of nodes was up and reachable: ``QuorumError`` (or any
              other exception of acquire), an uncontended acquire that returned False, an
              HTTP 503 (or other 5xx, or a failed connection), a 423 on a key that no other
              client asks for. Every scenario keeps a quorum up, so every one counts. (A 423
              on a shared key is contention, as designed; a waiter that gives up after its
              timeout on a shared key is slow, not wrong, and is shown in the detail.)
``lost``      locks lost while a quorum was up and reachable: the handle reported it lost or
              without validity before its release, or its ``release()`` raised ``LockLost``
              or ``LockNotOwned``. Each lock counts once.
``overlaps``  where several holders share a key: holds (acquire returned -> release called,
              ``time.monotonic``, one clock for every process on Linux) that overlapped on one
              key. ``-`` where every holder has its own key.
``rate``      throughput of the row's operation (the unit is in the column).
``condition`` ``burners``: 2 x cores processes spinning beside the run; ``no stress``: the
              same run's baseline without them; ``15 % loss``, ``node paused``... the fault.

Every row is one measurement on one machine: rerun it on yours. Nothing here is a test; the
suite's ``tests/test_load.py`` runs small variants of a, c, d and e and asserts zeros.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import functools
import http.client
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.lossy_proxy import ProxyProcess  # noqa: E402
from django_redlock import (  # noqa: E402
    AsyncRedlock,
    LockLost,
    LockNotOwned,
    Redlock,
)
from django_redlock.core.renewal import renewer  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")
#: Scenario ew: seconds of work each holder does in the lock.
EW_WORK = 0.1
SCENARIOS = ("a", "b", "c", "d", "e", "ew", "f", "g", "h", "down")


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How big each scenario runs (``--quick`` or full)."""

    a_cycles: int  #: cycles per node count under burners
    a_baseline: int  #: cycles per node count without stress
    b_rounds: int
    b_tasks: int
    b_cycles: int  #: acquire+release cycles per task per round
    c_locks: int
    c_hold: float
    d_locks: int
    d_pause: float
    e_seconds: float  #: per loss level
    f_seconds: float  #: per configuration
    f_processes: int
    g_waiters: int
    g_drain: float  #: seconds the waiters get to take their turns once the key is free
    h_seconds: float  #: per configuration
    h_clients: int
    down_ops: int


FULL = Sizes(
    a_cycles=100_000,
    a_baseline=20_000,
    b_rounds=5,
    b_tasks=100,
    b_cycles=50,
    c_locks=10_000,
    c_hold=30.0,
    d_locks=2_000,
    d_pause=60.0,
    e_seconds=20.0,
    f_seconds=10.0,
    f_processes=16,
    g_waiters=1_000,
    g_drain=120.0,
    h_seconds=8.0,
    h_clients=30,
    down_ops=2_000,
)
QUICK = Sizes(
    a_cycles=5_000,
    a_baseline=3_000,
    b_rounds=2,
    b_tasks=100,
    b_cycles=20,
    c_locks=2_000,
    c_hold=10.0,
    d_locks=1_000,
    d_pause=15.0,
    e_seconds=6.0,
    f_seconds=4.0,
    f_processes=16,
    g_waiters=1_000,
    g_drain=45.0,
    h_seconds=3.0,
    h_clients=30,
    down_ops=500,
)

#: Lease of the locks the scenarios take unless they say otherwise (seconds).
TTL = 10.0
#: The renewed locks of scenarios c and d: each gets a ttl drawn from this range.
RENEWED_TTL = (5.0, 6.0)


# -- results ---------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table."""

    scenario: str
    variant: str
    condition: str
    n: int  #: operations (or locks) the row counts over
    spurious: int
    lost: int
    overlaps: int | None  #: None where every holder had its own key
    rate: float | None
    unit: str
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: The first message of each kind of spurious error (printed under the table).
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Hold:
    """One hold of a key: acquire returned, release called, release returned (monotonic)."""

    key: str
    acquired: float
    releasing: float
    released: float


class Tally:
    """Thread-safe counters of one run: operations, spurious errors and losses by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops = 0
        self.spurious: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self.holds: list[Hold] = []
        #: The first message of each kind of error, to tell what went wrong.
        self.first: dict[str, str] = {}

    def op(self, n: int = 1) -> None:
        with self._lock:
            self.ops += n

    def error(self, kind: str, exc: BaseException | None = None) -> None:
        with self._lock:
            self.spurious[kind] += 1
            if exc is not None:
                self.first.setdefault(kind, str(exc)[:500])

    def loss(self, kind: str) -> None:
        with self._lock:
            self.lost[kind] += 1

    def hold(self, hold: Hold) -> None:
        with self._lock:
            self.holds.append(hold)

    def merge(self, other: Tally) -> None:
        with self._lock:
            self.ops += other.ops
            self.spurious.update(other.spurious)
            self.lost.update(other.lost)
            self.holds.extend(other.holds)
            for kind, message in other.first.items():
                self.first.setdefault(kind, message)


def kinds(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common())


def count_overlaps(holds: Sequence[Hold]) -> int:
    """Holds whose acquire returned before an earlier holder of the same key called release."""
    by_key: dict[str, list[Hold]] = {}
    for h in holds:
        by_key.setdefault(h.key, []).append(h)
    overlaps = 0
    for group in by_key.values():
        group.sort(key=lambda h: h.acquired)
        busy_until = -math.inf
        for h in group:
            if h.acquired < busy_until:
                overlaps += 1
            busy_until = max(busy_until, h.releasing)
    return overlaps


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def error_kind(exc: BaseException) -> str:
    return type(exc).__name__


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- CPU burners -----------------------------------------------------------------------------

# Spins until its parent is gone (checked every few milliseconds), so a burner never outlives
# the run that started it, even when that run is killed with SIGKILL.
_SPIN = (
    "import os\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200000):\n"
    "        pass\n"
)


class Burners:
    """``count`` processes (default: twice the cores) spinning on the CPU while in the block."""

    def __init__(self, count: int | None = None) -> None:
        self.count = count if count is not None else 2 * (os.cpu_count() or 1)
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Burners:
        try:
            for _ in range(self.count):
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _SPIN],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self._procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in self._procs:
            p.wait()
        self._procs = []

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def stress(on: bool) -> Iterator[None]:
    if on:
        with Burners():
            yield
    else:
        yield


def condition(burners: bool) -> str:
    return "burners" if burners else "no stress"


# -- shared lock loops -------------------------------------------------------------------------


def release_counted(lock: Any, tally: Tally) -> bool:
    """Release, counting a lost lock (LockLost / LockNotOwned) or another error; True if clean."""
    try:
        lock.release()
    except (LockLost, LockNotOwned) as exc:
        tally.loss(error_kind(exc))
        return False
    except Exception as exc:
        tally.error(f"release {error_kind(exc)}")
        return False
    return True


def one_cycle(lock: Any, tally: Tally, timeout: float | None = None) -> bool:
    """Acquire a free key and release it, counting what went wrong; True when it was held."""
    try:
        ok = lock.acquire(timeout=timeout)
    except Exception as exc:
        tally.error(error_kind(exc), exc)
        return False
    if not ok:
        tally.error("refused (free key)")
        return False
    release_counted(lock, tally)
    return True


def sync_cycles(rl: Redlock, key: str, cycles: int, tally: Tally) -> list[float]:
    """Uncontended acquire+release cycles on one key; returns each cycle's time in µs."""
    lock = rl.lock(key, ttl=TTL)
    samples = []
    clock = time.perf_counter
    for _ in range(cycles):
        t0 = clock()
        if one_cycle(lock, tally):
            samples.append((clock() - t0) * 1e6)
            tally.op()
    return samples


def lost_now(locks: Sequence[Any]) -> int:
    """Handles that no longer hold their lock by their own account (lost or no validity)."""
    return sum(1 for lock in locks if lock.lost is not None or not lock.held)


def acquire_many(locks: Sequence[Any], tally: Tally, threads: int = 8) -> list[Any]:
    """Acquire every (free) lock from ``threads`` threads; returns those acquired."""
    acquired: list[Any] = []
    guard = threading.Lock()

    def work(part: Sequence[Any]) -> None:
        for lock in part:
            try:
                ok = lock.acquire()
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                continue
            if not ok:
                tally.error("refused (free key)")
                continue
            tally.op()
            with guard:
                acquired.append(lock)

    parts = [locks[i::threads] for i in range(threads)]
    ts = [threading.Thread(target=work, args=(p,), daemon=True) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return acquired


def release_many(locks: Sequence[Any], tally: Tally, already_lost: set[int]) -> int:
    """Release every lock from 8 threads; returns how many more were found lost."""
    more = Tally()

    def work(part: Sequence[Any]) -> None:
        for lock in part:
            if id(lock) in already_lost:
                with contextlib.suppress(Exception):
                    lock.release()
                continue
            release_counted(lock, more)

    ts = [threading.Thread(target=work, args=(locks[i::8],), daemon=True) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    tally.merge(more)
    return sum(more.lost.values())


# -- a: uncontended cycles under burners -----------------------------------------------------


def scenario_a(cycles: int, baseline_cycles: int, node_counts: Sequence[int] = (3, 5)) -> list[Row]:
    rows = []
    with RedisCluster(max(node_counts)) as cluster:
        for n in node_counts:
            for burners, count in ((False, baseline_cycles), (True, cycles)):
                if count <= 0:
                    continue
                progress(f"a: {n} nodes, {count} cycles, {condition(burners)}")
                rl = Redlock(cluster.urls[:n], key_prefix=f"a{n}{int(burners)}")
                try:
                    sync_cycles(rl, "warm", 200, Tally())
                    tally = Tally()
                    with stress(burners):
                        t0 = time.perf_counter()
                        samples = sync_cycles(rl, "cycle", count, tally)
                        elapsed = time.perf_counter() - t0
                finally:
                    rl.close()
                rows.append(
                    Row(
                        "a",
                        f"{n} nodes",
                        condition(burners),
                        count,
                        sum(tally.spurious.values()),
                        sum(tally.lost.values()),
                        None,
                        tally.ops / elapsed,
                        "cycles/s",
                        f"p50 {pct(samples, 50):,.0f} µs, p99 {pct(samples, 99):,.0f} µs"
                        + (f"; {kinds(tally.spurious + tally.lost)}" if tally.spurious else ""),
                        errors=tally.first,
                    )
                )
    return rows


# -- b: AsyncRedlock, many tasks on distinct keys --------------------------------------------


async def _b_ours(urls: Sequence[str], rounds: int, tasks: int, cycles: int, tally: Tally) -> None:
    rl = AsyncRedlock(list(urls))

    async def worker(r: int, i: int) -> None:
        lock = rl.lock(f"b:{r}:{i}", ttl=TTL)
        for _ in range(cycles):
            try:
                ok = await lock.acquire()
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                continue
            if not ok:
                tally.error("refused (free key)")
                continue
            try:
                await lock.release()
            except (LockLost, LockNotOwned) as exc:
                tally.loss(error_kind(exc))
            except Exception as exc:
                tally.error(f"release {error_kind(exc)}")
            tally.op()

    try:
        for r in range(rounds):
            await asyncio.gather(*(worker(r, i) for i in range(tasks)))
    finally:
        await rl.close()


async def _b_redis_py(url: str, rounds: int, tasks: int, cycles: int, tally: Tally) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)

    async def worker(r: int, i: int) -> None:
        lock = client.lock(f"b:{r}:{i}", timeout=TTL)
        for _ in range(cycles):
            try:
                ok = await lock.acquire(blocking=True, blocking_timeout=10)
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                continue
            if not ok:
                tally.error("refused (free key)")
                continue
            try:
                await lock.release()
            except Exception as exc:
                tally.loss(error_kind(exc))
            tally.op()

    try:
        for r in range(rounds):
            await asyncio.gather(*(worker(r, i) for i in range(tasks)))
    finally:
        await client.aclose()


def scenario_b(rounds: int, tasks: int, cycles: int) -> list[Row]:
    rows = []
    with RedisCluster(3) as cluster:
        for burners in (False, True):
            rates: dict[str, float] = {}
            for label, run in (
                ("ours (3)", lambda t: _b_ours(cluster.urls, rounds, tasks, cycles, t)),
                (
                    "redis.asyncio Lock (1)",
                    lambda t: _b_redis_py(cluster.urls[0], rounds, tasks, cycles, t),
                ),
            ):
                progress(f"b: {label}, {condition(burners)}")
                cluster.flush()
                tally = Tally()
                with stress(burners):
                    t0 = time.perf_counter()
                    asyncio.run(run(tally))
                    elapsed = time.perf_counter() - t0
                rates[label] = tally.ops / elapsed
                rows.append(
                    Row(
                        "b",
                        label,
                        condition(burners),
                        rounds * tasks * cycles,
                        sum(tally.spurious.values()),
                        sum(tally.lost.values()),
                        None,
                        rates[label],
                        "cycles/s",
                        f"{rounds} rounds x {tasks} tasks x {cycles} cycles"
                        + (f"; {kinds(tally.spurious + tally.lost)}" if tally.spurious else ""),
                        errors=tally.first,
                    )
                )
            ratio = rates["ours (3)"] / rates["redis.asyncio Lock (1)"]
            rows[-2].detail += f"; {ratio:.2f}x redis.asyncio"
    return rows


# -- c and d: many renewed locks --------------------------------------------------------------


def _renewed_locks(rl: Redlock, prefix: str, count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    return [
        # Acquired by one pool of threads, released by another: the bench is their one owner.
        rl.lock(f"{prefix}:{i}", ttl=rng.uniform(*RENEWED_TTL), auto_renew=True, owner="bench")
        for i in range(count)
    ]


def _hold_watching(locks: Sequence[Any], seconds: float) -> tuple[int, float | None]:
    """Hold for ``seconds``, looking every 0.5 s: (most lost at once, seconds to first loss)."""
    start = time.monotonic()
    peak, first = 0, None
    while (left := start + seconds - time.monotonic()) > 0:
        time.sleep(min(0.5, left))
        now_lost = lost_now(locks)
        if now_lost and first is None:
            first = time.monotonic() - start
        peak = max(peak, now_lost)
    return peak, first


def _settle_losses(locks: Sequence[Any], tally: Tally) -> set[int]:
    """Count (once each) the locks whose handle already knows it lost them."""
    gone = {id(lock) for lock in locks if lock.lost is not None or not lock.held}
    for _ in gone:
        tally.loss("lost while held")
    return gone


@contextlib.contextmanager
def busy_callers(rl: Redlock, threads: int, tally: Tally) -> Iterator[list[int]]:
    """``threads`` threads taking and releasing a lock each (their own keys) as fast as they
    can while in the block; yields their cycle counts (final once the block ends)."""
    stop = threading.Event()
    ops = [0] * threads

    def cycle(i: int) -> None:
        lock = rl.lock(f"caller:{i}", ttl=TTL)
        while not stop.is_set():
            if one_cycle(lock, tally, timeout=TTL):
                ops[i] += 1

    workers = [threading.Thread(target=cycle, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield ops
    finally:
        stop.set()
        for worker in workers:
            worker.join()


#: The three causes a lost renewed lock names (``lost`` events' reason), as the table shows.
LOSS_CAUSES = ("renewal fell behind", "the process was paused", "the nodes refused")


def loss_cause(reason: str | None) -> str:
    """Which of :data:`LOSS_CAUSES` a ``lost`` event's reason names (else the reason)."""
    text = reason or "?"
    found = [(text.find(cause), cause) for cause in LOSS_CAUSES if cause in text]
    return min(found)[1] if found else text[:60]


class LossReasons:
    """A listener counting the ``lost`` events of a Redlock by cause, with the first message
    of each."""

    def __init__(self) -> None:
        self.causes: Counter[str] = Counter()
        self.first: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        if event.kind != "lost":
            return
        cause = loss_cause(event.reason)
        with self._lock:
            self.causes[cause] += 1
            self.first.setdefault(cause, f"{event.name}: {event.reason}")


def round_stats(since: float) -> dict[str, Any]:
    """The watchdog's rounds that began after ``since`` (monotonic): how many, how late
    they began after their first lease was due and how long they took (p50, p99, max, in
    seconds), and the largest."""
    rounds = [r for r in list(renewer.rounds) if r.started >= since]
    if not rounds:
        return {"rounds": 0}
    late = [r.late for r in rounds]
    took = [r.took for r in rounds]
    return {
        "rounds": len(rounds),
        "late": [round(pct(late, 50), 3), round(pct(late, 99), 3), round(max(late), 3)],
        "took": [round(pct(took, 50), 3), round(pct(took, 99), 3), round(max(took), 3)],
        "largest": max(r.leases for r in rounds),
    }


def renewed_hold(
    urls: Sequence[str],
    count: int,
    hold: float,
    *,
    burners: bool,
    prefix: str,
    during: Callable[[], None] | None = None,
    callers: int = 0,
) -> tuple[Tally, dict[str, Any]]:
    """Acquire ``count`` auto-renewed locks, hold them ``hold`` s, release them; counts, with
    the lost locks' causes (``info["causes"]``) and the watchdog's rounds meanwhile
    (``info["renewal"]``, see :func:`round_stats`). ``callers`` threads take and release
    locks of their own as fast as they can while the locks are held (``info["caller_ops"]``:
    how many cycles): the watchdog competes with them for the interpreter."""
    tally = Tally()
    rl = Redlock(list(urls), key_prefix=prefix)
    reasons = LossReasons()
    rl.listeners.append(reasons)
    info: dict[str, Any] = {}
    try:
        locks = _renewed_locks(rl, "r", count, seed=count)
        started = time.monotonic()
        with stress(burners):
            t0 = time.perf_counter()
            held = acquire_many(locks, tally)
            info["acquire_s"] = time.perf_counter() - t0
            info["held"] = len(held)
            if during is not None:
                watcher = threading.Thread(target=during, daemon=True)
                watcher.start()
            with busy_callers(rl, callers, tally) as ops:
                info["peak_lost"], info["first_loss_s"] = _hold_watching(held, hold)
            if callers:
                info["caller_ops"] = sum(ops)
            gone = _settle_losses(held, tally)
        info["release_errors"] = release_many(held, tally, gone)
    finally:
        rl.close()
    info["renewal"] = round_stats(started)
    info["causes"] = dict(reasons.causes)
    info["cause_first"] = dict(reasons.first)
    return tally, info


def _renewed_row(
    scenario: str, variant: str, cond: str, count: int, tally: Tally, info: dict[str, Any]
) -> Row:
    first = info["first_loss_s"]
    detail = (
        f"held {info['held']:,}; most lost at once {info['peak_lost']:,}"
        + (f" (first after {first:.1f} s)" if first is not None else "")
        + f"; release errors {info['release_errors']:,}"
    )
    if info.get("causes"):
        detail += "; lost because " + ", ".join(
            f"{cause} {n:,}" for cause, n in Counter(info["causes"]).most_common()
        )
    renewal = info.get("renewal", {})
    if renewal.get("rounds"):
        detail += (
            f"; {renewal['rounds']:,} renewal rounds, late p99 {renewal['late'][1]:.2f} s "
            f"(max {renewal['late'][2]:.2f}), took p99 {renewal['took'][1]:.2f} s "
            f"(max {renewal['took'][2]:.2f}), largest {renewal['largest']:,} leases"
        )
    if tally.spurious:
        detail += f"; {kinds(tally.spurious)}"
    return Row(
        scenario,
        variant,
        cond,
        count,
        sum(tally.spurious.values()),
        sum(tally.lost.values()),
        None,
        info["held"] / info["acquire_s"] if info["acquire_s"] else None,
        "acquires/s",
        detail,
        {k: v for k, v in info.items() if k not in ("probe", "cause_first")},
        {**tally.first, **{f"lost ({k})": v for k, v in info.get("cause_first", {}).items()}},
    )


def scenario_c(count: int, hold: float, burners_only: bool = False, callers: int = 0) -> list[Row]:
    """``count`` renewed locks held ``hold`` s, without stress and beside burners (or only
    beside them); with ``callers`` threads taking other locks meanwhile (see
    :func:`renewed_hold`)."""
    rows = []
    variant = f"{count:,} locks, {hold:.0f} s" + (f", {callers} busy threads" if callers else "")
    with RedisCluster(3) as cluster:
        for burners in (True,) if burners_only else (False, True):
            progress(f"c: {variant}, {condition(burners)}")
            tally, info = renewed_hold(
                cluster.urls,
                count,
                hold,
                burners=burners,
                prefix=f"c{int(burners)}",
                callers=callers,
            )
            row = _renewed_row("c", variant, condition(burners), count, tally, info)
            if callers:
                row.detail += f"; the busy threads' cycles {info['caller_ops'] / hold:,.0f}/s"
            rows.append(row)
    return rows


def _pause_and_probe(
    node: Any, paused: bool, pause: float, rl: Redlock, probe: Tally, stop: threading.Event
) -> None:
    """Pause ``node`` (when ``paused``) for ``pause`` s, taking and releasing a probe key all
    the while; resume it however this ends."""
    if stop.wait(0.5):
        return
    if paused:
        node.pause()
    try:
        lock = rl.lock("probe", ttl=TTL)
        end = time.monotonic() + pause
        while time.monotonic() < end and not stop.is_set():
            try:
                ok: bool | None = lock.acquire()
            except Exception as exc:
                probe.error(error_kind(exc), exc)
                ok = None
            if ok is False:
                probe.error("refused (free key)")
            elif ok:
                release_counted(lock, probe)
                probe.op()
            stop.wait(0.005)
    finally:
        node.resume()


def scenario_d(count: int, pause: float, baseline: bool = True) -> list[Row]:
    """One of three nodes SIGSTOPped for ``pause`` s while ``count`` renewed locks are held, then
    resumed, then every lock released. A probe thread takes and releases another key all the
    while, counting spurious errors; the baseline holds the same locks as long, no pause."""
    rows = []
    # After the resume the locks live through the node answering what queued up while it was
    # frozen, and through one more renewal, before they are released.
    settle = RENEWED_TTL[1] / 3 + 2.0
    with RedisCluster(3) as cluster:
        for paused in (False, True) if baseline else (True,):
            progress(f"d: {count} renewed locks, node {'paused' if paused else 'up'} {pause:.0f} s")
            probe = Tally()
            # The probe shares the held locks' key prefix, whose node markers their acquires
            # set while every node was up: a prefix first used during the pause would (rightly)
            # find the nodes guarded, since the paused one cannot vouch for them.
            probe_rl = Redlock(cluster.urls, key_prefix=f"d{int(paused)}")
            stop = threading.Event()

            during = functools.partial(
                _pause_and_probe, cluster[0], paused, pause, probe_rl, probe, stop
            )

            try:
                tally, info = renewed_hold(
                    cluster.urls,
                    count,
                    0.5 + pause + settle,
                    burners=False,
                    prefix=f"d{int(paused)}",
                    during=during,
                )
            finally:
                stop.set()
                cluster[0].resume()
                probe_rl.close()
            tally.merge(probe)
            row = _renewed_row(
                "d",
                f"{count:,} locks",
                f"node paused {pause:.0f} s" if paused else "no pause",
                count,
                tally,
                info,
            )
            row.detail += f"; probe {probe.ops / pause:,.0f} cycles/s in the pause window"
            row.extra["probe_ops"] = probe.ops
            rows.append(row)
    return rows


# -- e: emulated packet loss ------------------------------------------------------------------


def contended_loop(
    rl: Redlock, key: str, deadline: float, tally: Tally, timeout: float = 10.0, work: float = 0.0
) -> int:
    """Acquire (blocking) / release ``key`` until ``deadline``, holding it ``work`` seconds
    each time; returns acquires that timed out."""
    gave_up = 0
    clock = time.monotonic
    while clock() < deadline:
        lock = rl.lock(key, ttl=TTL)
        try:
            ok = lock.acquire(blocking=True, timeout=timeout)
        except Exception as exc:
            tally.error(error_kind(exc), exc)
            continue
        if not ok:
            gave_up += 1
            continue
        acquired = clock()
        if work:
            time.sleep(work)
        releasing = clock()
        release_counted(lock, tally)
        tally.hold(Hold(key, acquired, releasing, clock()))
        tally.op()
    return gave_up


def _collect(into: list[Any], function: Callable[..., Any], *args: Any) -> None:
    into.append(function(*args))


@contextlib.contextmanager
def lossy_cluster(prefix: str) -> Iterator[tuple[RedisCluster, ProxyProcess]]:
    """Three nodes, each behind a lossy proxy (a clean link to start with), ``prefix``'s
    node markers set while the link is clean: a prefix first used under loss could (rightly)
    find a node guarded when another one answered too late to vouch for it, which is the
    restart guard at work, not the link's doing."""
    with (
        RedisCluster(3) as cluster,
        ProxyProcess([(n.host, n.port) for n in cluster], seed=7) as proxy,
    ):
        warm = Redlock(proxy.urls, key_prefix=prefix)
        try:
            sync_cycles(warm, "warm", 20, Tally())
        finally:
            warm.close()
        yield cluster, proxy


def scenario_e(
    seconds: float,
    levels: Sequence[float] = (0.0, 0.15, 0.30),
    threads: int = 4,
    keys: int = 2,
    work: float = 0.0,
) -> list[Row]:
    """``threads`` threads share ``keys`` keys through a lossy proxy in front of every node,
    each holder working ``work`` seconds in the lock (none: the lock's own cost alone)."""
    rows = []
    base: float | None = None
    name = "ew" if work else "e"
    with lossy_cluster(name) as (_, proxy):
        for level in levels:
            progress(f"{name}: {level:.0%} loss, {seconds:.0f} s")
            proxy.set_link(level, 0.0)
            before = proxy.stats()
            rl = Redlock(proxy.urls, key_prefix=name)
            tally = Tally()
            gave_up: list[int] = []
            try:
                deadline = time.monotonic() + seconds
                t0 = time.perf_counter()
                ts = [
                    threading.Thread(
                        target=_collect,
                        args=(
                            gave_up,
                            contended_loop,
                            rl,
                            f"k{i % keys}",
                            deadline,
                            tally,
                            10.0,
                            work,
                        ),
                        daemon=True,
                    )
                    for i in range(threads)
                ]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                elapsed = time.perf_counter() - t0
            finally:
                rl.close()
            after = proxy.stats()
            rate = tally.ops / elapsed
            if level == 0:
                base = rate
            worked = f", {work * 1000:.0f} ms of work per hold" if work else ""
            detail = (
                f"{threads} threads on {keys} keys{worked}; {after.lost - before.lost:,} of "
                f"{after.chunks - before.chunks:,} chunks lost, gave up {sum(gave_up)}"
            )
            if base and level:
                detail += f"; {rate / base - 1:+.0%} vs no loss"
            if tally.spurious:
                detail += f"; {kinds(tally.spurious)}"
            rows.append(
                Row(
                    name,
                    "3 nodes",
                    f"{level:.0%} loss" if level else "no loss",
                    tally.ops,
                    sum(tally.spurious.values()),
                    sum(tally.lost.values()),
                    count_overlaps(tally.holds),
                    rate,
                    "holds/s",
                    detail,
                    {
                        "chunks": after.chunks - before.chunks,
                        "chunks_lost": after.lost - before.lost,
                        "gave_up": sum(gave_up),
                    },
                    tally.first,
                )
            )
    return rows


# -- f: a hot key across processes ------------------------------------------------------------


def _f_worker(
    kind: str,
    urls: list[str],
    key: str,
    fair: bool,
    seconds: float,
    barrier: Any,
    out: Any,
) -> None:
    tally = Tally()
    gave_up = 0
    try:
        if kind == "ours":
            rl: Any = Redlock(urls, key_prefix="f")
            make = lambda: rl.lock(key, ttl=TTL, fair=fair)  # noqa: E731
            take = lambda lock: lock.acquire(blocking=True, timeout=10)  # noqa: E731
            close = rl.close
        else:
            import redis

            client = redis.Redis.from_url(urls[0])
            make = lambda: client.lock(f"f:{key}", timeout=TTL)  # noqa: E731
            take = lambda lock: lock.acquire(blocking=True, blocking_timeout=10)  # noqa: E731
            close = client.close
        # Opens this process's connections before the clock starts.
        if kind == "ours":
            warm = rl.lock(f"warm-{os.getpid()}", ttl=TTL)
        else:
            warm = client.lock(f"warm-{os.getpid()}", timeout=TTL)
        take(warm)
        warm.release()
        barrier.wait()
        deadline = time.monotonic() + seconds
        clock = time.monotonic
        while clock() < deadline:
            lock = make()
            try:
                ok = take(lock)
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                continue
            if not ok:
                gave_up += 1
                continue
            acquired = clock()
            releasing = clock()
            try:
                lock.release()
            except Exception as exc:
                tally.loss(error_kind(exc))
            tally.hold(Hold(key, acquired, releasing, clock()))
            tally.op()
        close()
        out.put((tally.first, tally.holds, dict(tally.spurious), dict(tally.lost), gave_up, None))
    except Exception:
        out.put(({}, [], {}, {}, gave_up, traceback.format_exc(limit=4)))


def hot_key(kind: str, urls: list[str], fair: bool, processes: int, seconds: float) -> Row:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes + 1)
    out = ctx.Queue()
    key = f"hot-{kind}-{int(fair)}-{os.urandom(3).hex()}"
    procs = [
        ctx.Process(
            target=_f_worker, args=(kind, urls, key, fair, seconds, barrier, out), daemon=True
        )
        for _ in range(processes)
    ]
    tally = Tally()
    gave_up = 0
    shares = []
    try:
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        for _ in procs:
            first, holds, spurious, lost, gave, err = out.get(timeout=seconds + 60)
            if err:
                raise RuntimeError(f"hot-key worker failed:\n{err}")
            tally.holds.extend(holds)
            tally.spurious.update(spurious)
            tally.lost.update(lost)
            for kind, message in first.items():
                tally.first.setdefault(kind, message)
            tally.ops += len(holds)
            gave_up += gave
            shares.append(len(holds))
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    holds = sorted(tally.holds, key=lambda h: h.acquired)
    gaps = [(b.acquired - a.released) * 1000 for a, b in itertools.pairwise(holds)]
    label = f"ours (3), fair={fair}" if kind == "ours" else "redis-py Lock (1)"
    detail = (
        f"{processes} processes; gap p50 {pct(gaps, 50):.2f} ms, p99 {pct(gaps, 99):.2f} ms; "
        f"shares {min(shares)}-{max(shares)}"
    )
    if gave_up:
        detail += f"; gave up {gave_up}"
    if tally.spurious:
        detail += f"; {kinds(tally.spurious)}"
    return Row(
        "f",
        label,
        "no stress",
        len(holds),
        sum(tally.spurious.values()),
        sum(tally.lost.values()),
        count_overlaps(holds),
        len(holds) / seconds,
        "acquires/s",
        detail,
        {"gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99)},
        tally.first,
    )


def scenario_f(seconds: float, processes: int) -> list[Row]:
    rows = []
    with RedisCluster(3) as cluster:
        for kind, fair in (("ours", False), ("ours", True), ("redis-py", False)):
            progress(f"f: {kind} fair={fair}, {processes} processes, {seconds:.0f} s")
            urls = cluster.urls if kind == "ours" else cluster.urls[:1]
            rows.append(hot_key(kind, urls, fair, processes, seconds))
    return rows


# -- g: many waiters on one key: open file descriptors ---------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class FdSampler:
    """Samples this process's open fds every 5 ms in a thread; ``peak`` is the most seen."""

    def __init__(self) -> None:
        self.peak = _open_fds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _open_fds())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def _g_tasks(urls: list[str], waiters: int, drain: float, tally: Tally) -> dict[str, Any]:
    rl = AsyncRedlock(urls)
    try:
        holder = rl.lock("g", ttl=60)
        await holder.acquire()
        held_from = time.monotonic()
        before = _open_fds()
        sampler = FdSampler()
        started = 0
        gave_up: list[int] = []
        # The waiting phase (a few seconds) plus the drain: a waiter still waiting then gives up.
        deadline = time.monotonic() + 10 + drain

        async def waiter() -> None:
            nonlocal started
            lock = rl.lock("g", ttl=TTL)
            started += 1
            try:
                ok = await lock.acquire(
                    blocking=True, timeout=max(0.001, deadline - time.monotonic())
                )
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                return
            if not ok:
                gave_up.append(1)  # slow, not an error: counted apart
                return
            acquired = time.monotonic()
            releasing = time.monotonic()
            try:
                await lock.release()
            except (LockLost, LockNotOwned) as exc:
                tally.loss(error_kind(exc))
            tally.hold(Hold("g", acquired, releasing, time.monotonic()))
            tally.op()

        tasks = [asyncio.ensure_future(waiter()) for _ in range(waiters)]
        while started < waiters:
            await asyncio.sleep(0.01)
        await asyncio.sleep(2.0)  # let every waiter settle into its wait
        waiting_peak = sampler.peak
        t0 = time.perf_counter()
        tally.hold(Hold("g", held_from, time.monotonic(), time.monotonic()))
        await holder.release()
        await asyncio.gather(*tasks)
        drain_s = time.perf_counter() - t0
        peak = sampler.stop()
        return {
            "before": before,
            "waiting": waiting_peak,
            "peak": peak,
            "drain_s": drain_s,
            "gave_up": len(gave_up),
        }
    finally:
        await rl.close()


def _g_threads(urls: list[str], waiters: int, drain: float, tally: Tally) -> dict[str, Any]:
    threading.stack_size(512 * 1024)
    rl = Redlock(urls)
    try:
        holder = rl.lock("g", ttl=60)
        holder.acquire()
        held_from = time.monotonic()
        before = _open_fds()
        sampler = FdSampler()
        started = threading.Semaphore(0)
        gave_up: list[int] = []
        # The waiting phase (a few seconds) plus the drain: a waiter still waiting then gives up.
        deadline = time.monotonic() + 10 + drain

        def waiter() -> None:
            lock = rl.lock("g", ttl=TTL)
            started.release()
            try:
                ok = lock.acquire(blocking=True, timeout=max(0.001, deadline - time.monotonic()))
            except Exception as exc:
                tally.error(error_kind(exc), exc)
                return
            if not ok:
                gave_up.append(1)  # slow, not an error: counted apart
                return
            acquired = time.monotonic()
            releasing = time.monotonic()
            release_counted(lock, tally)
            tally.hold(Hold("g", acquired, releasing, time.monotonic()))
            tally.op()

        ts = [threading.Thread(target=waiter, daemon=True) for _ in range(waiters)]
        for t in ts:
            t.start()
        for _ in ts:
            started.acquire()
        time.sleep(2.0)  # let every waiter settle into its wait
        waiting_peak = sampler.peak
        t0 = time.perf_counter()
        tally.hold(Hold("g", held_from, time.monotonic(), time.monotonic()))
        holder.release()
        for t in ts:
            t.join()
        drain_s = time.perf_counter() - t0
        peak = sampler.stop()
        return {
            "before": before,
            "waiting": waiting_peak,
            "peak": peak,
            "drain_s": drain_s,
            "gave_up": len(gave_up),
        }
    finally:
        rl.close()


def _g_child(mode: str, urls: list[str], waiters: int, drain: float, out: Any) -> None:
    tally = Tally()
    try:
        if mode == "asyncio tasks":
            info = asyncio.run(_g_tasks(urls, waiters, drain, tally))
        else:
            info = _g_threads(urls, waiters, drain, tally)
        info["errors"] = tally.first
        out.put((info, tally.holds, dict(tally.spurious), dict(tally.lost), None))
    except Exception:
        out.put(({}, [], {}, {}, traceback.format_exc(limit=4)))


def scenario_g(waiters: int, drain: float) -> list[Row]:
    if not os.path.isdir("/proc/self/fd"):
        progress("g: skipped (no /proc/self/fd to count open files)")
        return []
    rows = []
    ctx = mp.get_context("spawn")
    with RedisCluster(3) as cluster:
        for mode in ("asyncio tasks", "threads"):
            progress(f"g: {waiters} {mode} waiting on one key")
            cluster.flush()
            out = ctx.Queue()
            proc = ctx.Process(target=_g_child, args=(mode, cluster.urls, waiters, drain, out))
            proc.start()
            try:
                info, holds, spurious, lost, err = out.get(timeout=600)
            finally:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if err:
                raise RuntimeError(f"g ({mode}) failed:\n{err}")
            done = len(holds) - 1
            rows.append(
                Row(
                    "g",
                    f"{waiters:,} {mode}",
                    "no stress",
                    waiters,
                    sum(spurious.values()),
                    sum(lost.values()),
                    count_overlaps(holds),
                    done / info["drain_s"] if info["drain_s"] else None,
                    "acquires/s",
                    f"open fds {info['before']:,} -> {info['waiting']:,} while waiting, peak "
                    f"{info['peak']:,}" + (f"; {kinds(Counter(spurious))}" if spurious else ""),
                    {k: info[k] for k in ("before", "waiting", "peak")},
                    info["errors"],
                )
            )
    return rows


# -- h: @locked views under gunicorn ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG), so a
    killed bench leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def gunicorn(worker_class: str, nodes: Sequence[str]) -> Iterator[int]:
    """testproject under gunicorn on a free port; stopped (SIGTERM, then SIGKILL) on exit."""
    port = _free_port()
    workers = (
        ["--workers", "2", "--threads", "16"] if worker_class == "gthread" else ["--workers", "4"]
    )
    tmp = tempfile.mkdtemp(prefix="redlock-load-")
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="testproject.settings",
        REDLOCK_NODES=",".join(nodes),
        REDLOCK_SQLITE=os.path.join(tmp, "db.sqlite3"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    log = open(os.path.join(tmp, "gunicorn.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "testproject.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--worker-class",
            worker_class,
            *workers,
            "--backlog",
            "256",
            "--log-level",
            "warning",
            "--chdir",
            ROOT,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log.flush()
                with open(os.path.join(tmp, "gunicorn.log"), "rb") as f:
                    raise RuntimeError(
                        f"gunicorn exited: {f.read()[-2000:].decode(errors='replace')}"
                    )
            try:
                if _get(port, "/ping/")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not answer within 60 s")
            time.sleep(0.1)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def http_load(port: int, paths: Sequence[str], seconds: float) -> tuple[Counter[int], list[Hold]]:
    """One client thread per path, each requesting it again and again for ``seconds``."""
    statuses: Counter[int] = Counter()
    holds: list[Hold] = []
    guard = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(path: str) -> None:
        mine: Counter[int] = Counter()
        my_holds = []
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < deadline:
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                body = r.read()
                status = r.status
                if r.will_close:
                    conn.close()
            except (OSError, http.client.HTTPException):
                conn.close()
                mine[0] += 1  # connection-level failure
                continue
            mine[status] += 1
            if status == 200:
                data = json.loads(body)
                my_holds.append(Hold(str(data["lock"]), data["start"], data["end"], data["end"]))
        conn.close()
        with guard:
            statuses.update(mine)
            holds.extend(my_holds)

    ts = [threading.Thread(target=client, args=(p,), daemon=True) for p in paths]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return statuses, holds


def scenario_h(seconds: float, clients: int, with_baseline: bool = True) -> list[Row]:
    try:
        import gunicorn as _gunicorn  # noqa: F401
    except ImportError:
        progress("h: skipped (gunicorn is not installed: pip install -e '.[bench]')")
        return []
    views = {
        "async view": lambda i: f"/reports/{i}/",
        "sync view": lambda i: f"/orders/{i}/pay/",
    }
    rows = []
    with RedisCluster(3) as cluster:
        for worker_class in ("gthread", "sync"):
            with gunicorn(worker_class, cluster.urls) as port:
                for view, path in views.items():
                    for keys in ("one key", "distinct keys"):
                        paths = [path(7 if keys == "one key" else 1000 + i) for i in range(clients)]
                        for burners in (False, True) if with_baseline else (True,):
                            progress(f"h: {worker_class}, {view}, {keys}, {condition(burners)}")
                            with stress(burners):
                                t0 = time.perf_counter()
                                statuses, holds = http_load(port, paths, seconds)
                                elapsed = time.perf_counter() - t0
                            total = sum(statuses.values())
                            bad = sum(v for s, v in statuses.items() if s >= 500 or s == 0)
                            if keys == "distinct keys":
                                # Each client asks for its own key, one request after the
                                # other: nobody else holds it, so a 423 is not contention.
                                bad += statuses.get(423, 0)
                            rows.append(
                                Row(
                                    "h",
                                    f"{worker_class}, {view}, {keys}",
                                    condition(burners),
                                    total,
                                    bad,
                                    0,
                                    count_overlaps(holds),
                                    total / elapsed,
                                    "responses/s",
                                    ", ".join(
                                        f"{'conn err' if s == 0 else s}: {v:,}"
                                        for s, v in sorted(statuses.items())
                                    ),
                                    {"statuses": dict(statuses)},
                                )
                            )
    return rows


# -- down: a node that is really down ---------------------------------------------------------


def _timed_ops(rl: Redlock, count: int, tally: Tally) -> list[float]:
    """Each acquire+release cycle's time in ms (failed cycles included: their cost is paid)."""
    lock = rl.lock("down", ttl=TTL)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        try:
            ok = lock.acquire()
        except Exception as exc:
            tally.error(error_kind(exc), exc)
            ok = False
        if ok:
            release_counted(lock, tally)
            tally.op()
        times.append((time.perf_counter() - t0) * 1000)
    return times


def scenario_down(ops: int) -> list[Row]:
    rows = []
    for how in ("killed", "frozen"):
        progress(f"down: one of 3 nodes {how}, {ops} cycles")
        with RedisCluster(3) as cluster:
            rl = Redlock(cluster.urls)
            try:
                _timed_ops(rl, 200, Tally())
                base = _timed_ops(rl, ops, Tally())
                if how == "killed":
                    cluster[2].kill()
                else:
                    cluster[2].pause()
                tally = Tally()
                t0 = time.perf_counter()
                times = _timed_ops(rl, ops, tally)
                elapsed = time.perf_counter() - t0
            finally:
                cluster[2].resume()
                rl.close()
        timeout_ms = rl.node_timeout * 1000
        p50 = statistics.median(base)
        extra = [t - p50 for t in times]
        paying = sum(1 for e in extra if e >= timeout_ms / 2)
        met = paying <= 1 and extra[0] <= 1.5 * timeout_ms + pct(base, 99)
        rows.append(
            Row(
                "down",
                f"1 of 3 {how}",
                "no stress",
                ops,
                sum(tally.spurious.values()),
                sum(tally.lost.values()),
                None,
                tally.ops / elapsed,
                "cycles/s",
                f"first op {extra[0]:+.1f} ms, then p50 {statistics.median(extra[1:]):+.2f} ms "
                f"(up: p50 {p50:.2f} ms); {paying} ops paid >= half a node timeout "
                f"({timeout_ms:.0f} ms), +{sum(max(e, 0) for e in extra):,.0f} ms in all; "
                f"goal {'met' if met else 'missed'}"
                + (f"; {kinds(tally.spurious)}" if tally.spurious else ""),
                {"first_extra_ms": extra[0], "paying": paying, "goal_met": met},
                tally.first,
            )
        )
    return rows


# -- report ------------------------------------------------------------------------------------

HEADERS = (
    "scenario",
    "variant",
    "condition",
    "n",
    "spurious",
    "lost",
    "overlaps",
    "rate",
    "unit",
    "detail",
)


def cells(row: Row) -> list[str]:
    return [
        row.scenario,
        row.variant,
        row.condition,
        f"{row.n:,}",
        f"{row.spurious:,}",
        f"{row.lost:,}",
        "-" if row.overlaps is None else f"{row.overlaps:,}",
        "-" if row.rate is None else f"{row.rate:,.0f}",
        row.unit,
        row.detail,
    ]


def text_table(rows: Sequence[Row]) -> list[str]:
    data = [list(HEADERS), *(cells(r) for r in rows)]
    widths = [max(len(r[i]) for r in data) for i in range(len(HEADERS) - 1)]
    right = {3, 4, 5, 6, 7}

    def line(r: list[str]) -> str:
        parts = [
            (c.rjust(w) if i in right else c.ljust(w))
            for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        return "  ".join([*parts, r[-1]]).rstrip()

    return [line(data[0]), "  ".join("-" * w for w in widths) + "  ------", *map(line, data[1:])]


def error_lines(rows: Sequence[Row]) -> list[str]:
    """The first message of each kind of spurious error, per row that had any."""
    out = []
    for r in rows:
        for kind, message in r.errors.items():
            out.append(f"{r.scenario} {r.variant} ({r.condition}), {kind}: {message}")
    return out


def markdown_table(rows: Sequence[Row]) -> list[str]:
    return [
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("--:" if i in (3, 4, 5, 6, 7) else "---" for i in range(len(HEADERS))) + "|",
        *("| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in rows),
    ]


def machine() -> dict[str, Any]:
    import django_redlock
    from django_redlock.testing import redis_server_binary

    try:
        server = subprocess.run(
            [redis_server_binary(), "--version"], capture_output=True, text=True, timeout=30
        )
        redis_server = server.stdout.strip().split(" sha=")[0]
    except Exception:
        redis_server = "?"
    return {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "django_redlock": django_redlock.__version__,
        "redis_server": redis_server,
        "loadavg_start": os.getloadavg(),
    }


def run(names: Sequence[str], sizes: Sizes) -> list[Row]:
    runners: dict[str, Callable[[], list[Row]]] = {
        "a": lambda: scenario_a(sizes.a_cycles, sizes.a_baseline),
        "b": lambda: scenario_b(sizes.b_rounds, sizes.b_tasks, sizes.b_cycles),
        "c": lambda: scenario_c(sizes.c_locks, sizes.c_hold),
        "d": lambda: scenario_d(sizes.d_locks, sizes.d_pause),
        "e": lambda: scenario_e(sizes.e_seconds),
        # The outside run's pace (6.8 holds/s without loss): a lock guards work, and loss
        # then costs a share of a hold, not many holds' worth of back-to-back cycles.
        "ew": lambda: scenario_e(sizes.e_seconds, work=EW_WORK),
        "f": lambda: scenario_f(sizes.f_seconds, sizes.f_processes),
        "g": lambda: scenario_g(sizes.g_waiters, sizes.g_drain),
        "h": lambda: scenario_h(sizes.h_seconds, sizes.h_clients),
        "down": lambda: scenario_down(sizes.down_ops),
    }
    rows: list[Row] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows += runners[name]()
        except Exception as exc:
            traceback.print_exc()
            rows.append(
                Row(name, "FAILED", "-", 0, 0, 0, None, None, "-", f"{error_kind(exc)}: {exc}")
            )
        progress(f"{name}: {time.perf_counter() - t0:.0f} s")
    return rows


def _terminate(signum: int, frame: Any) -> None:
    # Unwinds through every `with` and `finally`, so servers and burners are stopped.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about 5 minutes)")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {','.join(SCENARIOS)}",
    )
    parser.add_argument("--markdown", action="store_true", help="also write bench/results/*.md")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    signal.signal(signal.SIGTERM, _terminate)
    sizes = QUICK if args.quick else FULL
    info = machine()
    wall0 = time.perf_counter()
    rows = run(names, sizes)
    info["loadavg_end"] = os.getloadavg()
    info["wall_s"] = round(time.perf_counter() - wall0)
    head = (
        f"bench/load.py{' --quick' if args.quick else ''} --scenarios {','.join(names)}: "
        f"{info['date']}, {info['cpus']} CPUs, Linux {info['kernel']}, Python {info['python']}, "
        f"{info['redis_server']}, django-redlock {info['django_redlock']}, load "
        f"{info['loadavg_start'][0]:.1f} -> {info['loadavg_end'][0]:.1f}, {info['wall_s']} s"
    )
    print()
    print(head)
    print("\n".join(text_table(rows)))
    errors = error_lines(rows)
    if errors:
        print("\nFirst error of each kind:")
        print("\n".join(f"  {line}" for line in errors))
    if args.markdown:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        stem = f"load-{_dt.date.today().isoformat()}-{info['cpus']}cpu" + (
            "-quick" if args.quick else ""
        )
        if list(names) != list(SCENARIOS):
            stem += "-partial-" + "+".join(names)
        md = "\n".join([head, "", *markdown_table(rows)]) + "\n"
        written = []
        for name, text in ((f"{stem}.md", md),):
            with open(os.path.join(RESULTS_DIR, name), "w") as f:
                f.write(text)
            written.append(name)
        with open(os.path.join(RESULTS_DIR, f"{stem}.json"), "w") as f:
            json.dump({"info": info, "rows": [asdict(r) for r in rows]}, f, indent=1, default=str)
        written.append(f"{stem}.json")
        if "partial" not in stem:
            with open(os.path.join(RESULTS_DIR, "load-latest.md"), "w") as f:
                f.write(md)
            written.append("load-latest.md")
        print()
        print(md)
        print("wrote " + ", ".join(f"bench/results/{w}" for w in written))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
