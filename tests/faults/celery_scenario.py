"""A Celery worker killed mid-task (``LockedTask``), with real prefork workers and a real
Redis broker.

Two workers (``-c 1`` each) consume tasks that all lock the same key with a 1 s lease renewed
while they run, ``on_locked="wait"``, ``acks_late`` + ``reject_on_worker_lost``. Two faults:

1. the pool process running a task is SIGKILLed: the worker's main process sees the
   WorkerLostError and releases that task's lock by token at once (the dead process cannot act
   any more, so its hold ends at the kill); the message goes back to the queue;
2. a whole worker (main process and pool) is SIGKILLed: nobody releases, the key must stay
   until the lease runs out (the hold ends at its last known validity, so a successor that got
   the lock earlier would show as an overlap); the unacknowledged message comes back after the
   visibility timeout.

Every task run records its hold with the shared monotonic clock; the checker looks for overlaps
and the result says how long the key stayed blocked after each kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django_redlock.testing import RedisNode, _reap_with_owner

from .harness import Harness, Profile, ScenarioResult
from .history import HistoryWriter, load_events

REPO = Path(__file__).resolve().parents[2]


def _start_worker(name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.faults.celery_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "1",
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # In a session of its own, so a signal to the test run's group misses it: the reaper
    # kills the worker and its pool if the test run ends without its cleanup.
    _reap_with_owner(proc.pid, group=True)
    return proc


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


def run_celery_scenario(p: Profile) -> ScenarioResult:
    tasks = 6 * p.scale
    hold = 0.6
    with Harness(3) as h, RedisNode() as broker:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "FAULTS_BROKER": broker.url,
            "FAULTS_NODES": ",".join(h.urls),
            "FAULTS_VISIBILITY": "3",
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        os.environ["FAULTS_BROKER"] = broker.url  # for this process's producer
        from .celery_app import app, job

        app.conf.broker_url = broker.url
        h.warm_up(node_timeout=0.1)
        workers = [_start_worker(f"w{i}", env) for i in range(2)]
        controller = HistoryWriter(h.dir / "controller.jsonl", "controller")
        killed_child_tokens: list[str] = []
        errors: list[str] = []
        try:
            h.begin()
            for _ in range(tasks):
                job.apply_async(args=["k", hold, str(h.dir)])

            def running(exclude: set[str]) -> dict[str, Any] | None:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    events = load_events(h.dir)
                    done = {e["token"] for e in events if e["ev"] == "rel"}
                    for e in events:
                        if (
                            e["ev"] == "task"
                            and e["token"] not in done
                            and e["token"] not in exclude
                        ):
                            return e
                    time.sleep(0.02)
                return None

            seen: set[str] = set()
            # 1. SIGKILL the pool process running a task.
            ev = running(seen)
            if ev is None:
                errors.append("no task started within 60 s")
            else:
                seen.add(ev["token"])
                time.sleep(0.2)
                os.kill(ev["pid"], signal.SIGKILL)
                controller.releasing(ev["token"], time.monotonic())  # dead: its hold ended
                controller.outcome(ev["token"], "killed")
                killed_child_tokens.append(ev["token"])
                h.faults += 1
                h.mark("pool process killed", subject=ev["proc"])
            # 2. SIGKILL a whole worker (main process + pool) mid-task.
            ev = running(seen)
            if ev is None:
                errors.append("no second task started")
            else:
                time.sleep(0.2)
                victim = next((w for w in workers if w.pid == ev["ppid"]), None)
                if victim is None:
                    errors.append(f"worker of pid {ev['pid']} not found")
                else:
                    _kill_group(victim)
                    h.faults += 1
                    h.mark("worker killed", subject=ev["proc"])
                    workers.append(_start_worker("w-replacement", env))
            # Every task id must complete once (redelivered ones included).
            deadline = time.monotonic() + 60 * p.scale
            completed: set[str] = set()
            while time.monotonic() < deadline:
                events = load_events(h.dir)
                ended = {
                    e["token"] for e in events if e["ev"] == "rel" and e["proc"] != "controller"
                }
                completed = {
                    e["task_id"] for e in events if e["ev"] == "task" and e["token"] in ended
                }
                if len(completed) >= tasks:
                    break
                time.sleep(0.1)
        finally:
            for w in workers:
                _kill_group(w)
            controller.close()
            with contextlib.suppress(Exception):
                app.close()
        events = load_events(h.dir)
        res = h.result(
            "celery_killed",
            "Celery worker killed mid-task (LockedTask)",
            tasks=tasks,
            tasks_completed=len(completed),
            redelivered_runs=sum(1 for e in events if e["ev"] == "task" and e["redelivered"]),
            errors=errors,
        )
        res.clients = 2
        return res
