"""docs/guarantees.rst's bounds on settings ("Validation"), tested at the edges the page
names: durations up to one year (``MAX_DURATION``), ``node_timeout`` up to 60 s
(``MAX_NODE_TIMEOUT``), ``retry_count`` from 0 to 1000 (``MAX_RETRY_COUNT``), each refused
just past its bound with a ValueError naming the value, before anything is sent."""

from __future__ import annotations

import pytest

from django_redlock import Redlock
from django_redlock.core import MAX_DURATION, MAX_NODE_TIMEOUT, MAX_RETRY_COUNT

# Nothing listens here: a constructor or lock() that tried to connect would fail, not pass.
URLS = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


def test_the_documented_bounds() -> None:
    assert (MAX_DURATION, MAX_NODE_TIMEOUT, MAX_RETRY_COUNT) == (365 * 86400.0, 60.0, 1000)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": MAX_DURATION, "max_ttl": MAX_DURATION},
        {"retry_delay": MAX_DURATION},
        {"retry_delay": 0},
        {"fair_heartbeat": MAX_DURATION},
        {"node_timeout": MAX_NODE_TIMEOUT, "ttl": 120.0},
        {"retry_count": 0},
        {"retry_count": MAX_RETRY_COUNT},
    ],
)
def test_values_at_the_bound_are_accepted(kwargs) -> None:
    Redlock(URLS, **kwargs).close()


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"ttl": MAX_DURATION + 1, "max_ttl": MAX_DURATION + 1}, "31536001"),
        ({"max_ttl": MAX_DURATION + 1}, "31536001"),
        ({"retry_delay": MAX_DURATION + 1}, "31536001"),
        ({"fair_heartbeat": MAX_DURATION + 1}, "31536001"),
        ({"node_timeout": MAX_NODE_TIMEOUT + 0.5, "ttl": 120.0}, "60.5"),
        ({"retry_count": MAX_RETRY_COUNT + 1}, "1001"),
    ],
)
def test_values_past_the_bound_are_refused_naming_them(kwargs, shown) -> None:
    with pytest.raises(ValueError, match=shown):
        Redlock(URLS, **kwargs)


def test_a_finite_acquire_timeout_is_bounded_by_a_year_and_renew_for_too() -> None:
    rl = Redlock(URLS)
    try:
        rl.lock("k", timeout=MAX_DURATION)  # builds the handle, sends nothing
        with pytest.raises(ValueError, match="timeout"):
            rl.lock("k", timeout=MAX_DURATION + 1)
        rl.lock("k", auto_renew=True, renew_for=MAX_DURATION)
        with pytest.raises(ValueError, match="renew_for"):
            rl.lock("k", auto_renew=True, renew_for=MAX_DURATION + 1)
        rl.lock("k", timeout=float("inf"))  # waits for ever: accepted
    finally:
        rl.close()


def test_the_failure_detector_and_watchdog_knobs_have_the_values_operating_rst_gives() -> None:
    """docs/operating.rst, "Telling a busy client from a dead node", names these by value;
    the behaviour behind each is tested in tests/test_core_detector*.py and
    tests/test_core_renewal.py."""
    from django_redlock.core import detector, renewal

    assert (detector.MISSES_TO_DOWN, detector.MIN_SPAN) == (3, 0.5)
    assert (detector.STALL_SLACK, detector.MAX_STALLS, detector.CONNECT_AT_LEAST) == (
        0.005,
        3,
        1.0,
    )
    assert (renewal.BEHIND_AFTER, renewal.YIELD_AT_MOST, renewal.ROUND_MAX) == (0.1, 0.5, 1000)
