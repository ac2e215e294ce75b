"""LockedTask in a real ``celery worker -P prefork`` process (the only pool that enforces time
limits and runs tasks in processes apart from the worker): the lock wait is not charged to
the task's time limits, and a revoked task that waits for its lock is stopped at once.

The worker runs ``testproject.celery_app`` with ``-I tests.celery_support`` (which calls
``django_redlock.celery.install(app)`` and adds the time-limited tasks); lock nodes, broker
and results are embedded redis-servers. The tests synchronise on the tasks' records and
gates (``tests.celery_support.Run``), never on sleeps.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from testproject import tasks
from tests import celery_support
from tests.celery_support import TIMEOUT, Run, WorkerProcess, wait_until, worker_env

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(300)]

#: Rounds of each time-limit scenario (the outside report saw 14 failures in 18). Each round
#: checks that the wait fell inside the limit's window, so a charged wait fails every round.
ROUNDS = 3
SOFT_LIMIT = 1.0  # the limited tasks' soft (or hard) time limit
BODY = 0.5  # what the waiter's own run takes
HOLD = 0.7  # what the holder keeps the key for once the waiter waits


@pytest.fixture
def rl(redlock_settings):
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture(scope="module")
def _module_worker(
    _redlock_session_cluster, celery_broker_node, celery_test_app, tmp_path_factory
) -> Iterator[WorkerProcess]:
    """One ``celery worker -P prefork -c 2`` for the module, killed after its last test
    (starting one per test cost a few seconds each). Every test uses keys and task ids of
    its own; a pool process killed by a hard limit is replaced by the pool."""
    # Healthy, empty nodes before the worker's client first sees them, as redis_nodes does:
    # nodes restarted under a connected client would keep the restart guard on.
    redis_nodes = _redlock_session_cluster.heal()
    for node in redis_nodes:
        node.flush()
    queue = f"prefork-{uuid.uuid4().hex[:8]}"
    env = worker_env(redis_nodes.urls, celery_broker_node.url, celery_broker_node.url, 600)
    log = tmp_path_factory.mktemp("prefork") / "worker.log"
    worker = WorkerProcess(log, env, queue, concurrency=2)
    try:
        yield worker.start()
    finally:
        worker.stop()


class WorkerView:
    """The module's worker as one test sees it: its log from the test's start on."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.start = len(worker.text(tail=None))

    def text(self, tail: int | None = 8000) -> str:
        text = self.worker.text(tail=None)[self.start :]
        return text if tail is None else text[-tail:]


@pytest.fixture
def queue(_module_worker: WorkerProcess) -> str:
    return _module_worker.queue


@pytest.fixture
def prefork_worker(_module_worker: WorkerProcess, rl, redis_nodes) -> WorkerView:
    return WorkerView(_module_worker)


def _prerun(run: Run, task_id: str) -> dict[str, Any]:
    """When ``task_id`` started in its pool process (before taking its lock)."""
    n = 1
    while True:
        found = [e for e in run.wait("prerun", n) if e["task_id"] == task_id]
        if found:
            return found[0]
        n = len(run.seen["prerun"]) + 1


def _queue_behind_holder(
    run: Run,
    key: str,
    waiter_task: Any,
    queue: str,
    body: float,
    hold: float = HOLD,
    **options: Any,
) -> tuple[Any, Any, dict[str, Any]]:
    """A holder takes ``demo:<key>``; the waiter starts and blocks for the key; then the
    holder keeps the key ``hold`` seconds more. Returns (holder, waiter, waiter prerun)."""
    holder = tasks.critical.apply_async((key, run.id), {"gate": "hold", "hold": hold}, queue=queue)
    run.started_by(holder.id)
    waiter = waiter_task.apply_async((key, run.id), {"hold": body}, queue=queue, **options)
    prerun = _prerun(run, waiter.id)  # it runs: its limits count from here
    run.open("hold")
    return holder, waiter, prerun


