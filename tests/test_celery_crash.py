"""LockedTask when a worker dies: real ``celery worker`` processes (prefork pool) started with
``celery -A testproject.celery_app worker``, killed with SIGKILL (the whole worker, its main
process only, or one pool process), SIGQUIT (cold shutdown) or made to terminate a revoked task.
Every SIGKILL scenario runs on both brokers: an embedded redis-server, and the RabbitMQ at
``REDLOCK_RABBITMQ_URL`` (default ``amqp://guest:guest@127.0.0.1:5672//``; skipped with the
reason when it does not answer, a failure under ``REDLOCK_REQUIRE_ALL=1``). The lock nodes and
the result backend are embedded redis-servers.

What must hold, with LockedTask's default settings (``long_task`` sets none of the delivery
options): a task whose worker dies mid-run is delivered again and runs to the end, after the
killed run's key is free, and no two runs of the key overlap.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from typing import Any

import pytest

from testproject import tasks
from tests.celery_support import (
    TIMEOUT,
    Run,
    WorkerProcess,
    assert_no_overlap,
    wait_until,
    worker_env,
)

pytestmark = [pytest.mark.celery, pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]

LEASE = 2.0  # long_task's lock_ttl
#: The Redis transport hands an unacknowledged message out again after this many seconds.
VISIBILITY = 4
RABBITMQ_URL = os.environ.get("REDLOCK_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _rabbitmq_problem(url: str) -> str | None:
    """Why RabbitMQ at ``url`` cannot be used (None when it answers)."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request, celery_broker_node, celery_test_app) -> dict[str, Any]:
    """A producer app on one broker: ``{"kind", "url", "app"}``. Results and the tasks'
    records live on ``celery_broker_node`` (Redis) for both brokers."""
    from celery import Celery

    from testproject.celery_app import configure

    if request.param == "redis":
        url = celery_broker_node.url
    else:
        url = RABBITMQ_URL
        problem = _rabbitmq_problem(url)
        if problem is not None:
            pytest.skip(f"RabbitMQ is not reachable at {url} ({problem})")
    app = Celery(f"crash-{request.param}", set_as_current=False)
    configure(app, url, visibility_timeout=VISIBILITY, results=celery_broker_node.url)
    yield {"kind": request.param, "url": url, "app": app}
    with contextlib.suppress(Exception):
        app.backend.result_consumer.stop()
    app.close()


@pytest.fixture
def rl(redlock_settings):
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture
def queue() -> str:
    return f"crash-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def spawn_worker(rl, redis_nodes, celery_broker_node, tmp_path, queue):
    """``spawn_worker(broker_url) -> WorkerProcess`` (started and ready) consuming ``queue``;
    all are killed at teardown."""
    made: list[WorkerProcess] = []

    def spawn(broker_url: str) -> WorkerProcess:
        env = worker_env(redis_nodes.urls, broker_url, celery_broker_node.url, VISIBILITY)
        worker = WorkerProcess(tmp_path / f"worker{len(made)}.log", env, queue)
        made.append(worker)
        return worker.start()

    yield spawn
    for worker in made:
        worker.stop()


def _start_victim(
    rl, broker, queue: str, run: Run, key: str, lock_ttl: float | None = None, **options: Any
) -> tuple[Any, dict[str, Any]]:
    """Send ``long_task`` (60 s) and wait until it runs with its lease renewed twice (or,
    with a per-call ``lock_ttl``, until it holds that lease); ``options`` are more per-call
    options (header fields). Returns the AsyncResult and the holder metadata."""
    headers = {"redlock": {"ttl": lock_ttl, **options}} if lock_ttl is not None else None
    victim = broker["app"].send_task(
        "testproject.long_task", (key, run.id, 60), queue=queue, headers=headers
    )
    assert run.started_by(victim.id)["lock"] == f"long:{key}"
    renewals = 2 if lock_ttl is None else 0
    wait_until(
        lambda: (info := rl.lock_info(f"long:{key}")) is not None and info.renewals >= renewals,
        what="renewals",
    )
    return victim, rl.lock_info(f"long:{key}").meta


