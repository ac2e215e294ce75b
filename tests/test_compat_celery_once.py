"""docs/migrating.rst, celery-once: every row of the guide's table, through the guide's
translation, with a real worker (threads pool in this process; a ``celery worker -P prefork``
process for the killed worker) on real lock nodes. One test per row, named in the table; where
the table's left column names a test, that test runs celery-once itself (the ``peer`` fixture).

The translated tasks live in ``tests.celery_support``: ``once_sync_account`` is the guide's
example (``lock_key="sync:{account_id}"``, ``lock_dedupe="drop"``), ``once_default_key`` a task
without ``keys`` and with celery-once's default ``AlreadyQueued`` (``lock_dedupe="raise"``).
A task "queued" here waits in a queue no worker reads (``UNREAD_QUEUE``), so it stays queued.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from typing import Any

import pytest

from django_redlock import LockNotAcquired
from django_redlock.celery import default_lock_key, task_dropped
from tests.celery_support import (
    TIMEOUT,
    UNREAD_QUEUE,
    Run,
    WorkerProcess,
    assert_no_overlap,
    drop_queue,
    once_default_key,
    once_sync_account,
    queued_messages,
    wait_until,
    worker_env,
)

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]


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


@pytest.fixture
def peer(broker_url):
    """celery-once itself (``QueueOnce`` tasks of their own app) on the broker node, sending where
    no worker reads: the table's left column, checked. Its keys are deleted afterwards."""
    import redis
    from celery import Celery

    once = pytest.importorskip("celery_once", reason="celery-once is not installed")
    app = Celery(f"once-peer-{uuid.uuid4().hex[:8]}", broker=broker_url, set_as_current=False)
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": broker_url, "default_timeout": 60},
    }
    app.conf.task_default_queue = UNREAD_QUEUE

    @app.task(base=once.QueueOnce, once={"keys": ["account_id"], "graceful": True})
    def sync_account(account_id: int, run: str, full: bool = False) -> None: ...

    @app.task(base=once.QueueOnce)
    def default_key(account_id: int, run: str, full: bool = False) -> None: ...

    yield once, sync_account, default_key
    client = redis.Redis.from_url(broker_url)
    try:
        for task in (sync_account, default_key):
            for key in client.scan_iter(f"qo_{task.name}*"):
                client.delete(key)
    finally:
        client.close()
        app.close()


def _park(task: Any, args: tuple[Any, ...], kwargs: Any = None, **options: Any) -> Any:
    """Send ``task`` where no worker reads: it stays queued, holding its marker."""
    return task.apply_async(args, kwargs, queue=UNREAD_QUEUE, **options)


def _default_key(account_id: int, run: str, gate: str | None = None) -> str:
    return default_lock_key(
        once_default_key.name, {"account_id": account_id, "run": run, "gate": gate, "full": False}
    )


def test_a_call_while_one_is_queued_raises(worker, rl, broker_url):
    run = Run()
    queued = _park(once_default_key, (1, run.id))
    with pytest.raises(LockNotAcquired, match="already queued") as caught:
        _park(once_default_key, (1, run.id))
    assert queued.id in str(caught.value)
    assert queued_messages(broker_url) == 1  # nothing was sent


def test_the_error_says_when_the_marker_ends(worker, rl, broker_url):
    run = Run()
    _park(once_default_key, (2, run.id), lock_dedupe_ttl=60)
    with pytest.raises(LockNotAcquired) as caught:
        once_default_key.delay(2, run.id)
    assert caught.value.retry_after is not None and 0 < caught.value.retry_after <= 60