@pytest.mark.parametrize(
    "waiter_task",
    [celery_support.soft_limited_wait, celery_support.soft_limited_retry],
    ids=["wait", "retry-slot"],
)
def test_lock_wait_is_not_charged_to_the_soft_time_limit(prefork_worker, rl, queue, waiter_task):
    """docs/celery.rst, "Time limits": a task with soft_time_limit=1.0 whose body takes 0.5 s,
    queued behind a holder of 0.7 s, succeeds every time; with the wait charged, every round
    would overrun the limit (checked: more than 1 s passes between the start of the waiter's
    run and its end)."""
    for round_ in range(ROUNDS):
        run = Run()
        holder, waiter, prerun = _queue_behind_holder(
            run, f"soft{round_}", waiter_task, queue, BODY
        )
        entry = waiter.get(timeout=TIMEOUT)  # SoftTimeLimitExceeded would be raised here
        holder_entry = holder.get(timeout=TIMEOUT)
        assert entry["held"] and entry["start"] >= holder_entry["end"]
        assert entry["end"] - prerun["t"] > SOFT_LIMIT, (round_, entry, prerun)
        assert not rl.locked(f"demo:soft{round_}")


def test_a_wait_longer_than_the_soft_time_limit_is_not_charged(prefork_worker, rl, queue):
    """While the task waits its limits are suspended, not only re-armed once it holds the
    lock: a 1.5 s wait under a 1 s soft limit, then a 0.2 s body."""
    for round_ in range(3):
        run = Run()
        holder, waiter, prerun = _queue_behind_holder(
            run, f"long{round_}", celery_support.soft_limited_wait, queue, 0.2, hold=1.5
        )
        entry = waiter.get(timeout=TIMEOUT)
        holder.get(timeout=TIMEOUT)
        assert entry["held"] and entry["start"] - prerun["t"] > SOFT_LIMIT, (round_, entry)


def test_lock_wait_is_not_charged_to_the_hard_time_limit(prefork_worker, rl, queue):
    """The same with time_limit=1.0 (a hard limit kills the pool process)."""
    for round_ in range(ROUNDS):
        run = Run()
        holder, waiter, prerun = _queue_behind_holder(
            run, f"hard{round_}", celery_support.hard_limited_wait, queue, BODY
        )
        entry = waiter.get(timeout=TIMEOUT)  # TimeLimitExceeded would be raised here
        holder.get(timeout=TIMEOUT)
        assert entry["held"] and entry["end"] - prerun["t"] > SOFT_LIMIT, (round_, entry)
    assert "TimeLimitExceeded" not in prefork_worker.text(tail=None)


def test_time_limits_still_count_from_the_moment_the_lock_is_held(prefork_worker, rl, queue):
    """Not charged is not switched off: a body longer than the soft limit still gets
    SoftTimeLimitExceeded, about one limit after it took the lock, and the key is free.
    (Counted from the task's start instead, the limit would fire at most 0.3 s into the body,
    after the 0.7 s wait; the bound below sits half-way, far from either.)"""
    run = Run()
    holder, waiter, prerun = _queue_behind_holder(
        run, "over", celery_support.soft_limited_wait, queue, body=5.0
    )
    with pytest.raises(SoftTimeLimitExceeded):
        waiter.get(timeout=TIMEOUT)
    holder.get(timeout=TIMEOUT)
    (entry,) = [e for e in run.wait("intervals", 2) if e["task_id"] == waiter.id]
    assert entry["start"] - prerun["t"] >= HOLD  # it did wait
    assert SOFT_LIMIT / 2 < entry["end"] - entry["start"] < 5.0, entry
    assert not rl.locked("demo:over")


@pytest.mark.faults
def test_a_hard_time_limit_after_the_wait_frees_the_key_at_once(prefork_worker, rl, queue):
    """The pool process killed by its hard limit cannot release; the worker's main process
    releases the lock it knows the task holds (its map), long before the lease ends."""
    run = Run()
    holder, waiter, _ = _queue_behind_holder(
        run, "killed", celery_support.hard_limited_wait, queue, body=60.0, lock_ttl=30
    )
    with pytest.raises(TimeLimitExceeded):
        waiter.get(timeout=TIMEOUT)
    holder.get(timeout=TIMEOUT)
    assert run.started_by(waiter.id)["lock"] == "demo:killed"  # it held the key when killed
    # Its 30 s lease would keep the key that long; the main process frees it at the kill
    # (task_failure comes just after the result is stored).
    wait_until(lambda: not rl.locked("demo:killed"), timeout=15, what="the key to be freed")
    # The worker logs the release once it returned, which may be after the nodes show it.
    line = "released lock demo:killed of task tests.hard_limited_wait"
    wait_until(lambda: line in prefork_worker.text(tail=None), timeout=15, what="the log line")
    assert line in prefork_worker.text(tail=None)