def _runs_of(run: Run, task_id: str) -> list[dict[str, Any]]:
    return [e for e in run.all("intervals") if e["task_id"] == task_id]


def test_sigkill_of_the_whole_worker_redelivers_the_task(rl, broker, spawn_worker, queue):
    run = Run()
    worker = spawn_worker(broker["url"])
    victim, holder = _start_victim(rl, broker, queue, run, "all")
    assert holder["task_id"] == victim.id and holder["pid"] != worker.proc.pid  # a pool process
    assert holder["worker"] == worker.name.replace("%h", socket.gethostname())

    worker.signal(signal.SIGKILL)
    killed_at = time.time()
    worker.wait()
    run.r.set(f"{run.id}:stop", 1)  # the copy delivered again ends at once

    spawn_worker(broker["url"])
    again = victim.get(timeout=TIMEOUT)
    assert again["task_id"] == victim.id and again["start"] > killed_at
    # The killed run never recorded its end; the ones delivered again (the Redis transport may
    # hand the message out more than once) did, one at a time.
    runs = _runs_of(run, victim.id)
    assert again in runs and all(r["start"] > killed_at for r in runs)
    assert_no_overlap(runs)
    wait_until(lambda: not rl.locked("long:all"), timeout=15, what="the key to be free")


def test_sigkill_of_a_pool_process_requeues_the_task_and_frees_its_key(
    rl, broker, spawn_worker, queue
):
    run = Run()
    worker = spawn_worker(broker["url"])
    # A lease far longer than a redelivery takes, even on a loaded machine: the rerun can only
    # start early because it freed its own dead attempt's lease (with the 2 s lease the key
    # might simply run out first, and nothing would be shown).
    victim, holder = _start_victim(rl, broker, queue, run, "pool", lock_ttl=30)
    os.kill(holder["pid"], signal.SIGKILL)  # the pool process running the task
    run.r.set(f"{run.id}:stop", 1)

    # reject_on_worker_lost: the main process puts the message back, this worker runs it
    # again, finds the lease of its own dead attempt and frees it (not one lease later).
    again = victim.get(timeout=TIMEOUT)
    assert again["task_id"] == victim.id and again["pid"] != holder["pid"]
    wait_until(lambda: "of this task's earlier attempt (pid" in worker.text(), what="the log")
    assert f"freed lock long:pool of this task's earlier attempt (pid {holder['pid']}" in (
        worker.text()
    )
    # The killed attempt never recorded its end. With the 4 s visibility timeout the Redis
    # transport may hand the message out once more while this runs; such a copy takes the
    # lock too (never overlapping), so the key is free once it is done, long before the
    # 30 s lease of the dead attempt would have run out.
    runs = _runs_of(run, victim.id)
    assert again in runs and all(r["pid"] != holder["pid"] for r in runs)
    assert_no_overlap(runs)
    assert worker.proc.poll() is None  # the worker itself lives on
    wait_until(lambda: not rl.locked("long:pool"), timeout=15, what="the key to be free")


@pytest.mark.parametrize("on_locked", ["retry", "wait"])
def test_a_pool_process_killed_mid_run_is_run_again_without_waiting_out_lock_wait(
    rl, broker, spawn_worker, queue, on_locked
):
    """docs/celery.rst: the next delivery frees the dead process's lease and runs. With a
    ``lock_wait`` as long as the lease it must do so before it starts waiting, not once the
    wait (or the dead attempt's lease) has run out."""
    run = Run()
    worker = spawn_worker(broker["url"])
    victim, holder = _start_victim(
        rl, broker, queue, run, "waiting", lock_ttl=40, on_locked=on_locked, wait=40
    )
    os.kill(holder["pid"], signal.SIGKILL)
    killed_at = time.time()
    run.r.set(f"{run.id}:stop", 1)

    again = victim.get(timeout=TIMEOUT)
    assert again["task_id"] == victim.id and again["pid"] != holder["pid"]
    # Waiting would have taken until the lease or lock_wait ran out (about 40 s); a
    # redelivery on a loaded machine takes a few seconds.
    assert again["start"] - killed_at < 15, worker.text()
    assert f"freed lock long:waiting of this task's earlier attempt (pid {holder['pid']}" in (
        worker.text()
    )
    assert_no_overlap(_runs_of(run, victim.id))


