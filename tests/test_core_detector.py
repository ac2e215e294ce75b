"""The failure detector's decisions (pure: every time is handed in)."""

from __future__ import annotations

import pytest

from django_redlock.core.detector import (
    MAX_STALLS,
    MIN_SPAN,
    MISSES_TO_DOWN,
    STALL_SLACK,
    PauseLog,
    overrun,
    why_lost,
)
from django_redlock.core.fanout import Wait
from django_redlock.core.nodes import NodeDetector


def test_one_late_reply_is_not_a_failed_node() -> None:
    detector = NodeDetector(0.05)
    assert detector.missed(10.0) is False
    assert not detector.down
    assert detector.misses == 1


def test_consecutive_misses_over_the_minimum_span_make_a_node_down() -> None:
    detector = NodeDetector(0.05)
    now = 10.0
    for _ in range(MISSES_TO_DOWN - 1):
        assert detector.missed(now) is False
        now += MIN_SPAN
    assert detector.missed(now) is True
    assert detector.down and detector.down_since == now
    assert f"{MISSES_TO_DOWN} times in a row" in detector.reason
    # Further misses of a down node change nothing.
    assert detector.missed(now + 1) is False


def test_a_burst_of_misses_in_one_bad_moment_is_not_enough() -> None:
    detector = NodeDetector(0.05)
    for i in range(20):
        assert detector.missed(10.0 + i * 0.01) is False  # 20 misses within 0.2 s
    assert not detector.down
    # Once they are spread over the span, the next one decides.
    assert detector.missed(10.0 + MIN_SPAN) is True


def test_an_answer_between_misses_starts_the_count_over() -> None:
    detector = NodeDetector(0.05)
    detector.missed(10.0)
    detector.missed(10.3)
    detector.answered(10.4)
    assert detector.missed(10.8) is False
    assert detector.missed(11.0) is False
    assert detector.missed(11.3) is True  # three in a row again, 0.5 s apart


def test_a_miss_of_a_node_that_answered_later_traffic_is_no_evidence() -> None:
    """A lossy link: the reply to a command sent at 10.0 is held up, while the node answered
    a command sent at 10.01 on another connection. The node ran what reached it after the
    missed command went out: it is there, and the miss does not count."""
    detector = NodeDetector(0.05)
    detector.answered(10.012, sent=10.01)
    assert detector.heard_since(10.0) and not detector.heard_since(10.02)
    for i in range(MISSES_TO_DOWN + 2):
        assert detector.missed(10.05 + i * MIN_SPAN, since=10.0) is False
    assert detector.misses == 0 and not detector.down
    # A command sent after the last answer and never answered is a miss as before.
    assert detector.missed(20.0, since=19.95) is False
    assert detector.misses == 1


def test_a_reply_read_late_to_a_command_sent_before_the_misses_clears_nothing() -> None:
    """A frozen node's reply that arrived before it froze, read only later, is old news: it
    neither forgets the misses nor brings a down node back; an answer to a command sent
    after them does."""
    detector = NodeDetector(0.05)
    now = 10.0
    for _ in range(MISSES_TO_DOWN):
        detector.missed(now, since=now - 0.05)
        now += MIN_SPAN
    assert detector.down
    assert detector.answered(now, sent=9.0) is False
    assert detector.down
    assert detector.answered(now + 0.1, sent=now) is True
    assert not detector.down
    detector.missed(20.0, since=19.95)
    detector.answered(20.1, sent=19.9)
    assert detector.misses == 1
    detector.answered(20.2, sent=20.15)
    assert detector.misses == 0


def test_misses_while_the_process_was_stalled_are_excused() -> None:
    detector = NodeDetector(0.05)
    for i in range(10):
        assert detector.missed(10.0 + i, excused=True) is False
    assert detector.misses == 0 and not detector.down


def test_a_connection_error_is_down_at_once_and_an_answer_brings_it_back() -> None:
    detector = NodeDetector(0.05)
    assert detector.refused(5.0, "Connection refused") is True
    assert detector.down and "Connection refused" in detector.reason
    assert detector.refused(5.1, "Connection refused") is False  # already down
    assert detector.answered(6.0) is True
    assert not detector.down and detector.reason == ""
    assert detector.answered(6.1) is False


