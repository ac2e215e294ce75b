"""LockedTask against a real Celery worker (threads pool, concurrency 4, in this process) with a
real Redis broker and real lock nodes (embedded redis-server processes). No mocks.

Tasks record their start/end in Redis (``testproject.tasks``); the tests synchronise with
those records, gates (a task blocks on BLPOP until the test pushes) and barriers, never with
sleeps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from celery import signals as celery_signals
from celery.worker import state as worker_state

from django_redlock import LockNotAcquired, QuorumError, Redlock
from django_redlock.celery import (
    MAX_UNKNOWN_HOLD_DELAY,
    UNKNOWN_HOLD_DELAY,
    LockedTask,
    default_lock_key,
    release_held_locks,
    task_dropped,
    task_skipped,
)
from django_redlock.core import MAX_KEY_LENGTH
from django_redlock.signals import lock_contended
from testproject import tasks
from tests.celery_support import TIMEOUT, UNREAD_QUEUE, Run, assert_no_overlap, wait_until
from tests.helpers import held_everywhere

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
        # A ready state with the documented result, so canvases complete (docs/celery.rst).
        assert result.get(timeout=TIMEOUT) is None
        assert result.state == "SUCCESS"
    finally:
        lock_contended.disconnect(on_contended)
        task_skipped.disconnect(on_skipped)
    assert [(s["lock_name"], s["holder"]["task_id"]) for s in skipped] == [("demo:s", holder.id)]
    # the core's lock_contended signal, with the task as holder-to-be in meta
    mine = [c for c in contended if c["name"] == "demo:s" and c["meta"].get("task_id") == result.id]
    assert len(mine) == 1 and mine[0]["meta"]["on_locked"] == "skip"
    assert [s["task_id"] for s in skipped] == [result.id]
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
        assert result.get(timeout=TIMEOUT) is None  # skipped: it never ran
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
    assert skipped.get(timeout=TIMEOUT) is None  # a run would return its record
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
        # The worker drops the re-scheduled message when it comes due, before __call__; or,
        # when the message came due before the revoke reached the worker, the task is in its
        # waiting slot and ends itself there, not run (REVOKED).
        wait_until(
            lambda: victim.id in revoked_ids or victim.state == "REVOKED",
            what="the worker to drop the message or the waiting task to end revoked",
        )
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


def test_force_release_turns_the_running_tasks_held_false(worker, rl, redis_nodes):
    """docs/celery.rst: after an operator's force release (from another process: a Redlock of
    its own) ``self.lock.held`` turns False within about a round trip: the renewing holder
    listens for the release notice (its next renewal is 10 s away, so only the notice can
    explain a change within 0.5 s)."""
    run = Run()
    holder = tasks.critical.apply_async(
        ("fr", run.id), {"gate": "hold"}, lock_ttl=30, lock_renew=True
    )
    run.started_by(holder.id)
    from django_redlock.celery import _held

    (lock,) = [lock for lock in _held.values() if lock.name == "demo:fr"]
    assert lock.held
    operator = Redlock(list(redis_nodes.urls), ttl=10)
    try:
        held_everywhere(redis_nodes, "demo:fr")
        assert operator.force_release("demo:fr") == 3
        wait_until(lambda: not lock.held, timeout=0.5, what="held to turn False")
    finally:
        operator.close()
        run.open("hold")
        holder.get(timeout=TIMEOUT)


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


def test_a_tasks_own_retry_is_not_a_duplicate(worker, rl):
    # A runs (its queued marker is gone), B is queued for the same key; A's self.retry() is A
    # going on, not a new call: lock_dedupe="raise" must not refuse it (Celery would Reject A
    # with none of its retries used), "drop"/"merge" must not leave A's result RETRY for ever.
    run = Run()
    first = tasks.dedupe_retrying.delay("dr", run.id, gate="hold")
    run.wait("started")
    queued = tasks.dedupe_retrying.delay("dr", run.id)
    assert queued.id != first.id
    run.open("hold")
    assert first.get(timeout=TIMEOUT)["retries"] == 1
    assert queued.get(timeout=TIMEOUT)["retries"] == 1
    started = [(e["task_id"], e["retries"]) for e in run.all("started")]
    assert sorted(started) == sorted([(first.id, 0), (first.id, 1), (queued.id, 0), (queued.id, 1)])


def _key_scans(redis_nodes) -> int:
    """SCAN and KEYS calls the lock nodes served since their statistics were reset (from
    clients and from scripts alike)."""
    total = 0
    for node in redis_nodes:
        client = redis.Redis.from_url(node.url)
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        total += sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("scan", "keys"))
    return total


def test_revoking_a_queued_task_frees_its_dedupe_marker(
    worker, rl, celery_test_app, celery_broker_node, redis_nodes
):
    """docs/celery.rst, "Revoking": once the revoke's reply is in, a queued task's marker
    merges no more calls (not only when a worker reaches the revoked message: the task sits
    in a queue no worker reads), and the revoke costs the lock nodes no SCAN (nor KEYS)."""
    run = Run()
    parked = tasks.critical_dedupe.apply_async(("rq", run.id), queue=UNREAD_QUEUE)
    try:
        assert rl.locked("demo:rq:queued")
        assert tasks.critical_dedupe.delay("rq", run.id).id == parked.id  # merged, as promised
        for node in redis_nodes:
            client = redis.Redis.from_url(node.url)
            client.config_resetstat()
            client.close()
        replies = celery_test_app.control.revoke(parked.id, reply=True, timeout=10, limit=1)
        assert replies, "the worker did not confirm the revoke"
        assert _key_scans(redis_nodes) == 0
        list(rl.live_locks("*"))  # a listing, for contrast: this check can see one
        assert _key_scans(redis_nodes) > 0
        fresh = tasks.critical_dedupe.delay("rq", run.id)
        assert fresh.id != parked.id, "merged into a revoked task: this call's work is lost"
        assert fresh.get(timeout=TIMEOUT)["task_id"] == fresh.id
    finally:
        broker = redis.Redis.from_url(celery_broker_node.url)
        broker.delete(UNREAD_QUEUE, f"_kombu.binding.{UNREAD_QUEUE}")
        broker.close()


def test_dedupe_drop_and_raise_policies(worker, rl):
    run = Run()
    holder = tasks.critical_dedupe.delay("dp", run.id, gate="hold")
    run.started_by(holder.id)
    queued = tasks.critical_dedupe.delay("dp", run.id)
    dropped: list[dict[str, Any]] = []

    def on_dropped(sender=None, **kwargs: Any) -> None:
        dropped.append(kwargs)

    task_dropped.connect(on_dropped, weak=False)
    try:
        result = tasks.critical_dedupe.apply_async(("dp", run.id), lock_dedupe="drop")
    finally:
        task_dropped.disconnect(on_dropped)
    assert result.state == "REJECTED" and result.id not in (holder.id, queued.id)
    assert [(d["task_id"], d["queued_id"], d["lock_name"]) for d in dropped] == [
        (result.id, queued.id, "demo:dp")
    ]
    with pytest.raises(LockNotAcquired, match="already queued for lock 'demo:dp'") as caught:
        tasks.critical_dedupe.apply_async(("dp", run.id), lock_dedupe="raise")
    assert queued.id in str(caught.value)
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    queued.get(timeout=TIMEOUT)
    assert sorted(e["task_id"] for e in run.all("started")) == sorted([holder.id, queued.id])


def test_one_task_per_busy_key_waits_the_others_are_rescheduled(worker, rl, retries):
    run = Run()
    holder = hold(run, "slot")
    sent = [tasks.critical.delay("slot", run.id, hold=0.05) for _ in range(3)]
    ids = {r.id for r in sent}
    for result in sent:  # every one was turned away at least once
        retries.wait(result.id, 1)
    # Sample the worker's running requests while the holder keeps the key. An attempt that
    # is turned away is active for a few milliseconds; one that sits waiting is active in
    # samples 100 ms apart.
    samples: list[set[str]] = []
    for _ in range(60):
        samples.append({r.id for r in worker_state.active_requests if r.id in ids})
        info = rl.lock_info("demo:slot:waiter")
        assert info is None or info.meta["task_id"] in ids
        time.sleep(0.02)
    sitting = [a & b for a, b in zip(samples, samples[5:], strict=False)]
    assert max(len(s) for s in sitting) == 1  # one waits, and only one
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    for result in sent:
        result.get(timeout=TIMEOUT)
    assert_no_overlap(run.wait("intervals", 4))


def test_project_defaults_fill_what_a_task_does_not_set(settings, redis_nodes):
    settings.REDLOCK = {
        "NODES": list(redis_nodes.urls),
        "LOCKED_TASK": {"lock_ttl": 42, "on_locked": "wait", "lock_dedupe": "drop"},
    }
    options = tasks.bench_locked.lock_options()
    assert options.ttl == 10  # the task's own lock_ttl wins
    assert options.on_locked == "wait" and options.dedupe == "drop"  # project defaults
    assert tasks.bench_locked.lock_options({"on_locked": "skip"}).on_locked == "skip"
    assert tasks.critical_dedupe.lock_options().dedupe == "merge"  # its own True


def test_task_attributes_refuse_nan_like_the_setting_and_per_call_options():
    class NanTask(LockedTask):
        name = "tests.nan_task"
        lock_wait = float("nan")

        def run(self):  # pragma: no cover - never runs
            return None

    with pytest.raises(ValueError, match=r"task tests\.nan_task: lock_wait must be a number"):
        NanTask().lock_options()


@pytest.mark.parametrize(
    "override, text",
    [
        ({"wait": float("nan")}, "lock_wait must be a number, got nan"),
        ({"retry_jitter": float("nan")}, "lock_retry_jitter must be a number, got nan"),
        ({"ttl": float("inf")}, "lock_ttl must be finite"),
        ({"dedupe": "sometimes"}, "lock_dedupe must be"),
    ],
)
def test_per_call_options_refuse_nan_and_nonsense(override, text):
    with pytest.raises(ValueError, match=text):
        tasks.bench_locked.lock_options(override)


# --------------------------------------------------------------------------- without a worker


def test_default_key_is_stable_and_normalised():
    import datetime
    import decimal

    first = default_lock_key("t", {"a": (1, 2), "b": {"y": 1, "x": {3, 2}}, "c": None})
    again = default_lock_key("t", {"c": None, "b": {"x": {2, 3}, "y": 1}, "a": [1, 2]})
    assert first == again == "t:a=[1,2],b={x=[2,3],y=1},c=%none"
    # the separators between arguments are escaped in values, so they cannot forge another
    assert default_lock_key("t", {"a": "1,b=2", "b": 3}) == "t:a=1%2Cb%3D2,b=3"
    assert default_lock_key("t", {"a": ["1", "2"]}) != default_lock_key("t", {"a": ["1,2"]})
    # values survive Celery's JSON round trip with the same key
    moment = datetime.datetime(2024, 1, 2, 3, 4, 5)
    assert default_lock_key("t", {"d": moment, "m": decimal.Decimal("1.50")}) == default_lock_key(
        "t", {"d": moment.isoformat(), "m": "1.50"}
    )
    # an id that reaches one task as an int (a beat job's ORM value) and as a string (a URL's)
    # is one key: two runs for one account would otherwise overlap
    assert default_lock_key("t", {"account_id": 42}) == default_lock_key("t", {"account_id": "42"})
    # a decimal keeps its written form, which is what Celery's JSON carries (``"1.50"``)
    assert default_lock_key("t", {"m": decimal.Decimal("1.50")}) == "t:m=1.50"
    long = default_lock_key("t", {"blob": "x" * 1000})
    assert long.startswith("t:blob=xxx") and "%sha256-" in long and len(long) == MAX_KEY_LENGTH
    assert long != default_lock_key("t", {"blob": "x" * 999 + "y"})

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"no stable text.*lock_key"):
        default_lock_key("t", {"o": Opaque()})
    assert default_lock_key("t", {"e": ValueError("boom")}) == "t:e=boom"


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
    assert plain.lock_name((1,)) == f"{plain.name}:a=1,b=2,extra={{}},rest=[]"
    assert plain.lock_name((1, 2, 3), {"x": "y"}) == f"{plain.name}:a=1,b=2,extra={{x=y}},rest=[3]"
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


def test_eager_apply_takes_the_per_call_options(rl, celery_test_app):
    """docs/celery.rst: per-call options can be changed for one call, eager calls lock too,
    and invalid values are refused when the task is sent: ``task.apply(...)`` and
    ``sig.set(...).apply()`` take them as ``apply_async`` does (Celery's own ``apply``
    dropped them: the task's own policy ran, and ``lock_ttl=-1`` went through)."""
    run = Run()
    lock = rl.lock("demo:e", ttl=5)
    assert lock.acquire(blocking=False)
    try:
        skipped = tasks.critical.apply(("e", run.id), on_locked="skip")
        assert skipped.state == "SUCCESS" and skipped.result is None
        skipped = tasks.critical.s("e", run.id).set(on_locked="skip").apply()
        assert skipped.state == "SUCCESS" and skipped.result is None
        with pytest.raises(ValueError, match=r"per-call options.*lock_ttl"):
            tasks.critical.apply(("e", run.id), lock_ttl=-1)
        # Another key for this call: the held one is not in its way.
        other = tasks.critical.apply(("e", run.id), lock_key="demo:other:{key}").get()
        assert other["lock"] == "demo:other:e"
    finally:
        lock.release()
    assert not rl.locked("demo:other:e")


@pytest.mark.parametrize(
    "template",
    ["s:{}", "s:{0}", "s:{key", "s:key}", "{key}{run}", "s:{account_id}"],
)
def test_per_call_lock_key_is_checked_like_locked_when_sent(celery_test_app, template):
    """docs/celery.rst: per-call values are refused when the task is sent (ValueError) and
    templates follow @locked's rules, including naming an argument of the task."""
    with pytest.raises(ValueError, match=r"per-call options.*lock_key") as caught:
        tasks.critical.apply_async(("k", "r"), lock_key=template)
    assert repr(template) in str(caught.value)
    with pytest.raises(ValueError, match=r"per-call options.*lock_key"):
        tasks.critical.s("k", "r").set(lock_key=template).delay()
    assert tasks.critical.lock_options({"key": "s:{key}:{run}"}).key == "s:{key}:{run}"


def test_per_call_values_the_worker_would_refuse_are_refused_when_sent(celery_test_app, rl):
    """docs/celery.rst: a per-call lock_ttl past the Redlock's max_ttl and a lock_renew that
    is not a bool are refused by apply_async with ValueError naming the option and the
    value, not sent to fail on the worker."""
    too_long = rl.max_ttl + 1
    with pytest.raises(ValueError, match=rf"per-call options.*lock_ttl {too_long!r}.*max_ttl"):
        tasks.critical.apply_async(("k", "r"), lock_ttl=too_long)
    with pytest.raises(TypeError, match=r"per-call options.*lock_renew.*'yes'"):
        tasks.critical.s("k", "r").set(lock_renew="yes").delay()
    assert tasks.critical.lock_options({"ttl": rl.max_ttl}).ttl == rl.max_ttl


WRONG_TYPES = [
    ("lock_renew", "yes"),
    ("lock_renew", 1),
    ("lock_retry_counts", "no"),
    ("lock_max_retries", 1.5),
    ("lock_max_retries", "3"),
    ("lock_limit", 2.5),
    ("lock_ttl", "10"),
    ("on_locked", 1),
    ("lock_dedupe", 1),
]


@pytest.mark.parametrize("option, value", WRONG_TYPES)
def test_per_call_options_of_the_wrong_type_are_a_type_error(celery_test_app, option, value):
    """docs/celery.rst: a value of the wrong type is a TypeError when the task is sent, as
    the core's flags are (``auto_renew=1``), naming the task, the option and the value."""
    with pytest.raises(TypeError, match=rf"per-call options.*{option}.*{value!r}"):
        tasks.critical.apply_async(("k", "r"), **{option: value})
    with pytest.raises(TypeError, match=rf"per-call options.*{option}"):
        tasks.critical.s("k", "r").set(**{option: value}).delay()


def _no_run(self: Any) -> None:  # pragma: no cover - never runs
    return None


@pytest.mark.parametrize("option, value", WRONG_TYPES)
def test_task_options_of_the_wrong_type_are_a_type_error(option, value):
    """The task's own options and the project's LOCKED_TASK defaults go through the same
    check as the per-call ones."""
    wrong = type(
        "WrongType", (LockedTask,), {"name": "tests.wrong_type", option: value, "run": _no_run}
    )
    with pytest.raises(TypeError, match=rf"task tests\.wrong_type: {option}"):
        wrong().lock_options()


@pytest.mark.parametrize(
    "option, value",
    [("lock_renew", 1), ("lock_retry_counts", "no"), ("lock_max_retries", 1.5)],
)
def test_project_defaults_of_the_wrong_type_are_a_type_error(settings, redis_nodes, option, value):
    settings.REDLOCK = {"NODES": list(redis_nodes.urls), "LOCKED_TASK": {option: value}}
    with pytest.raises(TypeError, match=rf"task testproject\.bench_locked: {option}"):
        tasks.bench_locked.lock_options()


@pytest.mark.parametrize(
    "option, value",
    [("lock_max_retries", -1), ("on_locked", "later"), ("lock_dedupe", "sometimes")],
)
def test_per_call_options_of_the_right_type_but_a_wrong_value_are_a_value_error(
    celery_test_app, option, value
):
    with pytest.raises(ValueError, match=rf"per-call options.*{option}"):
        tasks.critical.apply_async(("k", "r"), **{option: value})


def test_task_lock_key_is_checked_by_the_same_rules():
    class MisnamedKey(LockedTask):
        name = "tests.misnamed_key"
        lock_key = "acct:{acount_id}"

        def run(self, account_id):  # pragma: no cover - never runs
            return account_id

    class KwargsKey(MisnamedKey):
        name = "tests.kwargs_key"

        def run(self, **fields):  # pragma: no cover - never runs
            return fields

    with pytest.raises(ValueError, match=r"tests\.misnamed_key: lock_key 'acct:\{acount_id\}' "):
        MisnamedKey().lock_options()
    assert KwargsKey().lock_name(kwargs={"acount_id": 7}) == "acct:7"  # **kwargs: any name


def test_bad_per_call_lock_key_in_a_raw_header_fails_the_task_in_the_worker(worker, rl):
    """send_task bypasses LockedTask on the producer side: the worker applies the same check."""
    run = Run()
    result = tasks.critical.app.send_task(
        "testproject.critical", ("k", run.id), headers={"redlock": {"key": "s:{}"}}
    )
    with pytest.raises(ValueError, match="positional"):
        result.get(timeout=TIMEOUT)
    assert run.all("started") == []


def test_bad_options_are_refused_early():
    with pytest.raises(ValueError, match="on_locked"):
        tasks.critical.lock_options({"on_locked": "later"})
    with pytest.raises(ValueError, match="lock_ttl"):
        tasks.critical.lock_options({"ttl": 0})
    with pytest.raises(TypeError, match="str template"):
        tasks.critical.lock_options({"key": 42})


@pytest.fixture
def hold_times(monkeypatch):
    """A fresh record of typical holds for this process (no task has finished a hold)."""
    from django_redlock import celery as celery_module
    from django_redlock.holders import HoldTimes

    fresh = HoldTimes()
    monkeypatch.setattr(celery_module, "_hold_times", fresh)
    return fresh


def test_retry_countdown_without_a_known_hold_stays_short(hold_times) -> None:
    """Until some holder has published its typical hold (a fresh worker's first burst), the
    countdown doubles from UNKNOWN_HOLD_DELAY but never past MAX_UNKNOWN_HOLD_DELAY (plus
    jitter): a blind backoff that kept doubling up to the 30 s lease once left a cold burst
    of 100 ms tasks idle for seconds between holds. An explicit lock_retry_delay keeps its
    plain exponential backoff, capped by the holder's lease."""
    task = tasks.bench_locked
    opts = task.lock_options()  # the defaults: on_locked="retry", no lock_retry_delay
    holder = {"ttl": 30.0}  # a holder that never said how long it usually holds
    countdowns = [task._countdown(opts, retries, holder) for retries in range(12)]
    assert countdowns[0] >= UNKNOWN_HOLD_DELAY
    assert max(countdowns) <= MAX_UNKNOWN_HOLD_DELAY * 1.5, countdowns
    explicit = dataclasses.replace(opts, retry_delay=0.5)
    assert task._countdown(explicit, 8, holder) >= 30.0  # 0.5 x 2**8, capped by the lease


def test_retry_countdown_uses_this_process_typical_hold_when_the_holder_has_none(
    hold_times,
) -> None:
    """A holder in a process that has not finished a hold yet publishes no typical hold; a
    retrying task that knows the typical hold of its own kind comes back about then, not at
    the end of the holder's 30 s lease (a fresh worker's burst once idled ~10 s that way)."""
    task = tasks.bench_locked
    for _ in range(5):
        hold_times.record(task.name, 0.1)
    opts = task.lock_options()
    holder = {"ttl": 30.0, "age": 0.02}  # no typical hold in the holder's metadata
    countdowns = [task._countdown(opts, retries, holder) for retries in range(6)]
    assert max(countdowns) < 1.0, countdowns


# --------------------------------------------------------------------------- canvases


def test_skipped_members_let_a_group_and_a_chord_complete(worker, rl):
    """docs/celery.rst: a skipped task ends SUCCESS with the result None, so a group's get()
    returns and a chord's callback runs, with None in the skipped members' places."""
    from celery import chord, group

    from tests.celery_support import collect

    run = Run()
    holder = hold(run, "cg-busy")
    members = [
        tasks.critical_skip.s("cg-busy", run.id),
        tasks.critical_skip.s("cg-free1", run.id),
        tasks.critical_skip.s("cg-busy", run.id),
    ]
    grouped = group(members).apply_async()
    results = grouped.get(timeout=TIMEOUT)
    assert results[0] is None and results[2] is None
    assert results[1]["lock"] == "demo:cg-free1"
    chorded = chord(
        [tasks.critical_skip.s("cg-busy", run.id), tasks.critical_skip.s("cg-free2", run.id)]
    )(collect.s())
    called_back = chorded.get(timeout=TIMEOUT)
    assert called_back[0] is None and called_back[1]["lock"] == "demo:cg-free2"
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert sorted(e["lock"] for e in run.all("started")) == [
        "demo:cg-busy",
        "demo:cg-free1",
        "demo:cg-free2",
    ]


# --------------------------------------------------------------------------- the hand-off


@pytest.fixture
def handoff_probe():
    """``arm(point, task_id)``: SoftTimeLimitExceeded lands at that point of the task's
    hand-off, waiting to holding (django_redlock.celery's test hook), as a soft time limit firing
    right then would; records whether the key was held when it landed."""
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock import celery as celery_module

    landed: list[dict[str, Any]] = []
    armed: dict[str, str] = {}

    def probe(point: str, task_id: str | None) -> None:
        if armed.get("point") == point and armed.get("task_id") == task_id:
            armed.clear()
            landed.append({"point": point})
            raise SoftTimeLimitExceeded(f"landed at {point}")

    def arm(point: str, task_id: str) -> list[dict[str, Any]]:
        armed.update(point=point, task_id=task_id)
        return landed

    celery_module._handoff_probe = probe
    yield arm
    celery_module._handoff_probe = None


@pytest.mark.parametrize(
    "point", ["slot-taken", "slot-handoff", "slot-released", "acquired", "before-run"]
)
def test_an_exception_anywhere_in_the_handoff_leaves_nothing_held(worker, rl, handoff_probe, point):
    """A task in the key's waiting slot gets the key as the holder releases; an exception
    landing at any point between taking the slot and running the body (a soft time limit,
    forced here through the test hook, no timing involved) fails the task and leaves
    neither the key nor the slot held: the next task takes the key at once."""
    from celery.exceptions import SoftTimeLimitExceeded

    run = Run()
    key = f"ho-{point}"
    holder = hold(run, key)
    victim_id = uuid.uuid4().hex
    landed = handoff_probe(point, victim_id)
    victim = tasks.critical.apply_async((key, run.id), task_id=victim_id)
    if point != "slot-taken":  # the others land once the holder lets go
        wait_until(
            lambda: (
                (info := rl.lock_info(f"demo:{key}:waiter")) is not None
                and info.meta["task_id"] == victim_id
            ),
            what="the victim to hold the waiting slot",
        )
        run.open("hold")
    with pytest.raises(SoftTimeLimitExceeded, match=f"landed at {point}"):
        victim.get(timeout=TIMEOUT)
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert landed == [{"point": point}]
    # Released before the failure was stored: no waiting for a lease to run out.
    assert not rl.locked(f"demo:{key}")
    assert not rl.locked(f"demo:{key}:waiter")
    follower = tasks.critical_raise.delay(key, run.id)
    assert follower.get(timeout=TIMEOUT)["lock"] == f"demo:{key}"
    assert victim_id not in [e["task_id"] for e in run.all("started")]


# --------------------------------------------------------------------------- revoke, install


def test_revoking_a_waiting_task_frees_its_slot_and_it_never_runs(worker, rl, celery_test_app):
    """docs/celery.rst, "Revoking": the revoke's reply comes after the waiting slot was freed
    (the worker's map names it: no listing of the nodes); another task takes the slot; the
    revoked one ends REVOKED without running (in the threads pool, when its wait ends)."""
    run = Run()
    holder = hold(run, "rvw")
    victim = tasks.critical.delay("rvw", run.id)
    slot = "demo:rvw:waiter"
    wait_until(
        lambda: (info := rl.lock_info(slot)) is not None and info.meta["task_id"] == victim.id,
        what="the victim to hold the waiting slot",
    )
    replies = celery_test_app.control.revoke(victim.id, reply=True, timeout=10, limit=1)
    assert replies, "the worker did not confirm the revoke"
    # Before the reply once the worker knew the task waited; a revoke that came as it took
    # the slot frees it as the task reports its wait.
    wait_until(lambda: not rl.locked(slot), what="the slot to be freed")
    other = tasks.critical.delay("rvw", run.id)
    wait_until(
        lambda: (info := rl.lock_info(slot)) is not None and info.meta["task_id"] == other.id,
        what="another task to take the freed slot",
    )
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert other.get(timeout=TIMEOUT)["task_id"] == other.id
    wait_until(lambda: victim.state == "REVOKED", what="state REVOKED")
    assert victim.id not in [e["task_id"] for e in run.all("started")]
    assert not rl.locked("demo:rvw")


def test_a_revoke_that_comes_as_the_task_begins_to_wait_stops_it(worker, rl, celery_test_app):
    """The revoke's reply comes before the task reported its wait (held there through the
    test hook, no timing): the task still never waits for the holder, and ends REVOKED."""
    import threading as _threading

    from django_redlock import celery as celery_module

    run = Run()
    holder = hold(run, "rvb")
    victim_id = uuid.uuid4().hex
    reached, go = _threading.Event(), _threading.Event()

    def probe(point: str, task_id: str | None) -> None:
        if point == "wait-begins" and task_id == victim_id:
            reached.set()
            go.wait(TIMEOUT)

    celery_module._handoff_probe = probe
    try:
        # lock_wait longer than the test waits for REVOKED: only the revoke can end it.
        victim = tasks.critical_wait.apply_async(("rvb", run.id), task_id=victim_id, lock_wait=60)
        assert reached.wait(TIMEOUT), "the victim never began to wait"
        assert celery_test_app.control.revoke(victim_id, reply=True, timeout=10, limit=1)
        go.set()
        wait_until(lambda: victim.state == "REVOKED", what="state REVOKED")
    finally:
        go.set()
        celery_module._handoff_probe = None
    assert rl.lock_info("demo:rvb").meta["task_id"] == holder.id  # it did not wait it out
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert victim_id not in [e["task_id"] for e in run.all("started")]


def test_importing_the_module_changes_nothing_in_celery():
    """Worker-side hooks come from install(app) only: importing django_redlock.celery leaves
    Celery's remote control commands, its worker signals and every app's bootsteps as they
    were, and install(app) adds two bootsteps to that app alone."""
    script = r"""
import json
from celery import Celery, signals
from celery.worker.control import Panel

def snapshot(app):
    return {
        "panel": {name: id(fn) for name, fn in Panel.data.items()},
        "receivers": {
            name: len(getattr(signals, name).receivers)
            for name in ("task_revoked", "task_failure", "worker_shutting_down",
                         "worker_process_shutdown", "worker_init", "task_prerun")
        },
        "steps": {kind: sorted(map(str, steps)) for kind, steps in app.steps.items()},
    }

app, other = Celery("one"), Celery("other")
before = snapshot(app)
import django_redlock.celery as module
after_import = snapshot(app)
module.install(app)
print(json.dumps({
    "before": before,
    "after_import": after_import,
    "after_install": snapshot(app),
    "other": snapshot(other),
    "revoke_hooked": bool(getattr(Panel.data["revoke"], "redlock_hooked", False)),
}))
"""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == seen["before"]
    assert seen["after_install"]["panel"] == seen["before"]["panel"]
    assert seen["after_install"]["receivers"] == seen["before"]["receivers"]
    assert not seen["revoke_hooked"]
    added = {
        kind: sorted(set(steps) - set(seen["before"]["steps"].get(kind, [])))
        for kind, steps in seen["after_install"]["steps"].items()
    }
    assert added == {
        "worker": ["django_redlock.celery.LockedTaskWorker"],
        "consumer": ["django_redlock.celery.LockedTaskControl"],
    }
    assert seen["other"]["steps"] == seen["before"]["steps"]


def test_a_running_worker_hooks_revoke_in_its_own_mailbox_only(worker):
    """The revoke command of the running worker is wrapped in its mailbox's handler table;
    Celery's registry of commands still holds Celery's own function."""
    from celery.worker.control import Panel

    consumer = worker.consumer
    control = consumer.blueprint.steps["celery.worker.consumer.control.Control"]
    assert getattr(control.box.node.handlers["revoke"], "redlock_hooked", False)
    assert not getattr(Panel.data["revoke"], "redlock_hooked", False)


def test_a_worker_without_install_says_what_is_missing(
    rl, redis_nodes, celery_broker_node, celery_test_app, tmp_path
):
    """docs/celery.rst: without install(app) tasks lock and release as usual, and the first
    LockedTask that runs in such a worker logs a WARNING naming what is missing (a real
    ``celery worker`` of the example app, which does not call install itself)."""
    from tests.celery_support import WorkerProcess, worker_env

    run = Run()
    queue = f"bare-{uuid.uuid4().hex[:8]}"
    env = worker_env(redis_nodes.urls, celery_broker_node.url, celery_broker_node.url, 600)
    env["REDLOCK_CELERY_INSTALL"] = "0"
    bare = WorkerProcess(tmp_path / "bare.log", env, queue, concurrency=1, include=None)
    try:
        bare.start()
        for key in ("bare1", "bare2"):
            entry = tasks.critical.apply_async((key, run.id), queue=queue).get(timeout=TIMEOUT)
            assert entry["held"] and entry["lock"] == f"demo:{key}"
        assert not rl.locked("demo:bare1") and not rl.locked("demo:bare2")
        log = bare.text()
    finally:
        bare.stop()
    warnings = [
        line
        for line in log.splitlines()
        if "WARNING" in line and "without django_redlock.celery.install(app)" in line
    ]
    assert len(warnings) == 1, log  # once per process, not per task


def test_time_limit_handling_per_pool():
    """docs/celery.rst, "Time limits": which pools have the wait kept out of their limits."""
    from types import SimpleNamespace

    from celery.concurrency import get_implementation

    from django_redlock.celery import (
        LIMITS_CHARGED,
        LIMITS_NOT_ENFORCED,
        LIMITS_REARMED,
        _limits_mode,
    )

    def mode(pool: str, eventloop: bool) -> str:
        worker = SimpleNamespace(pool_cls=get_implementation(pool), use_eventloop=eventloop)
        return _limits_mode(worker)

    assert mode("prefork", True) == LIMITS_REARMED
    assert mode("prefork", False) == LIMITS_CHARGED
    assert mode("threads", True) == mode("solo", True) == LIMITS_NOT_ENFORCED


def test_a_pool_that_charges_the_wait_says_so_once_per_task(worker, rl, monkeypatch, caplog):
    """docs/celery.rst, "Time limits": where the pool counts the lock wait against the limits,
    a task with a time limit that waits logs a WARNING, once per task and process. (This
    worker's threads pool enforces no limit; the test gives its hooks the charging mode of a
    gevent or eventlet pool.)"""
    from django_redlock import celery as celery_module
    from tests.celery_support import soft_limited_wait

    hooks = celery_module._worker_hooks
    assert hooks is not None and hooks.app is tasks.app
    monkeypatch.setattr(hooks, "limits", celery_module.LIMITS_CHARGED)
    monkeypatch.setattr(hooks, "_warned", set())
    caplog.set_level(logging.WARNING, logger="django_redlock.celery")
    run = Run()
    for key in ("ch1", "ch2"):
        assert soft_limited_wait.delay(key, run.id).get(timeout=TIMEOUT)["held"]
    assert tasks.critical_wait.delay("ch3", run.id).get(timeout=TIMEOUT)["held"]  # no limit
    warnings = [r.getMessage() for r in caplog.records if "counts the wait" in r.getMessage()]
    assert len(warnings) == 1 and "tests.soft_limited_wait" in warnings[0]


def test_the_main_process_frees_a_stopped_pool_process_lock_only_once_it_exited(worker, rl, caplog):
    """docs/celery.rst, "The worker's main process cleans up for its pool": after a hard time
    limit the main process releases the lock of the task's pool process once that process has
    exited, not when Celery reports the limit (before billiard's SIGTERM and SIGKILL). Celery
    sends task_failure twice for one limit: one release, no second attempt. (A child process
    stands in for the pool process; this worker's map gets the report a pool process sends.)"""
    import subprocess
    import sys

    from django_redlock import celery as celery_module

    hooks = celery_module._worker_hooks
    assert hooks is not None and hooks.app is tasks.app
    caplog.set_level(logging.WARNING, logger="django_redlock.celery")
    lock = rl.lock("demo:stopped-process", ttl=30)
    assert lock.acquire(blocking=False)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    task_id = uuid.uuid4().hex
    report = {"kind": "hold", "id": task_id, "task": tasks.critical.name, "lock": lock.name}
    hooks.locks.record({**report, "pid": child.pid, "token": lock.token})
    try:
        for _ in range(2):
            assert hooks.release_once_exited(task_id, "task failed: TimeLimitExceeded")
        time.sleep(0.3)  # nothing to wait for: the release must not come while it runs
        assert rl.locked(lock.name)
    finally:
        child.kill()
        child.wait()
    wait_until(lambda: not rl.locked(lock.name), timeout=10, what="the release")
    wait_until(lambda: task_id not in hooks._awaiting_exit, timeout=10, what="the end")
    released = [r.getMessage() for r in caplog.records if task_id in r.getMessage()]
    assert released == [
        f"released lock {lock.name} of task {tasks.critical.name}[{task_id}] "
        "(task failed: TimeLimitExceeded)"
    ]
    assert not hooks.release_once_exited(task_id, "task failed: TimeLimitExceeded")