def test_sigkill_of_the_main_process_only_runs_the_task_again_without_overlap(
    rl, broker, spawn_worker, queue
):
    run = Run()
    worker = spawn_worker(broker["url"])
    victim, _ = _start_victim(rl, broker, queue, run, "main")
    worker.signal(signal.SIGKILL, group=False)
    worker.wait()
    # The pool process may outlive its parent and finish the run it started; the copy the
    # broker hands out again must not start before the key is free.
    spawn_worker(broker["url"])
    run.r.set(f"{run.id}:stop", 1)
    again = victim.get(timeout=TIMEOUT)
    assert again["task_id"] == victim.id
    runs = _runs_of(run, victim.id)
    assert again in runs
    assert_no_overlap(runs)
    wait_until(lambda: not rl.locked("long:main"), what="the key to be free")


def test_opting_out_of_late_acks_loses_the_task_as_documented(rl, broker, spawn_worker, queue):
    """The other side of the default: with ``acks_late=False`` the killed run never comes
    back (the key still frees itself)."""
    run = Run()
    worker = spawn_worker(broker["url"])
    victim = broker["app"].send_task(
        "testproject.long_task_early_ack", ("optout", run.id, 60), queue=queue
    )
    run.started_by(victim.id)
    worker.signal(signal.SIGKILL)
    worker.wait()
    run.r.set(f"{run.id}:stop", 1)
    spawn_worker(broker["url"])
    # A task sent later, due after the broker would have handed the killed message out
    # again (visibility timeout, or at once for RabbitMQ), runs; the victim never does.
    later = broker["app"].send_task(
        "testproject.long_task", ("sentinel", run.id, 0), queue=queue, countdown=VISIBILITY + 2
    )
    assert later.get(timeout=TIMEOUT)["task_id"] == later.id
    started = [e["task_id"] for e in run.all("started")]
    # The killed run never came back. (The later task itself may start twice on the Redis
    # broker: a countdown longer than the visibility timeout gets redelivered, a Celery
    # trait this test's short visibility timeout provokes; not what is tested here.)
    assert started.count(victim.id) == 1 and later.id in started, started
    assert victim.state in ("PENDING", "STARTED")
    wait_until(lambda: not rl.locked("long:optout"), what="the key to free itself")


def test_revoke_terminate_frees_the_key_at_once(
    rl, celery_test_app, celery_broker_node, spawn_worker, queue
):
    run = Run()
    spawn_worker(celery_broker_node.url)
    # A 20 s lease: seeing the key free within a few seconds proves someone released it.
    task = tasks.long_task.apply_async(("rv", run.id, 60), queue=queue, lock_ttl=20)
    run.started_by(task.id)
    assert rl.locked("long:rv")
    revoked_at = time.monotonic()
    task.revoke(terminate=True, signal="SIGKILL")
    wait_until(lambda: not rl.locked("long:rv"), timeout=15, what="the key to be released")
    assert time.monotonic() - revoked_at < 10
    wait_until(lambda: task.state == "REVOKED", what="state REVOKED")


def test_cold_shutdown_frees_the_key_at_once(
    rl, celery_test_app, celery_broker_node, spawn_worker, queue
):
    run = Run()
    worker = spawn_worker(celery_broker_node.url)
    task = tasks.long_task.apply_async(("cold", run.id, 60), queue=queue, lock_ttl=20)
    run.started_by(task.id)
    assert rl.locked("long:cold")
    worker.signal(signal.SIGQUIT, group=False)  # cold shutdown: running tasks are abandoned
    stopped_at = time.monotonic()
    wait_until(lambda: not rl.locked("long:cold"), timeout=15, what="the key to be released")
    assert time.monotonic() - stopped_at < 10, worker.text()
    worker.wait()
    # Operators learn which task lost its lock at shutdown (docs/celery.rst, "Signals and logs").
    released = [
        line
        for line in worker.text().splitlines()
        if "WARNING" in line and "long:cold" in line and "shutdown" in line
    ]
    assert released, worker.text()
