"""System checks for the ``REDLOCK`` setting (every id is documented in docs/checks.rst).

The regular checks never touch the network: they report what :func:`.setting.validate` finds,
the judgement ``get_redlock()`` also applies (it raises ImproperlyConfigured with the same id
and message for servers that never run the checks). Only the deploy checks
(``manage.py check --deploy``) talk to the nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, register

from .conf import resolve_node
from .core import NodeHealth, Redlock, node_client, redact
from .setting import DEFAULTS, REDLOCK_ARGUMENTS, error, node_urls, validate, warning

__all__ = [
    "SAFE_EVICTION",
    "TAG",
    "check_deploy",
    "check_metrics",
    "check_reachable",
    "check_settings",
    "eviction_warnings",
    "node_eviction_policies",
]

#: ``manage.py check --tag django_redlock`` runs only this app's checks.
TAG = "django_redlock"
#: The only ``maxmemory-policy`` under which Redis never deletes a lock key to free memory.
SAFE_EVICTION = "noeviction"


def _user_setting() -> Any:
    return getattr(settings, "REDLOCK", None)


@register(TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Everything that can be checked without talking to Redis."""
    return validate(_user_setting())


@register(TAG)
def check_metrics(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``REDLOCK["METRICS"]`` (``django_redlock.E013``). Apart from the lock settings: a broken
    metrics setting turns the metrics off (logged at startup), it never stops the locks."""
    from .metrics import metrics_settings

    user = _user_setting()
    if not isinstance(user, Mapping):
        return []
    try:
        metrics_settings(user.get("METRICS"))
    except (TypeError, ValueError, ImportError) as exc:
        return [
            error(
                13,
                f"{exc}.",
                hint="REDLOCK['METRICS'] = True, or a dict of LABEL (a callable or dotted "
                "path: lock name -> label), MAX_LABELS (int) and HEALTH_CACHE (seconds); "
                "it needs the 'metrics' extra (prometheus_client).",
            )
        ]
    return []


# ----------------------------------------------------------------------------- deploy


def _valid_nodes() -> list[tuple[int, str, dict[str, Any]]] | None:
    user = _user_setting()
    if not isinstance(user, Mapping):
        return None
    nodes = user.get("NODES")
    if not isinstance(nodes, (list, tuple)) or not nodes:
        return None
    parsed, problems = node_urls(nodes)
    return None if problems else parsed


@register(Tags.security, TAG, deploy=True)
def check_deploy(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A single node is a single point of failure, and loses locks on failover."""
    user = _user_setting()
    nodes = user.get("NODES") if isinstance(user, Mapping) else None
    if isinstance(nodes, (list, tuple)) and len(nodes) == 1:
        return [
            warning(
                4,
                "REDLOCK has a single node: when it fails no lock can be taken, and a "
                "replica promoted after a failover may hand out locks that are still held.",
                hint="Use 3 (or 5) independent Redis servers in production.",
            )
        ]
    return []


@register(TAG, deploy=True)
def check_reachable(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """PING every node and run the health probe on each that answers (deploy checks only):
    fewer than a quorum that could vote is an error, and a node that may evict keys draws
    W006."""
    parsed = _valid_nodes()
    if not parsed:
        return []
    prober = _prober()
    try:
        down, policies, servers, replicas = _probe_all(parsed, prober)
    finally:
        if prober is not None:
            prober.close()
    return (
        _same_server_errors(servers)
        + _replica_errors(replicas)
        + _quorum_messages(parsed, down)
        + eviction_warnings(policies)
    )


def _same_server_errors(servers: Sequence[tuple[int, str, str]]) -> list[CheckMessage]:
    """E014 for each node that reached the server an earlier node reached (the same INFO
    run_id): a unix socket and a TCP port of one server, which no URL comparison can tell."""
    first: dict[str, tuple[int, str]] = {}
    found: list[CheckMessage] = []
    for index, url, run_id in servers:
        earlier = first.setdefault(run_id, (index, url))
        if earlier[0] != index:
            found.append(
                error(
                    14,
                    f"REDLOCK nodes [{earlier[0]}] {redact(earlier[1])} and [{index}] "
                    f"{redact(url)} are the same Redis server (run_id {run_id}): it would vote "
                    "twice, so the later entry never votes (its connections are refused).",
                    hint="List each server once: Redlock needs independent nodes.",
                )
            )
    return found


def _replica_errors(replicas: Sequence[tuple[int, str, str]]) -> list[CheckMessage]:
    """E015 for each ``(index, url, primary)`` that is a replica, not a primary."""
    return [
        error(
            15,
            f"REDLOCK node [{index}] {redact(url)} is a replica of {primary}, not an "
            "independent primary: it never votes (its connections are refused), so the "
            "cluster survives one failure fewer than its size says.",
            hint="Make every node a primary of its own (REPLICAOF NO ONE), with no "
            "replication between nodes.",
        )
        for index, url, primary in replicas
    ]


_Probed = list[tuple[int, str, str]]


def _prober() -> Redlock | None:
    """A Redlock over the configured nodes, whose health probe the deploy check runs (it
    opens no connection: the probe goes through the check's own clients). None when the
    setting cannot build one: the regular checks report why."""
    user = _user_setting()
    if not isinstance(user, Mapping):
        return None
    config = {**DEFAULTS, **user}
    try:
        # As conf builds the process's Redlock: the same arguments, from the same names.
        return Redlock(
            [resolve_node(spec) for spec in config["NODES"] or []],
            **{arg: config[name] for name, arg in REDLOCK_ARGUMENTS.items()},
        )
    except Exception:
        return None


def _probe_all(
    parsed: Sequence[tuple[int, str, dict[str, Any]]], prober: Redlock | None = None
) -> tuple[_Probed, _Probed, _Probed, _Probed]:
    """Every node probed at once: ``(index, url, why)`` of those down, ``(index, url,
    maxmemory-policy)``, ``(index, url, run_id)`` and, for a replica, ``(index, url, its
    primary)`` of those that answered. With ``prober`` (a Redlock over the same nodes), a
    node that answers PING but fails its health probe counts as down, with the probe's
    reason (a user who may not run the lock scripts or INFO can never vote)."""

    def probe(item: tuple[int, str, dict[str, Any]]) -> tuple[Any, ...]:
        index, url, options = item
        if prober is None:
            return _probe(url, options)
        redlock, node = prober, prober.nodes[index]
        return _probe(url, options, lambda client: redlock.probe_with(node, client))

    with ThreadPoolExecutor(max_workers=max(len(parsed), 1)) as pool:
        results = list(pool.map(probe, parsed))
    down: _Probed = []
    policies: _Probed = []
    servers: _Probed = []
    replicas: _Probed = []
    for (index, url, _), (why, policy, run_id, primary) in zip(parsed, results, strict=True):
        if why is not None:
            down.append((index, url, why))
            continue
        if policy is not None:
            policies.append((index, url, policy))
        if run_id is not None:
            servers.append((index, url, run_id))
        if primary is not None:
            replicas.append((index, url, primary))
    return down, policies, servers, replicas


def eviction_warnings(policies: Sequence[tuple[int, str, str]]) -> list[CheckMessage]:
    """W006 for each ``(index, url, maxmemory-policy)`` other than ``noeviction``
    (``manage.py redlock check`` prints the same messages)."""
    return [
        warning(
            6,
            f"REDLOCK node [{index}] {redact(url)} has maxmemory-policy {policy!r}: under "
            "memory pressure Redis deletes keys to make room, lock keys included (they all "
            "carry a TTL, so volatile-* policies pick them first), and a second client then "
            "gets a lock that is still held.",
            hint=f"Set maxmemory-policy {SAFE_EVICTION} on lock nodes (CONFIG SET "
            f"maxmemory-policy {SAFE_EVICTION}, and in redis.conf); locks need little memory.",
        )
        for index, url, policy in policies
        if policy != SAFE_EVICTION
    ]


def _quorum_messages(
    parsed: Sequence[tuple[int, str, dict[str, Any]]], down: Sequence[tuple[int, str, str]]
) -> list[CheckMessage]:
    if not down:
        return []
    quorum = len(parsed) // 2 + 1
    reachable = len(parsed) - len(down)
    detail = "; ".join(f"[{i}] {redact(url)}: {why}" for i, url, why in down)
    if reachable < quorum:
        return [
            error(
                11,
                f"Only {reachable} of {len(parsed)} REDLOCK nodes answer and may take locks, "
                f"{quorum} needed: "
                f"no lock can be taken ({detail}).",
                hint="Start the nodes or fix their addresses/credentials; "
                "`manage.py redlock check` shows each node's state.",
            )
        ]
    return [
        warning(
            5,
            f"{len(down)} of {len(parsed)} REDLOCK nodes do not answer or may not take locks "
            f"({detail}).",
            hint=f"Locks still work with {quorum} nodes, but one more failure stops them.",
        )
    ]


def _probe(
    url: str,
    options: Mapping[str, Any],
    health_probe: Callable[[Any], NodeHealth] | None = None,
) -> tuple[str | None, str | None, str | None, str | None]:
    """``(why it is down, maxmemory-policy, run_id, the primary of a replica)``: PING, then
    ``INFO`` (readable without the CONFIG permission managed services often withhold), then,
    with ``health_probe`` (a node's :meth:`.Redlock.probe_with`, given the client), the
    health probe ``health()`` runs (the lock scripts' permission, TIME, INFO, the restart
    guard's marker)."""
    import redis

    try:
        client = node_client(url, options, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            client.ping()
            try:
                # One INFO: its default sections hold all three (one round trip per node).
                info = client.info()
            except redis.ResponseError:  # INFO renamed or denied: the health probe says
                info = {}
            policy, run_id = info.get("maxmemory_policy"), info.get("run_id")
            health = None
            # A replica is reported as such (E015): its probe would fail on its writes.
            if health_probe is not None and info.get("role") != "slave":
                health = health_probe(client)
        finally:
            client.close()
    except Exception as exc:
        return str(exc) or type(exc).__name__, None, None, None
    if health is not None and not health.reachable:
        return health.error or "its health probe failed", None, None, None
    primary = None
    if info.get("role") == "slave":
        primary = f"{info.get('master_host')}:{info.get('master_port')}"
    return (
        None,
        str(policy) if policy is not None else None,
        str(run_id) if run_id is not None else None,
        primary,
    )


def node_eviction_policies() -> list[tuple[int, str, str]]:
    """``(index, url, maxmemory-policy)`` of every well-formed node that answers."""
    return _probe_all(_valid_nodes() or [])[1]
