"""django-redlock against the Python lock libraries, in one run, on the same local nodes.

    python bench/run.py            # full run (about 4 minutes), prints the tables
    python bench/run.py --quick    # about a minute
    python bench/run.py --markdown --plot   # also bench/results/*.md|.rst, docs/_static/*.png

Five real ``redis-server`` nodes are started here (``django_redlock.testing.RedisCluster``);
1-node and 3-node configurations use the first 1 or 3 of them. Phases (``--phases``):

``cycle``       uncontended acquire+release latency, one thread, p50/p99 in microseconds
``throughput``  8 threads, a distinct key each, acquire+release cycles per second
``handoff``     4 workers (threads, then processes) pass ONE key around on 5 nodes: hold 1 ms,
                release, at once ask again (blocking, timeout 10 s). Gap = the next holder's
                acquire-returned time minus the previous holder's release-returned time
                (time.monotonic: CLOCK_MONOTONIC, one clock for all processes on Linux).
                Then again in strict rotation (a worker asks again only after another one has
                acquired), so every acquire is a waiter being woken: the wake-up latency
``delay``       the uncontended cycle with ``--latency-ms`` added per direction to every node
                (tc netem in a network namespace when the kernel has it, else a delaying proxy)

Every library is called through its public API (see bench/peers.py). Nothing here is a test:
the script only measures and prints, and always ends by itself.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import latency  # noqa: E402
import peers  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")
STATIC_DIR = os.path.join(ROOT, "docs", "_static")

#: (adapter id, node count) for the cycle and throughput phases, in table order.
CONFIGS: list[tuple[str, int]] = [
    ("ours", 1),
    ("ours", 3),
    ("ours", 5),
    ("redis-py", 1),
    ("python-redis-lock", 1),
    ("pottery", 1),
    ("pottery", 3),
    ("pottery", 5),
    ("redlock-ng", 3),
    ("redlock-ng", 5),
    ("redlock-py", 3),
    ("redlock-py", 5),
    ("floor", 1),
    ("floor", 3),
    ("floor", 5),
]
#: Not lock libraries: measured in the cycle phase only, never in the ratios.
CYCLE_ONLY = ("floor",)
#: Handoff: one key, 5 nodes for the Redlocks, the single-node locks on node 1.
HANDOFF: list[tuple[str, int]] = [
    ("ours", 5),
    ("pottery", 5),
    ("redlock-ng", 5),
    ("redlock-py", 5),
    ("redis-py", 1),
    ("python-redis-lock", 1),
]
#: Uncontended cycle under added latency.
DELAYED: list[tuple[str, int]] = [
    ("ours", 1),
    ("ours", 5),
    ("redis-py", 1),
    ("pottery", 5),
    ("redlock-ng", 5),
    ("redlock-py", 5),
]
PHASES = ("cycle", "throughput", "handoff", "delay")
#: Immediate: each worker asks again as soon as it released (the releaser may win again).
#: Rotation: after releasing, a worker waits until another worker has acquired before asking
#: again, so waiters are always queued and every acquire is a waiter being woken.
HANDOFF_VARIANTS = ("threads", "processes", "rotation-threads", "rotation-processes")
REDLOCKS_5 = ("pottery", "redlock-ng", "redlock-py")  # "other Python Redlocks"


# -- small helpers ---------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def fmt(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    """Plain-text table; ``align`` per column: ``l`` or ``r`` (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if a == "l" else str(c).rjust(w)
            for c, w, a in zip(cells, widths, align, strict=False)
        ).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def rst_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    # A lone "-" in a cell would be read as an empty bullet list.
    rows = [[("n/a" if str(c).strip() == "-" else c) for c in row] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    rule = "  ".join("=" * w for w in widths)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return [rule, line(headers), rule, *(line(r) for r in rows), rule]


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "--:" for i in range(len(headers))) + "|",
        *("| " + " | ".join(str(c) for c in r) + " |" for r in rows),
    ]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- machine ---------------------------------------------------------------------------------


def machine_info(cluster: Any) -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        server = cluster[0].info("server")
        redis_version = f"{server.get('redis_version')} ({server.get('executable', '?')})"
    except Exception:
        redis_version = "?"
    versions = {}
    for kind, cls in peers.ADAPTERS.items():
        try:
            versions[kind] = cls.version()
        except Exception:
            versions[kind] = "?"
    return {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "redis_server": redis_version,
        "loadavg_start": os.getloadavg(),
        "versions": versions,
    }


# -- phase 1: uncontended cycle ------------------------------------------------------------


def _warm(adapter: peers.Adapter, warmup: int) -> Any:
    h = adapter.handle(f"cycle-{uuid.uuid4().hex[:8]}")
    for _ in range(warmup):
        if not adapter.acquire(h, 1.0):
            raise RuntimeError("a free lock was not granted during warm-up")
        adapter.release(h)
    return h


