"""The options of :class:`~django_redlock.celery.LockedTask` and their rules, free of Celery so
the system checks can judge ``REDLOCK["LOCKED_TASK"]`` with the very code the task runs.

Numbers and flags go through the core's validators (``django_redlock.core.check_positive``,
``check_flag``), the same the ``Redlock`` constructor and ``@locked`` use: NaN, infinities and
out-of-range values are refused everywhere with the same message, and, as there, a value of the
wrong type is a ``TypeError``, a wrong value of the right type a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .core import check_flag, check_limit, check_positive

__all__ = [
    "CALL_OPTIONS",
    "DEDUPE_POLICIES",
    "HEADER_FIELDS",
    "ON_LOCKED",
    "SETTING_OPTIONS",
    "check_task_options",
    "header_values",
]

#: The accepted ``on_locked`` policies.
ON_LOCKED = ("retry", "wait", "skip", "raise")
#: Enqueue-time duplicate policies of ``lock_dedupe`` (``True`` means ``"merge"``).
DEDUPE_POLICIES = ("merge", "drop", "raise")

#: Per-call option (apply_async keyword / signature option / task attribute) -> field of the
#: ``redlock`` message header and of ``LockOptions``.
CALL_OPTIONS = {
    "lock_key": "key",
    "lock_ttl": "ttl",
    "on_locked": "on_locked",
    "lock_wait": "wait",
    "lock_renew": "renew",
    "lock_retry_counts": "retry_counts",
    "lock_max_retries": "max_retries",
    "lock_retry_delay": "retry_delay",
    "lock_retry_jitter": "retry_jitter",
    "lock_dedupe": "dedupe",
    "lock_dedupe_ttl": "dedupe_ttl",
    "lock_limit": "limit",
}
HEADER_FIELDS = {v: k for k, v in CALL_OPTIONS.items()}
#: Options a project may default in ``REDLOCK["LOCKED_TASK"]`` (a key is per task).
SETTING_OPTIONS = tuple(name for name in CALL_OPTIONS if name not in ("lock_key", "lock_limit"))

_BOOLEANS = ("renew", "retry_counts")


def header_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """``{"lock_ttl": 5, ...}`` (option names) as header fields ``{"ttl": 5, ...}``."""
    return {CALL_OPTIONS[k]: v for k, v in options.items() if k in CALL_OPTIONS}


def check_task_options(
    values: Mapping[str, Any],
    where: str,
    *,
    per_call: bool = False,
    max_ttl: float | None = None,
    without_semaphores: str | None = None,
) -> None:
    """Raise ValueError/TypeError naming ``where`` and the option for a bad value in
    ``values`` (header field names; None means "not given"). A ``per_call`` key travels in
    the JSON message header, so it must be a template, not a callable. Given the lock
    service's ``max_ttl``, a longer ``ttl`` is refused, as the service would refuse it at
    every run; given the name of a service ``without_semaphores``, so is any ``limit``."""
    on_locked = values.get("on_locked")
    if on_locked is not None and on_locked not in ON_LOCKED:
        error = ValueError if isinstance(on_locked, str) else TypeError
        raise error(f"{where}: on_locked must be one of {ON_LOCKED}, got {on_locked!r}")
    try:
        for name in ("ttl", "retry_delay", "dedupe_ttl", "wait", "retry_jitter"):
            value = values.get(name)
            if value is not None:
                check_positive(
                    HEADER_FIELDS[name], value, allow_zero=name in ("wait", "retry_jitter")
                )
        for name in _BOOLEANS:
            if values.get(name) is not None:
                check_flag(HEADER_FIELDS[name], values[name])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None
    ttl = values.get("ttl")
    if max_ttl is not None and ttl is not None and ttl > max_ttl:
        raise ValueError(
            f"{where}: lock_ttl {ttl!r} exceeds max_ttl {max_ttl!r} (the lock service refuses "
            "a longer lease)"
        )
    retries = values.get("max_retries")
    if retries is not None:
        not_int = isinstance(retries, bool) or not isinstance(retries, int)
        if not_int or retries < 0:
            raise (TypeError if not_int else ValueError)(
                f"{where}: lock_max_retries must be an int >= 0 or None, got {retries!r}"
            )
    dedupe = values.get("dedupe")
    if dedupe is not None and not isinstance(dedupe, bool) and dedupe not in DEDUPE_POLICIES:
        error = ValueError if isinstance(dedupe, str) else TypeError
        raise error(
            f"{where}: lock_dedupe must be True, False or one of {DEDUPE_POLICIES}, got {dedupe!r}"
        )
    limit = values.get("limit")
    if limit is not None:
        try:
            check_limit(limit, "lock_limit")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if without_semaphores is not None:
            raise ValueError(
                f"{where}: lock_limit {limit!r} needs a semaphore, and {without_semaphores} has "
                "none (semaphores are the Redlock's: lock_using='default')"
            )
    key = values.get("key")
    if key is not None and not isinstance(key, str) and (per_call or not callable(key)):
        kinds = "a str template" if per_call else "a str template or a callable"
        raise TypeError(f"{where}: lock_key must be {kinds}, got {key!r}")
