"""The moving parts of a fault scenario: nodes, an oracle, client processes, a controller.

A scenario builds a :class:`Harness` (N real ``redis-server`` nodes, optionally each behind a
:class:`~tests.faults.proxy.Proxy`, and the fenced-write :class:`~tests.faults.oracle.Oracle`),
forks its client processes (they all wait on one start event, so they begin together), injects
faults from the controller (the parent process) while they contend, then stops them and turns
what happened into a :class:`ScenarioResult`.

Client processes (:func:`client_main`) loop: acquire (fencing on), record the hold, sleep a
random hold time, write their fence to the oracle if the lock is still valid by the local
monotonic clock, record the release time, release. Each has a duplex pipe to the controller
(one per process, so a SIGKILLed or SIGSTOPped client cannot wedge a lock shared with others):
it reports ``holding``/``checked``/``wrote`` events and its counters on it, and a *victim*
(the paused-holder scenario) waits on it for the controller's go-ahead between checking its
validity and writing, which is exactly where a GC pause or SIGSTOP hurts.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from django_redlock.core.commands import lock_fields
from django_redlock.testing import RedisCluster

from .history import Hold, Overlap, find_overlaps, load_events, load_holds
from .oracle import Oracle, OracleClient
from .proxy import Proxy

__all__ = ["PREFIX", "Harness", "Profile", "ScenarioResult", "WorkerSpec", "client_main"]

PREFIX = "redlock"
_CTX = multiprocessing.get_context("fork")


@dataclass(frozen=True)
class Profile:
    """How long scenarios run: ``scale`` multiplies rounds and durations (quick = 1)."""

    name: str = "quick"
    scale: int = 1

    @classmethod
    def quick(cls) -> Profile:
        return cls("quick", 1)

    @classmethod
    def soak(cls, scale: int = 10) -> Profile:
        return cls("soak", scale)

    def rounds(self, quick: int) -> int:
        return quick * self.scale

    def seconds(self, quick: float) -> float:
        return quick * self.scale


@dataclass
class WorkerSpec:
    """What one client process does."""

    urls: list[str]
    redlock: dict[str, Any] = field(default_factory=dict)
    name: str = "fault:shared"
    ttl: float = 1.0
    auto_renew: bool = False
    fencing: bool = True
    mode: str = "blocking"  #: "blocking" (acquire with timeout) or "poll" (blocking=False)
    acquire_timeout: float = 2.0
    poll_interval: float = 0.02
    hold: tuple[float, float] = (0.005, 0.03)
    max_cycles: int | None = None
    clock_jump: bool = False  #: jump time.time() by +-1 h every few hundred ms
    check_after_acquire: bool = False  #: ask the nodes (lock.check()) right after acquiring
    #: How many times to wait for the controller between the validity check and the write
    #: (the controller freezes the process there).
    victim: int = 0


@dataclass
class ScenarioResult:
    name: str
    title: str
    nodes: int
    clients: int
    cycles: int
    faults: int
    overlaps: list[Overlap]
    stale_rejected: int
    rejected_in_valid_hold: int
    recovery: float | None
    duration: float
    stats: Counter[str] = field(default_factory=Counter)
    checks: dict[str, Any] = field(default_factory=dict)
    #: (mark label, seconds to the next acquire or None) for every mark.
    recoveries: list[tuple[str, float | None]] = field(default_factory=list)

    def summary(self) -> str:
        rec = "-" if self.recovery is None else f"{self.recovery:.2f}s"
        return (
            f"{self.name}: cycles={self.cycles} faults={self.faults} "
            f"overlaps={len(self.overlaps)} stale_rejected={self.stale_rejected} "
            f"recovery={rec} duration={self.duration:.1f}s checks={self.checks} "
            f"stats={dict(self.stats)}"
        )


# --------------------------------------------------------------------------- client process


def _install_clock_jumps(stats: Counter[str]) -> threading.Event:
    """Make ``time.time()`` of this process jump by +-1 h every 0.1-0.3 s (the wall clock an
    NTP step or an operator moves). ``time.monotonic()`` is untouched: it is what validity is
    measured with, which is the point."""
    real_time = time.time
    offset = [3600.0]
    stats["clock_jumps"] += 1
    time.time = lambda: real_time() + offset[0]  # type: ignore[assignment]
    stop = threading.Event()

    def jumper() -> None:
        while not stop.wait(random.uniform(0.1, 0.3)):
            offset[0] = random.choice([o for o in (3600.0, -3600.0, 0.0) if o != offset[0]])
            stats["clock_jumps"] += 1

    threading.Thread(target=jumper, daemon=True).start()
    return stop


def _valid_until(lock: Any) -> float | None:
    """The end of the lease as the holder last knew it: for an auto-renewed lock the last
    successful renewal moved it past the end recorded at acquire time. Read from the lease
    (``Lock._lease.valid_until``, monotonic) before release drops it; None if unknown."""
    lease = getattr(lock, "_lease", None)
    return getattr(lease, "valid_until", None)


def client_main(
    index: int,
    spec: WorkerSpec,
    history: str,
    oracle: tuple[str, int],
    conn: Connection,
    go: Any,
    stop: Any,
    idle: Any,
) -> None:
    """One contender (runs in a forked child)."""
    from django_redlock import LockLost, LockNotOwned, QuorumError, Redlock

    from .history import HistoryWriter

    logging.getLogger("django_redlock").setLevel(logging.ERROR)  # "lost" warnings are expected
    proc = f"c{index}"
    stats: Counter[str] = Counter()
    error = None
    try:
        hist = HistoryWriter(history, proc)
        writer = OracleClient(oracle)
        if spec.clock_jump:
            _install_clock_jumps(stats)
        rl = Redlock(spec.urls, **spec.redlock)
        min_validity, max_validity = float("inf"), 0.0
        go.wait(60)
        while not stop.is_set():
            if spec.max_cycles is not None and stats["cycles"] >= spec.max_cycles:
                break
            if idle.is_set():
                time.sleep(0.01)
                continue
            lock = rl.lock(
                spec.name, ttl=spec.ttl, fencing=spec.fencing, auto_renew=spec.auto_renew
            )
            stats["attempts"] += 1
            t0 = time.monotonic()
            try:
                if spec.mode == "poll":
                    ok = lock.acquire(blocking=False)
                else:
                    ok = lock.acquire(blocking=True, timeout=spec.acquire_timeout)
            except QuorumError:
                stats["quorum_errors"] += 1
                time.sleep(spec.poll_interval)
                continue
            if not ok:
                stats["refused"] += 1
                if spec.mode == "poll":
                    time.sleep(spec.poll_interval * random.uniform(0.5, 1.5))
                continue
            now = time.monotonic()
            validity = lock.validity
            token, fence = lock.token or "", lock.fence
            hist.acquired(spec.name, token, fence, now, now + validity, t0)
            stats["cycles"] += 1
            min_validity, max_validity = min(min_validity, validity), max(max_validity, validity)
            if spec.check_after_acquire and not lock.check():
                stats["false_success"] += 1
            conn.send(("holding", proc, os.getpid(), token, now))
            if spec.victim > 0:
                # Check, then (SIGSTOP lands here) write: the window the fence exists for.
                if lock.validity <= 0:
                    stats["victim_expired_before_check"] += 1
                conn.send(("checked", proc, os.getpid(), token, time.monotonic()))
                conn.recv()  # the controller's go-ahead, sent while we are stopped
                accepted = writer.write(
                    spec.name, fence or 0, proc=proc, token=token, vend=now + validity
                )
                stats["victim_writes"] += 1
                stats["victim_write_rejected"] += not accepted
                stats["victim_held_after_pause"] += lock.held
                stats["victim_check_after_pause"] += lock.check()
                stats["victim_lost_detected"] += lock.lost is not None
                conn.send(("wrote", proc, os.getpid(), token, accepted))
            else:
                time.sleep(random.uniform(*spec.hold))
                if lock.validity > 0:
                    accepted = writer.write(
                        spec.name, fence or 0, proc=proc, token=token, vend=now + validity
                    )
                    stats["writes"] += 1
                    conn.send(("wrote", proc, os.getpid(), token, accepted))
                else:
                    stats["writes_skipped_expired"] += 1
            hist.releasing(token, time.monotonic(), _valid_until(lock))
            try:
                lock.release()
                outcome = "ok"
            except LockLost:
                outcome = "lost"
            except LockNotOwned:
                outcome = "not-owned"
            hist.outcome(token, outcome)
            stats[f"release_{outcome}"] += 1
            if spec.victim > 0:
                stats[f"victim_release_{outcome}"] += 1
                spec.victim -= 1
        if max_validity:
            stats["validity_min_ms"] = int(min_validity * 1000)
            stats["validity_max_ms"] = int(max_validity * 1000)
        rl.close()
        writer.close()
    except BaseException:
        error = traceback.format_exc()
    with contextlib.suppress(Exception):
        conn.send(("done", proc, os.getpid(), dict(stats), error))


# --------------------------------------------------------------------------- controller


class Harness:
    """Nodes, oracle, history directory and client processes of one scenario run."""

    def __init__(
        self,
        nodes: int = 3,
        *,
        proxies: bool = False,
        markers: tuple[bytes, ...] = (),
        **node_kwargs: Any,
    ) -> None:
        self.cluster = RedisCluster(nodes, **node_kwargs)
        self.proxies = (
            [Proxy((node.host, node.port), markers=markers) for node in self.cluster]
            if proxies
            else []
        )
        self.oracle = Oracle()
        self.dir = Path(tempfile.mkdtemp(prefix="redlock-faults-"))
        self.go, self.stop, self.idle = _CTX.Event(), _CTX.Event(), _CTX.Event()
        self.procs: dict[str, tuple[Any, Connection]] = {}
        self.events: list[tuple[Any, ...]] = []
        self.done: dict[str, tuple[dict[str, int], str | None]] = {}
        #: (label, time, process the fault hit, if any)
        self.marks: list[tuple[str, float, str | None]] = []
        self.faults = 0
        self.started = time.monotonic()
        self._next_index = 0

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.proxies] if self.proxies else list(self.cluster.urls)

    def warm_up(self, **redlock_kwargs: Any) -> None:
        """One acquire/release straight to the nodes, so each holds its restart-guard marker:
        faults then hit a cluster in service, not a brand-new one."""
        from django_redlock import Redlock

        rl = Redlock(list(self.cluster.urls), **redlock_kwargs)
        try:
            lock = rl.lock("fault:warm-up")
            if not lock.acquire(blocking=False):
                raise RuntimeError("warm-up acquire failed on a healthy cluster")
            lock.release()
        finally:
            rl.close()

    # -- clients --------------------------------------------------------------------------------

    def start_clients(self, count: int, spec: WorkerSpec, **overrides: Any) -> list[str]:
        names = []
        for _ in range(count):
            index = self._next_index
            self._next_index += 1
            parent, child = _CTX.Pipe(duplex=True)
            worker_spec = WorkerSpec(**{**spec.__dict__, **overrides})
            proc = _CTX.Process(
                target=client_main,
                name=f"fault-client-{index}",
                args=(
                    index,
                    worker_spec,
                    str(self.dir / f"c{index}.jsonl"),
                    self.oracle.address,
                    child,
                    self.go,
                    self.stop,
                    self.idle,
                ),
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs[f"c{index}"] = (proc, parent)
            names.append(f"c{index}")
        return names

    def begin(self) -> None:
        """Release every client at once."""
        self.started = time.monotonic()
        self.go.set()

    def pump(
        self, seconds: float = 0.0, until: Callable[[tuple[Any, ...]], bool] | None = None
    ) -> tuple[Any, ...] | None:
        """Read client events for ``seconds`` (always at least once, without blocking); with
        ``until``, return the first new event it accepts (None on timeout)."""
        deadline = time.monotonic() + seconds
        while True:
            conns = {conn: name for name, (_, conn) in self.procs.items() if name not in self.done}
            if not conns:
                return None
            remaining = max(deadline - time.monotonic(), 0.0)
            for conn in wait(list(conns), timeout=remaining):
                try:
                    event = conn.recv()
                except (EOFError, OSError):
                    self.done.setdefault(conns[conn], ({}, "the process died"))
                    continue
                if event[0] == "done":
                    self.done[event[1]] = (event[3], event[4])
                    continue
                self.events.append(event)
                if until is not None and until(event):
                    return event
            if time.monotonic() >= deadline:
                return None

    def sleep(self, seconds: float) -> None:
        self.pump(seconds)

    def send(self, proc: str, message: Any) -> None:
        self.procs[proc][1].send(message)

    def pid(self, proc: str) -> int:
        pid = self.procs[proc][0].pid
        assert pid is not None
        return pid

    def kill_client(self, proc: str) -> None:
        os.kill(self.pid(proc), signal.SIGKILL)
        self.procs[proc][0].join(5)
        self.done.setdefault(proc, ({}, None))

    def stop_clients(self, timeout: float = 20.0) -> None:
        self.idle.clear()
        self.stop.set()
        self.go.set()
        for name, (proc, conn) in self.procs.items():
            if name not in self.done and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)
                    conn.send("stop")  # a victim waiting for its go-ahead
        deadline = time.monotonic() + timeout
        while any(name not in self.done for name in self.procs) and time.monotonic() < deadline:
            self.pump(0.1)
        for name, (proc, _) in self.procs.items():
            proc.join(max(deadline - time.monotonic(), 0.5))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
                self.done.setdefault(name, ({}, "did not stop in time (killed)"))

    # -- faults and marks ------------------------------------------------------------------------

    def mark(self, label: str, at: float | None = None, subject: str | None = None) -> None:
        """A moment to measure recovery from: the next successful acquire (by anyone) after
        it. ``subject`` names the client the fault hit (a killed or frozen holder)."""
        self.marks.append((label, time.monotonic() if at is None else at, subject))

    def lock_keys(self, nodes: Iterable[int] | None = None) -> list[dict[str, str]]:
        """Per node (straight to the node, not through a proxy): ``{lock key: token}``."""
        out = []
        for i in range(len(self.cluster)) if nodes is None else nodes:
            with self.cluster[i].client(socket_timeout=5) as c:
                keys = {}
                for raw in c.scan_iter(match=f"{PREFIX}:lock:*"):
                    value = c.get(raw)
                    keys[raw.decode()] = lock_fields(value)["token"] if value else ""
                out.append(keys)
        return out

    # -- results ---------------------------------------------------------------------------------

    def holds(self) -> list[Hold]:
        return load_holds(load_events(self.dir))

    def recoveries(self, holds: list[Hold]) -> list[tuple[str, float | None]]:
        out: list[tuple[str, float | None]] = []
        for label, at, _ in self.marks:
            nxt = [h.acquired_at for h in holds if h.acquired_at >= at]
            out.append((label, min(nxt) - at if nxt else None))
        return out

    def result(self, name: str, title: str, **extra: Any) -> ScenarioResult:
        holds = self.holds()
        oracle = self.oracle.stats()
        stats: Counter[str] = Counter()
        errors = []
        for proc, (counters, error) in self.done.items():
            for key, value in counters.items():
                if key.startswith("validity_min"):
                    stats[key] = min(stats.get(key, value), value)
                elif key.startswith("validity_max"):
                    stats[key] = max(stats.get(key, 0), value)
                else:
                    stats[key] += value
            if error:
                errors.append(f"{proc}: {error}")
        stats["oracle_accepted"] = oracle["accepted"]
        res = ScenarioResult(
            name=name,
            title=title,
            nodes=len(self.cluster),
            clients=len(self.procs),
            cycles=len(holds),
            faults=self.faults,
            overlaps=find_overlaps(holds),
            stale_rejected=oracle["rejected"],
            rejected_in_valid_hold=oracle["rejected_in_valid_hold"],
            recovery=None,
            duration=time.monotonic() - self.started,
            stats=stats,
            recoveries=self.recoveries(holds),
        )
        measured = [r for _, r in res.recoveries if r is not None]
        res.recovery = max(measured) if measured else None
        res.checks.update(extra)
        if errors:
            res.checks["client_errors"] = errors
        return res

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if any(name not in self.done for name in self.procs):
                self.stop_clients(5)
        for proc, conn in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        for proxy in self.proxies:
            proxy.close()
        self.oracle.stop()
        self.cluster.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
