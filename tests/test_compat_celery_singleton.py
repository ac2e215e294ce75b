"""docs/migrating.rst, celery-singleton: every row of the guide's table, through the guide's
translation, with a real worker (threads pool in this process; a ``celery worker -P prefork``
process for the killed worker) on real lock nodes. One test per row, named in the table.

The translated task is ``tests.celery_support.singleton_build_report`` (the guide's
``lock_key="report:{report_id}"``, ``lock_dedupe=True``). A task "queued" here waits in a
queue no worker reads (``UNREAD_QUEUE``), so it stays queued.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest
import redis

from django_redlock import LockNotAcquired
from tests.celery_support import (
    TIMEOUT,
    UNREAD_QUEUE,
    Run,
    WorkerProcess,
    assert_no_overlap,
    drop_queue,
    queued_messages,
    singleton_build_report,
    wait_until,
    worker_env,
)

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]

build_report = singleton_build_report


@pytest.fixture
def rl(redlock_settings):
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture
def worker(celery_thread_worker, rl):
    return celery_thread_worker


@pytest.fixture
def broker_url(celery_broker_node, celery_test_app):
    """The broker; the unread queue is emptied after each test."""
    drop_queue(celery_broker_node.url)
    yield celery_broker_node.url
    drop_queue(celery_broker_node.url)


def _park(args: tuple[Any, ...], kwargs: Any = None, **options: Any) -> Any:
    """Send ``build_report`` where no worker reads: it stays queued, holding its marker."""
    return build_report.apply_async(args, kwargs, queue=UNREAD_QUEUE, **options)


def test_a_call_while_one_is_queued_returns_its_result(worker, rl, broker_url):
    run = Run()
    first = _park((7, run.id))
    second = _park((7, run.id))
    assert second.id == first.id
    assert queued_messages(broker_url) == 1  # nothing more was sent


def test_a_call_while_one_runs_is_queued_and_runs_after_it(worker, rl):
    run = Run()
    first = build_report.delay(8, run.id, gate="g")
    run.started_by(first.id)  # running: its marker was freed when it started
    second = build_report.delay(8, run.id)
    assert second.id != first.id  # a task of its own, not the running one's result
    assert build_report.delay(8, run.id).id == second.id  # merged into the queued one
    run.open("g")
    first.get(timeout=TIMEOUT)
    second.get(timeout=TIMEOUT)
    intervals = run.wait("intervals", 2)
    assert_no_overlap(intervals)
    assert [e["task_id"] for e in sorted(intervals, key=lambda e: e["start"])] == [
        first.id,
        second.id,
    ]


def test_unique_on_is_a_lock_key_template(worker, rl, broker_url):
    run = Run()
    first = _park((9, run.id), {"fmt": "pdf"})
    assert rl.locked("report:9:queued")
    assert _park((9, run.id), {"fmt": "html"}).id == first.id  # fmt is not in the key
    other = _park((10, run.id))
    assert other.id != first.id
    assert queued_messages(broker_url) == 2


def test_raise_on_duplicate_is_lock_dedupe_raise(worker, rl, broker_url):
    run = Run()
    first = _park((11, run.id))
    with pytest.raises(LockNotAcquired, match="already queued") as caught:
        _park((11, run.id), lock_dedupe="raise")
    assert first.id in str(caught.value)
    assert queued_messages(broker_url) == 1


def test_lock_expiry_is_lock_dedupe_ttl(worker, rl, broker_url):
    run = Run()
    capped = _park((18, run.id), lock_dedupe_ttl=600)
    # 600 s is capped by the Redlock's MAX_TTL, as the table says
    assert rl.lock_info("report:18:queued").lease == rl.max_ttl == 60
    assert capped.state == "PENDING"
    first = _park((12, run.id), lock_dedupe_ttl=1)
    assert rl.locked("report:12:queued")
    wait_until(lambda: not rl.locked("report:12:queued"), what="the marker to expire")
    assert _park((12, run.id)).id != first.id  # sent: no longer a duplicate


def test_a_failed_task_frees_its_key(worker, rl):
    run = Run()
    failing = build_report.delay(13, run.id, fail=True)
    with pytest.raises(ValueError, match="failing on purpose"):
        failing.get(timeout=TIMEOUT)
    assert not rl.locked("report:13") and not rl.locked("report:13:queued")
    after = build_report.delay(13, run.id)
    assert after.id != failing.id and after.get(timeout=TIMEOUT)["lock"] == "report:13"


def test_clear_locks_is_force_release_of_one_key(worker, rl, broker_url):
    """A marker whose task will never run (here: in a queue nobody reads; after a crash: a
    lost message) merges every call until it is removed by hand, as the guide's example
    does, or its lease ends."""
    from django_redlock import get_redlock

    run = Run()
    stuck = _park((14, run.id))
    assert build_report.delay(14, run.id).id == stuck.id
    assert get_redlock().force_release("report:14:queued") >= 2  # a quorum of 3 nodes
    fresh = build_report.delay(14, run.id)
    assert fresh.id != stuck.id
    assert fresh.get(timeout=TIMEOUT)["task_id"] == fresh.id


# A crashed worker is a fault scenario (a worker started and killed): the marked set.
@pytest.mark.faults
def test_a_killed_worker_frees_the_key(
    rl, redis_nodes, celery_broker_node, celery_test_app, tmp_path
):
    """A ``celery worker -P prefork`` killed with SIGKILL while the task runs: a new call
    sends a task of its own at once, the run's key frees when its 2 s lease ends (no
    ``clear_locks``), and the killed task is delivered again and runs to its end."""
    run = Run()
    queue = f"singleton-{uuid.uuid4().hex[:8]}"
    env = worker_env(redis_nodes.urls, celery_broker_node.url, celery_broker_node.url, 4)
    workers = [WorkerProcess(tmp_path / "w0.log", env, queue)]
    try:
        workers[0].start()
        victim = build_report.apply_async((15, run.id), {"gate": "never"}, queue=queue)
        assert run.started_by(victim.id)["lock"] == "report:15"
        workers[0].signal(signal.SIGKILL)
        killed_at = time.time()
        workers[0].wait()
        run.r.set(f"{run.id}:stop", 1)  # the copy delivered again ends at once
        again = build_report.apply_async((15, run.id), queue=queue)
        assert again.id != victim.id
        wait_until(lambda: not rl.locked("report:15"), timeout=30, what="the lease to end")
        workers.append(WorkerProcess(tmp_path / "w1.log", env, queue).start())
        assert victim.get(timeout=TIMEOUT)["task_id"] == victim.id
        assert again.get(timeout=TIMEOUT)["task_id"] == again.id
        runs = [e for e in run.all("intervals") if e["task_id"] == victim.id]
        assert runs and all(e["start"] > killed_at for e in runs)
        assert_no_overlap(run.all("intervals"))
    finally:
        for process in workers:
            process.stop()


def test_locks_live_on_the_lock_nodes(worker, rl, redis_nodes, celery_test_app, broker_url):
    """The marker and the run's lock are on the REDLOCK nodes; the result backend (database
    1 of the broker's server here) holds results only."""
    run = Run()
    _park((16, run.id))
    running = build_report.delay(17, run.id, gate="g")
    run.started_by(running.id)
    assert rl.locked("report:16:queued") and rl.locked("report:17")
    on_nodes: list[str] = []
    for node in redis_nodes:
        client = redis.Redis.from_url(node.url)
        try:
            on_nodes += [key.decode() for key in client.scan_iter("*report:1[67]*")]
        finally:
            client.close()
    assert any(k.endswith("report:16:queued") for k in on_nodes)
    assert any(k.endswith("report:17") for k in on_nodes)
    backend = redis.Redis.from_url(celery_test_app.conf.result_backend)
    try:
        assert not list(backend.scan_iter("*report:*"))
    finally:
        backend.close()
    run.open("g")
    running.get(timeout=TIMEOUT)
