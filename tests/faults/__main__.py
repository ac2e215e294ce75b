"""``python -m tests.faults [--soak] [--scale N] [--table] [--markdown] [scenario ...]``

Runs the scenarios (all by default) and prints a line per scenario to stderr; with ``--table``
the results table (RST, or Markdown with ``--markdown``) goes to stdout, ready for
docs/faults.rst.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time

from .harness import Profile
from .report import table
from .scenarios import SCENARIOS, ScenarioSkipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="scenario",
        help=f"run only these (default: all): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--soak", action="store_true", help="the long profile (10x)")
    parser.add_argument("--scale", type=int, default=None, help="scale factor (soak: 10)")
    parser.add_argument("--table", action="store_true", help="print the results table")
    parser.add_argument("--markdown", action="store_true", help="Markdown instead of RST")
    args = parser.parse_args(argv)
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    logging.getLogger("django_redlock").setLevel(logging.ERROR)
    if args.soak:
        profile = Profile.soak(args.scale or 10)
    elif args.scale:
        profile = Profile("custom", args.scale)
    else:
        profile = Profile.quick()
    results, skipped, failed = [], [], 0
    started = time.monotonic()
    for name in args.scenarios or list(SCENARIOS):
        t0 = time.monotonic()
        try:
            res = SCENARIOS[name](profile)
        except ScenarioSkipped as exc:
            skipped.append((name, str(exc)))
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        except Exception as exc:  # keep going: the table shows what ran
            failed += 1
            print(f"{name}: FAILED {exc!r}", file=sys.stderr)
            continue
        results.append(res)
        print(f"{res.summary()} [{time.monotonic() - t0:.1f}s]", file=sys.stderr)
        slow = [
            f"{label}: {'-' if r is None else f'{r:.2f}s'}"
            for label, r in res.recoveries
            if r is None or r > 2 * (res.recovery or 0) / 3
        ]
        if slow:
            print(f"    slowest recoveries: {', '.join(slow[:5])}", file=sys.stderr)
        for overlap in res.overlaps[:3]:
            print(f"    overlap: {overlap}", file=sys.stderr)
    print(
        f"profile {profile.name} (x{profile.scale}), {time.monotonic() - started:.0f} s, "
        f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
        file=sys.stderr,
    )
    if args.table:
        print(table(results, "markdown" if args.markdown else "rst", skipped))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
