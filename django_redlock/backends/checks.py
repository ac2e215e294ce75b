"""System checks for ``REDLOCK["BACKENDS"]`` (ids E101-E106 and W101, listed in
docs/checks.rst).

Building a backend opens no connection, so the settings checks build each one to let its
constructor judge the options; only the deploy check (``check --deploy``) talks to the
services.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register

from ..conf import get_config
from .registry import build_backend

__all__ = ["check_backends", "check_backends_reachable", "judge_backends", "judge_entry"]

TAG = "django_redlock"
OBJ = 'settings.REDLOCK["BACKENDS"]'
EXAMPLE = (
    '"BACKENDS": {"db": {"BACKEND": "django_redlock.backends.database.DatabaseLocks", '
    '"OPTIONS": {"using": "default"}}}'
)


def _error(n: int, msg: str, hint: str | None = None) -> Error:
    return Error(msg, hint=hint, obj=OBJ, id=f"django_redlock.E{n:03d}")


def judge_backends(backends: Any) -> list[CheckMessage]:
    """E101 when ``REDLOCK["BACKENDS"]`` is set but not a dict (None: no backends)."""
    if backends is None or isinstance(backends, Mapping):
        return []
    # an empty list or string too
    return [
        _error(
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
        return None, _error(
            101, f"REDLOCK['BACKENDS'] alias {alias!r} must be a non-empty str.", EXAMPLE
        )
    if not isinstance(entry, Mapping) or not isinstance(entry.get("BACKEND"), str):
        return None, _error(
            102,
            f"REDLOCK['BACKENDS'][{alias!r}] needs a 'BACKEND' dotted path, got {entry!r}.",
            EXAMPLE,
        )
    try:
        return build_backend(alias, entry), None
    except ImportError as exc:
        return None, _error(
            103,
            f"REDLOCK['BACKENDS'][{alias!r}]: cannot import {entry['BACKEND']!r} ({exc}).",
            "Known backends: django_redlock.backends.database.DatabaseLocks, "
            "django_redlock.backends.zookeeper.ZooKeeperLocks (extra 'zookeeper'), "
            "django_redlock.backends.etcd.EtcdLocks.",
        )
    except (TypeError, ValueError) as exc:
        return None, _error(104, f"{exc}", "See docs/backends.rst for each backend's OPTIONS.")


def _entries() -> dict[Any, Any]:
    backends = get_config().get("BACKENDS")
    return dict(backends) if isinstance(backends, Mapping) else {}


@register(TAG)
def check_backends(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E101 malformed BACKENDS, E102 entry without BACKEND, E103 backend path that does not
    import, E104 options the backend refuses (missing, unknown or bad values), E106 a
    database that cannot hold locks (a private in-memory SQLite database), W101 a database
    setting under which the locks misbehave (SQLite with ATOMIC_REQUESTS)."""
    messages = judge_backends(get_config().get("BACKENDS"))
    for alias, entry in _entries().items():
        backend, problem = judge_entry(alias, entry)
        if problem is not None:
            messages.append(problem)
            continue
        reason = getattr(backend, "unusable_reason", lambda: None)()
        if reason:
            messages.append(_error(106, f"REDLOCK['BACKENDS'][{alias!r}]: {reason}"))
        caveat = getattr(backend, "caveat", lambda: None)()
        if caveat:
            messages.append(
                Warning(
                    f"REDLOCK['BACKENDS'][{alias!r}]: {caveat}",
                    hint="Turn ATOMIC_REQUESTS off for that database and release locks "
                    "outside transaction.atomic() blocks that write, or use PostgreSQL or "
                    "MySQL/MariaDB.",
                    obj=OBJ,
                    id="django_redlock.W101",
                )
            )
        backend.close()
    return messages


@register(TAG, deploy=True)
def check_backends_reachable(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E105 (``check --deploy``): a configured lock service does not answer."""
    messages: list[CheckMessage] = []
    for alias, entry in _entries().items():
        try:
            backend, problem = judge_entry(alias, entry)
        except Exception:  # reported by check_backends
            continue
        if problem is not None:  # reported by check_backends
            continue
        try:
            down = [h for h in backend.health() if not h.reachable]
        finally:
            backend.close()
        if down:
            detail = "; ".join(f"{h.node}: {h.error}" for h in down)
            messages.append(
                _error(
                    105,
                    f"Lock backend {alias!r} is unreachable ({detail}).",
                    "Start the service or fix its address; `manage.py redlock --using "
                    f"{alias} check` shows its state.",
                )
            )
    return messages
