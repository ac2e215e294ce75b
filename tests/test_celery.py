"""LockedTask against a real Celery worker (threads pool, concurrency 4, in this process) with a
real Redis broker and real lock nodes (embedded redis-server processes). No mocks.

Tasks record their start/end in Redis (``testproject.tasks``); the tests synchronise with
those records, gates (a task blocks on BLPOP until the test pushes) and barriers, never with
sleeps.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from typing import Any

import pytest
from celery import signals as celery_signals
from celery.worker import state as worker_state

from django_redlock import LockNotAcquired, QuorumError, Redlock
from django_redlock.celery import (
    SKIPPED,
    LockedTask,
    default_lock_key,
    release_held_locks,
    task_skipped,
)
from django_redlock.signals import lock_contended
from testproject import tasks
from tests.celery_support import TIMEOUT, Run, assert_no_overlap, wait_until

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]


class Retries:
    """Collects ``task_retry`` signals (sent in the worker thread, i.e. in this process)."""

    def __init__(self, check=None) -> None:
        self.by_id: dict[str, list[Any]] = {}
        self.cond = threading.Condition()
        self.check = check
        self.checked: list[Any] = []

    def __call__(self, sender=None, request=None, reason=None, **kwargs: Any) -> None:
        with self.cond:
            # ``reason`` is Celery's Retry; the lock's exception is its ``exc``.
            self.by_id.setdefault(request.id, []).append(getattr(reason, "exc", reason))
            if self.check is not None:
                self.checked.append(self.check(request))
            self.cond.notify_all()

    def wait(self, task_id: str, n: int = 1, timeout: float = TIMEOUT) -> list[Any]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.by_id.get(task_id, [])) >= n, timeout)
            assert ok, f"{task_id}: {len(self.by_id.get(task_id, []))} retries, wanted {n}"
            return list(self.by_id[task_id])


@pytest.fixture
def rl(redlock_settings) -> Redlock:
    """The Redlock the tasks use (``get_redlock()`` over the shared, emptied lock nodes)."""
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture
def worker(celery_thread_worker, rl):
    return celery_thread_worker


@pytest.fixture
def retries():
    collector = Retries()
    celery_signals.task_retry.connect(collector, weak=False)
    yield collector
    celery_signals.task_retry.disconnect(collector)


def hold(run: Run, key: str) -> Any:
    """Start a task that takes ``demo:<key>`` and keeps it until ``run.open("hold")``."""
    result = tasks.critical.delay(key, run.id, gate="hold")
    run.started_by(result.id)
    return result


# --------------------------------------------------------------------------- mutual exclusion


def test_same_key_tasks_never_overlap(worker, rl, retries):
    run = Run()
    results = [tasks.critical.delay("same", run.id, hold=0.1) for _ in range(5)]
    results += [tasks.critical_wait.delay("same", run.id, hold=0.1) for _ in range(3)]
    for result in results:
        result.get(timeout=TIMEOUT)
    intervals = run.wait("intervals", 8)
    assert {e["task_id"] for e in intervals} == {r.id for r in results}
    assert all(e["lock"] == "demo:same" and e["held"] for e in intervals)
    assert_no_overlap(intervals)
    # They really competed: some were sent back by the lock, none consumed its own retries.
    assert sum(len(v) for v in retries.by_id.values()) >= 1
    assert all(e["retries"] == 0 for e in intervals)
    assert not rl.locked("demo:same")


def test_different_keys_run_in_parallel(worker, rl):
    run = Run()
    results = [tasks.critical.delay(key, run.id, barrier=3) for key in ("a", "b", "c")]
    entries = [r.get(timeout=TIMEOUT) for r in results]
    # Each waited at a barrier for the other two: only possible if all three held their
    # (different) locks at the same time.
    assert all(e["barrier_met"] for e in entries)
    assert {e["lock"] for e in entries} == {"demo:a", "demo:b", "demo:c"}
    latest_start = max(e["start"] for e in entries)
    assert all(e["end"] > latest_start for e in entries)


# --------------------------------------------------------------------------- on_locked policies


def test_retry_policy_does_not_eat_the_tasks_own_retries(worker, rl, retries):
    run = Run()
    holder = hold(run, "r")
    result = tasks.counted.delay("r", run.id)  # max_retries=1
    reasons = retries.wait(result.id, 3)  # sent back three times by the busy lock
    assert all(isinstance(r, LockNotAcquired) for r in reasons), reasons
    assert "demo:r" in str(reasons[0]) and holder.id in str(reasons[0])
    run.open("hold")
    # Its own single retry is still available after three lock retries.
    assert result.get(timeout=TIMEOUT) == 1
    attempts = [json.loads(a) for a in run.r.lrange(f"{run.id}:attempts", 0, -1)]
    assert [a["retries"] for a in attempts] == [0, 1]
    assert all(a["lock_held"] for a in attempts)
    assert holder.get(timeout=TIMEOUT)["held"]


def test_retry_counts_option_makes_lock_retries_count(worker, rl, retries):
    run = Run()
    holder = hold(run, "rc")
    result = tasks.counted.apply_async(("rc", run.id), lock_retry_counts=True)
    retries.wait(result.id, 1)
    # max_retries=1 is used up by the lock retry, so the next lock retry fails the task.
    with pytest.raises(LockNotAcquired):
        result.get(timeout=TIMEOUT)
    run.open("hold")
    holder.get(timeout=TIMEOUT)


def test_lock_max_retries_fails_the_task_visibly(worker, rl, retries):
    run = Run()
    holder = hold(run, "mr")
    result = tasks.critical.apply_async(("mr", run.id), lock_max_retries=2)
    with pytest.raises(LockNotAcquired, match="gave up after 2 lock retries"):
        result.get(timeout=TIMEOUT)
    assert len(retries.by_id[result.id]) == 2
    run.open("hold")
    holder.get(timeout=TIMEOUT)


def test_wait_policy_runs_as_soon_as_the_holder_releases(worker, rl, retries):
    run = Run()
    holder = hold(run, "w")
    waiter = tasks.critical_wait.delay("w", run.id)
    wait_until(
        lambda: any(r.id == waiter.id for r in worker_state.active_requests),
        what="the waiter to be running (blocked on the lock)",
    )
    run.open("hold")
    holder_entry = holder.get(timeout=TIMEOUT)
    waiter_entry = waiter.get(timeout=TIMEOUT)
    assert waiter_entry["start"] >= holder_entry["end"]
    assert waiter.id not in retries.by_id  # it waited, it was not re-queued


def test_wait_policy_gives_up_after_lock_wait(worker, rl):
    run = Run()
    holder = hold(run, "wt")
    waiter = tasks.critical_wait.apply_async(("wt", run.id), lock_wait=0.3)
    with pytest.raises(LockNotAcquired, match=r"after waiting 0\.3s"):
        waiter.get(timeout=TIMEOUT)
    assert waiter.state == "FAILURE"
    run.open("hold")
    holder.get(timeout=TIMEOUT)


def test_skip_policy_is_visible(worker, rl, caplog):
    caplog.set_level(logging.WARNING, logger="django_redlock.celery")
    contended: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []

    def on_contended(sender, **kwargs):
        contended.append(kwargs)

    def on_skipped(sender, **kwargs):
        skipped.append(kwargs)

    lock_contended.connect(on_contended, weak=False)
    task_skipped.connect(on_skipped, weak=False)
    try:
        run = Run()
        holder = hold(run, "s")
        result = tasks.critical_skip.delay("s", run.id)
        wait_until(lambda: result.state == SKIPPED, what="state SKIPPED")
    finally:
        lock_contended.disconnect(on_contended)
        task_skipped.disconnect(on_skipped)
    assert result.info["lock"] == "demo:s"
    assert result.info["holder"] == holder.id
    # the core's lock_contended signal, with the task as holder-to-be in meta
    mine = [c for c in contended if c["name"] == "demo:s" and c["meta"].get("task_id") == result.id]
    assert len(mine) == 1 and mine[0]["meta"]["on_locked"] == "skip"
    assert [s["task_id"] for s in skipped] == [result.id]
    assert skipped[0]["holder"]["task_id"] == holder.id
    logs = [r for r in caplog.records if r.name == "django_redlock.celery"]
    assert any(
        "skipped" in r.getMessage()
        and result.id in r.getMessage()
        and holder.id in r.getMessage()
        and r.levelno == logging.WARNING
        for r in logs
    )
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert [e["task_id"] for e in run.all("started")] == [holder.id]  # the skipped one never ran


def test_skip_with_an_explicit_redlock_still_signals(worker, rl):
    contended: list[dict[str, Any]] = []

    def on_contended(sender, **kwargs):
        contended.append(kwargs)

    explicit = tasks.explicit_redlock()
    lock_contended.connect(on_contended, weak=False)
    try:
        run = Run()
        holder = tasks.critical_explicit.delay("ex", run.id, gate="hold")
        run.started_by(holder.id)
        assert explicit.locked("demo:ex") and not rl.locked("demo:ex")  # its own key prefix
        result = tasks.critical_explicit.delay("ex", run.id)
        wait_until(lambda: result.state == SKIPPED, what="state SKIPPED")
    finally:
        lock_contended.disconnect(on_contended)
    mine = [c for c in contended if c["meta"].get("task_id") == result.id]
    assert len(mine) == 1 and mine[0]["redlock"] is explicit
    run.open("hold")
    holder.get(timeout=TIMEOUT)


def test_raise_policy_fails_with_lock_not_acquired(worker, rl):
    run = Run()
    holder = hold(run, "x")
    result = tasks.critical_raise.delay("x", run.id)
    with pytest.raises(LockNotAcquired) as excinfo:
        result.get(timeout=TIMEOUT)
    assert holder.id in str(excinfo.value)
    assert result.state == "FAILURE"
    run.open("hold")
    holder.get(timeout=TIMEOUT)


def test_per_call_overrides(worker, rl):
    run = Run()
    # a different key for this call only (apply_async option)
    other = tasks.critical.apply_async(("o", run.id), lock_key="other:{key}")
    assert other.get(timeout=TIMEOUT)["lock"] == "other:o"
    holder = hold(run, "o")
    # a signature option
    skipped = tasks.critical.s("o", run.id).set(on_locked="skip").delay()
    # a raw message header (e.g. from app.send_task)
    raised = tasks.critical.apply_async(("o", run.id), headers={"redlock": {"on_locked": "raise"}})
    sent = worker.app.send_task(
        "testproject.critical", ("o", run.id), headers={"redlock": {"on_locked": "raise"}}
    )
    with pytest.raises(LockNotAcquired):
        raised.get(timeout=TIMEOUT)
    with pytest.raises(LockNotAcquired):
        sent.get(timeout=TIMEOUT)
    wait_until(lambda: skipped.state == SKIPPED, what="state SKIPPED")
    with pytest.raises(ValueError, match="on_locked must be one of"):
        tasks.critical.apply_async(("o", run.id), on_locked="bogus")
    run.open("hold")
    holder.get(timeout=TIMEOUT)


# --------------------------------------------------------------------------- release


def test_failure_releases_the_lock(worker, rl):
    run = Run()
    result = tasks.critical.delay("f", run.id, fail=True)
    with pytest.raises(ValueError, match="failing on purpose"):
        result.get(timeout=TIMEOUT)
    assert not rl.locked("demo:f")
    follower = tasks.critical_raise.delay("f", run.id)  # would fail if the key were still held
    assert follower.get(timeout=TIMEOUT)["lock"] == "demo:f"


def test_own_retry_releases_the_lock_between_attempts(worker, rl):
    checker = Retries(check=lambda request: rl.locked("demo:own"))
    celery_signals.task_retry.connect(checker, weak=False)
    try:
        run = Run()
        result = tasks.counted.delay("own", run.id)
        assert result.get(timeout=TIMEOUT) == 1
    finally:
        celery_signals.task_retry.disconnect(checker)
    # task_retry is sent after the attempt ended: the lock was already free then.
    assert checker.checked == [False]
    assert not rl.locked("demo:own")


def test_revoked_task_never_takes_the_lock(worker, rl, retries):
    revoked_ids: list[str] = []

    def on_revoked(sender=None, request=None, **kwargs):
        revoked_ids.append(getattr(request, "id", None))

    celery_signals.task_revoked.connect(on_revoked, weak=False)
    try:
        run = Run()
        holder = hold(run, "rv")
        victim = tasks.critical.delay("rv", run.id)
        retries.wait(victim.id, 1)  # waiting for its countdown, holding nothing
        victim.revoke()
        wait_until(lambda: victim.id in worker_state.revoked, what="the revoke to reach the worker")
        run.open("hold")
        holder.get(timeout=TIMEOUT)
        # The worker drops the re-scheduled message when it comes due, before __call__.
        wait_until(lambda: victim.id in revoked_ids, what="the worker to drop the message")
    finally:
        celery_signals.task_revoked.disconnect(on_revoked)
    assert [e["task_id"] for e in run.all("started")] == [holder.id]
    assert not rl.locked("demo:rv")


def test_worker_process_shutdown_releases_held_locks(worker, rl):
    run = Run()
    holder = hold(run, "sd")
    assert rl.locked("demo:sd")
    # A warm shutdown lets running tasks finish with their locks...
    celery_signals.worker_shutting_down.send(sender="test", sig="SIGTERM", how="Warm", exitcode=0)
    assert rl.locked("demo:sd")
    # ...the pool process going away does not.
    celery_signals.worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
    assert not rl.locked("demo:sd")
    run.open("hold")
    assert holder.get(timeout=TIMEOUT)["held"] is False  # the task can see it lost the lock
    assert release_held_locks() == 0


def test_unreachable_lock_nodes_retry_instead_of_dropping(worker, rl, redis_nodes, retries):
    run = Run()
    warm = rl.lock("warm-up", ttl=1)  # the nodes know this client: no restart guard after
    assert warm.acquire(blocking=False)
    warm.release()
    redis_nodes[0].pause()
    redis_nodes[1].pause()
    try:
        result = tasks.critical_skip.delay("q", run.id)  # even "skip" must not drop it
        reasons = retries.wait(result.id, 1)
    finally:
        redis_nodes[0].resume()
        redis_nodes[1].resume()
    assert isinstance(reasons[0], QuorumError)
    assert result.get(timeout=TIMEOUT)["lock"] == "demo:q"


# --------------------------------------------------------------------------- metadata, dedupe


def test_holder_metadata_names_the_task(worker, rl):
    run = Run()
    holder = hold(run, "meta")
    info = rl.lock_info("demo:meta")
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert info is not None
    meta = info.meta
    assert meta["task_id"] == holder.id
    assert meta["task"] == "testproject.critical"
    # the request's hostname: the node name with `celery worker -n`, else the host name
    assert meta["worker"] in (worker.hostname, socket.gethostname())
    assert meta["pid"] == os.getpid()
    assert "'meta'" in meta["args"] and run.id in meta["args"]
    assert meta["on_locked"] == "retry"
    assert info.ttl <= 5


def test_dedupe_keeps_one_queued_and_one_running(worker, rl):
    run = Run()
    holder = tasks.critical_dedupe.delay("d", run.id, gate="hold")
    run.wait("started")
    queued = tasks.critical_dedupe.delay("d", run.id)
    assert queued.id != holder.id
    again = [tasks.critical_dedupe.delay("d", run.id) for _ in range(3)]
    assert {r.id for r in again} == {queued.id}  # merged into the one already queued
    assert rl.locked("demo:d:queued")
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    queued.get(timeout=TIMEOUT)
    assert sorted(e["task_id"] for e in run.all("started")) == sorted([holder.id, queued.id])
    assert not rl.locked("demo:d:queued") and not rl.locked("demo:d")
    fresh = tasks.critical_dedupe.delay("d", run.id)
    assert fresh.id not in (holder.id, queued.id)
    fresh.get(timeout=TIMEOUT)


# --------------------------------------------------------------------------- without a worker


def test_default_key_is_stable_and_normalised():
    import datetime
    import decimal

    first = default_lock_key("t", {"a": (1, 2), "b": {"y": 1, "x": {3, 2}}, "c": None})
    again = default_lock_key("t", {"c": None, "b": {"x": {2, 3}, "y": 1}, "a": [1, 2]})
    assert first == again == 't:{"a":[1,2],"b":{"x":[2,3],"y":1},"c":null}'
    # values survive Celery's JSON round trip with the same key
    moment = datetime.datetime(2024, 1, 2, 3, 4, 5)
    assert default_lock_key("t", {"d": moment, "m": decimal.Decimal("1.50")}) == default_lock_key(
        "t", {"d": moment.isoformat(), "m": "1.50"}
    )
    long = default_lock_key("t", {"blob": "x" * 1000})
    assert long.startswith("t:sha256-") and len(long) < 80

    class Opaque:
        pass

    with pytest.raises(TypeError, match="lock_key"):
        default_lock_key("t", {"o": Opaque()})
    assert "0x" not in default_lock_key("t", {"e": ValueError("boom")})


def test_lock_name_binds_arguments_like_a_call():
    task = tasks.critical
    assert (
        task.lock_name(("k", "run")) == task.lock_name((), {"key": "k", "run": "run"}) == "demo:k"
    )
    assert tasks.bench_plain.name not in task.lock_name(("k", "r"))

    @worker_app_task(lock_key=None)
    def plain(self, a, b=2, *rest, **extra):
        return a

    assert plain.lock_name((1,)) == plain.lock_name((), {"a": 1, "b": 2})
    assert plain.lock_name((1,)) == f'{plain.name}:{{"a":1,"b":2,"extra":{{}},"rest":[]}}'
    with pytest.raises(TypeError, match="cannot bind"):
        plain.lock_name((), {"zzz": 1})


def worker_app_task(**options):
    def decorate(fn):
        name = f"tests.dynamic.{fn.__name__}.{uuid.uuid4().hex[:8]}"
        return tasks.app.task(name=name, base=LockedTask, bind=True, **options)(fn)

    return decorate


def test_lease_follows_time_limits(rl):
    from celery.app.task import Context

    @worker_app_task(lock_ttl=10, lock_renew=False, time_limit=30)
    def limited(self):
        return None

    opts = limited.lock_options()
    assert limited._lease_for(Context(), opts, rl) == (31.0, False, None)
    # renewal is capped at the hard limit instead
    assert limited._lease_for(Context(), limited.lock_options({"renew": True}), rl) == (
        10.0,
        True,
        30.0,
    )
    # a per-call limit wins, and a limit beyond max_ttl falls back to renewal
    assert limited._lease_for(Context(timelimit=(600, None)), opts, rl) == (10.0, True, 600.0)


def test_eager_calls_lock_too(rl, celery_test_app):
    run = Run()
    lock = rl.lock("demo:e", ttl=5)
    assert lock.acquire(blocking=False)
    try:
        # no worker to re-schedule on: "retry" raises after lock_wait
        with pytest.raises(LockNotAcquired):
            tasks.critical.apply(("e", run.id), throw=True)
        with pytest.raises(LockNotAcquired):
            tasks.critical("e", run.id)  # a direct call
    finally:
        lock.release()
    assert tasks.critical.apply(("e", run.id)).get()["lock"] == "demo:e"
    assert tasks.critical("e", run.id)["held"]
    assert not rl.locked("demo:e")


def test_bad_options_are_refused_early():
    with pytest.raises(ValueError, match="on_locked"):
        tasks.critical.lock_options({"on_locked": "later"})
    with pytest.raises(ValueError, match="lock_ttl"):
        tasks.critical.lock_options({"ttl": 0})
    with pytest.raises(TypeError, match="str template"):
        tasks.critical.lock_options({"key": 42})
