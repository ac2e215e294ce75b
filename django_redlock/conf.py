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
from .setting import (
    CACHE_PREFIX,
    DEFAULTS,
    REDLOCK_ARGUMENTS,
    cache_client,
    constructor_error,
    first_error,
    format_message,
)

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


def _build(factory: Callable[..., Any]) -> Any:
    """A Redlock (or AsyncRedlock) from the setting, its events sent as Django signals."""
    from . import signals

    # Servers never run the system checks: refuse a broken setting here, as the check would.
    problem = first_error(constructor=False, asyncio=factory is AsyncRedlock)
    if problem is not None:
        raise ImproperlyConfigured(format_message(problem))
    config = get_config()
    kwargs = {arg: config[name] for name, arg in REDLOCK_ARGUMENTS.items()}
    nodes = [resolve_node(spec) for spec in config["NODES"] or []]
    try:
        redlock = factory(nodes, **kwargs)
    except (TypeError, ValueError) as exc:  # what only the constructor judges
        raise ImproperlyConfigured(format_message(constructor_error(exc))) from exc
    redlock.listeners.append(signals.listener_for(redlock))
    return redlock


def _build_redlock() -> Redlock:
    """The process-wide :class:`~django_redlock.Redlock` built from ``settings.REDLOCK``.

    Built on first call (no I/O), shared by every thread, rebuilt after the setting changes.
    Its events are sent as the Django signals of :mod:`django_redlock.signals`.
    """
    return _build(Redlock)


def _build_async_redlock() -> Any:
    """The asyncio twin of :func:`get_redlock` (an ``AsyncRedlock``), same settings.

    The two count holds together: a view holding a lock through one re-enters it in the
    ``@locked`` function it calls through the other (``sync_to_async``, ``async_to_sync``).
    """
    redlock = _build(AsyncRedlock)
    redlock.share_holds(get_redlock())
    return redlock


get_redlock = _Shared(_build_redlock)
#: One AsyncRedlock for the process: it keeps connections per event loop itself (a WSGI
#: server runs each async view in a fresh loop; under ASGI there is one loop).
get_async_redlock = _Shared(_build_async_redlock)


def reset() -> None:
    """Drop the cached settings and Redlocks (closing them); the next call rebuilds them
    (both: the async one shares holds with the sync one it was built beside)."""
    get_config.cache_clear()
    for shared in (get_redlock, get_async_redlock):
        old = shared.cache_clear()
        if old is not None:
            _close(old)


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
