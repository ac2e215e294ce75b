"""Helpers shared by tests/test_celery.py and tests/test_celery_crash.py: the records the
example tasks of ``testproject.tasks`` leave in Redis, and waiting on them."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from testproject import tasks

TIMEOUT = 45  # seconds; generous, the machine is shared


# --------------------------------------------------------------------------- helpers


class Run:
    """One test's records in the recorder database (see testproject.tasks)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.r = tasks.recorder()
        self.seen: dict[str, list[dict[str, Any]]] = {"started": [], "intervals": []}

    def wait(self, kind: str, n: int = 1, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """The first ``n`` records of ``kind`` ("started" / "intervals"), waiting for them."""
        cache = self.seen[kind]
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
        while (raw := self.r.lpop(f"{self.id}:{kind}")) is not None:
            self.seen[kind].append(json.loads(raw))
        return list(self.seen[kind])

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
