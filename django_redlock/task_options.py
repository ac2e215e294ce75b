"""The options of :class:`~django_redlock.celery.LockedTask` and their rules, free of Celery so
the system checks can judge ``REDLOCK["LOCKED_TASK"]`` with the very code the task runs.

Numbers and flags go through the core's validators (``django_redlock.core.check_positive``,
``check_flag``), the same the ``Redlock`` constructor and ``@locked`` use: NaN, infinities and
out-of-range values are refused everywhere with the same message, and, as there, a value of the
wrong type is a ``TypeError``, a wrong value of the right type a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .core import check_flag, check_limit, check_positive

__all__ = [
    "CALL_OPTIONS",
    "DEDUPE_POLICIES",
    "HEADER_FIELDS",
    "ON_LOCKED",
    "SETTING_OPTIONS",
    "TASK_ONLY",
    "check_header_fields",
    "check_option_names",
    "check_task_options",
    "header_values",
    "misnamed_options",
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
#: LockedTask options only the task itself sets (decorator or subclass): never per call, never
#: a project default.
TASK_ONLY = ("lock_redlock", "lock_using")
#: Header fields LockedTask writes for itself besides the options: the enqueue-time marker
#: ``[name, token]`` and the count of re-schedules caused by a busy lock.
BOOKKEEPING_FIELDS = ("_queued", "_lock_retries")

_BOOLEANS = ("renew", "retry_counts")
_EVERY_OPTION = (*CALL_OPTIONS, *TASK_ONLY)


def header_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """``{"lock_ttl": 5, ...}`` (option names) as header fields ``{"ttl": 5, ...}``."""
    return {CALL_OPTIONS[k]: v for k, v in options.items() if k in CALL_OPTIONS}


def misnamed_options(names: Iterable[Any], allowed: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(unknown, task_only)``: the names in ``names`` that are no LockedTask option at all, and
    those that are options only a task sets itself (outside ``allowed``), each sorted."""
    allowed = set(allowed)
    unknown = sorted(str(n) for n in names if n not in allowed and n not in _EVERY_OPTION)
    task_only = sorted(str(n) for n in names if n not in allowed and n in _EVERY_OPTION)
    return unknown, task_only


def check_option_names(names: Iterable[Any], where: str) -> None:
    """Raise TypeError naming ``where`` and each ``lock_*`` name in ``names`` (apply_async
    keywords, signature options) that is no per-call option: a misspelt ``lock_tll`` would
    otherwise be sent as a message property and the task run with the default, and
    ``lock_using`` per call would be ignored the same way. Other names are Celery's."""
    unknown, task_only = misnamed_options(
        [n for n in names if isinstance(n, str) and n.startswith("lock_")], CALL_OPTIONS
    )
    said = [f"unknown options: {', '.join(unknown)}"] if unknown else []
    if task_only:
        said.append(f"options a task sets itself, never per call: {', '.join(task_only)}")
    if said:
        raise TypeError(f"{where}: {'; '.join(said)} (per-call options: {', '.join(CALL_OPTIONS)})")


def check_header_fields(header: object, where: str) -> Mapping[str, Any]:
    """The ``redlock`` message header, checked for its shape: a mapping whose keys are option
    fields (``ttl``, ``wait``, ...) or LockedTask's bookkeeping. The values are judged by
    :func:`check_task_options`. A raw header sent without LockedTask (``send_task``) is
    judged on the worker by this same code."""
    if not isinstance(header, Mapping):
        raise TypeError(
            f"{where}: the redlock header must be a dict of options "
            f"({', '.join(HEADER_FIELDS)}), got {header!r}"
        )
    unknown = sorted(
        repr(k) for k in header if k not in HEADER_FIELDS and k not in BOOKKEEPING_FIELDS
    )
    if unknown:
        raise TypeError(
            f"{where}: unknown fields in the redlock header: {', '.join(unknown)} (fields: "
            f"{', '.join(HEADER_FIELDS)})"
        )
    return header


def check_task_options(
    values: Mapping[str, Any],
    where: str,
    *,
    per_call: bool = False,
    max_ttl: float | None = None,
    without_semaphores: str | None = None,
    without_leases: str | None = None,
) -> None:
    """Raise ValueError/TypeError naming ``where`` and the option for a bad value in
    ``values`` (header field names; None means "not given"). A ``per_call`` key travels in
    the JSON message header, so it must be a template, not a callable. Given the lock
    service's ``max_ttl``, a longer ``ttl`` is refused, as the service would refuse it at
    every run; given the name of a service ``without_semaphores``, so is any ``limit``; given
    the name of a service ``without_leases`` (its locks live as long as their holder's
    session), so is any ``dedupe``: the queued marker would follow the producer's session,
    not ``dedupe_ttl``."""
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
    if dedupe and without_leases is not None:
        raise ValueError(
            f"{where}: lock_dedupe {dedupe!r} needs a queued marker that ends after "
            f"lock_dedupe_ttl, and {without_leases} has no lease: its marker would live as "
            "long as the sending process's session, not lock_dedupe_ttl (system check "
            "django_redlock.E107; de-duplicate with lock_using='default' or a leased backend)"
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
