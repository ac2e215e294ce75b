"""The ``REDLOCK`` setting, read lazily, and the one shared Redlock built from it.

Nothing here connects at import or in ``AppConfig.ready()``: the Redlock is built on first use
and rebuilt after ``override_settings(REDLOCK=...)`` (the ``setting_changed`` receiver clears
the cache), the way django-debug-toolbar reads its settings.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .core import Redlock
from .core.nodes import NodeSpec

__all__ = [
    "DEFAULTS",
    "get_async_redlock",
    "get_config",
    "get_redlock",
    "resolve_node",
]

#: Every accepted setting and its default. ``checks.py`` flags any other name as a typo.
DEFAULTS: dict[str, Any] = {
    "NODES": [],
    "KEY_PREFIX": "redlock",
    "TTL": 30.0,
    "NODE_TIMEOUT": 0.05,
    "RETRY_COUNT": 3,
    "RETRY_DELAY": 0.2,
    "DRIFT_FACTOR": 0.01,
    "MAX_TTL": None,
    "RESTART_GUARD": True,
    "TRUST_FRESH_CLUSTER": True,
    "REENTRANT": True,
    "AUTO_RENEW": False,
    "META": {},
    #: Dotted path of a callable ``(request, exc) -> HttpResponse`` for views that could not
    #: get their lock; None gives the built-in 423 response.
    "LOCKED_RESPONSE": None,
    #: Seconds after which the admin page flags a lock as stuck.
    "STUCK_AFTER": 300.0,
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
    "META": "meta",
}

CACHE_PREFIX = "cache:"


@functools.cache
def get_config() -> dict[str, Any]:
    """``REDLOCK`` merged over :data:`DEFAULTS` (unknown names are kept for the checks)."""
    user = getattr(settings, "REDLOCK", None) or {}
    if not isinstance(user, Mapping):
        return {**DEFAULTS}
    return {**DEFAULTS, **user}


def resolve_node(spec: Any) -> NodeSpec:
    """A ``NODES`` entry as the core takes it; ``"cache:<alias>"`` becomes that cache's client."""
    if isinstance(spec, str) and spec.startswith(CACHE_PREFIX):
        return _cache_client(spec[len(CACHE_PREFIX):])
    return spec  # type: ignore[no-any-return]


def _cache_client(alias: str) -> Any:
    from django.core.cache import caches
    from django.core.cache.backends.base import InvalidCacheBackendError

    try:
        cache = caches[alias]
    except InvalidCacheBackendError:
        raise ValueError(f"REDLOCK node 'cache:{alias}' names no cache in CACHES") from None
    try:  # django-redis
        from django_redis import get_redis_connection

        return get_redis_connection(alias)
    except (ImportError, NotImplementedError, AttributeError):
        pass
    client = getattr(cache, "_cache", None)
    if client is not None and hasattr(client, "get_client"):  # Django's RedisCache
        return client.get_client(write=True)
    raise ValueError(f"REDLOCK node 'cache:{alias}' is not a Redis cache ({type(cache).__name__})")


def _build(factory: type[Any]) -> Any:
    config = get_config()
    kwargs = {arg: config[name] for name, arg in REDLOCK_ARGUMENTS.items()}
    nodes = [resolve_node(spec) for spec in config["NODES"] or []]
    return factory(nodes, **kwargs)


@functools.cache
def get_redlock() -> Redlock:
    """The process-wide Redlock built from ``settings.REDLOCK`` (built on first call)."""
    redlock: Redlock = _build(Redlock)
    from . import signals

    redlock.listeners.append(signals.send_event)
    return redlock


@functools.cache
def get_async_redlock() -> Any:
    """The asyncio twin of :func:`get_redlock`, sharing its settings."""
    from .core.asyncio import AsyncRedlock
    from . import signals

    redlock = _build(AsyncRedlock)
    redlock.listeners.append(signals.send_event)
    return redlock


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting == "REDLOCK":
        for cached in (get_redlock, get_async_redlock):
            if cached.cache_info().currsize:
                with _suppress():
                    cached().close()
            cached.cache_clear()
        get_config.cache_clear()


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(Exception)
