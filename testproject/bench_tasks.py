"""Peer tasks for bench/bench_celery.py: the same 'hold the key for a while' task on
celery-once's ``QueueOnce`` and celery-singleton's ``Singleton`` (the benchmark's worker loads
this module with ``--include``; neither library is a dependency of the package)."""

from __future__ import annotations

import time

from celery_once import QueueOnce
from celery_singleton import Singleton

from .celery_app import app, broker_url

app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": app.conf.broker_url or broker_url(), "default_timeout": 600},
}


@app.task(name="testproject.bench_once", base=QueueOnce, once={"graceful": True})
def bench_once(key: str, hold: float = 0.0) -> None:
    """celery-once: a second call while one is queued or running is dropped at enqueue."""
    if hold:
        time.sleep(hold)


@app.task(name="testproject.bench_singleton", base=Singleton)
def bench_singleton(key: str, hold: float = 0.0) -> None:
    """celery-singleton: a second call while one is queued or running gets the first one's
    result (merged at enqueue)."""
    if hold:
        time.sleep(hold)
