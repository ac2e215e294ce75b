"""The ``REDLOCK`` setting: every name it may hold, its default, and the one :func:`validate`.

The system check (:mod:`.checks`), the shared Redlock's builder (:mod:`.conf`) and the
LockedTask defaults all judge a setting here, with the validators the core itself runs (and
finally the ``Redlock`` constructor, which opens no connection), so ``manage.py check`` rejects
exactly what ``get_redlock()`` would reject, with the same id and message. Every id is
documented in docs/checks.rst. Nothing here talks to Redis.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from .core import (
    Redlock,
    asyncio_refusal,
    check_positive,
    check_prefix,
    connection_args,
    default_max_ttl,
    node_identity,
    parse_spec,
    redact,
)
from .task_options import (
    CALL_OPTIONS,
    SETTING_OPTIONS,
    TASK_ONLY,
    check_task_options,
    header_values,
    misnamed_options,
)

__all__ = [
    "CACHE_PREFIX",
    "DEFAULTS",
    "OBJ",
    "REDIS_CACHE_BACKENDS",
    "REDLOCK_ARGUMENTS",
    "cache_client",
    "constructor_error",
    "error",
    "first_error",
    "format_message",
    "node_urls",
    "validate",
    "warning",
]

#: Every accepted setting and its default. ``checks.py`` flags any other name as a typo.
DEFAULTS: dict[str, Any] = {
    #: Redis nodes: URLs, ``{"URL": ..., "OPTIONS": {...}}`` dicts, or ``"cache:<alias>"``.
    "NODES": [],
    "KEY_PREFIX": "redlock",
    #: Default lease in seconds.
    "TTL": 30.0,
    #: Seconds to wait for one node's answer in a lock operation.
    "NODE_TIMEOUT": 0.05,
    "RETRY_COUNT": 3,
    "RETRY_DELAY": 0.2,
    "DRIFT_FACTOR": 0.01,
    #: Longest lease allowed; the restart guard keeps a restarted node out this long.
    "MAX_TTL": None,
    "RESTART_GUARD": True,
    "TRUST_FRESH_CLUSTER": True,
    "REENTRANT": True,
    #: Seconds after which a fair lock's silent waiter loses its place.
    "FAIR_HEARTBEAT": 3.0,
    #: Default of ``@locked(auto_renew=...)``.
    "AUTO_RENEW": False,
    #: Extra holder metadata stored with every lock (shown on the admin page).
    "META": {},
    #: Dotted path of a callable ``(request, exc) -> HttpResponse`` for views that could not
    #: get their lock; None gives the built-in 423 response.
    "LOCKED_RESPONSE": None,
    #: Seconds after which the admin page and ``manage.py redlock list`` flag a lock as stuck.
    "STUCK_AFTER": 300.0,
    #: Project-wide defaults of LockedTask options (``{"lock_ttl": 60, "on_locked": "wait"}``);
    #: a task's own options win.
    "LOCKED_TASK": {},
    #: More lock services by alias (django_redlock.backends.registry; checks E101-E105).
    "BACKENDS": {},
    #: Prometheus metrics (django_redlock.metrics): False, True or a dict of options (E013).
    "METRICS": False,
    #: OpenTelemetry spans where opentelemetry-api is installed (django_redlock.tracing).
    "TRACING": True,
}

#: Settings passed to the Redlock constructor, and the argument each becomes.
REDLOCK_ARGUMENTS = {
    "KEY_PREFIX": "key_prefix",
    "TTL": "ttl",
    "NODE_TIMEOUT": "node_timeout",
    "RETRY_COUNT": "retry_count",
    "RETRY_DELAY": "retry_delay",
    "DRIFT_FACTOR": "drift_factor",
    "MAX_TTL": "max_ttl",
    "RESTART_GUARD": "restart_guard",
    "TRUST_FRESH_CLUSTER": "trust_fresh_cluster",
    "REENTRANT": "reentrant",
    "FAIR_HEARTBEAT": "fair_heartbeat",
    "META": "meta",
}

CACHE_PREFIX = "cache:"

#: Cache backends whose client is a redis-py client ``"cache:<alias>"`` can reuse.
REDIS_CACHE_BACKENDS = (
    "django.core.cache.backends.redis.RedisCache",
    "django_redis.cache.RedisCache",
)

OBJ = "settings.REDLOCK"

#: NODE_TIMEOUT above TTL / this ratio draws W002.
TIMEOUT_RATIO = 10
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


def error(n: int, msg: str, hint: str | None = None) -> Error:
    return Error(msg, hint=hint, obj=OBJ, id=f"django_redlock.E{n:03d}")


def warning(n: int, msg: str, hint: str | None = None) -> Warning:
    return Warning(msg, hint=hint, obj=OBJ, id=f"django_redlock.W{n:03d}")


def validate(user: Any, *, constructor: bool = True) -> list[CheckMessage]:
    """Every problem of the ``REDLOCK`` setting ``user`` (the raw setting, None when it is
    missing) that can be found without talking to Redis: the system check, the shared
    Redlock's builder and the task options all judge a setting with this one function.
    ``constructor=False`` leaves out the trial construction, for a caller that is about to
    construct the Redlock anyway (its refusal then goes through :func:`constructor_error`)."""
    if user is None:
        return [
            error(
                2,
                "The REDLOCK setting is missing: no Redis nodes are configured.",
                hint='Add REDLOCK = {"NODES": ["redis://host1:6379/0", "redis://host2:6379/0", '
                '"redis://host3:6379/0"]} to your settings.',
            )
        ]
    if not isinstance(user, Mapping):
        return [
            error(
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
    messages += _check_locked_task(config.get("LOCKED_TASK"), _max_ttl(config))
    return messages


def _max_ttl(config: Mapping[str, Any]) -> float | None:
    """The longest lease the shared Redlock takes (as its constructor works it out), or None
    when the settings do not say (no nodes, or TTL/MAX_TTL not numbers: reported apart)."""
    ttl, max_ttl = config.get("TTL"), config.get("MAX_TTL")
    if not config.get("NODES"):
        return None
    if max_ttl is None:
        return default_max_ttl(ttl) if isinstance(ttl, (int, float)) else None
    return max_ttl if isinstance(max_ttl, (int, float)) else None


def format_message(message: CheckMessage) -> str:
    """``"django_redlock.E008: <msg> HINT: <hint>"``, as ImproperlyConfigured says it."""
    text = f"{message.id}: {message.msg}"
    return f"{text} HINT: {message.hint}" if message.hint else text


def first_error(*, constructor: bool = True, asyncio: bool = False) -> CheckMessage | None:
    """The first error :func:`validate` finds in ``settings.REDLOCK`` (None when it is
    usable). ``asyncio``: for ``AsyncRedlock``, which refuses a node that is only a
    ``W007`` for ``Redlock``: as the ``E004`` it is for it."""
    for message in validate(getattr(settings, "REDLOCK", None), constructor=constructor):
        if message.is_serious():
            return message
        if asyncio and message.id == "django_redlock.W007":
            return error(4, message.msg, hint=message.hint)
    return None


def constructor_error(exc: Exception) -> CheckMessage:
    """The ``E008`` message for the ``Redlock`` constructor's refusal ``exc``, naming the
    setting its argument comes from."""
    text = str(exc)
    names = [n for n, arg in REDLOCK_ARGUMENTS.items() if text.startswith(arg)]
    if names:
        return _invalid(names[0], f"is invalid: {text}")
    return error(8, f"REDLOCK is invalid: {text}.")


def _invalid(name: str, problem: str, hint: str | None = None) -> CheckMessage:
    """``E008``: setting ``name`` has a value its consumer refuses (hint: its default)."""
    return error(8, f"REDLOCK['{name}'] {problem}.", hint or f"The default is {DEFAULTS[name]!r}.")


# ----------------------------------------------------------------------------- names


def _check_names(user: Mapping[Any, Any]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for name in (n for n in user if n not in DEFAULTS):
        close = difflib.get_close_matches(str(name).upper(), list(DEFAULTS), n=1, cutoff=0.6)
        hint = (
            f"Did you mean {close[0]!r}?"
            if close
            else f"Known settings: {', '.join(sorted(DEFAULTS))}."
        )
        messages.append(
            warning(3, f"REDLOCK has an unknown setting {name!r}; it is ignored.", hint)
        )
    return messages


# ----------------------------------------------------------------------------- nodes


def node_urls(nodes: Any) -> tuple[list[tuple[int, str, dict[str, Any]]], list[CheckMessage]]:
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
                error(
                    4,
                    f"{where} is malformed: {exc}",
                    hint='A node is a URL ("redis://host:6379/0", "rediss://...", '
                    '"unix:///path/redis.sock?db=0", a Sentinel group '
                    '"redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE/DB"), '
                    '{"URL": ..., "OPTIONS": {...}} or "cache:<alias>".',
                )
            )
            continue
        refusal = asyncio_refusal(url, options)
        if refusal is not None:
            messages.append(
                warning(
                    7,
                    f"{where}: {refusal}.",
                    hint="get_async_redlock() (async views under @locked, async tasks) refuses "
                    "it (ImproperlyConfigured, django_redlock.E004); Redlock takes it. Drop the "
                    "option if any code of the project is async.",
                )
            )
        parsed.append((index, url, options))
    return parsed, messages


def _cache_node(where: str, alias: str) -> tuple[CheckMessage | None, Any]:
    caches = getattr(settings, "CACHES", {}) or {}
    if alias not in caches:
        known = ", ".join(repr(a) for a in caches) or "none"
        return error(
            5,
            f"{where} 'cache:{alias}' names no cache in CACHES.",
            hint=f"Configured cache aliases: {known}.",
        ), None
    backend = str(caches[alias].get("BACKEND", ""))
    try:
        cls = import_string(backend)
    except ImportError as exc:
        return error(
            6,
            f"{where} 'cache:{alias}': its BACKEND {backend!r} cannot be imported ({exc}).",
            hint="Install django-redis or use django.core.cache.backends.redis.",
        ), None
    if not _is_redis_cache(cls):
        return error(
            6,
            f"{where} 'cache:{alias}' is not a Redis cache ({backend}).",
            hint="Only django-redis (django_redis.cache.RedisCache) and Django's "
            "django.core.cache.backends.redis.RedisCache can lend their connection.",
        ), None
    try:
        return None, cache_client(alias)
    except Exception as exc:
        return error(4, f"{where} 'cache:{alias}' gives no usable Redis client: {exc}"), None


def _check_nodes(nodes: Any) -> list[CheckMessage]:
    if nodes is None or (isinstance(nodes, (list, tuple)) and not nodes):
        return [
            error(
                2,
                "REDLOCK['NODES'] is missing or empty: no Redis nodes are configured.",
                hint="List 3 or 5 independent Redis servers (1 for development).",
            )
        ]
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        return [
            error(
                3,
                f"REDLOCK['NODES'] must be a list, got {type(nodes).__name__}.",
                hint='Wrap a single node in a list: "NODES": ["redis://127.0.0.1:6379/0"].',
            )
        ]
    parsed, messages = node_urls(nodes)
    seen: dict[tuple[Any, ...], int] = {}
    for index, url, _ in parsed:
        ident = node_identity(url)
        if ident in seen:
            messages.append(
                error(
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
            warning(
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
            messages.append(_invalid(name, f"is invalid: {exc}"))
    drift = good.get("DRIFT_FACTOR")
    if drift is not None and drift >= 0.5:
        hint = "The default is 0.01 (1% of the TTL)."
        messages.append(_invalid("DRIFT_FACTOR", f"must be < 0.5, got {drift!r}", hint))
    try:
        check_prefix(config.get("KEY_PREFIX"))
    except (TypeError, ValueError) as exc:
        messages.append(_invalid("KEY_PREFIX", f"is invalid: {exc}"))
    if not isinstance(config.get("META"), Mapping):
        messages.append(_invalid("META", f"must be a dict, got {config.get('META')!r}"))
    messages += [
        _invalid(name, f"must be True or False, got {config.get(name)!r}")
        for name in _BOOLEANS
        if not isinstance(config.get(name), bool)
    ]
    ttl, timeout, max_ttl = good.get("TTL"), good.get("NODE_TIMEOUT"), good.get("MAX_TTL")
    if ttl is not None and timeout is not None:
        if timeout >= ttl:
            messages.append(
                error(
                    9,
                    f"REDLOCK['NODE_TIMEOUT'] ({timeout:g}s) is not smaller than TTL ({ttl:g}s): "
                    "no lock could ever be valid.",
                    hint="NODE_TIMEOUT is the wait for one node's answer: a few tens of ms.",
                )
            )
        elif timeout * TIMEOUT_RATIO > ttl:
            messages.append(
                warning(
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
            error(
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


def _check_locked_task(value: Any, max_ttl: float | None = None) -> list[CheckMessage]:
    """``LOCKED_TASK``: defaults for LockedTask options, judged by the code the task runs
    (and by the shared Redlock's ``max_ttl``, which refuses a longer lease at every run)."""
    if not isinstance(value, Mapping):
        return [error(12, f"REDLOCK['LOCKED_TASK'] must be a dict, got {value!r}.")]
    # Real LockedTask options that only a task may set: named as such, not as unknown.
    unknown, per_task = misnamed_options(value, SETTING_OPTIONS)
    if unknown or per_task:
        said = [f"unknown options: {', '.join(unknown)}"] if unknown else []
        if per_task:
            said.append(
                f"options a task sets itself, never a project default: {', '.join(per_task)}"
            )
        per_task_only = [n for n in (*CALL_OPTIONS, *TASK_ONLY) if n not in SETTING_OPTIONS]
        hint = (
            f"Options it may default: {', '.join(SETTING_OPTIONS)}. Set "
            f"{', '.join(per_task_only)} on the task (decorator or subclass)."
        )
        return [error(12, f"REDLOCK['LOCKED_TASK'] has {'; '.join(said)}.", hint)]
    try:
        check_task_options(header_values(value), "REDLOCK['LOCKED_TASK']", max_ttl=max_ttl)
    except (TypeError, ValueError) as exc:
        return [error(12, f"{exc}.")]
    return []


def _check_locked_response(value: Any) -> list[CheckMessage]:
    if value is None or callable(value):
        return []
    if not isinstance(value, str):
        return [error(10, f"REDLOCK['LOCKED_RESPONSE'] must be a dotted path, got {value!r}.")]
    try:
        target = import_string(value)
    except ImportError as exc:
        return [
            error(
                10,
                f"REDLOCK['LOCKED_RESPONSE'] {value!r} cannot be imported: {exc}",
                hint="Name a callable (request, exc) -> HttpResponse, e.g. "
                "'myapp.views.locked_response'.",
            )
        ]
    if not callable(target):
        return [error(10, f"REDLOCK['LOCKED_RESPONSE'] {value!r} is not callable.")]
    return []


def cache_client(alias: str) -> Any:
    """The redis-py client behind cache ``alias`` (django-redis or Django's RedisCache).

    Raises ValueError naming the problem: no such alias, or not a Redis cache. Building the
    client opens no connection.
    """
    from django.core.cache import caches
    from django.core.cache.backends.base import InvalidCacheBackendError

    if alias not in getattr(settings, "CACHES", {}):
        raise ValueError(f"REDLOCK node 'cache:{alias}' names no cache in CACHES")
    try:
        cache = caches[alias]
    except InvalidCacheBackendError as exc:
        raise ValueError(f"REDLOCK node 'cache:{alias}': {exc}") from None
    if not _is_redis_cache(type(cache)):
        raise ValueError(
            f"REDLOCK node 'cache:{alias}' is not a Redis cache ({type(cache).__module__}."
            f"{type(cache).__name__}); use django-redis or django.core.cache.backends.redis"
        )
    client = getattr(cache, "client", None)
    if client is not None and hasattr(client, "get_client"):  # django-redis
        return client.get_client(write=True)
    return cache._cache.get_client(write=True)  # type: ignore[attr-defined]  # Django's own


def _is_redis_cache(cls: Any) -> bool:
    """``cls`` is (or subclasses) a cache backend whose client is a redis-py client."""
    mro = getattr(cls, "__mro__", ())
    return any(f"{c.__module__}.{c.__qualname__}" in REDIS_CACHE_BACKENDS for c in mro)
