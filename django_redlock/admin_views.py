"""What the admin pages show about live locks: rows, the "stuck" rules, sorting, formatting and
the admin log of force releases. Kept apart from ``admin.py`` so the rules can be tested and
documented (docs/admin.rst, "What stuck means") without the views around them, and so
``manage.py redlock list`` flags locks with the same code (this module needs no admin app:
the admin log models are imported only to write an entry)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from .core import STALE_RENEWAL_FRACTION, STUCK_REASONS, LockInfo, NodeHealth, glob_escape

__all__ = [
    "STALE_RENEWAL_FRACTION",
    "STUCK_REASONS",
    "LockRow",
    "ServiceKind",
    "build_rows",
    "format_duration",
    "guard_display",
    "health_columns",
    "holder_summary",
    "log_force_release",
    "search_pattern",
    "service_kind",
    "sort_rows",
]

REASON_LABELS = {code: label for code, label, _ in STUCK_REASONS}

#: Sort orders offered on the list page: ``?o=<name>`` ascending, ``?o=-<name>`` descending.
SORT_FIELDS = ("key", "age", "ttl", "nodes", "renewals", "fence")
DEFAULT_SORT = "-age"


class LockRow:
    """One live lock with everything the list and detail pages show about it.

    Built for every live lock on each list request (10,000 of them must take milliseconds), so
    the values sorting and filtering need are computed once, against one clock reading.
    """

    __slots__ = ("age", "info", "lease", "reasons", "split")

    def __init__(
        self,
        info: LockInfo,
        lease: float | None,
        reasons: tuple[str, ...] = (),
        *,
        now: float | None = None,
    ) -> None:
        self.info = info
        #: Length of the current lease in seconds (what the last acquire/renewal set), if read.
        self.lease = lease
        self.reasons = reasons
        acquired = info.acquired_at
        if acquired is None:
            self.age = 0.0
        else:
            now = time.time() if now is None else now
            self.age = max(now - acquired.timestamp(), 0.0)
        self.split = info.split

    # -- shortcuts for the templates --------------------------------------------------------

    @property
    def since_renewal(self) -> float | None:
        """Seconds since the lease was last set (acquire or renewal) on a quorum."""
        if self.lease is None:
            return None
        return max(self.lease - self.info.ttl, 0.0)

    @property
    def stuck(self) -> bool:
        return bool(self.reasons)

    @property
    def degraded(self) -> bool:
        """Held with one token by fewer than all nodes (still a valid lock with a quorum)."""
        return self.info.nodes < self.info.total_nodes

    @property
    def reason_labels(self) -> list[str]:
        return [REASON_LABELS[r] for r in self.reasons]

    @property
    def holder(self) -> dict[str, Any]:
        return holder_summary(self.info.meta)

    @property
    def leftover_ttl(self) -> float:
        """Seconds until the last node's copy expires (for locks without a quorum, whose
        ``ttl`` is 0: they are free already, only leftovers remain)."""
        return max((s.ttl for s in self.info.per_node), default=0.0)

    @property
    def all_meta(self) -> list[tuple[str, Any]]:
        """Every holder metadata key and value, sorted, for the detail page."""
        return sorted(self.info.meta.items())


def holder_summary(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The holder's identity from lock metadata: host, pid, thread or task id, task or view, user.

    The core writes ``host``, ``pid``, ``thread`` and ``acquired_at``; ``@locked`` adds
    ``view``, ``method``, ``path`` and ``user`` (or ``function`` outside views), the Celery
    task base ``task``, ``task_id`` and ``worker``. The detail page shows every key, including
    those passed in ``meta=``.
    """

    def pick(*keys: str) -> Any:
        for key in keys:
            value = meta.get(key)
            if value not in (None, ""):
                return value
        return None

    return {
        "host": pick("host", "hostname"),
        "pid": pick("pid"),
        "thread": pick("thread"),
        "task_id": pick("task_id"),
        "task": pick("task", "task_name"),
        "worker": pick("worker"),
        "view": pick("view"),
        "request": " ".join(str(v) for v in (meta.get("method"), meta.get("path")) if v),
        "function": pick("function", "code"),
        "user": pick("user", "username", "user_id"),
    }


def guard_display(health: NodeHealth) -> str:
    """A node's restart guard as the node health page shows it (the core's judgement,
    :attr:`NodeHealth.status`, as ``manage.py redlock check`` shows it)."""
    if health.status == "guarded":
        wait = format_duration(health.guarded_for or 0)
        # Not armed yet: the countdown starts when the next lock operation reaches the node.
        return (
            f"guarded, votes {wait} after the next lock"
            if health.armed is False
            else (f"guarded, votes in {wait}")
        )
    return "off" if health.guarded_for is None else "can vote"


