"""LockedTask when a worker dies: a real ``celery worker`` process (prefork pool) started with
``celery -A testproject.celery_app worker``, killed with SIGKILL, SIGQUIT (cold shutdown) or
made to terminate a revoked task. The lock nodes and the broker are embedded redis-servers.

What must hold:

* SIGKILL of the whole worker mid-task frees the key within one lease (2 s here, renewed by the
  watchdog while the worker lived), and the ``acks_late`` message comes back after the broker's
  visibility timeout and runs once the key is free;
* a task revoked with ``terminate=True`` and a cold shutdown free the key at once (the worker's
  main process releases for the pool process it killed), not one lease later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from celery.contrib.testing.worker import start_worker

from testproject import tasks
from tests.celery_support import TIMEOUT, Run, assert_no_overlap, wait_until

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(240)]

REPO_ROOT = Path(__file__).resolve().parent.parent
LEASE = 2.0  # long_task's lock_ttl
QUEUE = "crash"


class WorkerProcess:
    """``celery -A testproject.celery_app worker`` in its own session (so SIGKILL reaches the
    pool processes too), logging to a file."""

    def __init__(self, log: Path, env: dict[str, str]) -> None:
        self.name = f"crash-{uuid.uuid4().hex[:6]}@%h"
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "testproject.celery_app",
                    "worker",
                    "-P",
                    "prefork",
                    "-c",
                    "2",
                    "-Q",
                    QUEUE,
                    "-n",
                    self.name,
                    "-l",
                    "INFO",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                ],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 90
        while b" ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"worker did not start:\n{self.text()}")
            time.sleep(0.05)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

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


@pytest.fixture
def rl(redlock_settings):
    from django_redlock import get_redlock

    return get_redlock()


@pytest.fixture
def spawn_worker(rl, redis_nodes, celery_test_app, celery_broker_node, tmp_path):
    """``spawn_worker() -> WorkerProcess`` (started and ready); all are killed at teardown."""
    made: list[WorkerProcess] = []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        ),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "REDLOCK_NODES": ",".join(redis_nodes.urls),
        "REDLOCK_CELERY_BROKER": celery_broker_node.url,
        "REDLOCK_CELERY_VISIBILITY": "4",
    }

    def spawn() -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"worker{len(made)}.log", env)
        made.append(worker)
        return worker.start()

    yield spawn
    for worker in made:
        worker.stop()


def test_sigkill_frees_the_key_within_one_lease_and_the_task_comes_back(
    rl, spawn_worker, celery_test_app
):
    first, second = Run(), Run()
    worker = spawn_worker()
    victim = tasks.long_task.apply_async(("k", first.id, 60), queue=QUEUE)
    assert first.started_by(victim.id)["lock"] == "long:k"
    # The watchdog keeps the 2 s lease alive while the task runs.
    wait_until(
        lambda: (
            (rl.lock_info("long:k") or None) is not None and rl.lock_info("long:k").renewals >= 2
        ),
        timeout=TIMEOUT,
        what="renewals",
    )
    holder = rl.lock_info("long:k").meta
    assert holder["task_id"] == victim.id and holder["pid"] != worker.proc.pid  # a pool process
    assert holder["worker"] == worker.name.replace("%h", socket.gethostname())

    worker.signal(signal.SIGKILL)
    killed_at = time.time()
    worker.wait()
    first.r.set(f"{first.id}:stop", 1)  # copies delivered again end at once

    with start_worker(
        celery_test_app,
        pool="threads",
        concurrency=2,
        queues=[QUEUE],
        perform_ping_check=False,
        shutdown_timeout=60,
        loglevel="WARNING",
    ):
        nxt = tasks.long_task.apply_async(
            ("k", second.id, 0.3), queue=QUEUE, on_locked="wait", lock_wait=30
        )
        entry = nxt.get(timeout=TIMEOUT)
        # Free within one lease of the kill (plus scheduling slack on a busy machine).
        assert entry["start"] - killed_at <= LEASE + 1.5, entry["start"] - killed_at
        # The unacknowledged message of the killed worker is delivered again after the
        # visibility timeout, and runs once the key is free.
        again = victim.get(timeout=TIMEOUT)
        assert again["task_id"] == victim.id
    # Every run that held long:k (the killed one never recorded its end) ran alone.
    runs = first.all("intervals") + second.all("intervals")
    assert {e["task_id"] for e in runs} == {victim.id, nxt.id}
    assert_no_overlap(runs)
    assert not rl.locked("long:k")


def test_revoke_terminate_frees_the_key_at_once(rl, spawn_worker):
    run = Run()
    spawn_worker()
    # A 20 s lease: seeing the key free within a few seconds proves someone released it.
    task = tasks.long_task.apply_async(("rv", run.id, 60), queue=QUEUE, lock_ttl=20)
    run.started_by(task.id)
    assert rl.locked("long:rv")
    revoked_at = time.monotonic()
    task.revoke(terminate=True, signal="SIGKILL")
    wait_until(lambda: not rl.locked("long:rv"), timeout=15, what="the key to be released")
    assert time.monotonic() - revoked_at < 10
    wait_until(lambda: task.state == "REVOKED", what="state REVOKED")


def test_cold_shutdown_frees_the_key_at_once(rl, spawn_worker):
    run = Run()
    worker = spawn_worker()
    task = tasks.long_task.apply_async(("cold", run.id, 60), queue=QUEUE, lock_ttl=20)
    run.started_by(task.id)
    assert rl.locked("long:cold")
    worker.signal(signal.SIGQUIT, group=False)  # cold shutdown: running tasks are abandoned
    stopped_at = time.monotonic()
    wait_until(lambda: not rl.locked("long:cold"), timeout=15, what="the key to be released")
    assert time.monotonic() - stopped_at < 10, worker.text()
    worker.wait()
