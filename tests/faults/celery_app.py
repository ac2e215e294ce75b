"""A Celery app for the worker-killed scenario: one LockedTask that records its hold.

Workers run it with ``celery -A tests.faults.celery_app worker`` (environment: ``FAULTS_BROKER``,
``FAULTS_NODES`` comma-separated lock node URLs, ``FAULTS_VISIBILITY`` seconds). No Django: the
task names its Redlock through ``lock_redlock``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from django_redlock import Redlock
from django_redlock.celery import LockedTask, install

from .history import HistoryWriter

app = Celery("faults_celery", broker=os.environ.get("FAULTS_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("FAULTS_VISIBILITY", "3")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)
install(app)

_redlock: Redlock | None = None


def redlock() -> Redlock:
    global _redlock
    if _redlock is None:
        nodes = [u for u in os.environ.get("FAULTS_NODES", "").split(",") if u]
        _redlock = Redlock(nodes, ttl=1.0, node_timeout=0.1, retry_delay=0.05)
    return _redlock


@app.task(
    name="faults.job",
    base=LockedTask,
    bind=True,
    lock_key="faults:{key}",
    lock_ttl=1.0,
    on_locked="wait",
    lock_wait=60,
    lock_redlock=redlock,
    acks_late=True,
    reject_on_worker_lost=True,
)
def job(self: Any, key: str, hold: float, history: str) -> None:
    """Holds ``faults:<key>`` for ``hold`` seconds (1 s lease renewed by the watchdog),
    recording the hold, its renewed validity every 50 ms, and the end."""
    lock = self.lock
    writer = HistoryWriter(
        os.path.join(history, f"celery-{os.getpid()}.jsonl"), f"worker{os.getppid()}/{os.getpid()}"
    )
    now = time.monotonic()
    token = lock.token
    writer.acquired(lock.name, token, lock.fence, now, now + lock.validity)
    writer.write(
        "task",
        token=token,
        task_id=self.request.id,
        ppid=os.getppid(),
        redelivered=bool((self.request.delivery_info or {}).get("redelivered")),
    )
    end = now + hold
    while time.monotonic() < end:
        time.sleep(0.05)
        validity = lock.validity
        if validity > 0:
            writer.extended(token, time.monotonic() + validity)
    lease = getattr(lock, "_lease", None)
    writer.releasing(token, time.monotonic(), getattr(lease, "valid_until", None))
    writer.close()
