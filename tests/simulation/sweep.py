"""Many seeded runs, their summary line, and the shrinking of a violating schedule."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from .scenario import VIOLATIONS, Outcome, Scenario, generate, run_scenario

__all__ = ["KNOWN_ISSUES", "Summary", "run_seed", "shrink", "sweep"]

#: Real bugs of the core the simulator finds and that are not fixed yet: issue -> (the first
#: seed of ``--seed 1`` that shows it, what it is). The simulator recognises them and counts
#: them apart (``known=``), not as violations.
KNOWN_ISSUES: dict[str, tuple[int, str]] = {
    "claim_after_release": (
        1000018,
        "a renewal's claim (EXTEND with a value) still queued on a frozen node runs after the "
        "lease's release, which went out on another connection: the node holds the released "
        "lock again until its ttl ends (liveness: one node's copy; the batch's dues carry no "
        "undo behind them, unlike an acquire's)",
    ),
}


def run_seed(seed: int, mutant: str | None = None, trace: bool = False) -> Outcome:
    return run_scenario(generate(seed), mutant, trace)


@dataclasses.dataclass
class Summary:
    runs: int = 0
    ops: int = 0
    sim_seconds: float = 0.0
    faults: int = 0
    assumption_runs: int = 0
    assumption_violations: int = 0
    known: int = 0
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(VIOLATIONS, 0))
    first: Outcome | None = None
    #: The run seeds that violated an invariant (within the assumptions).
    seeds: list[int] = dataclasses.field(default_factory=list)

    @property
    def violated(self) -> bool:
        return any(self.counts.values())

    def add(self, outcome: Outcome) -> None:
        self.runs += 1
        self.ops += outcome.ops
        self.sim_seconds += outcome.sim_seconds
        self.faults += outcome.faults
        if outcome.labels:
            self.assumption_runs += 1
            self.assumption_violations += sum(outcome.violations.values())
            return
        self.known += sum(outcome.known.values())
        for kind, count in outcome.violations.items():
            self.counts[kind] += count
        if outcome.violated:
            self.seeds.append(outcome.scenario.seed)
            if self.first is None:
                self.first = outcome

    def line(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in self.counts.items())
        return (
            f"runs={self.runs} ops={self.ops} {counts} known={self.known} "
            f"assumption_runs={self.assumption_runs} "
            f"assumption_violations={self.assumption_violations} faults={self.faults} "
            f"sim_hours={self.sim_seconds / 3600:.2f}"
        )


def sweep(
    runs: int,
    seed: int,
    mutant: str | None = None,
    stop_at_first: bool = False,
    progress: Callable[[int, Outcome], None] | None = None,
) -> Summary:
    """``runs`` scenarios, seeds ``seed*1_000_003 + i``."""
    summary = Summary()
    for i in range(runs):
        run = seed * 1_000_003 + i
        try:
            outcome = run_seed(run, mutant)
        except Exception as exc:  # a simulator bug: name the run that shows it
            raise RuntimeError(f"run seed={run} crashed (--replay {run}): {exc!r}") from exc
        summary.add(outcome)
        if progress is not None:
            progress(i, outcome)
        if stop_at_first and summary.violated:
            break
    return summary


def _still_fails(sc: Scenario, mutant: str | None) -> bool:
    out = run_scenario(sc, mutant)
    return out.violated and not out.labels


def shrink(sc: Scenario, mutant: str | None = None, budget: float = 20.0) -> Scenario:
    """A smaller schedule that still violates: faults, threads and operations dropped one at a
    time while the violation stays (bounded by ``budget`` seconds of CPU)."""
    deadline = time.process_time() + budget
    changed = True
    while changed and time.process_time() < deadline:
        changed = False
        for i in range(len(sc.faults)):
            trial = dataclasses.replace(sc, faults=sc.faults[:i] + sc.faults[i + 1 :])
            if _still_fails(trial, mutant):
                sc, changed = trial, True
                break
        if changed:
            continue
        for w in range(len(sc.workers)):
            if len(sc.workers) > 1:
                trial = dataclasses.replace(sc, workers=sc.workers[:w] + sc.workers[w + 1 :])
                if _still_fails(trial, mutant):
                    sc, changed = trial, True
                    break
            worker = sc.workers[w]
            for o in range(len(worker.ops) - 1, -1, -1):
                if len(worker.ops) <= 1:
                    break
                fewer = dataclasses.replace(worker, ops=worker.ops[:o] + worker.ops[o + 1 :])
                trial = dataclasses.replace(
                    sc, workers=(*sc.workers[:w], fewer, *sc.workers[w + 1 :])
                )
                if _still_fails(trial, mutant):
                    sc, changed = trial, True
                    break
            if changed or time.process_time() > deadline:
                break
    return sc
