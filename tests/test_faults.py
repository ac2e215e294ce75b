"""The fault-injection suite (tests/faults/, docs/faults.rst) in its quick profile.

Each test runs one scenario on its own real redis-server nodes with several client processes,
then asserts what the scenario must show. Safety (no two valid holds overlap) is asserted
everywhere except in the deliberate no-restart-guard case, where the checker must find the
overlap. ``pytest --soak`` runs the same scenarios ten times longer.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.faults.harness import Profile, ScenarioResult
from tests.faults.scenarios import SCENARIOS, ScenarioSkipped

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"),
        reason="compares time.monotonic() across processes (Linux: one clock)",
    ),
]

_results: dict[str, ScenarioResult] = {}


def run(name: str, profile: Profile) -> ScenarioResult:
    """Run a scenario once per session (two tests may look at one run)."""
    if name not in _results:
        try:
            _results[name] = SCENARIOS[name](profile)
        except ScenarioSkipped as exc:
            pytest.skip(str(exc))
        print(_results[name].summary())
    return _results[name]


def assert_safe(res: ScenarioResult) -> None:
    """No overlap of valid holds, no fence rejection inside a valid hold, no client crashed."""
    assert not res.checks.get("client_errors"), res.checks["client_errors"]
    assert res.overlaps == [], "\n".join(map(str, res.overlaps[:5])) + "\n" + res.summary()
    assert res.rejected_in_valid_hold == 0, res.summary()


def stat(res: ScenarioResult, key: str) -> Any:
    return res.stats.get(key, 0)


def test_contention(fault_profile: Profile) -> None:
    res = run("contention", fault_profile)
    assert_safe(res)
    assert res.cycles >= 10, res.summary()
    assert stat(res, "release_ok") == res.cycles, res.summary()
    # Consecutive holders' fences increase, so no in-time write was ever turned away.
    assert res.stale_rejected == 0, res.summary()
    assert stat(res, "oracle_accepted") == stat(res, "writes"), res.summary()


@pytest.mark.parametrize("name", ["minority_kill", "minority_pause", "minority_restart"])
def test_minority_faults_keep_the_lock_available_and_exclusive(
    name: str, fault_profile: Profile
) -> None:
    res = run(name, fault_profile)
    assert_safe(res)
    assert res.faults == 4 * fault_profile.scale
    # Three of five nodes still form a quorum: the lock was granted while two were down.
    assert res.checks["acquired_during_fault"] > 0, res.summary()
    assert res.recovery is not None, res.summary()


def test_majority_down_fails_closed_and_leaves_nothing(fault_profile: Profile) -> None:
    res = run("majority_down", fault_profile)
    assert_safe(res)
    assert stat(res, "quorum_errors") > 0, res.summary()
    assert res.checks["granted_while_down"] == 0, res.summary()
    assert res.checks["left_on_survivor"] == 0, res.summary()
    # Back after the restarted nodes sat out the restart guard (max_ttl 1.5 s).
    assert res.recovery is not None and res.recovery >= 1.0, res.summary()


def test_holder_killed(fault_profile: Profile) -> None:
    res = run("holder_killed", fault_profile)
    # Killed holds end at their validity (nobody may get the lock before the lease ran out).
    assert_safe(res)
    assert res.faults >= 1
    assert res.checks["killed_while_holding"] == res.faults, res.summary()
    assert res.recovery is not None, res.summary()


def test_holder_paused_past_its_ttl(fault_profile: Profile) -> None:
    res = run("holder_paused", fault_profile)
    assert_safe(res)
    paused = res.faults
    assert paused == 2 * fault_profile.scale, res.summary()
    assert stat(res, "victim_writes") == paused, res.summary()
    # The stale write was turned away by the fence...
    assert stat(res, "victim_write_rejected") == paused, res.summary()
    assert res.stale_rejected >= paused, res.summary()
    # ...the victim knows it lost the lock, and release refused.
    assert stat(res, "victim_held_after_pause") == 0, res.summary()
    assert stat(res, "victim_check_after_pause") == 0, res.summary()
    assert stat(res, "victim_lost_detected") == paused, res.summary()
    refused = stat(res, "victim_release_lost") + stat(res, "victim_release_not-owned")
    assert refused == paused and stat(res, "victim_release_ok") == 0, res.summary()


def test_replies_delayed_past_the_ttl_grant_nothing(fault_profile: Profile) -> None:
    res = run("replies_delayed", fault_profile)
    assert_safe(res)
    assert res.checks["granted_while_delayed"] == 0, res.summary()
    assert stat(res, "refused") + stat(res, "quorum_errors") > 0, res.summary()
    assert res.cycles > 0 and res.recovery is not None, res.summary()  # works once healed


def test_restart_inside_ttl_without_guard_is_caught_by_the_checker(fault_profile: Profile) -> None:
    """The deliberate unsafe configuration: proves the checker sees an overlap when one
    happens (the Redlock paper's restart hazard)."""
    res = run("restart_no_guard", fault_profile)
    assert len(res.overlaps) >= 1, res.summary()


def test_restart_inside_ttl_with_guard(fault_profile: Profile) -> None:
    res = run("restart_guard", fault_profile)
    assert_safe(res)
    # The guarded nodes refused to vote: the lock failed closed until the guard ended.
    assert stat(res, "quorum_errors") > 0, res.summary()
    assert res.recovery is not None and res.recovery >= 1.5, res.summary()


def test_key_deleted_on_one_node(fault_profile: Profile) -> None:
    """Deleting the key on one node never breaks a hold that had it on all three nodes (a
    bare-quorum hold does break: see the next test)."""
    res = run("key_deleted", fault_profile)
    assert_safe(res)
    assert res.checks["spare_deletions"] >= 1, res.summary()
    assert res.faults >= res.checks["spare_deletions"], res.summary()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "Redlock limit, not covered by the restart guard (which covers a node that "
        "lost *all* its data: FLUSHALL, restart, failover): here one lock key is deleted on one "
        "node while its marker survives, so nothing on the node shows the loss. A hold on a "
        "bare quorum (2 of 3, the usual result of a contended race) then has no quorum, and "
        "another client gets the lock before the holder's watchdog reports the loss at its "
        "next renewal. See docs/guarantees.rst, 'What the guard cannot see'."
    ),
)
def test_key_deleted_on_one_node_of_a_bare_quorum_hold(fault_profile: Profile) -> None:
    res = run("key_deleted_bare", fault_profile)
    assert res.faults >= 1, res.summary()
    assert_safe(res)