def test_graceful_is_lock_dedupe_drop(worker, rl, broker_url, caplog):
    caplog.set_level(logging.WARNING, logger="django_redlock.celery")
    dropped: list[dict[str, Any]] = []

    def on_dropped(sender=None, **kwargs: Any) -> None:
        dropped.append(kwargs)

    run = Run()
    queued = _park(once_sync_account, (42, run.id))
    task_dropped.connect(on_dropped, weak=False)
    try:
        again = _park(once_sync_account, (42, run.id))
    finally:
        task_dropped.disconnect(on_dropped)
    assert again.state == "REJECTED" and again.id != queued.id
    assert [(d["queued_id"], d["lock_name"]) for d in dropped] == [(queued.id, "sync:42")]
    assert any("dropped" in r.getMessage() and again.id in r.getMessage() for r in caplog.records)
    assert queued_messages(broker_url) == 1


def test_graceful_in_celery_once_returns_a_rejected_result_too(peer, broker_url):
    """The peer's column of the row: not ``None`` but a result in state ``REJECTED`` (without a
    task id, nothing logged)."""
    _, sync_account, _ = peer
    run = Run()
    queued = sync_account.delay(42, run.id)
    again = sync_account.delay(42, run.id)
    assert again is not None and again.state == "REJECTED"
    assert again.id is None and queued.id is not None
    assert queued_messages(broker_url) == 1


def test_graceful_for_one_call(worker, rl, broker_url):
    run = Run()
    _park(once_default_key, (3, run.id))
    again = _park(once_default_key, (3, run.id), lock_dedupe="drop")  # it raises otherwise
    assert again.state == "REJECTED"
    assert queued_messages(broker_url) == 1


def test_keys_is_a_lock_key_template(worker, rl, broker_url):
    run = Run()
    queued = _park(once_sync_account, (42, run.id))
    assert rl.locked("sync:42:queued")
    # only account_id makes the key: another value of full is a duplicate...
    assert _park(once_sync_account, (42, run.id), {"full": True}).state == "REJECTED"
    # ...another account is not
    other = _park(once_sync_account, (43, run.id))
    assert other.state == "PENDING" and other.id != queued.id
    assert queued_messages(broker_url) == 2


def test_no_fields_is_one_key_whatever_the_arguments(worker, rl, broker_url):
    """The guide's note under the table: ``once={"keys": []}`` is a key without fields."""
    run = Run()
    _park(once_sync_account, (1, run.id), lock_key="sync-all")
    assert _park(once_sync_account, (2, run.id), lock_key="sync-all").state == "REJECTED"


def test_no_keys_is_the_default_key(worker, rl, broker_url):
    run = Run()
    queued = _park(once_default_key, (4, run.id))
    assert rl.locked(f"{_default_key(4, run.id)}:queued")
    # the same call spelled three ways is one key (defaults included)...
    for args, kwargs in [((4, run.id), {"full": False}), ((), {"account_id": 4, "run": run.id})]:
        with pytest.raises(LockNotAcquired, match=queued.id):
            once_default_key.apply_async(args, kwargs, queue=UNREAD_QUEUE)
    # ...any other argument value is another key
    assert _park(once_default_key, (4, run.id), {"full": True}).id != queued.id
    assert _park(once_default_key, (5, run.id)).id != queued.id


def test_celery_once_leaves_defaults_out_of_its_key(peer, broker_url):
    """The peer's column of the row: its default key is the arguments as passed, so ``f(1)`` and
    ``f(1, full=False)`` are two keys there (one here); ``f(account_id=1)`` is ``f(1)``."""
    once, _, default_key = peer
    run = Run()
    default_key.delay(4, run.id)
    with pytest.raises(once.AlreadyQueued):
        default_key.delay(4, run.id)
    default_key.apply_async((4, run.id), {"full": False})  # sent: another key
    with pytest.raises(once.AlreadyQueued):  # arguments by name: the same key
        default_key.apply_async((), {"account_id": 4, "run": run.id})
    assert queued_messages(broker_url) == 2


