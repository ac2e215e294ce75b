"""``bench/semaphore.py`` at its smallest, on our rows only (no PyPI peer is installed here):
its history check, and that it runs end to end without an overshoot or a failed acquire.

The timings it prints are not asserted (docs/benchmarks.rst has them); what is asserted is
what the bench's tables rest on: the history check finds an overshoot when there is one, and
ours never shows more than ``limit`` holders, contended or held past the lease.
"""

from __future__ import annotations

import pytest

from bench import semaphore as bench


def test_history_check_counts_holders_and_ignores_touching_ends() -> None:
    assert bench.max_holders([]) == (0, 0)
    assert bench.max_holders([(0, 1), (1, 2), (2, 3)]) == (1, 3)
    assert bench.max_holders([(0, 2), (1, 3), (1.5, 4), (3.5, 5)]) == (3, 1)
    # Four holders of a limit-3 semaphore, the fourth inside the other three: found.
    most, at_most = bench.max_holders([(0, 10), (1, 10), (2, 10), (5, 6)])
    assert (most, at_most) == (4, 1)


def test_smallest_run_on_our_rows(capsys: pytest.CaptureFixture[str]) -> None:
    smallest = "--only ours --no-install --nodes 3 --rounds 1 --cycles 5 --threads 4 --seconds 0.3"
    bench.main([*smallest.split(), "--no-lease"])
    out = capsys.readouterr().out
    contended = out.split("\ncontended:", 1)[1].splitlines()[2:]
    rows = {line.split(" (")[0]: line.split() for line in contended if line.startswith("ours")}
    assert set(rows) == {"ours: mutex", "ours: semaphore"}, out
    for name, cols in rows.items():
        # cyc/s, /permit, slowest, failed, max held, at max, verdict
        assert cols[-1] == "ok", out
        assert int(cols[-4]) == 0, f"{name}: failed acquires\n{out}"
        assert 1 <= int(cols[-3]) <= (1 if "mutex" in name else 3), out
    assert "OVERSHOOT" not in out and "errors, first" not in out, out


def test_ours_past_the_lease_never_admits_a_fourth_beside_three_that_hold(
    redis_nodes, make_redlock
) -> None:
    """Renewed holds outlive the lease; a holder whose renewal lost the race on a loaded host is
    told (``held`` False), so a caller let in then is never a fourth beside three that hold."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    row = bench.PastLease("ours", 3)
    bench.past_lease(
        lambda name, limit, terms: bench._Ours(rl, name, limit, terms),
        "bench:lease",
        3,
        1.5,
        row,
    )
    assert row.probes == 2 and not row.errors, row
    assert len(row.told) == 3 and all(t is not None for t in row.told)
    still = sum(bool(t) for t in row.told)
    assert row.admitted <= 3 - still, row