@pytest.mark.faults
@pytest.mark.parametrize("stubborn", [False, True], ids=["exits-on-sigterm", "runs-to-sigkill"])
def test_a_hard_time_limit_frees_the_key_only_once_its_pool_process_is_gone(
    prefork_worker, rl, queue, stubborn
):
    """docs/celery.rst, "How it works" (one task per key at a time; the main process cleans up
    for its pool): at a hard limit billiard sends the pool process SIGTERM, and SIGKILL 0.1 s
    later; Celery reports the failure before either. A task waiting for the key must not
    start before the killed run's last write (its body a plain loop writing every 2 ms;
    stubborn: one that runs on after SIGTERM, so the main process frees the key after
    SIGKILL), and yet starts long before the 30 s lease ends. The dying run logs no "not
    exclusive" ERROR and the worker no failed release."""
    for round_ in range(5):
        run = Run()
        key = f"overrun{int(stubborn)}{round_}"
        killed = celery_support.hard_limited_loop.apply_async(
            (key, run.id, 60.0, stubborn), queue=queue
        )
        (first,) = run.wait("writes", 1)  # it holds the key
        assert first["task_id"] == killed.id
        killed_pid = first["pid"]
        waiter = celery_support.loop_wait.apply_async((key, run.id, 0.2), queue=queue)
        _prerun(run, waiter.id)
        with pytest.raises(TimeLimitExceeded):
            killed.get(timeout=TIMEOUT)
        assert waiter.get(timeout=TIMEOUT) == key
        writes = run.all("writes")
        killed_last = max(w["t"] for w in writes if w["pid"] == killed_pid)
        (waiter_start,) = [
            w["t"] for w in writes if w["task_id"] == waiter.id and w["kind"] == "start"
        ]
        assert waiter_start > killed_last, (round_, waiter_start - killed_last)
        assert waiter_start - killed_last < 15, (round_, waiter_start - killed_last)
        assert not rl.locked(f"demo:{key}")
    log = prefork_worker.text(tail=None)
    assert "Hard time limit (1.0s) exceeded" in log
    assert "finished without holding lock" not in log
    assert "could not release" not in log
    if stubborn:  # freed by the main process, after SIGKILL
        assert "(task failed: TimeLimitExceeded)" in log


@pytest.mark.faults
def test_a_terminated_task_frees_the_key_only_once_its_run_is_over(
    prefork_worker, rl, celery_test_app, queue
):
    """docs/celery.rst, "How it works": ``revoke(terminate=True)`` is reported as Celery sends
    SIGTERM, but a body goes on until the signal lands (a C call delays it, a body may catch
    the SystemExit it raises, as this one does). A task waiting for the key must not start
    before the terminated run's last write; the run then ends on its own and releases."""
    run = Run()
    key = "terminated"
    first = celery_support.loop_wait.apply_async((key, run.id, 2.0, True), queue=queue)
    (started,) = run.wait("writes", 1)
    assert started["task_id"] == first.id
    waiter = celery_support.loop_wait.apply_async((key, run.id, 0.2), queue=queue)
    _prerun(run, waiter.id)
    celery_test_app.control.revoke(first.id, terminate=True)
    assert waiter.get(timeout=TIMEOUT) == key
    writes = run.all("writes")
    first_last = max(w["t"] for w in writes if w["task_id"] == first.id)
    (waiter_start,) = [w["t"] for w in writes if w["task_id"] == waiter.id and w["kind"] == "start"]
    assert waiter_start > first_last, waiter_start - first_last
    assert not rl.locked(f"demo:{key}")
    assert "finished without holding lock" not in prefork_worker.text(tail=None)


