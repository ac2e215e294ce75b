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

__all__ = ["check_backends", "check_backends_reachable"]

TAG = "django_redlock"
OBJ = 'settings.REDLOCK["BACKENDS"]'
EXAMPLE = (
    '"BACKENDS": {"db": {"BACKEND": "django_redlock.backends.database.DatabaseLocks", '
    '"OPTIONS": {"using": "default"}}}'
)


def _error(n: int, msg: str, hint: str | None = None) -> Error:
    return Error(msg, hint=hint, obj=OBJ, id=f"django_redlock.E{n:03d}")


def _entries() -> tuple[dict[str, Any], list[CheckMessage]]:
    """The well-formed BACKENDS entries, and the problems of the others."""
    backends = get_config().get("BACKENDS")
    if backends is None:
        return {}, []
    if not isinstance(backends, Mapping):  # an empty list or string too
        return {}, [
            _error(
                101,
                f"REDLOCK['BACKENDS'] must be a dict of alias -> backend, got {backends!r}.",
                EXAMPLE,
            )
        ]
    good: dict[str, Any] = {}
    problems: list[CheckMessage] = []
    for alias, entry in backends.items():
        if not isinstance(alias, str) or not alias:
            problems.append(
                _error(
                    101, f"REDLOCK['BACKENDS'] alias {alias!r} must be a non-empty str.", EXAMPLE
                )
            )
        elif not isinstance(entry, Mapping) or not isinstance(entry.get("BACKEND"), str):
            problems.append(
                _error(
                    102,
                    f"REDLOCK['BACKENDS'][{alias!r}] needs a 'BACKEND' dotted path, got {entry!r}.",
                    EXAMPLE,
                )
            )
        else:
            good[alias] = entry
    return good, problems


@register(TAG)
def check_backends(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E101 malformed BACKENDS, E102 entry without BACKEND, E103 backend path that does not
    import, E104 options the backend refuses (missing, unknown or bad values), E106 a
    database that cannot hold locks (a private in-memory SQLite database), W101 a database
    setting under which the locks misbehave (SQLite with ATOMIC_REQUESTS)."""
    entries, messages = _entries()
    for alias, entry in entries.items():
        try:
            backend = build_backend(alias, entry)
        except ImportError as exc:
            messages.append(
                _error(
                    103,
                    f"REDLOCK['BACKENDS'][{alias!r}]: cannot import {entry['BACKEND']!r} ({exc}).",
                    "Known backends: django_redlock.backends.database.DatabaseLocks, "
                    "django_redlock.backends.zookeeper.ZooKeeperLocks (extra 'zookeeper'), "
                    "django_redlock.backends.etcd.EtcdLocks.",
                )
            )
        except (TypeError, ValueError) as exc:
            messages.append(
                _error(104, f"{exc}", "See docs/backends.rst for each backend's OPTIONS.")
            )
        else:
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
    entries, _ = _entries()
    messages: list[CheckMessage] = []
    for alias, entry in entries.items():
        try:
            backend = build_backend(alias, entry)
        except Exception:  # reported by check_backends
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