def test_a_call_while_one_runs_is_queued_and_runs_after_it(worker, rl):
    run = Run()
    first = once_default_key.delay(6, run.id, gate="g")
    run.started_by(first.id)  # running: its marker was freed when it started
    # the same call (the same key: every argument is part of it), sent, not AlreadyQueued
    second = once_default_key.delay(6, run.id, gate="g")
    assert second.id != first.id
    with pytest.raises(LockNotAcquired, match=second.id):  # one queued at most
        once_default_key.delay(6, run.id, gate="g")
    run.open("g", 2)
    first.get(timeout=TIMEOUT)
    second.get(timeout=TIMEOUT)
    intervals = run.wait("intervals", 2)
    assert len({e["lock"] for e in intervals}) == 1
    assert_no_overlap(intervals)
    assert [e["task_id"] for e in sorted(intervals, key=lambda e: e["start"])] == [
        first.id,
        second.id,
    ]


def test_timeout_is_lock_dedupe_ttl(worker, rl, broker_url):
    run = Run()
    default = _park(once_sync_account, (47, run.id))
    # the default (3600 s) is capped by the Redlock's MAX_TTL, as the table says
    assert rl.lock_info("sync:47:queued").lease == rl.max_ttl == 60
    assert default.state == "PENDING"
    queued = _park(once_sync_account, (44, run.id), lock_dedupe_ttl=1)
    assert rl.locked("sync:44:queued")
    wait_until(lambda: not rl.locked("sync:44:queued"), what="the marker to expire")
    again = _park(once_sync_account, (44, run.id))
    assert again.state == "PENDING" and again.id != queued.id  # sent: no longer a duplicate


def test_a_failed_task_frees_its_key(worker, rl):
    run = Run()
    failing = once_sync_account.delay(45, run.id, fail=True)
    with pytest.raises(ValueError, match="failing on purpose"):
        failing.get(timeout=TIMEOUT)
    assert not rl.locked("sync:45") and not rl.locked("sync:45:queued")
    after = once_sync_account.delay(45, run.id)
    assert after.id != failing.id and after.get(timeout=TIMEOUT)["lock"] == "sync:45"


# A crashed worker is a fault scenario (a worker started and killed): the marked set.
@pytest.mark.faults
def test_a_killed_worker_frees_the_key(
    rl, redis_nodes, celery_broker_node, celery_test_app, tmp_path
):
    """A ``celery worker -P prefork`` killed with SIGKILL while the task runs: a new call is
    sent at once, the run's key frees when its 2 s lease ends (not after celery-once's hour),
    and the killed task is delivered again to the next worker and runs to its end."""
    run = Run()
    queue = f"once-{uuid.uuid4().hex[:8]}"
    env = worker_env(redis_nodes.urls, celery_broker_node.url, celery_broker_node.url, 4)
    workers = [WorkerProcess(tmp_path / "w0.log", env, queue)]
    try:
        workers[0].start()
        victim = once_default_key.apply_async((46, run.id), {"gate": "never"}, queue=queue)
        key = _default_key(46, run.id, gate="never")
        assert run.started_by(victim.id)["lock"] == key
        workers[0].signal(signal.SIGKILL)
        killed_at = time.time()
        workers[0].wait()
        run.r.set(f"{run.id}:stop", 1)  # the copy delivered again ends at once
        # Not "AlreadyQueued for an hour": the marker went when the task started.
        again = once_default_key.apply_async((46, run.id), {"gate": "never"}, queue=queue)
        assert again.id != victim.id
        wait_until(lambda: not rl.locked(key), timeout=30, what="the lease to end")
        workers.append(WorkerProcess(tmp_path / "w1.log", env, queue).start())
        assert victim.get(timeout=TIMEOUT)["task_id"] == victim.id
        assert again.get(timeout=TIMEOUT)["task_id"] == again.id
        runs = [e for e in run.all("intervals") if e["task_id"] == victim.id]
        assert runs and all(e["start"] > killed_at for e in runs)
        assert_no_overlap(run.all("intervals"))
    finally:
        for process in workers:
            process.stop()