def _timed_cycles(adapter: peers.Adapter, h: Any, cycles: int) -> tuple[list[float], float]:
    """(cycle times in µs, process CPU seconds) for ``cycles`` acquire+release cycles."""
    samples = []
    clock = time.perf_counter_ns
    cpu0 = cpu_seconds()
    for _ in range(cycles):
        t0 = clock()
        ok = adapter.acquire(h, 1.0)
        adapter.release(h)
        samples.append((clock() - t0) / 1000)
        if not ok:
            raise RuntimeError("a free lock was not granted")
    return samples, cpu_seconds() - cpu0


def _cycle_stats(samples: list[float], cpu: float) -> dict[str, float]:
    return {
        "p50": pct(samples, 50),
        "p99": pct(samples, 99),
        "mean": statistics.fmean(samples),
        "cpu": cpu / len(samples) * 1e6,
        "n": len(samples),
    }


def measure_cycle(adapter: peers.Adapter, cycles: int, warmup: int) -> dict[str, float]:
    h = _warm(adapter, warmup)
    return _cycle_stats(*_timed_cycles(adapter, h, cycles))


def measure_cycles_interleaved(
    adapters: dict[str, peers.Adapter], cycles: int, warmup: int, rounds: int
) -> dict[str, dict[str, Any]]:
    """The cycle for every configuration, in ``rounds`` interleaved rounds with the samples
    pooled: on a shared machine a burst of foreign load then touches every library a little
    instead of one library a lot."""
    out: dict[str, dict[str, Any]] = {}
    handles, samples, cpu = {}, {}, {}
    for key, a in adapters.items():
        try:
            handles[key] = _warm(a, warmup)
            samples[key], cpu[key] = [], 0.0
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    per = max(1, cycles // rounds)
    for i in range(rounds):
        progress(f"cycle round {i + 1}/{rounds}")
        for key in list(handles):
            try:
                s, c = _timed_cycles(adapters[key], handles[key], per)
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
                del handles[key]
                continue
            samples[key] += s
            cpu[key] += c
    for key in handles:
        out[key] = _cycle_stats(samples[key], cpu[key])
    return out


# -- phase 2: throughput ---------------------------------------------------------------------


def measure_throughput(adapter: peers.Adapter, threads: int, duration: float) -> dict[str, float]:
    counts = [0] * threads
    errors: list[str] = []
    lib_errors: list[str] = []
    barrier = threading.Barrier(threads + 1)
    stop = threading.Event()

    def work(i: int) -> None:
        try:
            h = adapter.handle(f"tp-{i}-{uuid.uuid4().hex[:6]}")
            for _ in range(5):  # opens this thread's connections
                adapter.acquire(h, 1.0)
                adapter.release(h)
        except Exception as exc:
            errors.append(repr(exc))
        barrier.wait()
        n = 0
        while not stop.is_set():
            try:
                if adapter.acquire(h, 1.0):
                    adapter.release(h)
                    n += 1
            except Exception as exc:
                # A library error on its own lock (pottery can raise ReleaseUnlockedLock here):
                # counted and shown, and the thread goes on with a fresh lock object.
                lib_errors.append(f"{type(exc).__name__}")
                h = adapter.handle(f"tp-{i}-{uuid.uuid4().hex[:6]}")
                if len(lib_errors) > 1000:
                    break
        counts[i] = n

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    time.sleep(duration)
    stop.set()
    for t in ts:
        t.join(30)
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return {
        "ops": sum(counts) / elapsed,
        "threads": threads,
        "count": sum(counts),
        "elapsed": elapsed,
        "errors": len(lib_errors),
        "error_kinds": sorted(set(lib_errors)),
    }


# -- phase 3: handoff ------------------------------------------------------------------------


def _handoff_loop(
    adapter: peers.Adapter,
    key: str,
    deadline_after: float,
    hold: float,
    ready: Callable[[], None],
    counter: Any = None,
) -> tuple[list[tuple[float, float, float]], int]:
    """One worker: acquire (blocking, 10 s), hold, release, again; until the window closes.

    With ``counter`` (a shared ``multiprocessing.Value`` counting acquisitions), strict
    rotation: after its release a worker waits until someone else has acquired before it asks
    again. Returns (holds as (acquired, releasing, released) monotonic times, failed acquires).
    """
    warm = adapter.handle(f"warm-{uuid.uuid4().hex[:8]}")
    adapter.acquire(warm, 1.0)
    adapter.release(warm)
    ready()
    end = time.monotonic() + deadline_after
    holds = []
    failed = 0
    clock = time.monotonic
    while True:
        h = adapter.handle(key)
        if not adapter.acquire(h, 10.0):
            failed += 1
            if clock() >= end:
                break
            continue
        t_acq = clock()
        if counter is not None:
            with counter.get_lock():
                counter.value += 1
                mine = counter.value
        time.sleep(hold)
        t_rel0 = clock()
        adapter.release(h)
        t_rel = clock()
        holds.append((t_acq, t_rel0, t_rel))
        if t_rel >= end:
            break
        if counter is not None:
            # Not part of any measured interval: the next acquire is someone else's.
            while counter.value == mine and clock() < end + 5:
                time.sleep(0.0002)
    return holds, failed


def _handoff_process(
    kind: str,
    urls: list[str],
    prefix: str,
    key: str,
    duration: float,
    hold: float,
    counter: Any,
    barrier: Any,
    out: Any,
    idx: int,
) -> None:
    try:
        adapter = peers.ADAPTERS[kind](urls, prefix)
        holds, failed = _handoff_loop(adapter, key, duration, hold, barrier.wait, counter)
        out.put((idx, holds, failed, None))
        adapter.close()
    except Exception:
        out.put((idx, [], 0, traceback.format_exc(limit=3)))


def measure_handoff(
    kind: str,
    urls: list[str],
    prefix: str,
    workers: int,
    duration: float,
    hold: float,
    processes: bool,
    rotation: bool = False,
) -> dict[str, Any]:
    import redis

    key = f"handoff-{uuid.uuid4().hex[:8]}"
    per_worker: list[list[tuple[float, float, float]]] = [[] for _ in range(workers)]
    failed = 0
    # The nodes count the commands each attempt runs (below). Nothing else uses these nodes now.
    stats = [redis.Redis.from_url(u) for u in urls]
    for s in stats:
        s.config_resetstat()
    if processes:
        ctx = mp.get_context("spawn")
        counter = ctx.Value("q", 0) if rotation else None
        barrier = ctx.Barrier(workers + 1)
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_handoff_process,
                args=(kind, urls, prefix, key, duration, hold, counter, barrier, out, i),
                daemon=True,
            )
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        barrier.wait(timeout=60)
        t0 = time.monotonic()
        errors = []
        for _ in procs:
            idx, holds, f, err = out.get(timeout=duration + 60)
            per_worker[idx] = holds
            failed += f
            if err:
                errors.append(err)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if errors:
            raise RuntimeError(errors[0].strip().splitlines()[-1])
    else:
        adapter = peers.ADAPTERS[kind](urls, prefix)  # one per process, shared by its threads
        counter_t = mp.Value("q", 0) if rotation else None
        barrier_t = threading.Barrier(workers + 1)
        errs: list[str] = []
        fails = [0] * workers

        def work(i: int) -> None:
            try:
                per_worker[i], fails[i] = _handoff_loop(
                    adapter, key, duration, hold, barrier_t.wait, counter_t
                )
            except Exception as exc:
                errs.append(repr(exc))

        ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
        for t in ts:
            t.start()
        barrier_t.wait(timeout=60)
        t0 = time.monotonic()
        for t in ts:
            t.join(duration + 60)
        adapter.close()
        failed = sum(fails)
        if errs:
            raise RuntimeError(errs[0])
    # Every attempt of ours reads the restart-guard marker once per node (HMGET: after its
    # plain SET, or inside the acquire script); the peers' attempts are one SET each.
    command = "cmdstat_hmget" if kind == "ours" else "cmdstat_set"
    calls = sum(s.info("commandstats").get(command, {}).get("calls", 0) for s in stats)
    for s in stats:
        s.close()
    result = analyse_handoff(per_worker, t0, t0 + duration, failed)
    total = sum(len(h) for h in per_worker)
    # Minus the one warm-up acquire per worker (on its own key).
    result["attempts"] = (calls / len(urls) - workers) / total if total else math.nan
    return result


