"""Helpers shared by the Celery tests (tests/test_celery*.py, tests/test_compat_celery_*.py):
the records the example tasks of ``testproject.tasks`` leave in Redis and waiting on them, a
real ``celery worker`` process (prefork pool) for what only a pool process shows (time limits,
SIGKILL), and the tasks these tests add to the example app.

Importing this module installs LockedTask's worker side in the example app
(``django_redlock.celery.install``), as a project does where it defines its app; worker
processes started by :class:`WorkerProcess` import it too (``celery worker -I``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from celery import signals as celery_signals

from django_redlock.celery import LockedTask, install
from django_redlock.testing import _reap_with_owner
from testproject import tasks
from testproject.tasks import _COMMON, _critical, recorder

TIMEOUT = 45  # seconds; generous, the machine is shared
REPO_ROOT = Path(__file__).resolve().parent.parent

install(tasks.app)


# --------------------------------------------------------------------------- records


class Run:
    """One test's records in the recorder database (see testproject.tasks)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.r = tasks.recorder()
        self.seen: dict[str, list[dict[str, Any]]] = {"started": [], "intervals": []}

    def wait(self, kind: str, n: int = 1, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """The first ``n`` records of ``kind`` ("started" / "intervals"), waiting for them."""
        cache = self.seen.setdefault(kind, [])
        deadline = time.monotonic() + timeout
        while len(cache) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"only {len(cache)} of {n} {kind} records: {cache}")
            item = self.r.blpop([f"{self.id}:{kind}"], timeout=min(left, 5))
            if item is not None:
                cache.append(json.loads(item[1]))
        return list(cache)

    def started_by(self, task_id: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The "started" record of one task, waiting for it."""
        n = 1
        while True:
            found = [e for e in self.wait("started", n, timeout) if e["task_id"] == task_id]
            if found:
                return found[0]
            n = len(self.seen["started"]) + 1

    def all(self, kind: str) -> list[dict[str, Any]]:
        """Every record of ``kind`` so far (no waiting)."""
        cache = self.seen.setdefault(kind, [])
        while (raw := self.r.lpop(f"{self.id}:{kind}")) is not None:
            cache.append(json.loads(raw))
        return list(cache)

    def open(self, gate: str, n: int = 1) -> None:
        self.r.rpush(f"{self.id}:gate:{gate}", *["go"] * n)


def assert_no_overlap(intervals: list[dict[str, Any]]) -> None:
    ordered = sorted(intervals, key=lambda e: e["start"])
    for before, after in itertools.pairwise(ordered):
        assert after["start"] >= before["end"], f"overlap: {before} and {after}"


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- a real worker


class WorkerProcess:
    """``celery -A testproject.celery_app worker -I tests.celery_support`` (prefork pool) in
    its own session (so SIGKILL of the group reaches the pool processes too), logging to a
    file."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        queue: str,
        concurrency: int = 2,
        include: str | None = "tests.celery_support",
    ) -> None:
        self.name = f"w-{uuid.uuid4().hex[:6]}@%h"
        self.log = log
        self.env = env
        self.queue = queue
        self.concurrency = concurrency
        #: Imported by the worker (``-I``); this module installs LockedTask's worker side.
        self.include = include
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", "testproject.celery_app", "worker"),
                    *(("-I", self.include) if self.include else ()),
                    *("-P", "prefork", "-c", str(self.concurrency), "-Q", self.queue),
                    *("-n", self.name, "-l", "INFO", "--without-mingle", "--without-gossip"),
                    "--without-heartbeat",
                ],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Its own session is out of reach of a signal to the test run's group (a CI timeout):
        # the nodes' reaper kills the worker and its pool if this process ends first.
        _reap_with_owner(self.proc.pid, group=True)
        deadline = time.monotonic() + 90
        while b" ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"worker did not start:\n{self.text()}")
            time.sleep(0.05)
        return self

    def text(self, tail: int | None = 8000) -> str:
        """The worker's log (its last ``tail`` characters; None: all of it)."""
        text = self.log.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def signal(self, signum: int, group: bool = True) -> None:
        """Send ``signum`` to the whole worker (main and pool processes) or the main only."""
        assert self.proc is not None
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self.proc is not None:
            # Orphaned pool processes (after a SIGKILL of the main process only) are in the
            # worker's session too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def worker_env(
    node_urls: list[str], broker_url: str, results_url: str, visibility: float
) -> dict[str, str]:
    """The environment of a :class:`WorkerProcess`: lock nodes, broker, results."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        ),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "REDLOCK_NODES": ",".join(node_urls),
        "REDLOCK_CELERY_BROKER": broker_url,
        "REDLOCK_CELERY_RESULTS": results_url,
        "REDLOCK_CELERY_VISIBILITY": str(visibility),
    }


# --------------------------------------------------------------------------- tasks of these tests
# Registered on the example app, in the test process and in every WorkerProcess.

#: on_locked="wait" with a soft time limit of 1 s (the body is what must fit in it).
soft_limited_wait = tasks.app.task(
    name="tests.soft_limited_wait", on_locked="wait", lock_wait=20, soft_time_limit=1.0, **_COMMON
)(_critical)
#: on_locked="retry" (the waiting slot) with a soft time limit of 1 s.
soft_limited_retry = tasks.app.task(
    name="tests.soft_limited_retry", soft_time_limit=1.0, **{**_COMMON, "lock_retry_delay": None}
)(_critical)
#: on_locked="wait" with a hard time limit of 1 s.
hard_limited_wait = tasks.app.task(
    name="tests.hard_limited_wait", on_locked="wait", lock_wait=20, time_limit=1.0, **_COMMON
)(_critical)


def _loop(self: Any, key: str, run: str, hold: float, stubborn: bool = False) -> str:
    """A plain loop that records each write (about every 2 ms, ``<run>:writes``), so a pool
    process still running after its lock was freed shows as a write after the next run's
    start. ``stubborn``: it goes on after the SystemExit that billiard's SIGTERM raises (as a
    body catching every exception does), until SIGKILL."""
    r, task_id, pid = recorder(), self.request.id, os.getpid()

    def write(kind: str) -> None:
        record = {"task_id": task_id, "pid": pid, "kind": kind, "t": time.time()}
        r.rpush(f"{run}:writes", json.dumps(record))

    write("start")
    end = time.time() + hold
    while time.time() < end:
        try:
            write("work")
            time.sleep(0.002)
        except SystemExit:
            if not stubborn:
                raise
    return key


#: The loop under a hard time limit of 1 s (its lease 30 s).
hard_limited_loop = tasks.app.task(
    name="tests.hard_limited_loop", time_limit=1.0, **{**_COMMON, "lock_ttl": 30}
)(_loop)
#: The loop with on_locked="wait" and no time limit (a loaded host may pause it for seconds).
loop_wait = tasks.app.task(name="tests.loop_wait", on_locked="wait", lock_wait=30, **_COMMON)(_loop)


@tasks.app.task(name="tests.collect")
def collect(results: list[Any]) -> list[Any]:
    """A chord's callback: what the header's tasks returned, in order."""
    return list(results)


def _hold_key(
    self: Any, key: str, run: str, gate: str | None = None, fail: bool = False, full: bool = False
) -> dict[str, Any]:
    """Records its run like ``_critical``; blocks on ``gate`` until the test opens it, or
    until ``<run>:stop`` exists (a worker process the test kills)."""
    r = recorder()
    entry = {
        "task_id": self.request.id,
        "lock": self.lock.name,
        "start": time.time(),
        "pid": os.getpid(),
        "full": full,
    }
    r.rpush(f"{run}:started", json.dumps(entry))
    try:
        if gate:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not r.exists(f"{run}:stop"):
                if r.blpop([f"{run}:gate:{gate}"], timeout=0.2) is not None:
                    break
        if fail:
            raise ValueError("failing on purpose")
    finally:
        entry.update(end=time.time(), held=self.lock.held)
        r.rpush(f"{run}:intervals", json.dumps(entry))
    return entry


_TRANSLATED: dict[str, Any] = {
    "base": LockedTask,
    "bind": True,
    "lock_ttl": 2,
    "lock_retry_delay": 0.1,
}


#: celery-once's ``once={"keys": ["account_id"], "graceful": True}`` as docs/migrating.rst
#: translates it.
@tasks.app.task(
    name="tests.compat.once_sync_account",
    lock_key="sync:{account_id}",
    lock_dedupe="drop",
    **_TRANSLATED,
)
def once_sync_account(
    self: Any,
    account_id: int,
    run: str,
    gate: str | None = None,
    fail: bool = False,
    full: bool = False,
) -> dict[str, Any]:
    return _hold_key(self, str(account_id), run, gate, fail, full)


#: celery-once with no ``keys`` (the key is the task name and every argument) and its
#: default, ``AlreadyQueued``.
@tasks.app.task(name="tests.compat.once_default_key", lock_dedupe="raise", **_TRANSLATED)
def once_default_key(
    self: Any, account_id: int, run: str, gate: str | None = None, full: bool = False
) -> dict[str, Any]:
    return _hold_key(self, str(account_id), run, gate, False, full)


#: celery-singleton's ``unique_on=["report_id"]`` as docs/migrating.rst translates it.
@tasks.app.task(
    name="tests.compat.singleton_build_report",
    lock_key="report:{report_id}",
    lock_dedupe=True,
    **_TRANSLATED,
)
def singleton_build_report(
    self: Any,
    report_id: int,
    run: str,
    gate: str | None = None,
    fail: bool = False,
    fmt: str = "pdf",
) -> dict[str, Any]:
    return _hold_key(self, str(report_id), run, gate, fail)


def _record_prerun(
    sender: Any = None, task_id: str | None = None, args: Any = (), **kw: Any
) -> None:
    """When a ``_critical`` task of these tests starts in its pool process, before it takes
    its lock (``<run>:prerun``): the time its limits start counting."""
    name = getattr(sender, "name", "") or ""
    if name.startswith(("tests.", "testproject.critical")) and len(args or ()) >= 2:
        entry = {"task_id": task_id, "t": time.time(), "pid": os.getpid()}
        recorder().rpush(f"{args[1]}:prerun", json.dumps(entry))


celery_signals.task_prerun.connect(_record_prerun, weak=False, dispatch_uid="tests.prerun")

#: Lock keys whose ``lock_contended`` receiver stalls the refused task (:func:`_stall`).
STALLED_PREFIX = "demo:stalled-"


def _stall(sender: Any = None, name: str = "", **kw: Any) -> None:
    """A ``lock_contended`` receiver: a task refused a key ``demo:stalled-<run>`` (in a pool
    process, as it begins to wait) records ``<run>:stalled`` and sleeps until a signal's
    exception ends the sleep. A revoke's stop then lands inside code that catches
    ``Exception`` (Django's ``send_robust``), as it may land in any such code, with no
    timing involved."""
    run = name.removeprefix(STALLED_PREFIX)
    if run == name or ":" in run:
        return
    recorder().rpush(f"{run}:stalled", json.dumps({"pid": os.getpid(), "t": time.time()}))
    time.sleep(TIMEOUT)  # only a signal ends it early: the test fails otherwise


def _connect_stall() -> None:
    from django_redlock.signals import lock_contended

    lock_contended.connect(_stall, weak=False, dispatch_uid="tests.stall")


_connect_stall()


# --------------------------------------------------------------------------- parked messages

#: A queue no worker of the tests consumes: a task sent there stays queued.
UNREAD_QUEUE = "redlock-test-unread"


def queued_messages(broker_url: str, queue: str = UNREAD_QUEUE) -> int:
    """How many messages wait in ``queue`` on the Redis broker."""
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def drop_queue(broker_url: str, queue: str = UNREAD_QUEUE) -> None:
    """Delete ``queue`` (and its binding) from the Redis broker."""
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        client.delete(queue, f"_kombu.binding.{queue}")
    finally:
        client.close()