def test_wall_clock_jumps_do_not_touch_validity(fault_profile: Profile) -> None:
    res = run("clock_jump", fault_profile)
    assert_safe(res)
    assert stat(res, "clock_jumps") > 10, res.summary()
    # Validity comes from the monotonic clock: a +-1 h jump would show as ~3600 s or <= 0.
    assert 0 < stat(res, "validity_min_ms") <= stat(res, "validity_max_ms") <= 1000
    # Renewal went on across the jumps: every hold was released as its own.
    assert stat(res, "release_ok") == res.cycles, res.summary()


def test_hundred_forked_children(fault_profile: Profile) -> None:
    res = run("forks", fault_profile)
    c = res.checks
    n = res.clients
    assert c["child_errors"] == [], c["child_errors"]
    assert c["children_reported"] == n
    assert c["unique_tokens"] == c["expected_tokens"] == 2 * n + 1
    assert c["parent_lock_refused"] == n  # no child inherited the parent's lock
    assert c["renewed_children"] == n  # each child's own watchdog renewed its lock
    assert c["held_after_ttl"] == n
    assert c["parent_still_held"] and c["parent_renewals"] >= 1
    assert_safe(res)


def test_connection_reset_after_the_acquire_was_sent(fault_profile: Profile) -> None:
    res = run("conn_reset", fault_profile)
    assert_safe(res)
    c = res.checks
    assert res.faults > 2, res.summary()
    assert c["false_success"] == 0, res.summary()
    assert c["directed_a_resets"] and c["directed_b_resets"], c
    # A: the script ran on nodes 0 and 1, a quorum: a success, and a true one.
    assert c["directed_a_acquire"] is True and c["directed_a_true_success"], c
    # B: only node 0 ran it: no success.
    assert c["directed_b_acquire"] is False, c
    # Cleanup removed our token (release in A, the failed attempt's cleanup in B), and only
    # ours. (Regression: the re-sent acquire used to answer "held" and the failed attempt
    # skipped its cleanup, leaving our token for the whole lease.)
    assert c["directed_own_token_left"] == 0, c
    assert c["directed_foreign_intact"], c


def test_celery_worker_killed_mid_task(fault_profile: Profile) -> None:
    res = run("celery_killed", fault_profile)
    assert res.checks["errors"] == [], res.checks
    assert res.checks["tasks_completed"] == res.checks["tasks"], res.summary()
    assert res.faults == 2
    # The killed runs were delivered again (acks_late + reject_on_worker_lost).
    assert res.checks["redelivered_runs"] >= 1, res.summary()
    assert_safe(res)
