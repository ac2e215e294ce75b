"""``REDLOCK["BACKENDS"]``: lock services by alias, built on first use and shared.

Read through :func:`django_redlock.conf.get_config` (the one cached settings function) and
dropped, closing them, when ``REDLOCK`` or ``DATABASES`` changes. The alias ``"default"`` is
the Redlock over ``NODES`` unless ``BACKENDS`` names it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..conf import get_async_redlock, get_config, get_redlock
from ..setting import format_message
from .base import AsyncLocks, BackendLocks

__all__ = [
    "DEFAULT_ALIAS",
    "EXAMPLE",
    "OBJ",
    "aliases",
    "backend_error",
    "build_backend",
    "get_async_locks",
    "get_locks",
    "judge_backends",
    "judge_entry",
    "reset",
]

DEFAULT_ALIAS = "default"
OBJ = 'settings.REDLOCK["BACKENDS"]'
EXAMPLE = (
    '"BACKENDS": {"db": {"BACKEND": "django_redlock.backends.database.DatabaseLocks", '
    '"OPTIONS": {"using": "default"}}}'
)


def backend_error(n: int, msg: str, hint: str | None = None) -> Error:
    """A ``BACKENDS`` check message (the system check reports it, get_locks() raises it)."""
    return Error(msg, hint=hint, obj=OBJ, id=f"django_redlock.E{n:03d}")


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
    ``REENTRANT`` and ``META`` as the defaults of their locks. ``entry`` is a dict with a
    ``BACKEND`` string (:func:`judge_entry` says so first)."""
    where = f'REDLOCK["BACKENDS"][{alias!r}]'
    unknown = sorted(set(entry) - {"BACKEND", "OPTIONS"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}")
    # Only a missing OPTIONS means none: a falsy non-dict ([], None, 0) is a mistake.
    options = entry.get("OPTIONS", {})
    if not isinstance(options, Mapping):
        raise ValueError(f'{where}["OPTIONS"] must be a dict, got {options!r}')
    factory = import_string(entry["BACKEND"])
    config = get_config()
    if isinstance(factory, type) and issubclass(factory, BackendLocks):
        # One retry policy for every lock service: what acquire(timeout=None) waits.
        retry = {"retry_count": config["RETRY_COUNT"], "retry_delay": config["RETRY_DELAY"]}
        options = {**retry, **options}
    try:
        manager = factory(**options)
    except (TypeError, ValueError) as exc:  # the same type, with the alias in front
        raise type(exc)(f"{where}: {exc}") from None
    if isinstance(manager, BackendLocks):
        # As get_redlock(): @locked and locked() re-enter and store META on every service.
        manager.reentrant = bool(config["REENTRANT"])
        manager.meta = dict(config["META"] or {})
    return manager


def judge_backends(backends: Any) -> list[CheckMessage]:
    """E101 when ``REDLOCK["BACKENDS"]`` is set but not a dict (None: no backends)."""
    if backends is None or isinstance(backends, Mapping):
        return []
    # an empty list or string too
    return [
        backend_error(
            101,
            f"REDLOCK['BACKENDS'] must be a dict of alias -> backend, got {backends!r}.",
            EXAMPLE,
        )
    ]


def judge_entry(alias: Any, entry: Any) -> tuple[Any, CheckMessage | None]:
    """One ``BACKENDS`` entry, built as ``get_locks(alias)`` builds it (no connection is
    opened): ``(the backend, None)``, or ``(None, the error)``: E101 an alias that is not a
    non-empty str, E102 no BACKEND dotted path, E103 a path that does not import, E104
    OPTIONS the backend refuses. The system check reports the error, ``get_locks()`` raises
    it as ImproperlyConfigured: one judgement for both."""
    if not isinstance(alias, str) or not alias:
        return None, backend_error(
            101, f"REDLOCK['BACKENDS'] alias {alias!r} must be a non-empty str.", EXAMPLE
        )
    if not isinstance(entry, Mapping) or not isinstance(entry.get("BACKEND"), str):
        return None, backend_error(
            102,
            f"REDLOCK['BACKENDS'][{alias!r}] needs a 'BACKEND' dotted path, got {entry!r}.",
            EXAMPLE,
        )
    try:
        return build_backend(alias, entry), None
    except ImportError as exc:
        return None, backend_error(
            103,
            f"REDLOCK['BACKENDS'][{alias!r}]: cannot import {entry['BACKEND']!r} ({exc}).",
            "Known backends: django_redlock.backends.database.DatabaseLocks, "
            "django_redlock.backends.zookeeper.ZooKeeperLocks (extra 'zookeeper'), "
            "django_redlock.backends.etcd.EtcdLocks.",
        )
    except (TypeError, ValueError) as exc:
        return None, backend_error(
            104, f"{exc}", "See docs/backends.rst for each backend's OPTIONS."
        )


def get_locks(alias: str = DEFAULT_ALIAS) -> Any:
    """The lock manager named ``alias`` (``get_locks() is get_redlock()``); built on first
    call, shared by every thread, its events sent as the ``django_redlock.signals``."""
    return _cached(alias, get_redlock, asynchronous=False)


def get_async_locks(alias: str = DEFAULT_ALIAS) -> Any:
    """The asyncio twin of :func:`get_locks` (``AsyncRedlock`` for the Redlock default)."""
    return _cached(alias, get_async_redlock, asynchronous=True)


def _cached(alias: str, redlock: Callable[[], Any], *, asynchronous: bool) -> Any:
    backends = _configured()
    if alias == DEFAULT_ALIAS and DEFAULT_ALIAS not in backends:
        return redlock()
    # Servers never run the system checks: a broken entry is refused here as the check
    # reports it (ImproperlyConfigured starting with its id), as get_redlock() does.
    problems = judge_backends(get_config().get("BACKENDS"))
    if problems:  # BACKENDS itself is not a dict (E101)
        raise ImproperlyConfigured(format_message(problems[0]))
    if alias not in backends:
        raise ValueError(
            f'no lock backend {alias!r} in REDLOCK["BACKENDS"] (known: {", ".join(aliases())})'
        )
    with _lock:
        manager = _built.get((alias, False))
        if manager is None:
            from .. import signals

            manager, problem = judge_entry(alias, backends[alias])
            if problem is not None:
                raise ImproperlyConfigured(format_message(problem))
            _built[(alias, False)] = manager
            manager.listeners.append(signals.listener_for(manager))
        if asynchronous and (alias, True) not in _built:
            _built[(alias, True)] = AsyncLocks(manager)
        return _built[(alias, asynchronous)]


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