def analyse_handoff(
    per_worker: list[list[tuple[float, float, float]]], start: float, end: float, failed: int
) -> dict[str, Any]:
    holds = sorted((a, r0, r, w) for w, hs in enumerate(per_worker) for a, r0, r in hs)
    # Mutual exclusion check on the whole record: no acquire before the previous holder
    # started its release.
    overlaps = sum(1 for p, q in itertools.pairwise(holds) if q[0] < p[1])
    window = [h for h in holds if start <= h[0] < end]
    gaps, handoff_gaps = [], []
    for p, q in itertools.pairwise(window):
        g = (q[0] - p[2]) * 1000
        gaps.append(g)
        if q[3] != p[3]:
            handoff_gaps.append(g)
    counts = [sum(1 for h in window if h[3] == w) for w in range(len(per_worker))]
    mean = statistics.fmean(counts) if counts else 0
    dev = max(abs(c - mean) for c in counts) / mean * 100 if mean else math.nan
    return {
        "acquisitions": len(window),
        "per_s": len(window) / (end - start),
        "gap_p50": pct(gaps, 50),
        "gap_p99": pct(gaps, 99),
        "handoff_pct": 100 * len(handoff_gaps) / len(gaps) if gaps else math.nan,
        "handoff_gap_p50": pct(handoff_gaps, 50),
        "handoff_gap_p99": pct(handoff_gaps, 99),
        "share": counts,
        "share_dev": dev,
        "overlaps": overlaps,
        "failed": failed,
    }


# -- phase 4: added latency ------------------------------------------------------------------


