"""``python -m tests.simulation --runs N --seed S [--mutant NAME | --list-mutants]
[--no-shrink]``: N seeded scenarios; the last line is the summary; exit 1 on a violation."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .mutants import MUTANTS
from .scenario import Outcome, run_scenario
from .sweep import Summary, run_seed, shrink, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation", description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mutant", choices=sorted(MUTANTS))
    parser.add_argument("--list-mutants", action="store_true")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--stop", action="store_true", help="stop at the first violation")
    parser.add_argument(
        "--replay", type=int, metavar="RUN_SEED", help="run the one scenario of a run's seed"
    )
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    # Lock events are logged by the core; a simulation has millions of them.
    logging.getLogger("django_redlock").setLevel(logging.CRITICAL)
    if args.list_mutants:
        for name in sorted(MUTANTS):
            print(f"{name}: {MUTANTS[name]}")
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    started = time.process_time()

    def progress(i: int, outcome: Outcome) -> None:
        if args.verbose:
            print(
                f"run {i}: {outcome.scenario.family} ops={outcome.ops} "
                f"violations={sum(outcome.violations.values())}",
                file=sys.stderr,
            )

    if args.replay is not None:
        summary = Summary()
        outcome = run_seed(args.replay, args.mutant, trace=True)
        summary.add(outcome)
        if not summary.violated:  # a violation prints its schedule and trace below
            print("schedule:")
            print(outcome.scenario.describe())
            print("trace:")
            for line in outcome.trace:
                print(f"  {line}")
    else:
        summary = sweep(
            args.runs, args.seed, args.mutant, stop_at_first=args.stop, progress=progress
        )
    cpu = time.process_time() - started
    first = summary.first
    if first is not None:
        sc = first.scenario
        mutant = f" --mutant {args.mutant}" if args.mutant else ""
        print(
            f"VIOLATION in run seed={sc.seed} "
            f"(replay: python -m tests.simulation --replay {sc.seed}{mutant})"
        )
        for line in first.details[:10]:
            print(f"  {line}")
        print("schedule:")
        print(sc.describe())
        if not args.no_shrink:
            sc = shrink(sc, args.mutant)
            print("shrunk schedule:")
            print(sc.describe())
        replay = run_scenario(sc, args.mutant, trace=True)
        print("trace (last steps):")
        for line in replay.trace[-40:]:
            print(f"  {line}")
    print(
        f"cpu={cpu:.1f}s ops_per_cpu_minute={int(summary.ops / max(cpu, 1e-9) * 60)}",
        file=sys.stderr,
    )
    print(summary.line())
    return 1 if summary.violated else 0


if __name__ == "__main__":
    sys.exit(main())
