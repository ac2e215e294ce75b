"""Example tasks on :class:`~django_redlock.celery.LockedTask` (the tests and the benchmark run
them against real workers).

The ``critical*`` tasks record what they did in Redis (database 2 of the broker server), so a
test in another process can check that two runs of one key never overlapped:

``<run>:started``    one JSON entry per run as it starts (after taking the lock)
``<run>:intervals``  one JSON entry per run as it ends: task id, lock name, start/end times
``<run>:gate:<g>``   a run with ``gate=g`` blocks until the test pushes to this list
``<run>:barrier``    runs with ``barrier=n`` wait for each other (proof of parallelism)
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis

from django_redlock import Redlock
from django_redlock.celery import LockedTask

from .celery_app import app

_local = threading.local()


def recorder() -> redis.Redis:
    """A client on the recorder database (one per thread and process)."""
    url = app.conf.redlock_recorder_url
    client = getattr(_local, "client", None)
    if client is None or getattr(_local, "url", None) != url or _local.pid != os.getpid():
        client = redis.Redis.from_url(url, socket_timeout=60)
        _local.client, _local.url, _local.pid = client, url, os.getpid()
    return client


def _critical(
    self: Any,
    key: str,
    run: str,
    hold: float = 0.0,
    gate: str | None = None,
    fail: bool = False,
    barrier: int | None = None,
) -> dict[str, Any]:
    r = recorder()
    lock = self.lock
    start = time.time()
    entry = {
        "task_id": self.request.id,
        "task": self.name,
        "key": key,
        "lock": lock.name if lock is not None else None,
        "start": start,
        "pid": os.getpid(),
        "retries": self.request.retries,
    }
    r.rpush(f"{run}:started", json.dumps(entry))
    met = None
    try:
        if barrier:
            if r.incr(f"{run}:barrier") == barrier:
                r.rpush(f"{run}:barrier:go", *["go"] * barrier)
            met = r.blpop([f"{run}:barrier:go"], timeout=20) is not None
        if gate:
            r.blpop([f"{run}:gate:{gate}"], timeout=30)
        if hold:
            time.sleep(hold)
        if fail:
            raise ValueError("failing on purpose")
    finally:
        entry.update(end=time.time(), held=lock.held if lock is not None else None, barrier_met=met)
        r.rpush(f"{run}:intervals", json.dumps(entry))
    return entry


_COMMON: dict[str, Any] = {
    "base": LockedTask,
    "bind": True,
    "lock_key": "demo:{key}",
    "lock_ttl": 5,
    # Short backoff so the tests stay quick; the default is 1 s.
    "lock_retry_delay": 0.1,
}

#: on_locked="retry" (the default): re-scheduled while the key is busy.
critical = app.task(name="testproject.critical", **_COMMON)(_critical)
#: on_locked="wait": blocks up to 20 s, woken by the holder's release.
critical_wait = app.task(
    name="testproject.critical_wait", on_locked="wait", lock_wait=20, **_COMMON
)(_critical)
#: on_locked="skip": ends SUCCESS with result None when the key is busy (logged, signalled).
critical_skip = app.task(name="testproject.critical_skip", on_locked="skip", **_COMMON)(_critical)
#: on_locked="raise": fails with LockNotAcquired when the key is busy.
critical_raise = app.task(name="testproject.critical_raise", on_locked="raise", **_COMMON)(
    _critical
)
#: Enqueue-time de-duplication: at most one queued plus one running per key.
critical_dedupe = app.task(name="testproject.critical_dedupe", lock_dedupe=True, **_COMMON)(
    _critical
)


@app.task(
    name="testproject.dedupe_retrying",
    lock_dedupe="raise",
    max_retries=2,
    default_retry_delay=0.1,
    **_COMMON,
)
def dedupe_retrying(self: Any, key: str, run: str, gate: str | None = None) -> dict[str, Any]:
    """Retries itself once (``self.retry()``) after its first run; de-duplicated with the
    strictest policy: its own retry is the same task going on, never a duplicate."""
    entry = _critical(self, key, run, gate=gate if self.request.retries == 0 else None)
    if self.request.retries == 0:
        raise self.retry()
    return entry


_explicit: dict[tuple[str, ...], Redlock] = {}


def explicit_redlock() -> Redlock:
    """A Redlock of its own (not ``get_redlock()``) over the ``REDLOCK`` nodes, for
    ``lock_redlock=``: a callable is called at each run, so it should cache."""
    from django.conf import settings

    nodes = tuple(settings.REDLOCK["NODES"])
    if nodes not in _explicit:
        _explicit[nodes] = Redlock(list(nodes), key_prefix="explicit", ttl=10)
    return _explicit[nodes]


#: on_locked="skip" with an explicit ``lock_redlock`` (no Django signal listener attached).
critical_explicit = app.task(
    name="testproject.critical_explicit", on_locked="skip", lock_redlock=explicit_redlock, **_COMMON
)(_critical)


@app.task(name="testproject.counted", max_retries=1, default_retry_delay=0.2, **_COMMON)
def counted(self: Any, key: str, run: str) -> int:
    """Retries itself once (its own max_retries is 1), however often the lock sent it back."""
    recorder().rpush(
        f"{run}:attempts",
        json.dumps(
            {"retries": self.request.retries, "lock_held": self.lock.held, "t": time.time()}
        ),
    )
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    return int(self.request.retries)


_LONG: dict[str, Any] = {
    "base": LockedTask,
    "bind": True,
    "lock_key": "long:{key}",
    "lock_ttl": 2,
    "lock_retry_delay": 0.2,
}


def _long(self: Any, key: str, run: str, seconds: float = 30.0) -> dict[str, Any]:
    """Holds ``long:<key>`` for ``seconds`` on a 2 s lease renewed by the watchdog (or until
    the key ``<run>:stop`` exists). LockedTask's defaults (``acks_late``,
    ``reject_on_worker_lost``): a worker killed mid-run leaves the message unacknowledged, and
    the broker hands it out again."""
    r = recorder()
    start = time.time()
    entry = {
        "task_id": self.request.id,
        "key": key,
        "lock": self.lock.name,
        "start": start,
        "pid": os.getpid(),
        "redelivered": bool((self.request.delivery_info or {}).get("redelivered")),
    }
    r.rpush(f"{run}:started", json.dumps(entry))
    deadline = start + seconds
    while time.time() < deadline and not r.exists(f"{run}:stop"):
        time.sleep(0.05)
    entry.update(end=time.time(), held=self.lock.held)
    r.rpush(f"{run}:intervals", json.dumps(entry))
    return entry


long_task = app.task(name="testproject.long_task", **_LONG)(_long)
#: The same task opted out of LockedTask's delivery defaults (what docs/celery.rst says an
#: opt-out gives up: a worker killed mid-run loses the task).
long_task_early_ack = app.task(
    name="testproject.long_task_early_ack",
    acks_late=False,
    reject_on_worker_lost=False,
    **_LONG,
)(_long)


@app.task(
    name="testproject.sync_account",
    base=LockedTask,
    bind=True,
    lock_key="sync:{account_id}",
    lock_ttl=60,
    on_locked="retry",
    lock_wait=30,
)
def sync_account(self: Any, account_id: int) -> str:
    """The example of the docs: one sync per account at a time; a second one waits up to
    30 s for the first to finish, then goes back to the queue."""
    return f"account {account_id} synced under lock {self.lock.name}"


# -- benchmark tasks (bench/bench_celery.py) -------------------------------------------------


@app.task(name="testproject.bench_plain")
def bench_plain(key: str, hold: float = 0.0) -> None:
    if hold:
        time.sleep(hold)


@app.task(
    name="testproject.bench_locked", base=LockedTask, bind=True, lock_key="bench:{key}", lock_ttl=10
)
def bench_locked(self: Any, key: str, hold: float = 0.0) -> None:
    if hold:
        time.sleep(hold)


#: lock_limit=2: a semaphore per key, up to two runs at once (the tests of lock_limit).
_LIMITED: dict[str, Any] = {**_COMMON, "lock_key": "limited:{key}", "lock_limit": 2}
limited = app.task(name="testproject.limited", **_LIMITED)(_critical)
limited_wait = app.task(
    name="testproject.limited_wait", on_locked="wait", lock_wait=20, **_LIMITED
)(_critical)
limited_skip = app.task(name="testproject.limited_skip", on_locked="skip", **_LIMITED)(_critical)
limited_raise = app.task(name="testproject.limited_raise", on_locked="raise", **_LIMITED)(_critical)
