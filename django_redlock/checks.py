"""System checks for the ``REDLOCK`` setting (every id is documented in docs/checks.rst).

The regular checks never touch the network: they validate the setting with the same code the
core uses to build its nodes and judge its arguments (the validators ``django_redlock.core``
exports, and finally the ``Redlock`` constructor itself, which opens no connection), so
``manage.py check`` rejects exactly what ``get_redlock()`` would reject, with the reason; and
``get_redlock()`` raises ImproperlyConfigured with the same id and message
(:func:`first_error`) for servers that never run the checks. Only the deploy checks
(``manage.py check --deploy``) talk to the nodes.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from .conf import CACHE_PREFIX, DEFAULTS, REDIS_CACHE_BACKENDS, REDLOCK_ARGUMENTS, cache_client
from .core import (
    Redlock,
    check_positive,
    check_prefix,
    connection_args,
    node_client,
    node_identity,
    parse_spec,
    redact,
)
from .task_options import SETTING_OPTIONS, check_task_options, header_values

__all__ = [
    "SAFE_EVICTION",
    "TAG",
    "check_deploy",
    "check_reachable",
    "check_settings",
    "constructor_error",
    "eviction_warnings",
    "first_error",
    "format_message",
    "node_eviction_policies",
]

#: ``manage.py check --tag django_redlock`` runs only this app's checks.
TAG = "django_redlock"
OBJ = "settings.REDLOCK"

#: NODE_TIMEOUT above TTL / this ratio draws W002.
TIMEOUT_RATIO = 10
#: The only ``maxmemory-policy`` under which Redis never deletes a lock key to free memory.
SAFE_EVICTION = "noeviction"
#: A syntactically valid node for running the constructor's checks on the other settings.
_PLACEHOLDER_NODE = "redis://127.0.0.1:6379/0"

_NUMBERS = {
    # name: (allow_zero, allow_none)
    "TTL": (False, False),
    "NODE_TIMEOUT": (False, False),
    "RETRY_DELAY": (True, False),
    "DRIFT_FACTOR": (True, False),
    "MAX_TTL": (False, True),
    "FAIR_HEARTBEAT": (False, False),
    "STUCK_AFTER": (False, True),
}
_BOOLEANS = ("RESTART_GUARD", "TRUST_FRESH_CLUSTER", "REENTRANT", "AUTO_RENEW", "TRACING")


def _error(n: int, msg: str, hint: str | None = None) -> Error:
    return Error(msg, hint=hint, obj=OBJ, id=f"django_redlock.E{n:03d}")


def _warning(n: int, msg: str, hint: str | None = None) -> Warning:
    return Warning(msg, hint=hint, obj=OBJ, id=f"django_redlock.W{n:03d}")


def _user_setting() -> Any:
    return getattr(settings, "REDLOCK", None)


@register(TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Everything that can be checked without talking to Redis."""
    return _settings_messages(constructor=True)


def _settings_messages(*, constructor: bool) -> list[CheckMessage]:
    user = _user_setting()
    if user is None:
        return [
            _error(
                2,
                "The REDLOCK setting is missing: no Redis nodes are configured.",
                hint='Add REDLOCK = {"NODES": ["redis://host1:6379/0", "redis://host2:6379/0", '
                '"redis://host3:6379/0"]} to your settings.',
            )
        ]
    if not isinstance(user, Mapping):
        return [
            _error(
                1,
                f"REDLOCK must be a dict, got {type(user).__name__}.",
                hint='REDLOCK = {"NODES": [...], "TTL": 30.0, ...}',
            )
        ]
    config = {**DEFAULTS, **user}
    messages: list[CheckMessage] = []
    messages += _check_names(user)
    backends = user.get("BACKENDS")
    # No NODES is fine when BACKENDS names "default" (django_redlock.backends.registry).
    if user.get("NODES") or not (isinstance(backends, Mapping) and "default" in backends):
        messages += _check_nodes(user.get("NODES"))
    messages += _check_values(config, constructor=constructor)
    messages += _check_locked_response(config.get("LOCKED_RESPONSE"))
    messages += _check_locked_task(config.get("LOCKED_TASK"))
    return messages


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
            _error(
                13,
                f"{exc}.",
                hint="REDLOCK['METRICS'] = True, or a dict of LABEL (a callable or dotted "
                "path: lock name -> label), MAX_LABELS (int) and HEALTH_CACHE (seconds); "
                "it needs the 'metrics' extra (prometheus_client).",
            )
        ]
    return []