def ping_rtt(urls: Sequence[str], n: int = 200) -> float:
    """p50 PING round trip (ms) over all ``urls``, through whatever delay is in place."""
    import redis

    samples = []
    for url in urls:
        c = redis.Redis.from_url(url)
        c.ping()
        for _ in range(n // len(urls) or 1):
            t0 = time.perf_counter()
            c.ping()
            samples.append((time.perf_counter() - t0) * 1000)
        c.close()
    return pct(samples, 50)


def delay_phase(
    urls: Sequence[str], available: set[str], cycles: int, warmup: int, tag: str, rounds: int = 4
) -> dict[str, Any]:
    rtt_before = ping_rtt(urls)
    adapters: dict[str, peers.Adapter] = {}
    rows: dict[str, Any] = {}
    for kind, n in DELAYED:
        if kind not in available:
            continue
        name = f"{kind}:{n}"
        try:
            adapters[name] = peers.ADAPTERS[kind](list(urls[:n]), f"bd-{tag}-{kind}-{n}")
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    measured = measure_cycles_interleaved(adapters, cycles, warmup, rounds)
    for a in adapters.values():
        a.close()
    for name, r in measured.items():
        rows[name] = r if "error" in r else {k: r[k] / 1000 for k in ("p50", "p99", "mean")}
    # The round trip before and after, pooled: the unit the cycles are expressed in.
    rtt = (rtt_before + ping_rtt(urls)) / 2
    return {"rtt_ms": rtt, "rows": rows}


def run_delay(cluster: Any, available: set[str], args: argparse.Namespace) -> dict[str, Any]:
    ok, why = (
        (False, "--latency-method proxy")
        if args.latency_method == "proxy"
        else latency.netem_available()
    )
    if ok:
        method = (
            f"tc netem delay {args.latency_ms}ms on the loopback of a private network "
            "namespace (its own 5 nodes)"
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "delay.json")
            rc = latency.run_in_netns(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--_netns-child",
                    path,
                    "--latency-ms",
                    str(args.latency_ms),
                    "--delay-cycles",
                    str(args.delay_cycles),
                    "--rounds",
                    str(args.rounds),
                    "--peers",
                    ",".join(sorted(available)),
                ],
                args.latency_ms,
                timeout=600,
            )
            if rc == 0 and os.path.exists(path):
                with open(path) as f:
                    res = json.load(f)
                res["method"] = method
                return res
            why = f"the namespaced run failed (exit {rc})"
    if args.latency_method == "netem":
        raise RuntimeError(f"netem requested but not usable: {why}")
    method = (
        f"asyncio delaying proxy ({args.latency_ms} ms per direction per node, in its own "
        f"process), in front of the same 5 nodes; netem not used: {why}"
    )
    with latency.DelayProxy(
        [("127.0.0.1", node.port) for node in cluster], args.latency_ms
    ) as proxy:
        urls = [f"redis://127.0.0.1:{p}/0" for p in proxy.ports]
        res = delay_phase(
            urls,
            available,
            args.delay_cycles,
            max(10, args.delay_cycles // 10),
            "proxy",
            args.rounds,
        )
    res["method"] = method
    return res


# -- report ----------------------------------------------------------------------------------


def label(kind: str, n: int) -> str:
    return f"{peers.ADAPTERS[kind].label} ({n} node{'s' if n > 1 else ''})"


def _ops_cell(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    if "error" in t:
        return "error"
    cell = fmt(t.get("ops"))
    if t.get("errors"):
        cell += f" ({t['errors']} {'/'.join(t['error_kinds'])})"
    return cell


def build_tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for every table, shared by text, markdown and RST output."""
    out = []
    cyc, tp = res.get("cycle", {}), res.get("throughput", {})
    if cyc or tp:
        rows = []
        for kind, n in CONFIGS:
            c, t = cyc.get(f"{kind}:{n}"), tp.get(f"{kind}:{n}")
            if c is None and t is None:
                continue
            if c and "error" in c:
                rows.append([label(kind, n), "error", c["error"][:60], "", "", ""])
                continue
            rows.append(
                [
                    label(kind, n),
                    fmt(c and c["p50"]),
                    fmt(c and c["p99"]),
                    fmt(c and c["cpu"]),
                    _ops_cell(t),
                    fmt(c["p50"] / cyc["ours:5"]["p50"], 2) + "x"
                    if c and "ours:5" in cyc and "p50" in cyc["ours:5"]
                    else "-",
                ]
            )
        out.append(
            (
                "Uncontended acquire+release cycle (1 thread) and throughput (8 threads, "
                "distinct keys)",
                [
                    "library (nodes)",
                    "p50 µs",
                    "p99 µs",
                    "client CPU µs",
                    "8-thread ops/s",
                    "p50 vs ours (5)",
                ],
                rows,
            )
        )
    ratios = res.get("ratios")
    if ratios:
        rows = [[r["what"], fmt(r["value"], 2) + "x", r["target"], r["verdict"]] for r in ratios]
        out.append(("Targets (p50 of the cycle)", ["ratio", "value", "target", "met"], rows))
    for variant in HANDOFF_VARIANTS:
        ho = res.get("handoff", {}).get(variant)
        if not ho:
            continue
        rows = []
        for kind, n in HANDOFF:
            r = ho.get(f"{kind}:{n}")
            if r is None:
                continue
            if "error" in r:
                rows.append([label(kind, n), "error", r["error"][:60], *[""] * 8])
                continue
            rows.append(
                [
                    label(kind, n),
                    fmt(r["gap_p50"], 2),
                    fmt(r["gap_p99"], 2),
                    fmt(r["handoff_pct"]) + "%",
                    fmt(r["handoff_gap_p50"], 2),
                    fmt(r["handoff_gap_p99"], 2),
                    fmt(r["per_s"]),
                    fmt(r.get("attempts"), 2),
                    fmt(r["share_dev"]) + "%",
                    "/".join(str(c) for c in r["share"]),
                    str(r["overlaps"]),
                ]
            )
        rotation = variant.startswith("rotation")
        how = (
            "strict rotation: after its release a worker waits until another one has "
            "acquired, so every acquire is a waiter being woken"
            if rotation
            else "release then at once re-acquire"
        )
        out.append(
            (
                f"{'Handoff in rotation' if rotation else 'Handoff'}: 4 "
                f"{variant.split('-')[-1]}, one key, hold {res['params']['hold_ms']} ms, "
                f"{how} (blocking, timeout 10 s), {res['params']['handoff_s']} s window",
                [
                    "library (nodes)",
                    "gap p50 ms",
                    "gap p99 ms",
                    "to other worker",
                    "handoff p50 ms",
                    "handoff p99 ms",
                    "acquires/s",
                    "attempts/acquire",
                    "share dev",
                    "acquires per worker",
                    "overlaps",
                ],
                rows,
            )
        )
    d = res.get("delay")
    if d:
        rtt = d["rtt_ms"]
        rows = []
        for kind, n in DELAYED:
            r = d["rows"].get(f"{kind}:{n}")
            if r is None:
                continue
            if "error" in r:
                rows.append([label(kind, n), "error", r["error"][:60], "", ""])
                continue
            base = d["rows"].get("redis-py:1", {}).get("p50")
            rows.append(
                [
                    label(kind, n),
                    fmt(r["p50"], 2),
                    fmt(r["p99"], 2),
                    fmt(r["p50"] / rtt, 1),
                    fmt(r["p50"] / base, 2) + "x" if base else "-",
                ]
            )
        out.append(
            (
                f"Uncontended cycle with {res['params']['latency_ms']} ms added per "
                f"direction per node (measured PING RTT p50 {rtt:.2f} ms)",
                ["library (nodes)", "p50 ms", "p99 ms", "p50 in RTTs", "vs redis-py (1)"],
                rows,
            )
        )
    return out


def compute_ratios(cyc: dict[str, Any]) -> list[dict[str, Any]]:
    def p50(k: str) -> float | None:
        r = cyc.get(k)
        return r["p50"] if r and "p50" in r else None

    out = []
    ours5, rp = p50("ours:5"), p50("redis-py:1")
    if ours5 and rp:
        v = ours5 / rp
        out.append(
            {
                "what": "ours (5) p50 / redis-py Lock (1) p50",
                "value": v,
                "target": "<= 1.3x",
                "verdict": "yes" if v <= 1.3 else "NO",
            }
        )
    floor5 = p50("floor:5")
    cpu5, floor_cpu5 = (cyc.get(k, {}).get("cpu") for k in ("ours:5", "floor:5"))
    if cpu5 and floor_cpu5:
        v = cpu5 / floor_cpu5
        out.append(
            {
                "what": "ours (5) client CPU / floor (5) client CPU",
                "value": v,
                "target": "<= 2x",
                "verdict": "yes" if v <= 2 else "NO",
            }
        )
    if floor5 and rp:
        out.append(
            {
                "what": "floor: raw sockets (5) p50 / redis-py Lock (1) p50",
                "value": floor5 / rp,
                "target": "(machine)",
                "verdict": "-",
            }
        )
    for kind in REDLOCKS_5:
        other = p50(f"{kind}:5")
        if ours5 and other:
            v = other / ours5
            out.append(
                {
                    "what": f"{peers.ADAPTERS[kind].label} (5) p50 / ours (5) p50",
                    "value": v,
                    "target": ">= 2x",
                    "verdict": "yes" if v >= 2 else "NO",
                }
            )
    return out


def header_lines(info: dict[str, Any], params: dict[str, Any]) -> list[str]:
    v = info["versions"]
    return [
        f"django-redlock bench  {info['date']}  host {info['host']}",
        f"machine: {info['cpus']} CPUs ({info['cpu_model']}), Linux {info['kernel']}, "
        f"load avg at start {', '.join(f'{x:.2f}' for x in info['loadavg_start'])}"
        + (
            f", at end {', '.join(f'{x:.2f}' for x in info['loadavg_end'])}"
            if "loadavg_end" in info
            else ""
        ),
        f"python {info['python']}, redis-server {info['redis_server']}",
        "libraries: " + ", ".join(f"{k} {v[k]}" for k in peers.ADAPTERS if k != "floor"),
        "run: " + ", ".join(f"{k}={v}" for k, v in params.items()),
    ]


def report(res: dict[str, Any]) -> list[str]:
    lines = header_lines(res["info"], res["params"])
    for why in res.get("skipped", []):
        lines.append(f"skipped peer: {why}")
    for title, headers, rows in build_tables(res):
        lines += ["", title, *table(headers, rows)]
    if res.get("delay"):
        lines += ["", f"latency method: {res['delay']['method']}"]
    return lines


def write_markdown(res: dict[str, Any], stem: str, latest: bool = True) -> list[str]:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    info = res["info"]
    md = [
        f"# django-redlock bench, {info['date']}",
        "",
        *(f"    {x}" for x in header_lines(info, res["params"])),
        "",
    ]
    rst = [
        f".. Generated by bench/run.py --markdown on {info['date']} "
        f"({info['cpus']} vCPU, {info['host']}).",
        "",
    ]
    for title, headers, rows in build_tables(res):
        md += [f"## {title}", "", *md_table(headers, rows), ""]
        rst += [f".. table:: {title}", "", *("   " + x for x in rst_table(headers, rows)), ""]
    if res.get("delay"):
        md += [f"Latency method: {res['delay']['method']}", ""]
        rst += [f"Latency method: {res['delay']['method']}.", ""]
    paths = []
    for ext, body in (("md", md), ("rst", rst)):
        for name in (f"{stem}.{ext}", f"latest.{ext}") if latest else (f"{stem}.{ext}",):
            path = os.path.join(RESULTS_DIR, name)
            with open(path, "w") as f:
                f.write("\n".join(body).rstrip() + "\n")
            paths.append(path)
    return paths


def plot(res: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(STATIC_DIR, exist_ok=True)
    colours = {
        "ours": "#2b7bba",
        "redis-py": "#7f7f7f",
        "python-redis-lock": "#b5b5b5",
        "pottery": "#e3872d",
        "redlock-ng": "#c44e52",
        "redlock-py": "#8c6bb1",
        "floor": "#d9d9d9",
    }
    subtitle = f"{res['info']['cpus']} vCPU, {res['info']['date']}, loopback"
    paths = []

    cyc, d = res.get("cycle", {}), res.get("delay")
    if cyc:
        fig, axes = plt.subplots(1, 2 if d else 1, figsize=(12 if d else 7, 4.8), squeeze=False)
        ax = axes[0][0]
        keys = [(k, n) for k, n in CONFIGS if "p50" in cyc.get(f"{k}:{n}", {})]
        names = [label(k, n) for k, n in keys]
        p50 = [cyc[f"{k}:{n}"]["p50"] for k, n in keys]
        p99 = [cyc[f"{k}:{n}"]["p99"] for k, n in keys]
        y = range(len(keys))
        ax.barh(y, p50, color=[colours[k] for k, _ in keys])
        ax.scatter(p99, y, marker="|", s=200, color="black", label="p99", zorder=3)
        ax.set_yticks(list(y), names)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("acquire + release, µs (bar: p50, tick: p99; log scale)")
        ax.set_title(f"Uncontended cycle ({subtitle})", fontsize=10)
        ax.legend(loc="lower right")
        if d:
            ax = axes[0][1]
            keys = [(k, n) for k, n in DELAYED if "p50" in d["rows"].get(f"{k}:{n}", {})]
            vals = [d["rows"][f"{k}:{n}"]["p50"] for k, n in keys]
            y = range(len(keys))
            ax.barh(y, vals, color=[colours[k] for k, _ in keys])
            ax.set_yticks(list(y), [label(k, n) for k, n in keys])
            ax.invert_yaxis()
            rtt = d["rtt_ms"]
            for m, style in ((2, "--"), (10, ":")):
                ax.axvline(m * rtt, color="black", linestyle=style, linewidth=1)
                ax.text(m * rtt, len(keys) - 0.4, f" {m} RTT", fontsize=8)
            ax.set_xlabel("acquire + release p50, ms")
            ax.set_title(
                f"+{res['params']['latency_ms']} ms per direction per node (RTT {rtt:.2f} ms)",
                fontsize=10,
            )
        fig.tight_layout()
        path = os.path.join(STATIC_DIR, "bench-latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    ho = res.get("handoff", {})
    if ho:
        panels = [
            ("immediate re-acquire", ("threads", "processes"), "gap"),
            (
                "strict rotation (every acquire is a waiter being woken)",
                ("rotation-threads", "rotation-processes"),
                "handoff_gap",
            ),
        ]
        panels = [p for p in panels if any(v in ho for v in p[1])]
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
        for ax, (title, variants, metric) in zip(axes[0], panels, strict=False):
            keys = [
                (k, n)
                for k, n in HANDOFF
                if any(f"{metric}_p50" in ho.get(v, {}).get(f"{k}:{n}", {}) for v in variants)
            ]
            width = 0.38
            for j, variant in enumerate(variants):
                rows = ho.get(variant, {})
                xs, vals, errs, cols, notes = [], [], [], [], []
                for i, (k, n) in enumerate(keys):
                    r = rows.get(f"{k}:{n}", {})
                    v50, v99 = r.get(f"{metric}_p50"), r.get(f"{metric}_p99")
                    if v50 is None or math.isnan(v50):
                        continue
                    xs.append(i + (j - 0.5) * width)
                    vals.append(max(v50, 0.01))
                    errs.append(max(v99 - max(v50, 0.01), 0))
                    cols.append(colours[k])
                    notes.append(f"{r['handoff_pct']:.0f}%")
                ax.bar(
                    xs,
                    vals,
                    width,
                    color=cols,
                    alpha=1.0 if j == 0 else 0.55,
                    yerr=[[0] * len(errs), errs],
                    capsize=3,
                    edgecolor="black",
                    hatch="" if j == 0 else "//",
                    label=f"{variant.split('-')[-1]} (bar p50, whisker p99)",
                )
                for x, v, note in zip(xs, vals, notes, strict=False):
                    ax.text(x, v * 0.75, note, ha="center", va="top", fontsize=6.5, rotation=90)
            ax.set_xticks(
                range(len(keys)),
                [label(k, n) for k, n in keys],
                rotation=20,
                fontsize=7.5,
                ha="right",
            )
            ax.set_yscale("log")
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
            ax.set_ylabel("release -> next acquire, ms (log; 1 ms dashed)")
            ax.set_title(f"{title}\n% = acquires that went to another worker", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle(
            f"One key passed between 4 workers, hold {res['params']['hold_ms']} ms ({subtitle})",
            fontsize=10,
        )
        fig.tight_layout()
        path = os.path.join(STATIC_DIR, "bench-handoff.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# -- main ------------------------------------------------------------------------------------


def netns_child(args: argparse.Namespace) -> int:
    from django_redlock.testing import RedisCluster

    available = set(args.peers.split(",")) if args.peers else set(peers.ADAPTERS)
    with RedisCluster(n=5) as cluster:
        res = delay_phase(
            cluster.urls,
            available,
            args.delay_cycles,
            max(10, args.delay_cycles // 10),
            "netem",
            args.rounds,
        )
    with open(args._netns_child, "w") as f:
        json.dump(res, f)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--quick", action="store_true", help="short run (about a minute)")
    p.add_argument(
        "--cycles", type=int, help="timed cycles per configuration (default 2000, quick 300)"
    )
    p.add_argument("--warmup", type=int, help="untimed cycles first (default cycles/10)")
    p.add_argument("--threads", type=int, default=8, help="throughput threads (default 8)")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="cycle and throughput phases run every configuration in this many interleaved "
        "rounds, pooling the samples (default 4)",
    )
    p.add_argument(
        "--throughput-seconds", type=float, help="per configuration, over all rounds (2, quick 1)"
    )
    p.add_argument("--handoff-seconds", type=float, help="window per run (2.5, quick 1.5)")
    p.add_argument("--hold-ms", type=float, default=1.0, help="handoff hold time (1)")
    p.add_argument(
        "--no-rotation",
        action="store_true",
        help="skip the strict-rotation handoff runs (after its release a worker waits until "
        "another one has acquired, so every acquire is a waiter being woken)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=1.0,
        help="added delay per direction per node in the delay phase (default 1; 0 skips it)",
    )
    p.add_argument("--latency-method", choices=("auto", "netem", "proxy"), default="auto")
    p.add_argument("--delay-cycles", type=int, help="cycles per config under delay (200, quick 50)")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}"
    )
    p.add_argument(
        "--only",
        default="",
        help=f"comma-separated adapter ids to run ({','.join(peers.ADAPTERS)}); default all",
    )
    p.add_argument(
        "--no-install",
        action="store_true",
        help="do not pip-install missing optional peers (redlock-ng, redlock-py)",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="also write bench/results/<date>.md and .rst (and latest.*)",
    )
    p.add_argument(
        "--plot",
        action="store_true",
        help="write docs/_static/bench-latency.png and bench-handoff.png",
    )
    p.add_argument("--_netns-child", help=argparse.SUPPRESS)
    p.add_argument("--peers", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    a.cycles = a.cycles or (300 if q else 2000)
    a.warmup = a.warmup if a.warmup is not None else max(20, a.cycles // 10)
    a.throughput_seconds = a.throughput_seconds or (1.0 if q else 2.0)
    a.handoff_seconds = a.handoff_seconds or (1.5 if q else 2.5)
    a.delay_cycles = a.delay_cycles or (50 if q else 200)
    a.phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    bad = set(a.phases) - set(PHASES)
    if bad:
        p.error(f"unknown phase(s) {sorted(bad)}")
    if a.latency_ms <= 0 and "delay" in a.phases:
        a.phases.remove("delay")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args._netns_child:
        return netns_child(args)
    if args.no_install:
        peers.ALLOW_INSTALL = False
    from django_redlock.testing import RedisCluster

    wall0 = time.perf_counter()
    params = {
        "cycles": args.cycles,
        "warmup": args.warmup,
        "threads": args.threads,
        "rounds": args.rounds,
        "throughput_s": args.throughput_seconds,
        "handoff_s": args.handoff_seconds,
        "hold_ms": args.hold_ms,
        "latency_ms": args.latency_ms,
        "phases": "+".join(args.phases),
    }
    res: dict[str, Any] = {"params": params, "skipped": []}
    only = set(args.only.split(",")) - {""} if args.only else set(peers.ADAPTERS)
    with RedisCluster(n=5) as cluster:
        urls = cluster.urls
        res["info"] = info = machine_info(cluster)
        say(*header_lines(info, params))
        if info["loadavg_start"][0] > 0.5 * (info["cpus"] or 1):
            say(
                "warning: the machine is busy (1-min load average "
                f"{info['loadavg_start'][0]:.1f} on {info['cpus']} CPUs): other processes "
                "compete with the nodes and the clients, expect noisy numbers"
            )
        available = set()
        for kind in peers.ADAPTERS:
            if kind not in only:
                continue
            why = peers.probe(kind, urls)
            if why is None:
                available.add(kind)
            else:
                msg = f"{kind}: {why}"
                res["skipped"].append(msg)
                say(f"skipped peer: {msg}")

        def configs(lst: list[tuple[str, int]]) -> list[tuple[str, int]]:
            return [(k, n) for k, n in lst if k in available]

        if "cycle" in args.phases:
            adapters, failed = {}, {}
            for kind, n in configs(CONFIGS):
                try:
                    adapters[f"{kind}:{n}"] = peers.ADAPTERS[kind](urls[:n], f"b-{kind}-{n}")
                except Exception as exc:
                    failed[f"{kind}:{n}"] = {"error": f"{type(exc).__name__}: {exc}"}
            measured = measure_cycles_interleaved(adapters, args.cycles, args.warmup, args.rounds)
            res["cycle"] = cyc = {
                f"{k}:{n}": {**measured, **failed}[f"{k}:{n}"]
                for k, n in configs(CONFIGS)
                if f"{k}:{n}" in measured or f"{k}:{n}" in failed
            }
            for a in adapters.values():
                a.close()
            res["ratios"] = compute_ratios(cyc)
        if "throughput" in args.phases:
            tp = res["throughput"] = {}
            counts: dict[str, list[Any]] = {}
            for i in range(args.rounds):
                for kind, n in configs(CONFIGS):
                    key = f"{kind}:{n}"
                    if kind in CYCLE_ONLY or "error" in tp.get(key, {}):
                        continue
                    progress(f"throughput round {i + 1}/{args.rounds} {key}")
                    try:
                        a = peers.ADAPTERS[kind](urls[:n], f"b-{kind}-{n}")
                        r = measure_throughput(
                            a, args.threads, args.throughput_seconds / args.rounds
                        )
                        a.close()
                    except Exception as exc:
                        tp[key] = {"error": f"{type(exc).__name__}: {exc}"}
                        continue
                    c = counts.setdefault(key, [0, 0.0, 0, set()])
                    c[0] += r["count"]
                    c[1] += r["elapsed"]
                    c[2] += r["errors"]
                    c[3].update(r["error_kinds"])
                    tp[key] = {
                        "ops": c[0] / c[1],
                        "threads": args.threads,
                        "errors": c[2],
                        "error_kinds": sorted(c[3]),
                    }
        if "handoff" in args.phases:
            ho = res["handoff"] = {}
            for variant in HANDOFF_VARIANTS:
                if variant.startswith("rotation") and args.no_rotation:
                    continue
                ho[variant] = {}
                for kind, n in configs(HANDOFF):
                    progress(f"handoff {variant} {kind}:{n}")
                    try:
                        ho[variant][f"{kind}:{n}"] = measure_handoff(
                            kind,
                            urls[:n],
                            f"b-{kind}-{n}",
                            4,
                            args.handoff_seconds,
                            args.hold_ms / 1000,
                            processes=variant.endswith("processes"),
                            rotation=variant.startswith("rotation"),
                        )
                    except Exception as exc:
                        ho[variant][f"{kind}:{n}"] = {"error": f"{type(exc).__name__}: {exc}"}
        if "delay" in args.phases:
            progress("delay phase")
            try:
                res["delay"] = run_delay(cluster, available, args)
            except Exception as exc:
                say(f"delay phase failed: {type(exc).__name__}: {exc}")
    params["wall_s"] = round(time.perf_counter() - wall0, 1)
    res["info"]["loadavg_end"] = os.getloadavg()
    lines = report(res)
    say("", *lines[len(header_lines(res["info"], params)) :], "", f"done in {params['wall_s']} s")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stem = f"{_dt.date.today().isoformat()}-{res['info']['cpus']}cpu" + (
        "-quick" if args.quick else ""
    )
    if list(args.phases) != list(PHASES) or args.only:
        stem += "-partial-" + "+".join(args.phases)  # never overwrites a full run's files
    with open(os.path.join(RESULTS_DIR, f"{stem}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(RESULTS_DIR, f"{stem}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    written = [os.path.join(RESULTS_DIR, f"{stem}.json"), os.path.join(RESULTS_DIR, f"{stem}.txt")]
    if args.markdown:
        written += write_markdown(res, stem, latest="partial" not in stem)
    if args.plot:
        try:
            written += plot(res)
        except ImportError as exc:
            say(f"no plots: {exc} (pip install matplotlib)")
    say("wrote " + ", ".join(os.path.relpath(p, ROOT) for p in written))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
