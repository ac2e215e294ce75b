"""``REDLOCK["BACKENDS"]``: lock services by alias, built on first use and shared.

Read through :func:`django_redlock.conf.get_config` (the one cached settings function) and
dropped, closing them, when ``REDLOCK`` or ``DATABASES`` changes. The alias ``"default"`` is
the Redlock over ``NODES`` unless ``BACKENDS`` names it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..conf import get_async_redlock, get_config, get_redlock
from .base import AsyncLocks, BackendLocks

__all__ = ["DEFAULT_ALIAS", "aliases", "build_backend", "get_async_locks", "get_locks", "reset"]

DEFAULT_ALIAS = "default"

_built: dict[tuple[str, bool], Any] = {}
_lock = threading.Lock()


def _configured() -> Mapping[str, Any]:
    backends = get_config().get("BACKENDS") or {}
    return backends if isinstance(backends, Mapping) else {}


def aliases() -> list[str]:
    """Every alias :func:`get_locks` accepts, ``"default"`` first."""
    return [DEFAULT_ALIAS, *sorted(a for a in _configured() if a != DEFAULT_ALIAS)]


def build_backend(alias: str, entry: Any) -> Any:
    """A new backend from one ``BACKENDS`` entry; ValueError/TypeError/ImportError naming
    what is wrong (the system checks report the same message). The backends here take
    ``retry_count``/``retry_delay`` from ``REDLOCK`` unless their ``OPTIONS`` name them, and
    ``REENTRANT`` and ``META`` as the defaults of their locks."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("BACKEND"), str):
        raise ValueError(
            f'REDLOCK["BACKENDS"][{alias!r}] must be a dict with a "BACKEND" dotted path, '
            f"got {entry!r}"
        )
    unknown = sorted(set(entry) - {"BACKEND", "OPTIONS"})
    if unknown:
        raise ValueError(f'REDLOCK["BACKENDS"][{alias!r}] has unknown keys {unknown}')
    options = entry.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f'REDLOCK["BACKENDS"][{alias!r}]["OPTIONS"] must be a dict')
    factory = import_string(entry["BACKEND"])
    config = get_config()
    if isinstance(factory, type) and issubclass(factory, BackendLocks):
        # One retry policy for every lock service: what acquire(timeout=None) waits.
        options = {
            "retry_count": config["RETRY_COUNT"],
            "retry_delay": config["RETRY_DELAY"],
            **options,
        }
    try:
        manager = factory(**options)
    except (TypeError, ValueError) as exc:  # the same type, with the alias in front
        raise type(exc)(f'REDLOCK["BACKENDS"][{alias!r}]: {exc}') from None
    if isinstance(manager, BackendLocks):
        # As get_redlock(): @locked and locked() re-enter and store META on every service.
        manager.reentrant = bool(config["REENTRANT"])
        manager.meta = dict(config["META"] or {})
    return manager


def get_locks(alias: str = DEFAULT_ALIAS) -> Any:
    """The lock manager named ``alias`` (``get_locks() is get_redlock()``); built on first
    call, shared by every thread, its events sent as the ``django_redlock.signals``."""
    backends = _configured()
    if alias == DEFAULT_ALIAS and DEFAULT_ALIAS not in backends:
        return get_redlock()
    return _cached(alias, backends, asynchronous=False)


def get_async_locks(alias: str = DEFAULT_ALIAS) -> Any:
    """The asyncio twin of :func:`get_locks` (``AsyncRedlock`` for the Redlock default)."""
    backends = _configured()
    if alias == DEFAULT_ALIAS and DEFAULT_ALIAS not in backends:
        return get_async_redlock()
    return _cached(alias, backends, asynchronous=True)


def _cached(alias: str, backends: Mapping[str, Any], *, asynchronous: bool) -> Any:
    if alias not in backends:
        raise ValueError(
            f'no lock backend {alias!r} in REDLOCK["BACKENDS"] (known: {", ".join(aliases())})'
        )
    with _lock:
        manager = _built.get((alias, False))
        if manager is None:
            from .. import signals

            manager = _built[(alias, False)] = build_backend(alias, backends[alias])
            manager.listeners.append(signals.listener_for(manager))
        if not asynchronous:
            return manager
        twin = _built.get((alias, True))
        if twin is None:
            twin = _built[(alias, True)] = AsyncLocks(manager)
        return twin


def reset() -> None:
    """Forget (and close) every backend built; the next call rebuilds from the settings."""
    with _lock:
        built = [m for (_, twin), m in _built.items() if not twin]
        _built.clear()
    for manager in built:
        with contextlib.suppress(Exception):  # a broken one must not break override_settings
            manager.close()


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("REDLOCK", "DATABASES"):
        reset()
