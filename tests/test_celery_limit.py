"""LockedTask.lock_limit against a real Celery worker (threads pool, concurrency 4) and real
lock nodes: at most N runs of one key at once, N really reached, and the on_locked policies
once every permit is taken."""

from __future__ import annotations

import pytest

from django_redlock import LockNotAcquired
from django_redlock.celery import LockedTask
from testproject import tasks
from tests.celery_support import TIMEOUT, Run
from tests.test_core_semaphore import max_inside

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]


@pytest.fixture
def rl(redlock_settings):
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture
def worker(celery_thread_worker, rl):
    return celery_thread_worker


def hold_permits(run: Run, key: str, n: int = 2) -> list:
    results = [tasks.limited.delay(key, run.id, gate="hold") for _ in range(n)]
    for result in results:
        run.started_by(result.id)
    return results


def test_at_most_limit_runs_at_once_and_the_limit_is_reached(worker, rl):
    run = Run()
    # Two runs that wait for each other at a barrier: both inside at once, or neither meets it.
    pair = [tasks.limited.delay("b", run.id, barrier=2) for _ in range(2)]
    assert all(r.get(timeout=TIMEOUT)["barrier_met"] for r in pair)
    results = [tasks.limited.delay("many", run.id, hold=0.2) for _ in range(6)]
    for result in results:
        result.get(timeout=TIMEOUT)
    intervals = [e for e in run.wait("intervals", 8) if e["key"] == "many"]
    assert len(intervals) == 6 and all(e["held"] for e in intervals)
    assert all(e["lock"] == "limited:many" for e in intervals)
    assert max_inside([(e["start"], e["end"]) for e in intervals]) <= 2
    assert list(rl.live_locks("limited:*")) == []


def test_policies_once_every_permit_is_taken(worker, rl):
    run = Run()
    holders = hold_permits(run, "p")
    assert len(list(rl.live_locks("limited:p#permit:*"))) == 2
    skipped = tasks.limited_skip.delay("p", run.id)
    assert skipped.get(timeout=TIMEOUT) is None and skipped.state == "SUCCESS"
    raised = tasks.limited_raise.delay("p", run.id)
    with pytest.raises(LockNotAcquired, match="'limited:p' has all 2 permits taken"):
        raised.get(timeout=TIMEOUT)
    waiting = tasks.limited_wait.delay("p", run.id)
    retried = tasks.limited.delay("p", run.id)
    run.open("hold", 2)  # the holders finish; the waiting and the retried run get permits
    for result in holders:
        result.get(timeout=TIMEOUT)
    assert waiting.get(timeout=TIMEOUT)["held"]
    assert retried.get(timeout=TIMEOUT)["held"]
    started = {e["task_id"] for e in run.all("started")}
    assert skipped.id not in started and raised.id not in started


def test_bad_lock_limit_is_refused_naming_the_task(worker):
    def body(self):
        return None

    bad = tasks.app.task(name="tests.bad_limit", base=LockedTask, bind=True, lock_limit=0)(body)
    with pytest.raises(ValueError, match=r"tests\.bad_limit.*lock_limit must be 1\.\.1000"):
        bad.lock_options()
