"""The deterministic simulator (``python -m tests.simulation``): a short sweep of the real
steps must hold every invariant, the same seed must print the same summary, every mutant
(a historical bug switched back on) must be found within 300 runs of seed 7, and the simulated
node must answer the package's scripts as a real Redis does."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_redlock.core import scripts
from tests.simulation import MUTANTS, sweep
from tests.simulation.node import SimNode

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _quiet_lock_events() -> Iterator[None]:
    logger = logging.getLogger("django_redlock")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _cli(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
    return subprocess.run(
        [sys.executable, "-m", "tests.simulation", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_short_sweep_of_the_real_steps_violates_nothing() -> None:
    summary = sweep(25, seed=1)
    assert summary.runs == 25
    assert summary.ops > 1000
    assert summary.faults > 0
    assert not summary.violated, summary.line()
    assert summary.line().startswith(f"runs=25 ops={summary.ops} overlaps=0 ")


def test_the_same_seed_prints_the_same_summary_in_another_process() -> None:
    first = _cli("--runs", "6", "--seed", "3", hash_seed="1")
    second = _cli("--runs", "6", "--seed", "3", hash_seed="2")
    assert first.returncode == 0, first.stdout + first.stderr
    last = first.stdout.strip().splitlines()[-1]
    assert last == second.stdout.strip().splitlines()[-1]
    assert last.startswith("runs=6 ops=") and " overlaps=0 " in last


def test_list_mutants_names_at_least_ten_historical_bugs() -> None:
    listed = _cli("--list-mutants")
    assert listed.returncode == 0
    names = [line.split(":", 1)[0] for line in listed.stdout.splitlines()]
    assert names == sorted(MUTANTS) and len(names) >= 10


def test_a_violation_prints_its_seed_schedule_and_a_shrunk_trace() -> None:
    found = _cli("--runs", "3", "--seed", "7", "--mutant", "quorum_half", "--stop")
    assert found.returncode == 1
    out = found.stdout
    assert "VIOLATION in run seed=7000021 " in out
    assert "--replay 7000021 --mutant quorum_half" in out
    assert "schedule:" in out and "shrunk schedule:" in out and "trace (last steps):" in out
    assert "overlaps:" in out
    assert out.strip().splitlines()[-1].startswith("runs=1 ops=")
    replayed = _cli("--replay", "7000021", "--mutant", "quorum_half", "--no-shrink")
    assert replayed.returncode == 1 and "VIOLATION in run seed=7000021 " in replayed.stdout


def test_a_clean_replay_prints_its_schedule_and_whole_trace() -> None:
    """docs/faults.rst: ``--replay RUN_SEED`` runs one run again, with its trace, whether or
    not it broke a rule."""
    replayed = _cli("--replay", "1000236")
    assert replayed.returncode == 0
    out = replayed.stdout
    assert "schedule:\nseed=1000236 family=" in out
    trace = out.split("trace:\n", 1)[1].strip().splitlines()[:-1]  # the summary line ends it
    assert len(trace) >= 5 and any(" holds " in line for line in trace)
    assert "fault pause@" in out and "VIOLATION" not in out
    assert out.strip().splitlines()[-1].startswith("runs=1 ops=")


def test_the_run_docs_name_for_the_known_issue_shows_it() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "faults.rst").read_text()
    assert "``--replay 1000239`` shows it" in docs
    summary = _cli("--replay", "1000239").stdout.strip().splitlines()[-1]
    assert int(summary.split(" known=")[1].split()[0]) > 0
    assert " overlaps=0 " in summary


_SLOW = {"trust_apart", "fresh_kept", "flushed_votes", "fork_releases"}


@pytest.mark.parametrize(
    "mutant",
    [
        pytest.param(m, marks=[pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(600)])
        if m in _SLOW
        else m
        for m in sorted(MUTANTS)
    ],
)
def test_every_historical_bug_is_found_within_300_runs_of_seed_7(mutant: str) -> None:
    summary = sweep(300, seed=7, mutant=mutant, stop_at_first=True)
    assert summary.violated, f"{mutant} not found: {summary.line()}"
    assert summary.runs <= 300


# -- the simulated node runs the package's scripts as Redis does ---------------------------------


def _real(client: Any, args: list[Any]) -> Any:
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command(*args)
        return conn.read_response()
    finally:
        client.connection_pool.release(conn)


def _shape(reply: Any) -> Any:
    """A reply without what depends on the moment it ran (times, ttls, clock-seeded fences)."""
    if isinstance(reply, list) and len(reply) == 4 and isinstance(reply[2], int) and reply[2] >= 0:
        reply = [reply[0], reply[1], "age", reply[3]]  # ms since the node was trusted
    if isinstance(reply, list):
        return [
            type(r).__name__ if isinstance(r, int) and abs(r) > 100 else _shape(r) for r in reply
        ]
    if isinstance(reply, bytes) and reply.isdigit() and len(reply) > 6:
        return "digits"
    return reply


def test_the_simulated_node_answers_the_scripts_as_a_real_redis(redis_node: Any) -> None:
    client = redis_node.client()
    run_id = client.info("server")["run_id"]
    sim = SimNode(0, lambda: 0.0)
    sim.run_id = run_id
    keys = ["p:lock:a", "p:fence:a", "p:node"]
    acquire = ["EVAL", scripts.ACQUIRE.body, 3, *keys]
    release = ["p:lock:a", "p:waiters:a", "p:queue:a"]
    sequence: list[list[Any]] = [
        [*acquire, "t1", 10000, "{}", "1", run_id, "5000"],  # guarded: a fresh marker
        ["EVAL", scripts.TRUST_NOW.body, 1, "p:node", run_id],
        [*acquire, "t1", 10000, "{}", "1", run_id, "5000"],  # taken, with a fence
        [*acquire, "t2", 10000, "{}", "0", run_id, "5000"],  # held by t1
        ["EVAL", scripts.FENCE_SYNC.body, 2, "p:lock:a", "p:fence:a", "t1", 99],
        ["EVAL", scripts.EXTEND.body, 1, "p:lock:a", "t1", 20000, ""],
        ["EVAL", scripts.EXTEND.body, 1, "p:lock:a", "t2", 20000, ""],
        ["GET", "p:fence:a"],
        ["EVAL", scripts.RELEASE.body, 3, *release, "t2", "p:released:a"],
        ["ZADD", "p:waiters:a", "NX", 5, "w1"],
        ["ZADD", "p:waiters:a", "NX", 9, "w1"],  # keeps its place
        ["ZADD", "p:waiters:a", "NX", 7, "w2"],
        ["PEXPIRE", "p:waiters:a", 6000],
        ["EVAL", scripts.RELEASE.body, 3, *release, "t1", "p:released:a"],
        ["ZRANGE", "p:waiters:a", 0, -1],  # nobody listened: both were tried
        ["EXISTS", "p:lock:a"],
        ["SET", "p:lock:b", "t3 0 0 1 500\n{}", "NX", "PX", 500],
        ["SET", "p:lock:b", "t4 0 0 1 500\n{}", "NX", "PX", 500],
        ["EVAL", scripts.EXTEND.body, 1, "p:lock:c", "t5", 500, "t5 0 0 1 500\n{}"],
        ["EVAL", scripts.FAIR_TICKET.body, 1, "p:qseq:a", 6000],
        ["EVAL", scripts.FAIR_TICKET.body, 1, "p:qseq:a", 6000],
        ["HMGET", "p:node", "run_id", "fresh"],
    ]
    for args in sequence:
        real = _real(client, args)
        simulated = sim.command([str(a).encode() for a in args])
        assert _shape(simulated) == _shape(real), args[:2]
