"""Seeded scenarios: the cluster, the clients' work, the fault schedule; one run of a
scenario in a :class:`~.engine.World`, and the invariants checked on it."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from typing import Any

from django_redlock.core import scripts
from django_redlock.core.errors import QuorumError
from django_redlock.core.errors import RedlockError as LockError
from django_redlock.core.lock import Lease

from .engine import Cancelled, Driver, Gen, Proc, Sleep, Task, World
from .mutants import applied

__all__ = ["VIOLATIONS", "Fault", "Outcome", "Scenario", "generate", "run_scenario"]

#: The invariants, in the order the summary prints their counts.
VIOLATIONS = ("overlaps", "fences", "leftovers", "lost", "stuck", "not_free")

#: Faults outside the documented assumptions (docs/guarantees): a run with one is labelled,
#: and its violations are counted apart.
ASSUMPTION_BREAKING = {"clock_step", "evict_one", "drift_beyond"}

#: Faults that lose a node's data (the restart guard's business).
DATA_LOSS = ("crash", "flush", "evict_all", "failover")

#: Seconds within which restarted servers count as started together: the core's
#: ``FRESH_START_SPREAD``, plus a second (INFO's uptime is in whole seconds).
_TOGETHER = 3.0


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    at: float
    node: int = -1  #: the node (or the client process / task for client faults)
    span: float = 0.0  #: how long it lasts (pause, partition, delay, drop, stall, down time)
    value: float = 0.0  #: extra delay, drop rate, clock step, replica lag, spacing
    nodes: tuple[int, ...] = ()

    def __str__(self) -> str:
        parts = [f"{self.kind}@{self.at:.3f}"]
        if self.node >= 0:
            parts.append(f"#{self.node}")
        if self.span:
            parts.append(f"for {self.span:.3f}s")
        if self.value:
            parts.append(f"v={self.value:.3f}")
        if self.nodes:
            parts.append(f"nodes={list(self.nodes)}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    gap: float
    hold: float
    ttl: float
    kind: str = "plain"  #: plain, fencing, fair, renew, poll
    blocking: bool = True
    timeout: float = 2.0
    fork: bool = False


@dataclasses.dataclass(frozen=True)
class Worker:
    proc: int
    ops: tuple[Op, ...]
    start: float = 0.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    seed: int
    family: str
    n_nodes: int
    procs: int
    workers: tuple[Worker, ...]
    faults: tuple[Fault, ...]
    ttl: float
    max_ttl: float
    fresh_cluster: bool
    node_rates: tuple[float, ...]
    proc_rates: tuple[float, ...]
    fault_end: float
    drift_factor: float = 0.01
    node_timeout: float = 0.05

    def labels(self) -> set[str]:
        found = {f.kind for f in self.faults} & ASSUMPTION_BREAKING
        if self._all_lost_together():
            # docs/guarantees, "The risk of trusting a fresh cluster": every node lost its data
            # at once (or flushed apart, unseen in between): the cluster looks brand-new.
            found.add("all_lost_data")
        bound = self.drift_factor / 2
        if any(abs(r - 1) > bound for r in self.node_rates + self.proc_rates):
            found.add("drift_beyond")
        return found

    def _all_lost_together(self) -> bool:
        lost = [f for f in self.faults if f.kind in DATA_LOSS]
        if {f.node for f in lost} != set(range(self.n_nodes)):
            return False
        kinds = {f.kind for f in lost}
        if kinds == {"crash"}:
            # Servers restarted apart are told apart by their start times.
            first_restart: dict[int, float] = {}
            for f in lost:
                first_restart.setdefault(f.node, f.at + f.span)
            return max(first_restart.values()) - min(first_restart.values()) <= _TOGETHER
        # Replicas of a running cluster have the markers (another run id: guarded).
        return not (kinds == {"failover"} and not self.fresh_cluster)

    def describe(self) -> str:
        ops = sum(len(w.ops) for w in self.workers)
        head = (
            f"seed={self.seed} family={self.family} nodes={self.n_nodes} procs={self.procs} "
            f"threads={len(self.workers)} ops={ops} ttl={self.ttl} max_ttl={self.max_ttl} "
            f"fresh_cluster={self.fresh_cluster}"
        )
        faults = "\n".join(f"  {f}" for f in self.faults) or "  (no faults)"
        return f"{head}\n{faults}"


@dataclasses.dataclass
class Hold:
    name: str
    token: str
    fence: int | None
    proc: Proc
    start: float
    segments: list[list[float]]
    kind: str
    ended: bool = False
    #: Nodes that held the token (a live key) when the acquire returned, or since.
    copies: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Outcome:
    scenario: Scenario
    violations: dict[str, int]
    details: list[str]
    ops: int
    sim_seconds: float
    faults: int
    labels: set[str]
    trace: list[str]
    known: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def violated(self) -> bool:
        return any(self.violations.values())


# -- generation --------------------------------------------------------------------------------


def _rate(rng: random.Random, bound: float, beyond: bool) -> float:
    if beyond:
        return 1 + rng.choice((-1, 1)) * rng.uniform(bound * 2, 0.05)
    return 1 + rng.uniform(-bound, bound)


def generate(seed: int) -> Scenario:
    """The scenario of one seed."""
    rng = random.Random(seed)
    family = rng.choices(
        ("contend", "storm", "renew", "fork", "drift"), weights=(5, 2, 1.5, 1, 1.5)
    )[0]
    return _FAMILIES[family](rng, seed)


def _cluster(rng: random.Random, n: int, procs: int, beyond: float = 0.03) -> dict[str, Any]:
    bound = 0.01 / 2
    beyond_run = rng.random() < beyond
    return {
        "node_rates": tuple(_rate(rng, bound, beyond_run and rng.random() < 0.5) for _ in range(n)),
        "proc_rates": tuple(_rate(rng, bound, False) for _ in range(procs)),
    }


def _random_faults(rng: random.Random, n: int, procs: int, workers: int, end: float) -> list[Fault]:
    faults = []
    for _ in range(rng.randint(0, 6)):
        at = rng.uniform(0.2, end)
        kind = rng.choices(
            (
                "delay",
                "drop",
                "partition",
                "pause",
                "crash",
                "flush",
                "evict_all",
                "evict_one",
                "failover",
                "stall",
                "cancel",
                "clock_step",
            ),
            weights=(3, 2, 2, 3, 2, 1.5, 0.5, 0.3, 1.5, 2, 2, 0.3),
        )[0]
        node = rng.randrange(n)
        if kind == "delay":
            faults.append(Fault(kind, at, node, rng.uniform(0.2, 3), rng.uniform(0.01, 0.3)))
        elif kind == "drop":
            faults.append(Fault(kind, at, node, rng.uniform(0.2, 3), rng.uniform(0.05, 0.5)))
        elif kind == "partition":
            cut = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
            faults.append(Fault(kind, at, rng.randrange(procs), rng.uniform(0.1, 3), nodes=cut))
        elif kind == "pause":
            faults.append(Fault(kind, at, node, rng.uniform(0.05, 4)))
        elif kind == "crash":
            faults.append(Fault(kind, at, node, rng.uniform(0.05, 3)))
        elif kind == "failover":
            faults.append(Fault(kind, at, node, value=rng.uniform(0.0, 2.0)))
        elif kind == "stall":
            faults.append(Fault(kind, at, rng.randrange(procs), rng.uniform(0.05, 4)))
        elif kind == "cancel":
            faults.append(Fault(kind, at, rng.randrange(workers)))
        elif kind == "clock_step":
            faults.append(Fault(kind, at, node, value=rng.choice((-1, 1)) * rng.uniform(0.5, 5)))
        else:
            faults.append(Fault(kind, at, node))
    return sorted(faults, key=lambda f: f.at)


def _ops(rng: random.Random, names: list[str], count: int, ttl: float, kinds: tuple[str, ...]):
    ops = []
    for _ in range(count):
        kind = rng.choice(kinds)
        if kind == "renew":
            hold = rng.uniform(ttl, 3 * ttl)
        elif rng.random() < 0.15:
            hold = rng.uniform(0.5 * ttl, 1.5 * ttl)  # may outlive its lease
        else:
            hold = rng.expovariate(1 / 0.1)
        ops.append(
            Op(
                name=rng.choice(names),
                gap=rng.expovariate(1 / 0.2),
                hold=hold,
                ttl=ttl,
                kind=kind,
                blocking=rng.random() < 0.8,
                timeout=rng.uniform(0.2, 3.0),
            )
        )
    return tuple(ops)


def _contend(rng: random.Random, seed: int) -> Scenario:
    n = rng.choice((3, 3, 4, 5, 5, 7))
    procs = rng.randint(1, 3)
    ttl = rng.choice((0.5, 1.0, 2.0))
    names = [f"job{i}" for i in range(rng.randint(1, 3))]
    kinds = ("plain", "plain", "fencing", "fencing", "fair", "renew")
    workers = tuple(
        Worker(p % procs, _ops(rng, names, rng.randint(4, 12), ttl, kinds), rng.uniform(0, 0.3))
        for p in range(rng.randint(procs, procs + 3))
    )
    end = rng.uniform(3, 12)
    return Scenario(
        seed=seed,
        family="contend",
        n_nodes=n,
        procs=procs,
        workers=workers,
        faults=tuple(_random_faults(rng, n, procs, len(workers), end)),
        ttl=ttl,
        max_ttl=max(2 * ttl, 3.0),
        fresh_cluster=rng.random() < 0.5,
        fault_end=end,
        **_cluster(rng, n, procs),
    )


def _storm(rng: random.Random, seed: int) -> Scenario:
    """Every node loses its data (restarts empty, or fails over to a replica that missed the
    holder's write), at one moment or spaced apart, while a lock is held; a poller tries the
    lock now and then."""
    n = rng.choice((3, 3, 5))
    ttl = rng.uniform(8, 12)
    kind = rng.choices(("crash", "failover", "flush"), weights=(2, 1.5, 1))[0]
    spacing = rng.choice((0.0, rng.uniform(0.5, 4), rng.uniform(1.5, 4)))
    first = rng.uniform(0.5, 1.5)
    faults = []
    for k in range(n):
        at = first + k * spacing
        if kind == "crash":
            faults.append(Fault("crash", at, k, 0.05))
        elif kind == "failover":
            faults.append(Fault("failover", at, k, value=at + 1))
        else:
            faults.append(Fault("flush", at, k))
    faults += _random_faults(rng, n, 2, 2, first + n * spacing)[: rng.randint(0, 2)]
    holder = Worker(0, (Op("job", 0.0, ttl, ttl, rng.choice(("plain", "fencing"))),))
    gap = first + n * spacing + rng.uniform(0.1, 2)
    polls = tuple(
        Op("job", gap if i == 0 else rng.uniform(0.2, 3), 0.05, ttl, "plain", blocking=False)
        for i in range(rng.randint(2, 6))
    )
    end = first + n * spacing + 1
    return Scenario(
        seed=seed,
        family="storm",
        n_nodes=n,
        procs=2,
        workers=(holder, Worker(1, polls, 0.2)),
        faults=tuple(sorted(faults, key=lambda f: f.at)),
        ttl=ttl,
        max_ttl=20.0,
        fresh_cluster=rng.random() < 0.3,
        fault_end=end,
        **_cluster(rng, n, 2, beyond=0.0),
    )


def _renew(rng: random.Random, seed: int) -> Scenario:
    """One process holds many auto-renewed locks while a minority node goes silent."""
    n = rng.choice((3, 5))
    ttl = rng.uniform(0.8, 1.5)
    count = rng.randint(20, 40)
    ops = tuple(Op(f"bulk{i}", 0.0, 0.0, ttl, "renew", timeout=1.0) for i in range(count))
    faults = [Fault("pause", rng.uniform(0.5, 1.0), rng.randrange(n), rng.uniform(2, 4))]
    return Scenario(
        seed=seed,
        family="renew",
        n_nodes=n,
        procs=1,
        workers=(Worker(0, ops),),
        faults=tuple(faults),
        ttl=ttl,
        max_ttl=3.0,
        fresh_cluster=False,
        fault_end=faults[0].at + faults[0].span,
        **_cluster(rng, n, 1, beyond=0.0),
    )


def _fork(rng: random.Random, seed: int) -> Scenario:
    """A holder forks a child (a worker pool's prefork) while holding; contenders wait."""
    n = rng.choice((3, 5))
    ttl = rng.uniform(2, 4)
    holder = Worker(0, (Op("job", 0.0, ttl * 0.8, ttl, "plain", fork=True),))
    others = tuple(
        Worker(1 + i % 2, _ops(rng, ["job"], rng.randint(2, 5), ttl, ("plain", "fencing")), 0.1)
        for i in range(rng.randint(1, 3))
    )
    end = rng.uniform(2, 6)
    return Scenario(
        seed=seed,
        family="fork",
        n_nodes=n,
        procs=3,
        workers=(holder, *others),
        faults=tuple(_random_faults(rng, n, 3, 1 + len(others), end)[:2]),
        ttl=ttl,
        max_ttl=max(2 * ttl, 3.0),
        fresh_cluster=False,
        fault_end=end,
        **_cluster(rng, n, 3, beyond=0.0),
    )


def _drift(rng: random.Random, seed: int) -> Scenario:
    """Holders keep the lock to the end of their lease; contenders retry as it runs out, on
    clocks drifting apart within the bound."""
    n = rng.choice((3, 5))
    ttl = rng.uniform(1, 3)
    bound = 0.01 / 2
    workers = tuple(
        Worker(
            p,
            tuple(
                Op("job", 0.0, ttl * 2, ttl, "plain", timeout=ttl * 3)
                for _ in range(rng.randint(2, 4))
            ),
            0.0,
        )
        for p in range(2)
    )
    return Scenario(
        seed=seed,
        family="drift",
        n_nodes=n,
        procs=2,
        workers=workers,
        faults=(),
        ttl=ttl,
        max_ttl=max(2 * ttl, 3.0),
        fresh_cluster=False,
        fault_end=0.0,
        node_rates=tuple(1 + bound * rng.uniform(0.6, 1) for _ in range(n)),
        proc_rates=tuple(1 - bound * rng.uniform(0.6, 1) for _ in range(2)),
    )


_FAMILIES = {"contend": _contend, "storm": _storm, "renew": _renew, "fork": _fork, "drift": _drift}


# -- running -------------------------------------------------------------------------------------


class Run:
    """One scenario in one world, with the records the invariants read."""

    def __init__(self, sc: Scenario, mutant: str | None, trace: bool) -> None:
        self.sc = sc
        self.world = world = World(sc.seed, sc.n_nodes)
        world.trace = trace
        world.mutant = mutant
        self.driver: Driver = world.driver
        self.holds: dict[str, Hold] = {}
        self.failed_tokens: set[str] = set()
        self.violations = dict.fromkeys(VIOLATIONS, 0)
        self.known: dict[str, int] = {}
        self.details: list[str] = []
        self.ops = 0
        self.disturbed: list[tuple[float, float, frozenset[int], frozenset[int]]] = []
        world.on_lost = self._on_lost
        world.on_valid = self._on_valid
        world.on_leak = self._on_leak
        self.quorum = sc.n_nodes // 2 + 1

    def known_issue(self, issue: str, text: str) -> None:
        self.known[issue] = self.known.get(issue, 0) + 1
        self.world.note(f"KNOWN ISSUE {issue}: {text}")

    def violation(self, kind: str, text: str) -> None:
        self.violations[kind] += 1
        if len(self.details) < 20:
            self.details.append(f"{kind}: {text}")
        self.world.note(f"VIOLATION {kind}: {text}")

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        sc, world = self.sc, self.world
        rng = random.Random(sc.seed ^ 0xC1A5)
        for node, rate in zip(world.nodes, sc.node_rates, strict=False):
            node.rate = rate
            node.offset += rng.uniform(-0.02, 0.02)  # NTP keeps the wall clocks close
            node.run_id = f"{rng.getrandbits(160):040x}"
            if sc.fresh_cluster:
                node.started_wall = node.wall() - rng.uniform(0, 1)
            else:
                node.started_wall = node.wall() - rng.uniform(1000, 100000)
                ms = int((node.started_wall + 1) * 1000)
                node.data[b"redlock:node"] = {
                    b"run_id": node.run_id.encode(),
                    b"started": b"%d" % ms,
                    b"fresh": b"0",
                    b"trusted": b"0",
                    b"armed": b"%d" % ms,
                    b"id": b"%d" % (ms * 1000),
                }
        config = {
            "ttl": sc.ttl,
            "max_ttl": sc.max_ttl,
            "node_timeout": sc.node_timeout,
            "drift_factor": sc.drift_factor,
            "retry_delay": 0.2,
            "fair_heartbeat": 3.0,
        }
        for p in range(sc.procs):
            world.new_proc(sc.proc_rates[p], rng.uniform(0, 1000), **config)
        self.config = config
        for index, worker in enumerate(sc.workers):
            proc = world.procs[worker.proc]
            task = Task(world, proc, None, f"t{index}")
            task.gen = self._work(task, worker)
            task.start(worker.start)
        for fault in sc.faults:
            world.at(fault.at, self._inject, fault)

    # -- faults --------------------------------------------------------------------------

    def _disturb(self, start: float, end: float, nodes: Any = (), procs: Any = ()) -> None:
        self.disturbed.append((start, end, frozenset(nodes), frozenset(procs)))

    def _inject(self, f: Fault) -> None:
        world = self.world
        now = world.now
        world.note(f"fault {f}")
        inf = float("inf")
        if f.kind in ("delay", "drop"):
            table = world.extra_delay if f.kind == "delay" else world.drop
            table[f.node] = f.value
            world.at(now + f.span, _forget, table, f.node)
            self._disturb(now, now + f.span + 0.5, [f.node])
        elif f.kind == "partition":
            pid = world.procs[f.node].pid
            for i in f.nodes:
                world.cut.add((pid, i))
                world.heal_at[(pid, i)] = now + f.span
            world.at(now + f.span, self._heal, pid, f.nodes)
            self._disturb(now, now + f.span + 0.5, f.nodes)
        elif f.kind == "pause":
            node = world.nodes[f.node]
            node.paused = True
            world.at(now + f.span, world.resume_node, node)
            self._disturb(now, now + f.span + 0.5, [f.node])
        elif f.kind == "crash":
            self._crash(f.node, f.span)
            self._disturb(now, inf, [f.node])
        elif f.kind in ("flush", "evict_all"):
            world.nodes[f.node].flush()
            self._disturb(now, inf, [f.node])
        elif f.kind == "evict_one":
            node = world.nodes[f.node]
            keys = sorted(node.lock_keys())
            if keys:
                key = keys[world.rng.randrange(len(keys))]
                node.data.pop(key, None)
                node.expires.pop(key, None)
            self._disturb(now, inf, [f.node])
        elif f.kind == "failover":
            self._failover(f.node, f.value)
            self._disturb(now, inf, [f.node])
        elif f.kind == "clock_step":
            world.nodes[f.node].offset += f.value
            self._disturb(now, inf, [f.node])
        elif f.kind == "stall":
            proc = world.procs[f.node]
            proc.stalled_until = max(proc.stalled_until, now + f.span)
            self._disturb(now, now + f.span + 0.5, (), [proc.pid])
        elif f.kind == "cancel":
            task = world.tasks[f.node] if f.node < len(world.tasks) else None
            if task is not None and task.in_acquire:
                task.cancel()

    def _heal(self, pid: int, nodes: tuple[int, ...]) -> None:
        for i in nodes:
            self.world.cut.discard((pid, i))

    def _drop_subscriptions(self, index: int) -> None:
        node = self.world.nodes[index]
        for proc in self.world.procs:
            for n, _, notice in proc.notices:
                if n is node:
                    notice.dead = True
            proc.notices = [x for x in proc.notices if x[0] is not node]

    def _crash(self, index: int, down: float) -> None:
        world = self.world
        node = world.nodes[index]
        node.up = False
        node.paused = False
        node.queued = []
        node.epoch += 1
        self._drop_subscriptions(index)

        def restart() -> None:
            node.flush()
            node.up = True
            node.run_id = f"{world.rng.getrandbits(160):040x}"
            node.started_wall = node.wall()
            node.released = set()
            world.note(f"node{index} restarted empty")

        world.at(world.now + down, restart)

    def _failover(self, index: int, lag: float) -> None:
        """The node's replica, which has the data as of ``lag`` seconds ago, takes over."""
        world = self.world
        node = world.nodes[index]
        data, expires = self._snapshot_at(index, world.now - lag)
        node.data, node.expires = data, expires
        node.epoch += 1
        node.paused = False
        node.queued = []
        node.run_id = f"{world.rng.getrandbits(160):040x}"
        node.started_wall = node.wall() - 86400  # the replica has been running for a day
        node.released = set()
        self._drop_subscriptions(index)

    def _snapshot_at(self, index: int, t: float) -> tuple[dict[bytes, Any], dict[bytes, int]]:
        snaps = self._snaps.get(index, [])
        if not snaps:
            return {}, {}
        best = snaps[0][1]
        for when, snap in snaps:
            if when <= t:
                best = snap
        data, expires = best
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}, dict(expires)

    def _take_snapshots(self) -> None:
        """Replication, coarsely: each node's replica state every 0.25 s."""
        world = self.world
        for node in world.nodes:
            self._snaps.setdefault(node.index, []).append((world.now, node.snapshot()))
        if world.now < self.sc.fault_end:
            world.at(world.now + 0.25, self._take_snapshots)

    # -- the clients' work -----------------------------------------------------------------

    def _work(self, task: Task, worker: Worker) -> Gen:
        world, driver = self.world, self.driver
        proc = task.proc
        rl = proc.rl
        assert rl is not None
        for op in worker.ops:
            if op.gap:
                yield Sleep(op.gap)
            handle = rl.lock(
                op.name,
                ttl=op.ttl,
                auto_renew=op.kind == "renew",
                fencing=op.kind == "fencing",
                fair=op.kind == "fair",
                blocking=op.blocking,
            )
            self.ops += 1
            task.in_acquire = True
            lease = None
            tokens_before = set(self._attempt_tokens)
            try:
                lease = yield from driver.acquire(task, handle, op.blocking, op.timeout)
            except Cancelled:
                world.note(f"{task.name} cancelled in acquire of {op.name}")
            except (QuorumError, LockError):
                pass
            finally:
                task.in_acquire = False
            tried = self._attempt_tokens - tokens_before
            if lease is None:
                self.failed_tokens |= tried
                world.note(f"{task.name} {op.name} not acquired")
                continue
            self.failed_tokens |= tried - {lease.token}
            self._held(proc, lease, op.kind)
            world.note(f"{task.name} holds {op.name} fence={lease.fence} token={lease.token[:8]}")
            if op.fork:
                yield Sleep(op.hold * 0.2)
                child = world.fork(proc)
                ctask = Task(world, child, None, f"{task.name}-child")
                ctask.gen = self._child(ctask, _copy_lease(lease))
                ctask.start(world.now)
                yield Sleep(op.hold * 0.8)
            elif op.hold:
                yield Sleep(op.hold)
            if op.kind == "renew" and op.hold == 0.0:
                continue  # held to the end of the run (released by the final phase)
            self._end_hold(proc, lease)
            self.ops += 1
            with contextlib.suppress(LockError):
                yield from driver.release(task, lease)

    def _child(self, task: Task, lease: Lease) -> Gen:
        """A forked child runs the rest of its parent's ``with`` block: it leaves it too."""
        yield Sleep(0.01)
        with contextlib.suppress(LockError):
            yield from self.driver.release(task, lease)

    @property
    def _attempt_tokens(self) -> set[str]:
        return self.world.driver.tokens

    def _held(self, proc: Proc, lease: Lease, kind: str) -> None:
        now = self.world.now
        end = proc.real_of(lease.valid_until)
        self.holds[lease.token] = Hold(
            lease.name,
            lease.token,
            lease.fence,
            proc,
            now,
            [[now, end]],
            kind,
            copies=self._copies(lease),
        )

    def _copies(self, lease: Lease) -> set[int]:
        """The nodes that hold ``lease``'s token now (the simulator sees every keyspace)."""
        key = f"redlock:lock:{lease.name}".encode()
        head = lease.token.encode() + b" "
        return {
            node.index
            for node in self.world.nodes
            if isinstance(value := node.get(key), bytes) and value.startswith(head)
        }

    def _on_valid(self, proc: Proc, lease: Lease) -> None:
        hold = self.holds.get(lease.token)
        if hold is None or hold.ended:
            return
        now = self.world.now
        end = proc.real_of(lease.valid_until)
        last = hold.segments[-1]
        if last[1] >= now:
            last[1] = max(last[1], end)
        else:
            hold.segments.append([now, end])

    def _end_hold(self, proc: Proc, lease: Lease) -> None:
        hold = self.holds.get(lease.token)
        if hold is None or hold.ended:
            return
        hold.ended = True
        now = self.world.now
        for seg in hold.segments:
            seg[1] = min(seg[1], now)

    def _on_lost(self, proc: Proc, lease: Lease, why: str) -> None:
        hold = self.holds.get(lease.token)
        if hold is None:
            return
        now = self.world.now
        self.world.note(f"lease {lease.name} {lease.token[:8]} lost: {why}")
        if not hold.ended:
            self._end_hold(proc, lease)
        if self.sc.labels():
            return
        touched: set[int] = set()
        for start, end, nodes, procs in self.disturbed:
            if start <= now and end >= hold.start:
                touched |= nodes
                if proc.pid in procs:
                    return  # the holder itself was frozen
        if "force" in why:
            return
        # Copies on nodes nothing happened to: enough of them, and the loss is made up (a hold
        # on a bare quorum that loses one copy is lost, rightly).
        kept = (hold.copies | self._copies(lease)) - touched
        if len(kept) >= self.quorum:
            self.violation(
                "lost",
                f"{lease.name} {lease.token[:8]} reported lost ({why}) at {now:.3f} while "
                f"nodes {sorted(kept)} held it and were never disturbed",
            )

    def _on_leak(self, node: Any, token: bytes, script: str) -> None:
        if script == scripts.EXTEND.body:
            self.known_issue("claim_after_release", f"{node.name}: token {token[:8].decode()}")
            return
        self.violation(
            "leftovers",
            f"{node.name}: the acquire of token {token[:8].decode()} ran after its own undo "
            "there (a lease left behind by a failed attempt)",
        )

    # -- the run -------------------------------------------------------------------------

    def run(self) -> None:
        sc, world = self.sc, self.world
        self._snaps: dict[int, list[Any]] = {}
        self.setup()
        world.at(0.0, self._take_snapshots)
        budget = sum(op.gap + op.timeout + op.hold + 1.5 for w in sc.workers for op in w.ops)
        stuck_at = max(sc.fault_end, 0.0) + budget + sc.max_ttl + 5
        world.run_until(stuck_at)
        workers = [t for t in world.tasks if t.name.startswith("t") and "-child" not in t.name]
        for t in workers:
            if not t.done:
                self.violation("stuck", f"thread {t.name} still waiting at {world.now:.1f}s")
                t.done = True
        self._final()

    def _final(self) -> None:
        """Faults are over: everything still held is released, what could not reach a node
        goes out, and then every name must be free and no failed attempt left a key."""
        world, _driver = self.world, self.driver
        for node in world.nodes:
            if node.paused:
                world.resume_node(node)
            if not node.up:
                node.up = True
        world.cut.clear()
        world.extra_delay.clear()
        world.drop.clear()
        for proc in world.procs:
            rl = proc.rl
            assert rl is not None
            held = [lease for lease in list(rl.leases._leases.values()) if not lease.foreign]
            task = Task(world, proc, None, f"final-{proc.pid}")
            task.gen = self._release_all(task, held)
            task.start(world.now)
        world.run_until(world.now + 2.0)
        names = sorted({w_op.name for w in self.sc.workers for w_op in w.ops})
        if self.sc.labels():
            return
        live = {h.token for h in self.holds.values() if not h.ended}
        for node in world.nodes:
            for key, value in node.lock_keys().items():
                token = value.split(b" ", 1)[0].decode()
                if token in self.failed_tokens and token not in live:
                    self.violation(
                        "leftovers",
                        f"{node.name} still holds {key.decode()} for failed attempt {token[:8]}",
                    )
        proc = world.new_proc(1.0, 5000.0, **self.config)
        task = Task(world, proc, None, "final-check")
        task.gen = self._claim(task, names)
        task.start(world.now)
        world.run_until(world.now + self.sc.max_ttl + 10)
        if not task.done:
            self.violation("not_free", "the final check never finished")

    def _release_all(self, task: Task, leases: list[Lease]) -> Gen:
        proc = task.proc
        for lease in leases:
            self._end_hold(proc, lease)
            with contextlib.suppress(LockError):
                yield from self.driver.release(task, lease)
        rl = proc.rl
        assert rl is not None
        for name in sorted({h.name for h in self.holds.values()}):
            # Asked for its round trip to every node, not its answer: beside a node in its
            # restart guard it may not be able to tell.
            with contextlib.suppress(QuorumError):
                yield from self.driver.drive(task, rl._locked_steps(name))

    def _claim(self, task: Task, names: list[str]) -> Gen:
        rl = task.proc.rl
        assert rl is not None
        for name in names:
            handle = rl.lock(name, ttl=min(self.sc.ttl, rl.max_ttl))
            lease = None
            try:
                lease = yield from self.driver.acquire(
                    task, handle, True, self.sc.max_ttl + 2 * self.sc.ttl + 3
                )
            except LockError as exc:
                self.violation("not_free", f"{name}: {exc}")
            if lease is None:
                self.violation(
                    "not_free", f"{name} could not be taken once everything was released"
                )
                continue
            yield from self.driver.release(task, lease)

    def check(self) -> None:
        """No two holders' validity overlaps; fences increase in hold order."""
        by_name: dict[str, list[tuple[float, float, Hold]]] = {}
        for hold in self.holds.values():
            for start, end in hold.segments:
                if end > start:
                    by_name.setdefault(hold.name, []).append((start, end, hold))
        for name, segs in by_name.items():
            segs.sort(key=lambda s: (s[0], s[1]))
            far, who = -1.0, None
            for start, end, hold in segs:
                if who is not None and start < far and who.token != hold.token:
                    self.violation(
                        "overlaps",
                        f"{name}: {hold.token[:8]} valid from {start:.4f} while {who.token[:8]} "
                        f"was valid until {far:.4f}",
                    )
                if end > far:
                    far, who = end, hold
        for name in by_name:
            fenced = sorted(
                (h for h in self.holds.values() if h.name == name and h.fence is not None),
                key=lambda h: h.start,
            )
            for a, b in itertools.pairwise(fenced):
                if b.fence is not None and a.fence is not None and b.fence <= a.fence:
                    self.violation("fences", f"{name}: fence {b.fence} handed out after {a.fence}")


def _forget(table: dict[int, float], key: int) -> None:
    table.pop(key, None)


def _copy_lease(lease: Lease) -> Lease:
    import copy

    return copy.copy(lease)


def run_scenario(sc: Scenario, mutant: str | None = None, trace: bool = False) -> Outcome:
    run = Run(sc, mutant, trace)
    with run.world.installed(), applied(mutant, run.world):
        run.run()
        run.check()
    labels = sc.labels()
    return Outcome(
        scenario=sc,
        violations=run.violations,
        details=run.details,
        ops=run.world.driver.ops,
        sim_seconds=run.world.now,
        faults=len(sc.faults),
        labels=labels,
        trace=run.world.log,
        known=run.known,
    )


def used_scripts() -> list[str]:
    return [s.sha for s in (scripts.ACQUIRE, scripts.RELEASE)]