def format_message(message: CheckMessage) -> str:
    """``"django_redlock.E008: <msg> HINT: <hint>"``, as ImproperlyConfigured says it."""
    text = f"{message.id}: {message.msg}"
    return f"{text} HINT: {message.hint}" if message.hint else text


def first_error(*, constructor: bool = True) -> CheckMessage | None:
    """The first error :func:`check_settings` finds (None when the setting is usable);
    ``constructor=False`` leaves out the trial construction, for a caller that is about to
    construct the Redlock anyway (its refusal then goes through :func:`constructor_error`)."""
    messages = _settings_messages(constructor=constructor)
    return next((m for m in messages if m.is_serious()), None)


def constructor_error(exc: Exception) -> CheckMessage:
    """The ``E008`` message for the ``Redlock`` constructor's refusal ``exc``, naming the
    setting its argument comes from."""
    text = str(exc)
    names = [n for n, arg in REDLOCK_ARGUMENTS.items() if text.startswith(arg)]
    where = f"REDLOCK['{names[0]}']" if names else "REDLOCK"
    hint = f"The default is {DEFAULTS[names[0]]!r}." if names else None
    return _error(8, f"{where} is invalid: {text}.", hint=hint)


# ----------------------------------------------------------------------------- names


def _check_names(user: Mapping[Any, Any]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for name in user:
        if name in DEFAULTS:
            continue
        close = difflib.get_close_matches(str(name).upper(), list(DEFAULTS), n=1, cutoff=0.6)
        hint = (
            f"Did you mean {close[0]!r}?"
            if close
            else "Known settings: " + ", ".join(sorted(DEFAULTS)) + "."
        )
        messages.append(
            _warning(3, f"REDLOCK has an unknown setting {name!r}; it is ignored.", hint=hint)
        )
    return messages


# ----------------------------------------------------------------------------- nodes


def _node_urls(nodes: Any) -> tuple[list[tuple[int, str, dict[str, Any]]], list[CheckMessage]]:
    """``(index, url, options)`` of every well-formed node, and the problems of the others."""
    messages: list[CheckMessage] = []
    parsed: list[tuple[int, str, dict[str, Any]]] = []
    for index, spec in enumerate(nodes):
        where = f"REDLOCK['NODES'][{index}]"
        if isinstance(spec, str) and spec.startswith(CACHE_PREFIX):
            problem, spec = _cache_node(where, spec[len(CACHE_PREFIX) :])
            if problem is not None:
                messages.append(problem)
                continue
        try:
            url, options = parse_spec(spec)
            connection_args(url, options)
        except (TypeError, ValueError) as exc:
            messages.append(
                _error(
                    4,
                    f"{where} is malformed: {exc}",
                    hint='A node is a URL ("redis://host:6379/0", "rediss://...", '
                    '"unix:///path/redis.sock?db=0", a Sentinel group '
                    '"redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE/DB"), '
                    '{"URL": ..., "OPTIONS": {...}} or "cache:<alias>".',
                )
            )
            continue
        parsed.append((index, url, options))
    return parsed, messages


def _cache_node(where: str, alias: str) -> tuple[CheckMessage | None, Any]:
    caches = getattr(settings, "CACHES", {}) or {}
    if alias not in caches:
        known = ", ".join(repr(a) for a in caches) or "none"
        return _error(
            5,
            f"{where} 'cache:{alias}' names no cache in CACHES.",
            hint=f"Configured cache aliases: {known}.",
        ), None
    backend = str(caches[alias].get("BACKEND", ""))
    try:
        cls = import_string(backend)
    except ImportError as exc:
        return _error(
            6,
            f"{where} 'cache:{alias}': its BACKEND {backend!r} cannot be imported ({exc}).",
            hint="Install django-redis or use django.core.cache.backends.redis.",
        ), None
    names = {f"{c.__module__}.{c.__qualname__}" for c in getattr(cls, "__mro__", ())}
    if not names & set(REDIS_CACHE_BACKENDS):
        return _error(
            6,
            f"{where} 'cache:{alias}' is not a Redis cache ({backend}).",
            hint="Only django-redis (django_redis.cache.RedisCache) and Django's "
            "django.core.cache.backends.redis.RedisCache can lend their connection.",
        ), None
    try:
        return None, cache_client(alias)
    except Exception as exc:
        return _error(4, f"{where} 'cache:{alias}' gives no usable Redis client: {exc}"), None


def _check_nodes(nodes: Any) -> list[CheckMessage]:
    if nodes is None or (isinstance(nodes, (list, tuple)) and not nodes):
        return [
            _error(
                2,
                "REDLOCK['NODES'] is missing or empty: no Redis nodes are configured.",
                hint="List 3 or 5 independent Redis servers (1 for development).",
            )
        ]
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        return [
            _error(
                3,
                f"REDLOCK['NODES'] must be a list, got {type(nodes).__name__}.",
                hint='Wrap a single node in a list: "NODES": ["redis://127.0.0.1:6379/0"].',
            )
        ]
    parsed, messages = _node_urls(nodes)
    seen: dict[tuple[Any, ...], int] = {}
    for index, url, _ in parsed:
        ident = node_identity(url)
        if ident in seen:
            messages.append(
                _error(
                    7,
                    f"REDLOCK['NODES'][{seen[ident]}] and [{index}] are the same Redis server "
                    f"({redact(url)}).",
                    hint="Redlock needs independent servers: two entries for one server make a "
                    "single failure count twice. Remove the duplicate.",
                )
            )
        else:
            seen[ident] = index
    if not messages and len(nodes) % 2 == 0:
        n = len(nodes)
        messages.append(
            _warning(
                1,
                f"REDLOCK has an even number of nodes ({n}): it needs {n // 2 + 1} to agree and "
                f"tolerates {n - n // 2 - 1} failure(s), no more than {n - 1} nodes would.",
                hint=f"Use {n - 1} or {n + 1} nodes.",
            )
        )
    return messages


# ----------------------------------------------------------------------------- values


def _check_values(config: Mapping[str, Any], *, constructor: bool) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    good: dict[str, float | None] = {}
    for name, (allow_zero, allow_none) in _NUMBERS.items():
        value = config.get(name)
        if value is None and allow_none:
            good[name] = None
            continue
        try:
            good[name] = check_positive(name, value, allow_zero=allow_zero)
        except (TypeError, ValueError) as exc:
            messages.append(
                _error(
                    8,
                    f"REDLOCK['{name}'] is invalid: {exc}.",
                    hint=f"The default is {DEFAULTS[name]!r}.",
                )
            )
    drift = good.get("DRIFT_FACTOR")
    if drift is not None and drift >= 0.5:
        messages.append(
            _error(
                8,
                f"REDLOCK['DRIFT_FACTOR'] must be < 0.5, got {drift!r}.",
                hint="The default is 0.01 (1% of the TTL).",
            )
        )
    try:
        check_prefix(config.get("KEY_PREFIX"))
    except (TypeError, ValueError) as exc:
        messages.append(
            _error(8, f"REDLOCK['KEY_PREFIX'] is invalid: {exc}.", hint="The default is 'redlock'.")
        )
    if not isinstance(config.get("META"), Mapping):
        messages.append(_error(8, f"REDLOCK['META'] must be a dict, got {config.get('META')!r}."))
    for name in _BOOLEANS:
        if not isinstance(config.get(name), bool):
            messages.append(
                _error(8, f"REDLOCK['{name}'] must be True or False, got {config.get(name)!r}.")
            )
    ttl, timeout, max_ttl = good.get("TTL"), good.get("NODE_TIMEOUT"), good.get("MAX_TTL")
    if ttl is not None and timeout is not None:
        if timeout >= ttl:
            messages.append(
                _error(
                    9,
                    f"REDLOCK['NODE_TIMEOUT'] ({timeout:g}s) is not smaller than TTL ({ttl:g}s): "
                    "no lock could ever be valid.",
                    hint="NODE_TIMEOUT is the wait for one node's answer: a few tens of ms.",
                )
            )
        elif timeout * TIMEOUT_RATIO > ttl:
            messages.append(
                _warning(
                    2,
                    f"REDLOCK['NODE_TIMEOUT'] ({timeout:g}s) is not much smaller than TTL "
                    f"({ttl:g}s): a slow node can eat more than 1/{TIMEOUT_RATIO} of every "
                    "lease's validity.",
                    hint="Keep NODE_TIMEOUT at a few tens of ms and TTL at seconds "
                    "(the Redlock paper: 5-50 ms for a 10 s lease).",
                )
            )
    if ttl is not None and max_ttl is not None and ttl > max_ttl:
        messages.append(
            _error(
                9,
                f"REDLOCK['TTL'] ({ttl:g}s) is longer than MAX_TTL ({max_ttl:g}s).",
                hint="MAX_TTL caps every lease (the restart guard covers leases up to MAX_TTL); "
                "raise it or lower TTL.",
            )
        )
    if constructor and not any(m.is_serious() for m in messages):
        messages += _check_constructor(config)
    return messages


def _check_constructor(config: Mapping[str, Any]) -> list[CheckMessage]:
    """Whatever else the ``Redlock`` constructor refuses (RETRY_COUNT's range, the core's
    bounds on durations...): the check runs the constructor's own validation, so the two
    cannot disagree. Constructing opens no connection."""
    kwargs = {arg: config.get(name) for name, arg in REDLOCK_ARGUMENTS.items()}
    try:
        redlock = Redlock([_PLACEHOLDER_NODE], **kwargs)
    except (TypeError, ValueError) as exc:
        return [constructor_error(exc)]
    redlock.close()
    return []


def _check_locked_task(value: Any) -> list[CheckMessage]:
    """``LOCKED_TASK``: defaults for LockedTask options, judged by the code the task runs."""
    if not isinstance(value, Mapping):
        return [_error(12, f"REDLOCK['LOCKED_TASK'] must be a dict, got {value!r}.")]
    unknown = sorted(str(k) for k in value if k not in SETTING_OPTIONS)
    if unknown:
        return [
            _error(
                12,
                f"REDLOCK['LOCKED_TASK'] has unknown options: {', '.join(unknown)}.",
                hint="Known options: " + ", ".join(SETTING_OPTIONS) + ".",
            )
        ]
    try:
        check_task_options(header_values(value), "REDLOCK['LOCKED_TASK']")
    except (TypeError, ValueError) as exc:
        return [_error(12, f"{exc}.")]
    return []


def _check_locked_response(value: Any) -> list[CheckMessage]:
    if value is None or callable(value):
        return []
    if not isinstance(value, str):
        return [_error(10, f"REDLOCK['LOCKED_RESPONSE'] must be a dotted path, got {value!r}.")]
    try:
        target = import_string(value)
    except ImportError as exc:
        return [
            _error(
                10,
                f"REDLOCK['LOCKED_RESPONSE'] {value!r} cannot be imported: {exc}",
                hint="Name a callable (request, exc) -> HttpResponse, e.g. "
                "'myapp.views.locked_response'.",
            )
        ]
    if not callable(target):
        return [_error(10, f"REDLOCK['LOCKED_RESPONSE'] {value!r} is not callable.")]
    return []


# ----------------------------------------------------------------------------- deploy


def _valid_nodes() -> list[tuple[int, str, dict[str, Any]]] | None:
    user = _user_setting()
    if not isinstance(user, Mapping):
        return None
    nodes = user.get("NODES")
    if not isinstance(nodes, (list, tuple)) or not nodes:
        return None
    parsed, problems = _node_urls(nodes)
    return None if problems else parsed


@register(Tags.security, TAG, deploy=True)
def check_deploy(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A single node is a single point of failure, and loses locks on failover."""
    user = _user_setting()
    nodes = user.get("NODES") if isinstance(user, Mapping) else None
    if isinstance(nodes, (list, tuple)) and len(nodes) == 1:
        return [
            _warning(
                4,
                "REDLOCK has a single node: when it fails no lock can be taken, and a "
                "replica promoted after a failover may hand out locks that are still held.",
                hint="Use 3 (or 5) independent Redis servers in production.",
            )
        ]
    return []


@register(TAG, deploy=True)
def check_reachable(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """PING every node (deploy checks only); fewer than a quorum reachable is an error, and
    a node that may evict keys draws W006."""
    parsed = _valid_nodes()
    if not parsed:
        return []
    down, policies = _probe_all(parsed)
    return _quorum_messages(parsed, down) + eviction_warnings(policies)


def _probe_all(
    parsed: Sequence[tuple[int, str, dict[str, Any]]],
) -> tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """Every node probed at once: ``(index, url, why)`` of those down and ``(index, url,
    maxmemory-policy)`` of those that answered."""
    with ThreadPoolExecutor(max_workers=max(len(parsed), 1)) as pool:
        results = list(pool.map(lambda item: _probe(item[1], item[2]), parsed))
    down, policies = [], []
    for (index, url, _), (why, policy) in zip(parsed, results, strict=True):
        if why is not None:
            down.append((index, url, why))
        elif policy is not None:
            policies.append((index, url, policy))
    return down, policies


def eviction_warnings(policies: Sequence[tuple[int, str, str]]) -> list[CheckMessage]:
    """W006 for each ``(index, url, maxmemory-policy)`` other than ``noeviction``
    (``manage.py redlock check`` prints the same messages)."""
    return [
        _warning(
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
            _error(
                11,
                f"Only {reachable} of {len(parsed)} REDLOCK nodes answer PING, {quorum} needed: "
                f"no lock can be taken ({detail}).",
                hint="Start the nodes or fix their addresses/credentials; "
                "`manage.py redlock check` shows each node's state.",
            )
        ]
    return [
        _warning(
            5,
            f"{len(down)} of {len(parsed)} REDLOCK nodes do not answer PING ({detail}).",
            hint=f"Locks still work with {quorum} nodes, but one more failure stops them.",
        )
    ]


def _probe(url: str, options: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(why it is down, maxmemory-policy)``: PING, then ``INFO memory`` (readable without
    the CONFIG permission managed services often withhold)."""
    import redis

    try:
        client = node_client(url, options, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            client.ping()
            try:
                policy = client.info("memory").get("maxmemory_policy")
            except redis.ResponseError:  # INFO renamed or denied: nothing to judge
                policy = None
        finally:
            client.close()
    except Exception as exc:
        return str(exc) or type(exc).__name__, None
    return None, str(policy) if policy is not None else None


def node_eviction_policies() -> list[tuple[int, str, str]]:
    """``(index, url, maxmemory-policy)`` of every well-formed node that answers."""
    return _probe_all(_valid_nodes() or [])[1]