@pytest.mark.parametrize(
    "waiter_task, slot",
    [(tasks.critical_wait, False), (tasks.critical, True)],
    ids=["wait", "retry-slot"],
)
def test_revoking_a_waiting_task_stops_it_and_frees_its_slot(
    prefork_worker, rl, celery_test_app, queue, waiter_task, slot
):
    """docs/celery.rst, "Revoking": a task revoked while it waits for its lock stops waiting
    at once (the holder still holds the key), ends REVOKED without running, and its waiting
    slot is free when the revoke's reply arrives."""
    run = Run()
    holder = tasks.critical.apply_async(("rw", run.id), {"gate": "hold"}, queue=queue)
    run.started_by(holder.id)
    waiter = waiter_task.apply_async(("rw", run.id), queue=queue)
    _prerun(run, waiter.id)
    if slot:
        wait_until(
            lambda: (
                (info := rl.lock_info("demo:rw:waiter")) is not None
                and info.meta["task_id"] == waiter.id
            ),
            what="the waiter to hold the waiting slot",
        )
    replies = celery_test_app.control.revoke(waiter.id, reply=True, timeout=10, limit=1)
    assert replies, "the worker did not confirm the revoke"
    wait_until(lambda: waiter.state == "REVOKED", what="state REVOKED")
    assert not rl.locked("demo:rw:waiter")
    assert rl.lock_info("demo:rw").meta["task_id"] == holder.id  # still held: it did not wait
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    assert [e["task_id"] for e in run.all("started")] == [holder.id]
    assert waiter.state == "REVOKED"
    assert "revoked while it waited for lock demo:rw" in prefork_worker.text(tail=None)


def test_a_revoke_whose_stop_is_swallowed_still_stops_the_waiting_task(
    prefork_worker, rl, celery_test_app, queue
):
    """The worker's main process stops a waiting task with billiard's soft time limit
    signal; its SoftTimeLimitExceeded lands wherever the task is, here (through a test
    receiver, no timing) inside a ``lock_contended`` receiver that Django's ``send_robust``
    guards, which swallows it. The task used to wait on, take the key after the holder and
    run: it is stopped once its wait ends, REVOKED, never run, and the key is free."""
    run = Run()
    key = f"{celery_support.STALLED_PREFIX.removeprefix('demo:')}{run.id}"
    holder = tasks.critical.apply_async((key, run.id), {"gate": "hold"}, queue=queue)
    run.started_by(holder.id)
    waiter = tasks.critical_wait.apply_async((key, run.id), queue=queue)
    run.wait("stalled")  # refused, and inside the receiver
    replies = celery_test_app.control.revoke(waiter.id, reply=True, timeout=10, limit=1)
    assert replies, "the worker did not confirm the revoke"
    wait_until(lambda: waiter.state == "REVOKED", what="state REVOKED")
    run.open("hold")
    holder.get(timeout=TIMEOUT)
    ended = f"[{waiter.id}] revoked while it waited for lock demo:{key}: not run"
    wait_until(
        lambda: (
            ended in prefork_worker.text(tail=None)
            or waiter.id in [e["task_id"] for e in run.all("started")]
        ),
        what="the revoked waiter's run to end",
    )
    assert [e["task_id"] for e in run.all("started")] == [holder.id]
    assert waiter.state == "REVOKED"
    wait_until(lambda: not rl.locked(f"demo:{key}"), what="the key to be free")


def test_a_worker_outlives_no_test_run_that_ended_without_cleanup(celery_broker_node, tmp_path):
    """A worker runs in a session of its own (so the tests can kill its whole pool), out of
    reach of a signal to the test run's group such as a CI timeout's: when the process that
    started it ends without any cleanup (``os._exit``), the worker and its pool go too."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from tests.celery_support import WorkerProcess, worker_env\n"
        "url = sys.argv[1]\n"
        "env = worker_env([url], url, url, 600)\n"
        "w = WorkerProcess(Path(sys.argv[2]), env, 'orphan-' + os.urandom(4).hex()).start()\n"
        "print(w.proc.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    repo = celery_support.REPO_ROOT
    out = subprocess.run(
        [sys.executable, "-c", script, celery_broker_node.url, str(tmp_path / "w.log")],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    group = int(out.stdout.split()[-1])

    def members() -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as fh:
                        fields = fh.read().rpartition(b")")[2].split()
                except OSError:
                    continue
                if int(fields[2]) == group and fields[0] != b"Z":
                    found.append(int(name))
        return found

    try:
        deadline = time.monotonic() + 30
        while members() and time.monotonic() < deadline:
            time.sleep(0.1)  # the end of another session's processes sends this one no event
        assert members() == []
    finally:
        if members():
            os.killpg(group, signal.SIGKILL)
