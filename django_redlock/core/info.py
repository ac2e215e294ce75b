"""Read-only views of what the nodes hold, for the admin page, the CLI and monitoring."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .kinds import permit_of, reader_entry_of

__all__ = [
    "HOLDER_PLACE",
    "NODE_STATUSES",
    "PID_SPACE",
    "STALE_RENEWAL_FRACTION",
    "STUCK_REASONS",
    "LockInfo",
    "NodeHealth",
    "NodeLockState",
    "process_gone",
]

#: A lock that has been renewed at least once is "not renewing" when its last renewal is
#: longer ago than this fraction of its lease. The watchdog renews every third of the lease,
#: so 2/3 means two renewals in a row did not happen.
STALE_RENEWAL_FRACTION = 2 / 3

#: Why a lock can be flagged as stuck, in display order: (code, short label, explanation).
#: The one judgement the admin page and ``manage.py redlock list`` both show.
STUCK_REASONS: tuple[tuple[str, str, str], ...] = (
    ("old", "held too long", "held for longer than STUCK_AFTER"),
    ("split", "split", "fewer than a quorum of nodes hold one token, or tokens differ"),
    ("stale", "not renewing", "renewed before, but the last renewal is overdue"),
    ("dead", "holder gone", "the holder process on this host no longer exists"),
)

#: What a node does in the next acquire (:attr:`NodeHealth.status`): ``voting``; ``guarded``
#: (in its restart guard, not counted); ``down`` (unreachable).
NODE_STATUSES = ("voting", "guarded", "down")

_HOST = socket.gethostname()


def _pid_space() -> str | None:
    """This boot's id and this pid namespace (Linux): containers sharing the host's name
    (host networking) have pid namespaces of their own, where another one's pid means
    nothing."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot_id}/{namespace}"


#: Holder metadata key: the boot and pid namespace the holder's ``pid`` belongs to.
PID_SPACE = "pid_space"
_SPACE = _pid_space()
#: What every holder records about where its ``pid`` lives (empty where it cannot be known).
HOLDER_PLACE: dict[str, str] = {} if _SPACE is None else {PID_SPACE: _SPACE}


#: The largest pid a ``pid_t`` holds (32-bit signed): a larger one cannot name a process, and
#: would not even fit the ``kill`` system call.
_PID_MAX = 2**31 - 1


def process_gone(
    meta: Mapping[str, Any], cache: dict[int, bool] | None = None, *, certain: bool = False
) -> bool:
    """True when the holder described by ``meta`` ran on this host and its process no longer
    exists. A holder on another host, or one whose pid exists (possibly reused), counts as
    alive. With ``certain`` (before freeing a lock rather than flagging it) the holder must
    also have recorded this process's boot and pid namespace (:data:`PID_SPACE`). ``cache``
    keeps lookups across the locks of one listing."""
    pid = meta.get("pid")
    if (
        meta.get("host") != _HOST
        or isinstance(pid, bool)
        or not isinstance(pid, int)
        or not 0 < pid <= _PID_MAX  # meta is the caller's: a pid no process has is unjudged
    ):
        return False
    if certain and (_SPACE is None or meta.get(PID_SPACE) != _SPACE):
        return False
    if cache is not None and pid in cache:
        return cache[pid]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        gone = True
    except OSError:  # EPERM: it exists, owned by another user
        gone = False
    else:
        gone = False
    if cache is not None:
        cache[pid] = gone
    return gone


@dataclass(frozen=True, slots=True)
class NodeLockState:
    """One node's copy of a lock."""

    node: str
    token: str
    ttl: float  #: seconds left on this node
    renewals: int
    fence: int | None
    acquired_at: datetime | None
    lease: float | None = None  #: the lease length last armed (acquire or renewal), seconds
    #: A Sentinel group's master that answered (``host:port``); None for a server's URL.
    master: str | None = None


