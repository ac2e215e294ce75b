"""The ``REDLOCK`` setting, read lazily, and the one shared Redlock built from it.

Nothing here connects at import or in ``AppConfig.ready()``: the Redlock is built on the first
call of :func:`get_redlock` (constructing it opens no socket either; the first lock operation
does) and rebuilt after ``override_settings(REDLOCK=...)`` or a ``CACHES`` change, because the
``setting_changed`` receiver below drops the cached instance, the way django-debug-toolbar reads
its settings.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from .core import AsyncRedlock, NodeSpec, Redlock

__all__ = [
    "CACHE_PREFIX",
    "DEFAULTS",
    "REDLOCK_ARGUMENTS",
    "cache_client",
    "get_async_redlock",
    "get_config",
    "get_redlock",
    "reset",
    "resolve_node",
]

logger = logging.getLogger("django_redlock")

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

T = TypeVar("T")


class _Shared(Generic[T]):
    """A lazily built process-wide object: built once under a lock (two threads racing on
    the first request get the same instance), dropped by :meth:`cache_clear`."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._value: T | None = None
        self._lock = threading.Lock()
        self.__doc__ = build.__doc__
        self.__name__ = build.__name__
        self.__wrapped__ = build

    def __call__(self) -> T:
        value = self._value
        if value is None:
            with self._lock:
                value = self._value
                if value is None:
                    value = self._value = self._build()
        return value

    @property
    def built(self) -> bool:
        return self._value is not None

    def cache_clear(self) -> T | None:
        """Forget the instance (returns it, so the caller can close it)."""
        with self._lock:
            value, self._value = self._value, None
        return value


def _read_config() -> dict[str, Any]:
    """``REDLOCK`` merged over :data:`DEFAULTS` (unknown names are kept for the checks)."""
    user = getattr(settings, "REDLOCK", None) or {}
    if not isinstance(user, Mapping):
        return {**DEFAULTS}
    return {**DEFAULTS, **user}


get_config = _Shared(_read_config)


def resolve_node(spec: Any) -> NodeSpec:
    """A ``NODES`` entry as the core takes it; ``"cache:<alias>"`` becomes that cache's client."""
    if isinstance(spec, str) and spec.startswith(CACHE_PREFIX):
        return cache_client(spec[len(CACHE_PREFIX) :])
    return spec


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
    if not _is_redis_cache(cache):
        raise ValueError(
            f"REDLOCK node 'cache:{alias}' is not a Redis cache ({type(cache).__module__}."
            f"{type(cache).__name__}); use django-redis or django.core.cache.backends.redis"
        )
    client = getattr(cache, "client", None)
    if client is not None and hasattr(client, "get_client"):  # django-redis
        return client.get_client(write=True)
    return cache._cache.get_client(write=True)  # type: ignore[attr-defined]  # Django's own


def _is_redis_cache(cache: Any) -> bool:
    for cls in type(cache).__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" in REDIS_CACHE_BACKENDS:
            return True
    return False


def _build(factory: Callable[..., T]) -> T:
    # Servers never run the system checks: refuse a broken setting here, as the check would.
    from .checks import constructor_error, first_error, format_message

    problem = first_error(constructor=False)
    if problem is not None:
        raise ImproperlyConfigured(format_message(problem))
    config = get_config()
    kwargs = {arg: config[name] for name, arg in REDLOCK_ARGUMENTS.items()}
    nodes = [resolve_node(spec) for spec in config["NODES"] or []]
    try:
        return factory(nodes, **kwargs)
    except (TypeError, ValueError) as exc:  # what only the constructor judges
        raise ImproperlyConfigured(format_message(constructor_error(exc))) from exc


def _build_redlock() -> Redlock:
    """The process-wide :class:`~django_redlock.Redlock` built from ``settings.REDLOCK``.

    Built on first call (no I/O), shared by every thread, rebuilt after the setting changes.
    Its events are sent as the Django signals of :mod:`django_redlock.signals`.
    """
    from . import signals

    redlock = _build(Redlock)
    redlock.listeners.append(signals.listener_for(redlock))
    return redlock


def _build_async_redlock() -> Any:
    """The asyncio twin of :func:`get_redlock` (an ``AsyncRedlock``), same settings."""
    from . import signals

    redlock = _build(AsyncRedlock)
    redlock.listeners.append(signals.listener_for(redlock))
    return redlock


get_redlock = _Shared(_build_redlock)
#: One AsyncRedlock for the process: it keeps connections per event loop itself (a WSGI
#: server runs each async view in a fresh loop; under ASGI there is one loop).
get_async_redlock = _Shared(_build_async_redlock)


def reset() -> None:
    """Drop the cached settings and Redlocks (closing them); the next call rebuilds them."""
    get_config.cache_clear()
    old = get_redlock.cache_clear()
    if old is not None:
        _close(old)
    old_async = get_async_redlock.cache_clear()
    if old_async is not None:
        _close(old_async)


def _close(redlock: Any) -> None:
    try:
        result = redlock.close()
        if inspect.iscoroutine(result):
            # AsyncRedlock.close(): run it here, or schedule it on the loop running this code.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                asyncio.run(result)
            else:
                task = loop.create_task(result)
                _closing.add(task)
                task.add_done_callback(_closing.discard)
    except Exception:  # a broken instance must not break override_settings
        logger.debug("closing the previous Redlock failed", exc_info=True)


_closing: set[Any] = set()


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("REDLOCK", "CACHES"):
        reset()
