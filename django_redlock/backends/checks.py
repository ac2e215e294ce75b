"""System checks for ``REDLOCK["BACKENDS"]`` (ids E101-E107 and W101, listed in
docs/checks.rst).

Building a backend opens no connection, so the settings checks build each one to let its
constructor judge the options; only the deploy check (``check --deploy``) talks to the
services.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Warning, register

from ..conf import get_config
from .registry import OBJ, backend_error, judge_backends, judge_entry

__all__ = ["check_backends", "check_backends_reachable", "check_task_dedupe"]

TAG = "django_redlock"
W101_HINT = (
    "Turn ATOMIC_REQUESTS off for that database and release locks outside transaction.atomic() "
    "blocks that write, or use PostgreSQL or MySQL/MariaDB."
)


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
            messages.append(backend_error(106, f"REDLOCK['BACKENDS'][{alias!r}]: {reason}"))
        caveat = getattr(backend, "caveat", lambda: None)()
        if caveat:
            message = f"REDLOCK['BACKENDS'][{alias!r}]: {caveat}"
            messages.append(Warning(message, hint=W101_HINT, obj=OBJ, id="django_redlock.W101"))
        backend.close()
    return messages


@register(TAG)
def check_task_dedupe(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E107: a LockedTask de-duplicates (``lock_dedupe``) on a backend without leases
    (ZooKeeper), which cannot end its queued marker after ``lock_dedupe_ttl``. Only tasks of
    Celery apps this process has created are seen; when LockedTask was never imported there
    are none (and Celery is not imported for this check)."""
    celery_module = sys.modules.get("django_redlock.celery")
    if celery_module is None:
        return []
    try:
        found = celery_module.dedupe_without_leases()
    except Exception:  # an app that cannot be finalized here: its worker will say why
        return []
    return [
        backend_error(
            107,
            f"Task {task!r} has lock_dedupe on lock_using={alias!r} ({kind}): a lock there "
            "has no lease, it lives as long as its holder's session, so the queued marker "
            "would follow the sending process (gone when it exits, kept while it lives), not "
            "lock_dedupe_ttl. apply_async refuses such a call with a ValueError.",
            "De-duplicate on a leased service (lock_using='default', a database or etcd "
            "backend), or drop lock_dedupe from this task (or from REDLOCK['LOCKED_TASK']).",
        )
        for task, alias, kind in found
    ]


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
                backend_error(
                    105,
                    f"Lock backend {alias!r} is unreachable ({detail}).",
                    "Start the service or fix its address; `manage.py redlock --using "
                    f"{alias} check` shows its state.",
                )
            )
    return messages