@dataclass(frozen=True)
class LockInfo:
    """A live lock as the nodes report it.

    ``nodes`` counts the nodes holding the most common token; a lock with fewer than a quorum of
    them (``split``) is not a valid lock, only leftovers that will expire. ``guarded`` names the
    nodes without a copy that sit out their restart guard: they may have lost theirs, so they
    count toward neither side (a lock they could make up the quorum of is not ``split``).
    """

    name: str
    token: str
    meta: dict[str, Any]
    acquired_at: datetime | None
    ttl: float  #: seconds until the lease ends on enough nodes that the lock is free
    nodes: int
    total_nodes: int
    quorum: int
    fence: int | None
    renewals: int
    per_node: tuple[NodeLockState, ...] = field(default=())
    #: The lease length last armed (acquire or renewal), seconds: a lock renewed every lease/3
    #: never shows less than two thirds of it left.
    lease: float | None = None
    #: The nodes without a copy that sit out their restart guard (they may have lost it).
    guarded: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The lock's name (what ``rl.lock(key)`` was called with)."""
        return self.name

    @property
    def semaphore(self) -> str | None:
        """The semaphore this lock is a permit of (``"export:7"`` for
        ``"export:7#permit:2"``), else None."""
        permit = permit_of(self.name)
        return None if permit is None else permit[0]

    @property
    def reader_of(self) -> str | None:
        """The read/write lock this entry is a reader of (``"doc:9"`` for
        ``"doc:9#read:<token>"``), else None."""
        entry = reader_entry_of(self.name)
        return None if entry is None else entry[0]

    @property
    def permit(self) -> int | None:
        """Which permit of :attr:`semaphore` this is (0 .. limit-1), else None."""
        permit = permit_of(self.name)
        return None if permit is None else permit[1]

    @property
    def owner(self) -> dict[str, Any]:
        """The holder's metadata: host, pid, thread, acquired_at and what the caller added."""
        return self.meta

    @property
    def split(self) -> bool:
        """Held by fewer than a quorum with one token (a node that sits out its restart guard
        without a copy may have lost one: see :attr:`guarded`), or by several tokens at once."""
        tokens = {s.token for s in self.per_node}
        return self.nodes + len(self.guarded) < self.quorum or len(tokens) > 1

    @property
    def age(self) -> float | None:
        if self.acquired_at is None:
            return None
        return max((datetime.now(self.acquired_at.tzinfo) - self.acquired_at).total_seconds(), 0)

    def stuck_reasons(
        self,
        stuck_after: float | None,
        *,
        now: float | None = None,
        pid_cache: dict[int, bool] | None = None,
    ) -> tuple[str, ...]:
        """The codes of :data:`STUCK_REASONS` that apply (empty: not stuck). ``now`` is a
        ``time.time()`` reading to judge ages against (one per listing); ``pid_cache`` keeps
        process lookups across the locks of one listing."""
        reasons = []
        if stuck_after is not None and self.acquired_at is not None:
            when = datetime.now(timezone.utc).timestamp() if now is None else now
            if when - self.acquired_at.timestamp() > stuck_after:
                reasons.append("old")
        if self.split:
            reasons.append("split")
        lease = self.lease
        overdue = lease is not None and lease - self.ttl > STALE_RENEWAL_FRACTION * lease
        if self.renewals > 0 and overdue:
            reasons.append("stale")
        if process_gone(self.meta, pid_cache):
            reasons.append("dead")
        return tuple(reasons)


@dataclass(frozen=True)
class NodeHealth:
    """What one node looks like from this process."""

    node: str
    reachable: bool
    latency: float | None = None  #: seconds for a PING round trip
    #: The server's own version: ``valkey_version`` for Valkey (whose ``redis_version`` is the
    #: Redis release it is compatible with, not its own), else ``redis_version``.
    version: str | None = None
    uptime: float | None = None  #: seconds
    run_id: str | None = None
    used_memory: int | None = None
    lock_keys: int | None = None
    clock_offset: float | None = None  #: node clock minus local clock, seconds (RTT-corrected)
    guarded_for: float | None = None  #: seconds before the restart guard lets it vote
    #: True while the node's guard comes from a missing marker (never used, or restarted
    #: empty); a brand-new cluster is trusted at once when every node is fresh (its nodes
    #: then show ``guarded_for`` 0: they vote at the first lock).
    fresh: bool | None = None
    #: False while the guard has not started: the node's marker is missing or from an earlier
    #: run of the server, and the next lock operation that reaches the node arms it, which
    #: starts the ``guarded_for`` countdown (until then it shows the whole ``max_ttl``).
    armed: bool | None = None
    error: str | None = None
    #: The server software: INFO's ``server_name`` (``"valkey"``), else ``"redis"``.
    server: str | None = None
    #: One of :data:`NODE_STATUSES`, judged with the whole cluster in view (``health()``);
    #: left out, a reachable node with no guard votes (a one-node service such as a backend).
    status: str = ""
    #: A Sentinel group's current master (``host:port``, as the Sentinels last named it);
    #: None for a node given as a server's URL.
    master: str | None = None

    def __post_init__(self) -> None:
        if not self.status:
            guarded = self.guarded_for is not None and self.guarded_for > 0
            status = "down" if not self.reachable else "guarded" if guarded else "voting"
            object.__setattr__(self, "status", status)

    @property
    def voting(self) -> bool:
        return self.status == "voting"

    @property
    def software(self) -> str | None:
        """Server name and version as an operator knows them: ``"valkey-server 8.1.8"``,
        ``"redis-server 7.2.4"``, ``"postgresql 15.19"``, ``"etcd 3.4.23"`` (None when the
        node did not say)."""
        if self.version is None:
            return None
        if self.server in (None, "redis", "valkey"):
            return f"{self.server or 'redis'}-server {self.version}"
        return f"{self.server} {self.version}"  # another backend's service: "sqlite 3.40.1"
