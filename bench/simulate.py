"""A longer sweep of the deterministic simulator, for docs/faults.rst's numbers.

    python bench/simulate.py                     # 2,000 runs of seed 1, then every mutant
    python bench/simulate.py --runs 20000 --seed 5 --no-mutants

Runs the same scenarios as ``python -m tests.simulation`` (the core's own steps and Lua
scripts against simulated nodes in virtual time) and prints, per sweep: runs, lock operations,
simulated hours, faults injected, the violation counts, the assumption-breaking runs counted
apart, and CPU time with operations per CPU-minute. Then, unless ``--no-mutants``, how many
runs of seed 7 each mutant (a historical bug switched back on) needs to be found. Nothing
here is a test; exit 1 if the sweep of the real code violated an invariant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.simulation import MUTANTS, sweep  # noqa: E402
from tests.simulation.scenario import generate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-mutants", action="store_true")
    args = parser.parse_args()
    logging.getLogger("django_redlock").setLevel(logging.CRITICAL)
    families: Counter[str] = Counter()
    labels: Counter[str] = Counter()

    def seen(i: int, outcome: object) -> None:
        families[outcome.scenario.family] += 1  # type: ignore[attr-defined]
        for label in outcome.labels:  # type: ignore[attr-defined]
            labels[label] += 1

    cpu = time.process_time()
    summary = sweep(args.runs, args.seed, progress=seen)
    cpu = time.process_time() - cpu
    print(f"sweep: --runs {args.runs} --seed {args.seed}")
    print(f"  {summary.line()}")
    print(
        f"  cpu={cpu:.1f}s ops_per_cpu_minute={int(summary.ops / cpu * 60)} "
        f"simulated_hours_per_cpu_minute={summary.sim_seconds / 3600 / cpu * 60:.2f}"
    )
    print(f"  families: {dict(sorted(families.items()))}")
    if summary.seeds:
        print(f"  violating runs (--replay): {summary.seeds}")
    print(f"  assumption-breaking labels: {dict(sorted(labels.items()))}")
    if not args.no_mutants:
        print("mutants (runs of seed 7 until found, at most 300):")
        for name in sorted(MUTANTS):
            started = time.process_time()
            found = sweep(300, 7, mutant=name, stop_at_first=True)
            kinds = [k for k, v in found.counts.items() if v]
            family = found.first.scenario.family if found.first else "-"
            print(
                f"  {name:22s} found={'yes' if found.violated else 'NO':3s} "
                f"runs={found.runs:3d} by={','.join(kinds) or '-':10s} family={family:8s} "
                f"cpu={time.process_time() - started:.1f}s"
            )
    assert generate(args.seed).seed == args.seed
    return 1 if summary.violated else 0


if __name__ == "__main__":
    sys.exit(main())
