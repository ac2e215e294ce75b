"""A client process for the backend tests: ``python -m tests.backends.contender SPEC_JSON``.

``mode: "contend"``: ``rounds`` times take the lock, read the protected counter file, pause,
write it back incremented, release; every hold goes to the history file (tests/faults/history).
``mode: "hold"``: take the lock, print ``acquired <fence>`` and sleep until killed.
The backend is built from ``backend`` (dotted path) and ``options``; with ``django`` set,
Django is set up first (DJANGO_SETTINGS_MODULE from the environment).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


def build(spec: dict[str, Any]) -> Any:
    if spec.get("django"):
        import django

        django.setup()
    module, _, cls = spec["backend"].rpartition(".")
    return getattr(importlib.import_module(module), cls)(**spec.get("options", {}))


def contend(locks: Any, spec: dict[str, Any]) -> None:
    from tests.faults.history import HistoryWriter

    history = HistoryWriter(spec["history"], f"p{os.getpid()}")
    counter = Path(spec["counter"])
    for _ in range(spec["rounds"]):
        lock = locks.lock(spec["name"], ttl=spec.get("ttl", 5.0), fencing=True)
        started = time.monotonic()
        assert lock.acquire(timeout=60), "no lock within 60 s"
        now = time.monotonic()
        history.acquired(lock.name, lock.token, lock.fence, now, now + lock.validity, started)
        value = int(counter.read_text() or 0)
        time.sleep(spec.get("pause", 0.002))  # widen the read-modify-write window
        counter.write_text(str(value + 1))
        token = lock.token
        history.releasing(token, time.monotonic(), time.monotonic() + lock.validity)
        try:
            lock.release()
            history.outcome(token, "ok")
        except Exception as exc:
            history.outcome(token, f"{type(exc).__name__}: {exc}")
    history.close()


def hold(locks: Any, spec: dict[str, Any]) -> None:
    lock = locks.lock(spec["name"], ttl=spec.get("ttl", 5.0), fencing=True)
    assert lock.acquire(timeout=30)
    print("acquired", lock.fence, flush=True)
    time.sleep(3600)


def end_with_parent() -> None:
    """A test ended by pytest-timeout's thread method (os._exit) or SIGKILL runs no cleanup,
    and a holder sleeps for an hour: a child whose parent is gone ends itself."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    end_with_parent()
    spec = json.loads(sys.argv[1])
    locks = build(spec)
    {"contend": contend, "hold": hold}[spec["mode"]](locks, spec)
    locks.close()


if __name__ == "__main__":
    main()
