"""Serving the example project after the tour: a Celery worker on an embedded broker, Celery
tasks of one key serialized while other keys run in parallel, an admin user, one stuck lock
for the admin page, and the web server left running until a stop signal."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ..testing import RedisNode
from .resources import Resources
from .tour import title
from .web import DemoError, WebServer, repository_root

__all__ = ["ADMIN_USER", "STUCK_LOCK", "serve"]

ADMIN_USER = "demo"
#: The lock a vanished process leaves behind, for the admin page to flag.
STUCK_LOCK = "nightly-report"
_STUCK_TTL = 3600.0
_WORKER_PROCESSES = 4
_KEYS, _TASKS_PER_KEY, _HOLD = ("account-1", "account-2"), 3, 0.8


def serve(site: WebServer, nodes: list[str], resources: Resources, workdir: Path) -> bool:
    """Everything after the tour, up to the printed URLs and login; the web server keeps
    serving until a stop signal. False when the Celery step did not behave as promised."""
    title("The example project: Django admin, Celery worker, embedded broker")
    broker = RedisNode(autostart=False)
    resources.start_node(broker)
    print(f"  Celery broker and result backend: an embedded redis-server at {broker.url}")
    print("  creating the SQLite database (migrate) ...")
    password = _admin_user()
    worker = _start_worker(broker.url, resources, workdir)
    ok = celery_serialization()
    _leave_stuck_lock(nodes, resources)

    from django.urls import reverse

    admin = site.url + reverse("admin:django_redlock_lock_changelist")
    title("Serving until Ctrl-C")
    if site.note:
        print(f"  ({site.note})")
    print(f"  the project:   {site.url}/orders/42/pay/  (a @locked view)")
    print(f"  admin locks:   {admin}")
    print(f"  node health:   {admin}nodes/")
    print(f"  login:         user {ADMIN_USER}  password {password}")
    print(f"  stuck lock:    {STUCK_LOCK} (its holder process is gone; release it on the page)")
    print(f"  Celery worker: pid {worker.pid}, log {workdir / 'worker.log'}")
    # Serving from here on (a stop now exits 0), before the line that says so is printed: a
    # signal sent on reading it must find the flag set.
    resources.serving = True
    print("Press Ctrl-C to stop: every node, process and temp folder of the demo is removed.")
    return ok


def _admin_user() -> str:
    from django.contrib.auth.models import User
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    password = secrets.token_urlsafe(9)
    User.objects.create_superuser(ADMIN_USER, "demo@example.com", password)
    return password


def _start_worker(broker: str, resources: Resources, workdir: Path) -> subprocess.Popen[bytes]:
    from testproject.celery_app import app, configure

    configure(app, broker)
    log = workdir / "worker.log"
    command = [
        sys.executable, "-m", "celery", "-A", "testproject.celery_app", "worker",
        "-P", "prefork", "-c", str(_WORKER_PROCESSES), "-n", f"demo-{uuid.uuid4().hex[:6]}@%h",
        "-l", "INFO", "--without-mingle", "--without-gossip", "--without-heartbeat",
    ]  # fmt: skip
    # Its pool's temp files go in the demo's folder too, which the teardown removes.
    tmp = workdir / "tmp"
    tmp.mkdir()
    env = {**os.environ, "REDLOCK_CELERY_BROKER": broker, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        proc = resources.session(
            command, cwd=str(repository_root()), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    print(f"  starting a Celery worker ({_WORKER_PROCESSES} prefork processes) ...")
    started = last = time.monotonic()
    while b" ready." not in log.read_bytes():
        now = time.monotonic()
        if proc.poll() is not None or now - started > 120:
            tail = log.read_text(errors="replace")[-3000:]
            raise DemoError(f"the Celery worker did not start:\n{tail}")
        if now - last >= 2:
            last = now
            print(f"  ... waiting for the worker ({now - started:.0f}s)")
        time.sleep(0.1)
    print(f"  worker ready after {time.monotonic() - started:.1f}s")
    return proc


def celery_serialization() -> bool:
    """Send LockedTask runs of two keys; show that one key's runs never overlap while the
    other key's run alongside them."""
    from testproject.tasks import critical_wait, recorder

    n = len(_KEYS) * _TASKS_PER_KEY
    title(f"Celery: {n} LockedTask runs, {_TASKS_PER_KEY} per key, lock_key='demo:{{key}}'")
    run = uuid.uuid4().hex
    labels: dict[str, str] = {}
    for number in range(1, _TASKS_PER_KEY + 1):
        for key in _KEYS:
            result = critical_wait.apply_async(kwargs={"key": key, "run": run, "hold": _HOLD})
            labels[result.id] = f"{key} #{number}"
    print(f"  sent; each run holds its key's lock for {_HOLD}s (on_locked='wait')")
    client = recorder()
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 120
    while len(records) < n:
        left = deadline - time.monotonic()
        item = client.blpop([f"{run}:intervals"], timeout=max(1, min(left, 5)))
        if item is None:
            if left <= 0:
                print(f"  only {len(records)} of {n} runs finished (bug!)")
                return False
            print(f"  ... {len(records)} of {n} runs finished")
            continue
        entry = json.loads(item[1])
        records.append(entry)
        print(f"  finished {labels.get(entry['task_id'], '?'):<13} in worker pid {entry['pid']}")
    return _timeline(records, labels)


def _timeline(records: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    origin = min(r["start"] for r in records)
    span = max(r["end"] for r in records) - origin
    width = 48
    print(f"  timeline (0 to {span:.1f}s):")
    for entry in sorted(records, key=lambda r: (r["key"], r["start"])):
        first = int((entry["start"] - origin) / span * width)
        last = max(first + 1, int((entry["end"] - origin) / span * width))
        bar = " " * first + "#" * (last - first)
        print(f"    {labels.get(entry['task_id'], '?'):<13} |{bar:<{width}}|")
    pairs = list(itertools.combinations(records, 2))
    serialized = not any(_overlaps(a, b) for a, b in pairs if a["key"] == b["key"])
    parallel = any(_overlaps(a, b) for a, b in pairs if a["key"] != b["key"])
    print(f"  same key: {'never overlapped' if serialized else 'OVERLAPPED (bug!)'}")
    print(f"  different keys: {'ran in parallel' if parallel else 'never overlapped'}")
    return serialized


def _overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["start"] < b["end"] and b["start"] < a["end"])


def _leave_stuck_lock(nodes: list[str], resources: Resources) -> None:
    """A process takes a long lock and vanishes without releasing it (a crashed job)."""
    code = (
        "import os, sys\n"
        "from django_redlock.core import Redlock\n"
        f"rl = Redlock(sys.argv[1].split(','), ttl={_STUCK_TTL}, max_ttl={_STUCK_TTL})\n"
        f"lock = rl.lock({STUCK_LOCK!r}, meta={{'job': 'nightly report', "
        "'note': 'left behind on purpose by the demo'})\n"
        "os._exit(0 if lock.acquire(timeout=10) else 1)\n"
    )
    title("A stuck lock for the admin page")
    holder = resources.session([sys.executable, "-c", code, ",".join(nodes)])
    if holder.wait(timeout=60) != 0:
        raise DemoError(f"could not take the lock {STUCK_LOCK!r} for the admin page")
    print(
        f"  a process took '{STUCK_LOCK}' for {_STUCK_TTL / 3600:.0f} h and exited "
        "without releasing it"
    )