def format_duration(seconds: float | None) -> str:
    """``"850 ms"``, ``"4.2 s"``, ``"42 s"``, ``"3 min 12 s"``, ``"2 h 5 min"``, ``"3 d 4 h"``
    (under a second in milliseconds: never ``"0.0 s"``).

    The countdown script in ``static/django_redlock/admin-locks.js`` formats the same way.
    """
    if seconds is None:
        return ""
    seconds = max(float(seconds), 0.0)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{whole // 86400} d {whole % 86400 // 3600} h"


def search_pattern(query: str) -> str:
    """The SCAN MATCH pattern for the search box: a glob when it has ``*``, ``?`` or ``[``,
    otherwise a substring match on the key."""
    query = query.strip()
    if not query:
        return "*"
    if any(c in query for c in "*?["):
        return query
    return f"*{glob_escape(query)}*"


def build_rows(infos: Iterable[LockInfo], stuck_after: float | None) -> list[LockRow]:
    """Rows for every lock in ``infos``, with their stuck reasons (the core's judgement,
    :meth:`LockInfo.stuck_reasons`, shared with ``manage.py redlock``)."""
    pid_cache: dict[int, bool] = {}
    now = time.time()
    rows = []
    for info in infos:
        reasons = info.stuck_reasons(stuck_after, now=now, pid_cache=pid_cache)
        rows.append(LockRow(info, info.lease, reasons, now=now))
    return rows


def sort_rows(rows: list[LockRow], order: str) -> tuple[list[LockRow], str]:
    """``rows`` sorted by ``order`` (``"age"``, ``"-ttl"``, ...); unknown orders fall back to
    :data:`DEFAULT_SORT`. Returns the rows and the order used."""
    name = order.lstrip("-")
    if name not in SORT_FIELDS:
        order, name = DEFAULT_SORT, DEFAULT_SORT.lstrip("-")
    reverse = order.startswith("-")
    keys: dict[str, Any] = {
        "key": lambda r: r.info.name,
        "age": lambda r: r.age,
        "ttl": lambda r: r.info.ttl,
        "nodes": lambda r: r.info.nodes,
        "renewals": lambda r: r.info.renewals,
        "fence": lambda r: r.info.fence or 0,
    }
    # The core lists by name; a stable sort keeps that order among equal values.
    if name != "key":
        rows = sorted(rows, key=keys["key"])
    return sorted(rows, key=keys[name], reverse=reverse), order


@dataclass(frozen=True)
class ServiceKind:
    """How the node health page names a lock service, its nodes and its lock count."""

    #: The page's heading: the service's kind and what its nodes are.
    title: str
    #: The first column's label: what one row of ``health()`` is.
    node: str
    #: One row and several, in the line above the table ("1 of 3 endpoints reachable").
    noun: str
    nouns: str
    #: What ``NodeHealth.lock_keys`` counts there: a Redis node's lock keys (one copy per
    #: node of each lock it granted); the locks a backend holds (as its list shows them).
    lock_count: str = "Locks"
    #: A Redlock: a quorum of nodes, clock drift between them and a restart guard.
    redlock: bool = False


REDIS_NODES = ServiceKind("Redis nodes", "Node", "node", "nodes", "Lock keys", redlock=True)
SERVICE_KINDS = {
    "zookeeper": ServiceKind("ZooKeeper servers", "Servers", "server", "servers"),
    "etcd": ServiceKind("etcd endpoints", "Endpoint", "endpoint", "endpoints"),
    "database": ServiceKind("Database", "Database", "database", "databases"),
}


def service_kind(locks: Any) -> ServiceKind:
    """The kind of a lock service ``get_locks()`` returned: the Redlock (which has no
    ``service``), a backend by its ``service``, or a third-party backend by its own name."""
    service = getattr(locks, "service", None)
    if not service:
        return REDIS_NODES
    return SERVICE_KINDS.get(service) or ServiceKind(f"{service} nodes", "Node", "node", "nodes")


def health_columns(kind: ServiceKind, health: Sequence[NodeHealth]) -> list[tuple[str, str]]:
    """The node health table's columns after the node and whether it answers, as (key,
    label): those the service's ``health()`` filled in for some node (a backend reports no
    uptime or memory: empty columns would only say so), and the Redlock's restart guard."""
    fields = {  # column: (label, NodeHealth field)
        "latency": ("Latency", "latency"),
        "software": ("Software", "software"),
        "uptime": ("Uptime", "uptime"),
        "memory": ("Memory", "used_memory"),
        "locks": (kind.lock_count, "lock_keys"),
        "offset": ("Clock offset", "clock_offset"),
    }
    columns = [
        (key, label)
        for key, (label, field) in fields.items()
        if any(getattr(h, field) is not None for h in health)
    ]
    if kind.redlock:
        columns.append(("guard", "Restart guard"))
    return columns


def clock_spread(health: Sequence[NodeHealth]) -> float | None:
    """Largest clock difference between two reachable nodes, in seconds."""
    offsets = [h.clock_offset for h in health if h.reachable and h.clock_offset is not None]
    if len(offsets) < 2:
        return None
    return max(offsets) - min(offsets)


def describe_holder(info: LockInfo) -> str:
    """The holder metadata as one line for the admin log (every key, sorted)."""
    parts = [f"{k}={v!r}" for k, v in sorted(info.meta.items())]
    parts.append(f"token={info.token!r}")
    if info.fence is not None:
        parts.append(f"fence={info.fence}")
    if info.acquired_at is not None:
        parts.append(f"acquired={info.acquired_at.astimezone(timezone.utc).isoformat()}")
    return ", ".join(parts)


def log_force_release(user: Any, info: LockInfo, removed: int) -> Any:
    """Record one force release in the admin log (``LogEntry``, action DELETION); returns the
    entry.

    Django 5.1+ has ``LogEntry.objects.log_actions()``; 4.2 and 5.0 only ``log_action()``.
    """
    from django.contrib.admin.models import DELETION, LogEntry
    from django.contrib.contenttypes.models import ContentType

    from .models import Lock

    message = (
        f"Force-released lock {info.name!r} on {removed} of {info.total_nodes} nodes; "
        f"holder: {describe_holder(info)}"
    )
    lock = Lock(name=info.name)
    manager = LogEntry.objects
    if hasattr(manager, "log_actions"):
        entries = manager.log_actions(
            user_id=user.pk, queryset=[lock], action_flag=DELETION, change_message=message
        )
        return entries[0] if isinstance(entries, list) else entries
    return manager.log_action(  # Django < 5.1
        user_id=user.pk,
        content_type_id=ContentType.objects.get_for_model(Lock, for_concrete_model=False).pk,
        object_id=info.name,
        object_repr=info.name[:200],
        action_flag=DELETION,
        change_message=message,
    )
