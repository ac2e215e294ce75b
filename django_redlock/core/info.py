"""Read-only views of what the nodes hold, for the admin page, the CLI and monitoring."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["LockInfo", "NodeHealth", "NodeLockState"]


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


@dataclass(frozen=True)
class LockInfo:
    """A live lock as the nodes report it.

    ``nodes`` counts the nodes holding the most common token; a lock with fewer than a quorum of
    them (``split``) is not a valid lock, only leftovers that will expire.
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

    @property
    def key(self) -> str:
        """The lock's name (what ``rl.lock(key)`` was called with)."""
        return self.name

    @property
    def owner(self) -> dict[str, Any]:
        """The holder's metadata: host, pid, thread, acquired_at and what the caller added."""
        return self.meta

    @property
    def split(self) -> bool:
        """Held by fewer than a quorum with one token, or by several tokens at once."""
        return self.nodes < self.quorum or len({s.token for s in self.per_node}) > 1

    @property
    def age(self) -> float | None:
        if self.acquired_at is None:
            return None
        return max((datetime.now(self.acquired_at.tzinfo) - self.acquired_at).total_seconds(), 0)


@dataclass(frozen=True)
class NodeHealth:
    """What one node looks like from this process."""

    node: str
    reachable: bool
    latency: float | None = None  #: seconds for a PING round trip
    version: str | None = None
    uptime: float | None = None  #: seconds
    run_id: str | None = None
    used_memory: int | None = None
    lock_keys: int | None = None
    clock_offset: float | None = None  #: node clock minus local clock, seconds (RTT-corrected)
    guarded_for: float | None = None  #: seconds before the restart guard lets it vote
    #: True while the node's guard comes from a missing marker (never used, or restarted
    #: empty); a brand-new cluster is trusted at once when every node is fresh.
    fresh: bool | None = None
    error: str | None = None