def test_reset_forgets_everything() -> None:
    detector = NodeDetector(0.05)
    detector.answered(1.0)
    detector.srtt = detector.quick = 0.5
    detector.refused(1.0, "x")
    detector.reset()
    assert not detector.down and detector.srtt is None and detector.quick is None


@pytest.mark.parametrize(("misses", "span"), [(0, 0.5), (3, -1.0)])
def test_bad_settings_are_refused(misses: int, span: float) -> None:
    with pytest.raises(ValueError):
        NodeDetector(0.05, misses_to_down=misses, min_span=span)


def test_overrun_is_the_excess_beyond_the_slack() -> None:
    assert overrun(0.05, 0.05) == 0.0
    assert overrun(0.05, 0.05 + STALL_SLACK) == 0.0
    assert overrun(0.05, 0.55) == pytest.approx(0.5 - STALL_SLACK)


def test_a_wait_gives_back_the_time_the_process_did_not_run() -> None:
    wait = Wait(0.05, now=100.0)
    assert wait.remaining(100.0) == pytest.approx(0.05)
    # The 50 ms wait came back after 1 s: the process did not run, and the nodes on its
    # host may not have run either; they get the 50 ms again.
    left = wait.remaining(101.0)
    assert left == pytest.approx(0.05)
    assert wait.stalled == pytest.approx(1.0) and wait.stalls == 1


def test_a_wait_that_returns_in_time_gets_nothing_back() -> None:
    wait = Wait(0.05, now=100.0)
    assert wait.remaining(100.0) == pytest.approx(0.05)
    assert wait.remaining(100.02) == pytest.approx(0.03)  # woken early by a reply
    assert wait.remaining(100.05) == pytest.approx(0.0, abs=1e-9)
    assert wait.stalled == 0.0


def test_a_wait_ends_however_often_the_process_stalls() -> None:
    wait = Wait(0.05, now=0.0)
    now = 0.0
    wait.remaining(now)
    for _ in range(100):
        now += 1.0
        wait.remaining(now)
    assert wait.stalls == MAX_STALLS
    assert wait.stalled == pytest.approx(MAX_STALLS * 1.0)
    assert wait.remaining(now + 1.0) == 0.0


def test_a_wait_never_moves_out_beyond_the_cap() -> None:
    wait = Wait(0.05, now=0.0, cap=0.1)
    wait.remaining(0.0)
    wait.remaining(5.0)
    assert wait.stalled == pytest.approx(0.1)  # 5 s not run: only 0.1 s given back
    assert wait.remaining(5.0) == 0.0


def test_a_miss_is_excused_only_when_the_node_had_less_than_its_budget_since_a_stall() -> None:
    wait = Wait(0.05, now=0.0)
    assert not wait.excused  # no stall: a miss counts
    wait.remaining(0.0)
    wait.remaining(1.0)  # stalled: given back
    assert wait.excused
    wait.remaining(1.02)
    assert wait.excused  # 20 ms of running time since: not the node's whole budget
    wait.remaining(1.05)
    assert not wait.excused  # a full budget without a stall, and still no answer


def test_the_pause_log_keeps_the_stalls_and_answers_since_when() -> None:
    log = PauseLog()
    assert log.note(0.1, 0.1, now=10.0) == 0.0  # on time: nothing recorded
    assert log.note(0.1, 2.1, now=20.0) == pytest.approx(2.0 - STALL_SLACK)
    assert log.since(15.0) == pytest.approx(2.0 - STALL_SLACK)
    assert log.since(20.0) == 0.0  # it ended before
    log.clear()
    assert log.since(0.0) == 0.0


def test_why_a_renewed_lease_was_lost_names_one_of_three_causes() -> None:
    refused = why_lost(refused="1 of 3 nodes renewed it, 2 needed", paused=9.0, late=9.0, ttl=6)
    assert refused.startswith("the nodes refused: 1 of 3")
    paused = why_lost(refused=None, paused=4.0, late=4.0, ttl=6)
    assert paused.startswith("the process was paused: it did not run for 4.0 s")
    behind = why_lost(refused=None, paused=0.5, late=4.2, ttl=6)
    assert behind.startswith("renewal fell behind: the watchdog reached it 4.2 s after")
