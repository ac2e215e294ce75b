"""``bench/bench_admin.py`` as docs/admin.rst runs it, at its smallest: it fills the nodes, then
times every case it lists (the timings are not asserted; the page's table has them)."""

from __future__ import annotations

from tests.helpers import REPO_ROOT, run_python


def test_smallest_run_times_every_case() -> None:
    done = run_python(
        f"""
        import runpy, sys
        sys.argv = ["bench_admin.py", "--locks", "50", "--repeat", "1"]
        runpy.run_path({str(REPO_ROOT / "bench" / "bench_admin.py")!r}, run_name="__main__")
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    timed = [line.split("  ")[0] for line in done.stdout.splitlines() if line.endswith("ms")]
    assert "admin pages with 50 live locks" in done.stdout, done.stdout
    assert len(timed) == 10 and "list page (oldest first)" in timed, done.stdout
