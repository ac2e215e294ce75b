"""Recording every hold, and the offline pass that looks for overlapping valid holds.

Every client process appends one JSON line per event to a file of its own (``O_APPEND``, one
``write(2)`` per line), so a record written before a SIGKILL survives it. Times are
``time.monotonic()``: CLOCK_MONOTONIC is one clock for the whole machine on Linux, so holds of
different processes compare directly.

A *hold* is ``(process, name, token, fence, acquired_at, validity_end, released_at)``:

* ``acquired_at``: when ``acquire()`` returned True (the critical section starts);
* ``validity_end``: ``acquired_at + lock.validity`` read at that moment (for auto-renewed locks,
  the latest validity end the holder saw, recorded again just before release);
* ``released_at``: when the holder *called* ``release()`` (its critical section ends there; the
  nodes delete the key after that, so a successor's acquire can return before ``release()``
  does without any overlap). A hold never released (holder killed, or still frozen) ends at
  ``validity_end``.

The *valid* part of a hold is ``[acquired_at, min(released_at, validity_end)]``: after its
validity ran out, a holder that still acts is a stale writer (the fence must stop it), not an
overlap. Two valid parts of the same lock name that intersect are an overlap: a safety bug.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HistoryWriter", "Hold", "Overlap", "find_overlaps", "load_events", "load_holds"]


class HistoryWriter:
    """Appends events of one process to ``path`` (crash-safe: one write(2) per event)."""

    def __init__(self, path: str | os.PathLike[str], process: str) -> None:
        self.process = process
        self._fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "proc": self.process, "pid": os.getpid(), **fields})
        with self._lock:
            os.write(self._fd, line.encode() + b"\n")

    def acquired(
        self,
        name: str,
        token: str,
        fence: int | None,
        at: float,
        until: float,
        started: float | None = None,
    ) -> None:
        """``started``: when the ``acquire()`` call began (diagnostics)."""
        self.write("acq", name=name, token=token, fence=fence, t=at, vend=until, t0=started)

    def releasing(self, token: str, at: float, until: float | None = None) -> None:
        """Written just before ``release()`` is called. ``until``: the validity end the
        holder knows now (renewed locks extend it); what ``release()`` did follows in an
        ``outcome`` record."""
        self.write("rel", token=token, t=at, vend=until)

    def extended(self, token: str, until: float) -> None:
        """The holder saw its lease valid until ``until`` (renewed); moves validity_end."""
        self.write("ext", token=token, vend=until)

    def outcome(self, token: str, outcome: str) -> None:
        self.write("out", token=token, outcome=outcome)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Hold:
    process: str
    name: str
    token: str
    fence: int | None
    acquired_at: float
    validity_end: float
    released_at: float | None = None
    outcome: str | None = None  #: "ok", "not-owned", "lost", or None (never released)
    pid: int | None = None
    started_at: float | None = None  #: when the acquire() call began

    @property
    def valid_end(self) -> float:
        """End of the valid part of the hold."""
        if self.released_at is None:
            return self.validity_end
        return min(self.released_at, self.validity_end)


@dataclass
class Overlap:
    name: str
    first: Hold
    second: Hold
    seconds: float = field(default=0.0)

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.first.process} [{self.first.acquired_at:.3f}, "
            f"{self.first.valid_end:.3f}] fence {self.first.fence} and {self.second.process} "
            f"[{self.second.acquired_at:.3f}, {self.second.valid_end:.3f}] fence "
            f"{self.second.fence} overlap by {self.seconds * 1000:.1f} ms"
        )


def load_events(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of every process in ``directory`` (``*.jsonl``), in file order per process.

    A torn last line (a process killed mid-write cannot produce one with a single write(2),
    but be lenient) is skipped.
    """
    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def load_holds(events: Iterable[dict[str, Any]]) -> list[Hold]:
    holds: dict[str, Hold] = {}
    for ev in events:
        kind = ev.get("ev")
        if kind == "acq":
            holds[ev["token"]] = Hold(
                process=ev["proc"],
                name=ev["name"],
                token=ev["token"],
                fence=ev.get("fence"),
                acquired_at=ev["t"],
                validity_end=ev["vend"],
                pid=ev.get("pid"),
                started_at=ev.get("t0"),
            )
        elif kind == "rel" and ev["token"] in holds:
            hold = holds[ev["token"]]
            hold.released_at = ev["t"]
            if ev.get("vend") is not None:
                hold.validity_end = max(hold.validity_end, ev["vend"])
        elif kind == "ext" and ev["token"] in holds:
            hold = holds[ev["token"]]
            hold.validity_end = max(hold.validity_end, ev["vend"])
        elif kind == "out" and ev["token"] in holds:
            holds[ev["token"]].outcome = ev["outcome"]
    return sorted(holds.values(), key=lambda h: h.acquired_at)


def find_overlaps(holds: Iterable[Hold]) -> list[Overlap]:
    """Every pair of holds of the same name whose valid parts intersect.

    Sorted by start, each hold is compared with the holds still open when it starts (a sweep,
    so a long hold overlapping several short ones reports each pair).
    """
    by_name: dict[str, list[Hold]] = {}
    for hold in holds:
        by_name.setdefault(hold.name, []).append(hold)
    found: list[Overlap] = []
    for name, group in by_name.items():
        group.sort(key=lambda h: h.acquired_at)
        open_holds: list[Hold] = []
        for hold in group:
            open_holds = [h for h in open_holds if h.valid_end > hold.acquired_at]
            for other in open_holds:
                seconds = min(other.valid_end, hold.valid_end) - hold.acquired_at
                if seconds > 0:
                    found.append(Overlap(name, other, hold, seconds))
            if hold.valid_end > hold.acquired_at:
                open_holds.append(hold)
    return found
