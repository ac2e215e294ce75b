"""``LockedTask``: a Celery base task that runs at most one task per lock key at a time.

This is the only module of the package that imports Celery (``pip install
django-redlock[celery]``). Usage and the reasoning behind every default are in docs/celery.rst::

    @app.task(base=LockedTask, bind=True, lock_key="sync:{account_id}", lock_ttl=60,
              on_locked="retry", lock_wait=30)
    def sync_account(self, account_id): ...

How it works, in one paragraph: the lock is taken in :meth:`LockedTask.__call__`, i.e. when a
worker starts running the task (never at enqueue time, so a queued or revoked task holds
nothing), with a short lease that the core's watchdog renews while the task runs, and it is
released in a ``finally`` whatever the task does (returns, raises, retries). A worker killed
with SIGKILL stops renewing, so the key is free again within one lease. When the key is busy,
``on_locked`` decides: ``"retry"`` re-schedules the task (without eating its own
``max_retries``), ``"wait"`` blocks (woken by the holder's release), ``"skip"`` ends the task
in the ``SKIPPED`` state with a log line and signals, ``"raise"`` fails it with
:class:`~django_redlock.LockNotAcquired`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import date, datetime, timezone
from datetime import time as dtime
from decimal import Decimal
from typing import Any
from uuid import UUID

from celery import Task, signals
from celery.exceptions import Ignore, Retry
from celery.utils.dispatch import Signal
from celery.utils.saferepr import saferepr

from .core import (
    MAX_KEY_LENGTH,
    LockEvent,
    LockNotAcquired,
    QuorumError,
    Redlock,
    RedlockError,
    process_gone,
)
from .holders import TYPICAL_HOLD, HoldTimes, expected_free_in
from .task_options import (
    CALL_OPTIONS,
    DEDUPE_POLICIES,
    HEADER_FIELDS,
    ON_LOCKED,
    check_task_options,
    header_values,
)

__all__ = [
    "DEDUPE_POLICIES",
    "HEADER",
    "ON_LOCKED",
    "SKIPPED",
    "LockOptions",
    "LockedTask",
    "default_lock_key",
    "release_held_locks",
    "task_dropped",
    "task_skipped",
]

logger = logging.getLogger("django_redlock.celery")

#: Message header carrying per-call options and LockedTask's own bookkeeping.
HEADER = "redlock"
#: Result state of a task that ``on_locked="skip"`` did not run.
SKIPPED = "SKIPPED"

#: Sent (Celery signal) when ``on_locked="skip"`` ends a task without running it, with
#: ``sender`` = the task and the keyword arguments ``task_id``, ``lock_name``, ``holder`` (the
#: holder's metadata, ``{}`` when unknown), ``args``, ``kwargs``.
task_skipped = Signal(name="task_skipped")
#: Sent when ``lock_dedupe="drop"`` does not send a task because one is already queued for its
#: key, with ``sender`` = the task and ``task_id`` (the id it would have had), ``lock_name``,
#: ``queued_id`` (the queued task's id), ``args``, ``kwargs``.
task_dropped = Signal(name="task_dropped")

DEFAULT_TTL = 30.0
DEFAULT_WAIT = 30.0
DEFAULT_RETRY_JITTER = 0.5
#: Countdown of a lock retry when the holder's typical hold is unknown (doubles per retry,
#: up to :data:`MAX_UNKNOWN_HOLD_DELAY`).
UNKNOWN_HOLD_DELAY = 0.25
#: Longest countdown while the typical hold is unknown (a fresh worker's first burst): a
#: blind backoff that kept doubling left a burst of short tasks idle for seconds between holds.
MAX_UNKNOWN_HOLD_DELAY = 1.0
#: Later lock retries spread over up to this many typical holds (1, 2, 4, ... per retry).
MAX_SPREAD = 4
#: Suffix of the enqueue-time de-duplication marker of ``lock_dedupe``.
QUEUED_SUFFIX = ":queued"
#: Suffix of the per-key "one waiting task" slot of ``on_locked="retry"``.
WAITER_SUFFIX = ":waiter"
#: Seconds a waiting task blocks beyond the holder's lease (and its slot outlives the wait).
SLOT_GRACE = 0.5
#: Longest block in the waiting slot: a longer hold is waited for by re-scheduling, which
#: costs little next to it, so a busy key never ties up a worker slot for long.
MAX_SLOT_WAIT = 2.0
DEFAULT_DEDUPE_TTL = 3600.0
#: Keys longer than this (default keys only) are replaced by a readable prefix + SHA-256.
DEFAULT_KEY_MAX = 200
#: Characters of the arguments summary stored with the lock (admin page).
ARGS_SUMMARY_MAX = 200
#: Exponential backoff stops doubling after this many lock retries.
_MAX_DOUBLINGS = 10

# Bookkeeping keys (not options) in the header.
_QUEUED = "_queued"  # [lock name, token] of the enqueue-time de-duplication lock
_LOCK_RETRIES = "_lock_retries"  # re-schedules caused by a busy lock so far


@dataclasses.dataclass(frozen=True)
class LockOptions:
    """The options one run of a task uses: class attributes overlaid with per-call values."""

    key: Any
    ttl: float | None
    on_locked: str
    wait: float | None
    renew: bool
    retry_counts: bool
    max_retries: int | None
    retry_delay: float | None
    retry_jitter: float
    dedupe: str | bool
    dedupe_ttl: float

    def effective_wait(self) -> float:
        """Seconds to block for the lock before ``on_locked`` applies."""
        if self.wait is not None:
            return self.wait
        return DEFAULT_WAIT if self.on_locked == "wait" else 0.0


# ============================================================================ keys


_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")


def _normalise(value: Any) -> Any:
    """A JSON-ready, stable form of an argument: the same value gives the same key before
    and after Celery's JSON round trip (tuples become lists, UUIDs and dates strings), and
    nothing that depends on memory addresses or set ordering gets in."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return _normalise(value.value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (Decimal, UUID)):
        return str(value)
    if isinstance(value, (datetime, date, dtime)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes:" + bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_normalise(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, default=str))
    pk = getattr(value, "pk", None)
    meta = getattr(value, "_meta", None)
    label = getattr(meta, "label_lower", None)
    if pk is not None and label:  # a Django model instance
        return f"{label}:{_normalise(pk)}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {type(value).__qualname__: _normalise(fields)}
    if type(value).__str__ is not object.__str__:  # type: ignore[comparison-overlap]
        text = str(value)
        if not _ADDRESS.search(text):
            return f"{type(value).__qualname__}:{text}"
    raise TypeError(
        f"cannot build a lock key from a {type(value).__qualname__} argument (it has no stable "
        "text); give the task a lock_key template naming a stable field"
    )


def default_lock_key(task_name: str, arguments: Mapping[str, Any]) -> str:
    """The key used without ``lock_key``: the task name plus its bound arguments as canonical
    JSON (sorted keys, no spaces); long keys end in a SHA-256 of the JSON instead."""
    body = json.dumps(
        _normalise(dict(arguments)), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    key = f"{task_name}:{body}"
    if len(key) <= DEFAULT_KEY_MAX:
        return key
    digest = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{task_name}:sha256-{digest}"[:MAX_KEY_LENGTH]


# ============================================================================ holders
# Two locks are released by a process that did not take them: the enqueue-time
# de-duplication lock (taken by the producer, freed by the worker) and the lock of a pool
# child the worker's main process killed (revoke with terminate, cold shutdown, hard time
# limit). Both go through Redlock.release_token, the compare-and-delete a handle uses, so they
# can never remove someone else's lock.


def _holder(redlock: Redlock, name: str) -> dict[str, Any]:
    """The current holder's metadata (``{}`` when free or unknown)."""
    try:
        info = redlock.lock_info(name)
    except Exception:
        logger.debug("could not read the holder of %s", name, exc_info=True)
        return {}
    if info is None:
        return {}
    return {**info.meta, "token": info.token, "ttl": info.ttl, "age": info.age}


# ============================================================================ held locks


class _HeldLocks:
    """Locks this process's tasks hold right now, for release at worker shutdown."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, Any] = {}

    def add(self, lock: Any) -> None:
        with self._guard:
            self._locks[id(lock)] = lock

    def discard(self, lock: Any) -> None:
        with self._guard:
            self._locks.pop(id(lock), None)

    def snapshot(self) -> list[Any]:
        with self._guard:
            return list(self._locks.values())

    def clear(self) -> list[Any]:
        with self._guard:
            locks, self._locks = list(self._locks.values()), {}
        return locks

    def after_fork(self) -> None:
        self._guard = threading.Lock()
        self._locks = {}


_held = _HeldLocks()
_hold_times = HoldTimes()
#: The lock of the LockedTask run in progress in this thread / coroutine context.
_current_lock: ContextVar[Any] = ContextVar("django_redlock_celery_lock", default=None)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_held.after_fork)


def release_held_locks(reason: str = "worker shutdown") -> int:
    """Release every task lock this process holds (the shutdown signals call this); returns
    how many were released. Tasks still running lose their lock (their ``held`` turns False)."""
    released = 0
    for lock in _held.clear():
        try:
            lock.release()
        except RedlockError as exc:
            logger.debug("releasing %s at %s: %s", lock.name, reason, exc)
        except Exception:
            logger.warning("could not release %s at %s", lock.name, reason, exc_info=True)
        else:
            released += 1
            logger.warning("released lock %s of a running task (%s)", lock.name, reason)
    return released


# ============================================================================ the task class


class LockedTask(Task):
    """A Celery task that holds a Redlock lock while it runs (see docs/celery.rst).

    Attributes (all settable in ``@app.task(...)``, most overridable per call):

    ``lock_key``
        Template formatted with the task's bound arguments (``"sync:{account_id}"``; same
        rules as ``@locked``), or a callable ``(*args, **kwargs) -> str``. Default: the task
        name plus the normalised arguments (:func:`default_lock_key`).
    ``lock_ttl``
        Lease in seconds (default 30, renewed every ttl/3 while the task runs).
    ``on_locked``
        ``"retry"`` (default), ``"wait"``, ``"skip"`` or ``"raise"``.
    ``lock_wait``
        Seconds to block for the lock before ``on_locked`` applies (default 0, and 30 for
        ``"wait"``). Woken by the holder's release, not by polling.
    ``lock_renew``
        Renew the lease while the task runs (default True).
    ``lock_redlock``
        A :class:`~django_redlock.Redlock`, or a callable returning one; default
        :func:`django_redlock.get_redlock` (the ``REDLOCK`` setting).
    ``lock_using``
        The lock service, a ``REDLOCK["BACKENDS"]`` alias (``get_locks(alias)``) used when
        ``lock_redlock`` is not set; default ``"default"``.
    ``lock_retry_counts``
        Whether lock retries count against the task's own ``max_retries`` (default False).
    ``lock_max_retries``
        Lock retries allowed before the task fails with LockNotAcquired (None: no limit).
    ``lock_retry_delay`` / ``lock_retry_jitter``
        Backoff of lock retries. None (default): come back when the holder will probably be
        done (its typical hold), one waiting task per key blocking for the release; a number:
        ``min(delay * 2**n, holder's remaining lease)``, stretched by a random factor in
        ``[1, 1 + jitter]``.
    ``lock_dedupe`` / ``lock_dedupe_ttl``
        Enqueue-time duplicate policy: False (default), ``"merge"`` (or True: return the queued
        task's result), ``"drop"`` (log, signal, return a REJECTED result) or ``"raise"``
        (LockNotAcquired); at most one queued plus one running task per key.

    Every option except ``lock_key`` and ``lock_redlock`` defaults to the project's
    ``REDLOCK["LOCKED_TASK"]`` value when the task does not set it. ``acks_late`` and
    ``reject_on_worker_lost`` are True: a task whose worker dies mid-run is delivered again
    (docs/celery.rst, "No lost task").
    """

    abstract = True  # Celery < 5 compatibility; ignored by Celery 5
    # Acknowledge after the run, and requeue when the pool process dies: with Celery's early
    # acknowledgement a worker killed mid-task loses the task for good. The lock keeps the
    # redelivered copy from overlapping a run that is still going (see _contend).
    acks_late = True
    reject_on_worker_lost = True
    lock_key: Any = None
    lock_ttl: float | None = None
    on_locked: str = "retry"
    lock_wait: float | None = None
    lock_renew: bool = True
    lock_redlock: Any = None
    lock_using: str = "default"
    lock_retry_counts: bool = False
    lock_max_retries: int | None = None
    lock_retry_delay: float | None = None
    lock_retry_jitter: float = DEFAULT_RETRY_JITTER
    lock_dedupe: bool | str = False
    lock_dedupe_ttl: float = DEFAULT_DEDUPE_TTL

    # -- options ----------------------------------------------------------------------------

    def lock_options(self, overrides: Mapping[str, Any] | None = None) -> LockOptions:
        """Project defaults (``REDLOCK["LOCKED_TASK"]``) overlaid with the options this task
        sets itself, then with per-call ``overrides`` (header field names)."""
        defaults = header_values(_project_defaults())
        values = {
            field: _class_attr(self, option)
            if option == "lock_key" or _sets_itself(self, option) or field not in defaults
            else defaults[field]
            for option, field in CALL_OPTIONS.items()
        }
        check_task_options(values, f"task {self.name}")
        self._check_template(values["key"], f"task {self.name}")
        if overrides:
            given = {k: v for k, v in overrides.items() if k in HEADER_FIELDS}
            where = f"task {self.name} (per-call options)"
            check_task_options(given, where, per_call=True)
            self._check_template(given.get("key"), where)
            values.update(given)
        if values["dedupe"] is True:
            values["dedupe"] = "merge"
        return LockOptions(**values)

    def _check_template(self, key: Any, where: str) -> None:
        """Refuse a ``lock_key`` template ``@locked`` would refuse (malformed, positional or
        unseparated fields, via the same :class:`~django_redlock.keys.KeyTemplate`), or one
        naming a field that is not an argument of the task, before anything is sent."""
        if not isinstance(key, str) or ("{" not in key and "}" not in key):
            return
        from .keys import compiled_template

        try:
            template = compiled_template(key)
        except ValueError as exc:
            raise ValueError(f"{where}: lock_key: {exc}") from None
        try:
            signature = inspect.signature(self.run)
        except (TypeError, ValueError):
            return
        missing = template.unknown_fields(signature)
        if missing:
            names = {p.name for p in signature.parameters.values()}
            raise ValueError(
                f"{where}: lock_key {key!r} names {', '.join(missing)}, not an argument of the "
                f"task (arguments: {', '.join(sorted(names)) or 'none'})"
            )

    def get_redlock(self) -> Redlock:
        """The Redlock this task locks with (``lock_redlock``, else ``get_redlock()``)."""
        source = _class_attr(self, "lock_redlock")
        if source is None:
            from .backends.registry import get_locks

            return get_locks(self.lock_using)
        if isinstance(source, Redlock) or hasattr(source, "lock"):
            return source
        return source()

    def lock_name(
        self, args: Any = None, kwargs: Any = None, options: LockOptions | None = None
    ) -> str:
        """The lock name a call with these arguments uses."""
        options = options or self.lock_options()
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        key = options.key
        if callable(key):
            name = key(*args, **kwargs)
            if not isinstance(name, str):
                raise TypeError(f"task {self.name}: lock_key returned {name!r}, not a str")
            return name
        arguments = self._bound_arguments(args, kwargs)
        if key is None:
            return default_lock_key(self.name, arguments)
        if "{" not in key:
            return str(key)
        from .keys import make_key

        return make_key(key, **arguments)

    def _bound_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            signature = inspect.signature(self.run)
        except (TypeError, ValueError):
            return {"args": list(args), "kwargs": kwargs}
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"task {self.name}: cannot bind the arguments for its lock key: {exc}"
            ) from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD and param.name in arguments:
                # **kwargs fields are addressable by their own names in templates too.
                extra = arguments[param.name]
                arguments = {**extra, **arguments}
        return arguments

    # -- enqueueing -------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """``apply_async`` taking LockedTask's per-call options (``lock_key=...``,
        ``on_locked=...``, ...; also through ``sig.set(...)``), carried in the ``redlock``
        message header; with ``lock_dedupe`` it may return the already queued task's result
        instead of sending a new message."""
        overrides = {CALL_OPTIONS[k]: options.pop(k) for k in list(options) if k in CALL_OPTIONS}
        headers = dict(options.pop("headers", None) or {})
        header = dict(headers.get(HEADER) or {})
        header.update(overrides)
        opts = self.lock_options(header)
        queued = None
        if opts.dedupe and _QUEUED not in header and not self.app.conf.task_always_eager:
            from celery.utils import uuid

            task_id = task_id or uuid()
            name = self.lock_name(args, kwargs, opts)
            delay = _delay_of(options)
            queued = self._take_queued(name, task_id, opts, delay, args, kwargs)
            if isinstance(queued, str):  # someone else's queued task
                return self._duplicate(opts, name, task_id, queued, args, kwargs)
            if queued is not None:
                header[_QUEUED] = [queued[0], queued[1]]
        if header:
            headers[HEADER] = header
        if headers:
            options["headers"] = headers
        try:
            return super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
        except BaseException:
            if queued is not None and not isinstance(queued, str):
                self.get_redlock().release_token(queued[0], queued[1])
            raise

    def _duplicate(
        self, opts: LockOptions, name: str, task_id: str, queued_id: str, args: Any, kwargs: Any
    ) -> Any:
        """Apply the ``lock_dedupe`` policy to a call whose key already has a queued task."""
        if opts.dedupe == "raise":
            raise LockNotAcquired(
                f"task {self.name} not sent: {self.name}[{queued_id}] is already queued for "
                f"lock {name!r}",
                name,
            )
        if opts.dedupe == "drop":
            logger.warning(
                "task %s[%s] dropped: %s[%s] is already queued for lock %s",
                self.name,
                task_id,
                self.name,
                queued_id,
                name,
            )
            task_dropped.send(
                sender=self,
                task_id=task_id,
                lock_name=name,
                queued_id=queued_id,
                args=args,
                kwargs=kwargs,
            )
            from celery import states
            from celery.result import EagerResult

            return EagerResult(task_id, None, states.REJECTED)
        logger.info(
            "task %s merged into %s[%s], already queued for lock %s",
            self.name,
            self.name,
            queued_id,
            name,
        )
        return self.AsyncResult(queued_id)

    def _take_queued(
        self, name: str, task_id: str, opts: LockOptions, delay: float, args: Any, kwargs: Any
    ) -> tuple[str, str] | str | None:
        """Take ``<name>:queued`` for this task id: ``(queued name, token)``, or the id of
        the task already queued for the key (a str), or None when de-duplication could not
        tell (nodes down: the task is sent anyway, never lost)."""
        redlock = self.get_redlock()
        queued_name = f"{name}{QUEUED_SUFFIX}"
        ttl = min(opts.dedupe_ttl + delay, redlock.max_ttl)
        lock = redlock.lock(
            queued_name,
            ttl=ttl,
            reentrant=False,
            owner=("celery-queued", task_id),
            meta={
                "task_id": task_id,
                "task": self.name,
                "queued": True,
                "args": _summary(args, kwargs),
            },
        )
        try:
            acquired = lock.acquire(blocking=False)
        except QuorumError:
            logger.warning(
                "task %s[%s]: de-duplication unavailable (too few lock nodes), sending it anyway",
                self.name,
                task_id,
                exc_info=True,
            )
            return None
        if acquired:
            # The worker that runs the task frees it by token (Redlock.release_token).
            return (queued_name, lock.detach())
        holder = _holder(redlock, queued_name)
        other = holder.get("task_id")
        if not other:
            return None  # freed in between; send it (at worst two queued, never zero)
        return str(other)

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        header = _header_of(request)
        opts = self.lock_options(header)
        redlock = self.get_redlock()
        name = self.lock_name(args, kwargs, opts)
        task_id = request.id
        lock_retries = int(header.get(_LOCK_RETRIES, 0) or 0)
        ttl, renew, renew_for = self._lease_for(request, opts, redlock)
        meta = {
            "task_id": task_id,
            "task": self.name,
            "worker": request.hostname,
            "args": _summary(args, kwargs),
            "attempt": f"{request.retries or 0}.{lock_retries}",
            "on_locked": opts.on_locked,
            **_hold_times.meta(self.name),
        }
        lock = redlock.lock(
            name,
            ttl=ttl,
            auto_renew=renew,
            renew_for=renew_for,
            reentrant=False,
            owner=("celery", task_id or id(request)),
            meta=meta,
        )
        wait = opts.effective_wait()
        holder: dict[str, Any] | None = None
        try:
            acquired = lock.acquire(blocking=wait > 0, timeout=wait if wait > 0 else None)
            if not acquired:
                acquired, holder = self._contend(redlock, lock, request, opts, name)
        except QuorumError as exc:
            # Too few nodes answered: nobody knows whether the key is free. "retry" and "skip"
            # re-schedule (a skip needs a holder to skip for); "wait" and "raise" fail.
            requeue = opts.on_locked in ("retry", "skip") and not _eager(request)
            logger.warning("task %s[%s]: lock %s unavailable: %s", self.name, task_id, name, exc)
            if requeue:
                countdown = self._countdown(opts, lock_retries, {})
                self._retry_later(request, header, opts, name, lock_retries, exc, countdown)
            self._release_queued(redlock, request, header, final=True)
            raise
        if not acquired:
            return self._locked_out(
                redlock, lock, request, header, opts, name, lock_retries, args, kwargs, holder
            )
        self._release_queued(redlock, request, header, final=True)
        # Not an attribute of the request: Celery copies unknown request attributes into the
        # headers of any message the task sends (retries included).
        current = _current_lock.set(lock)
        _held.add(lock)
        started = time.monotonic()
        stopped: BaseException | None = None
        try:
            return super().__call__(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt) as exc:
            # The pool process is being stopped (a cold shutdown, a terminate): the task did
            # not finish, and its key is freed for the next one below; operators must see it.
            stopped = exc
            raise
        finally:
            _hold_times.record(self.name, time.monotonic() - started)
            _current_lock.reset(current)
            _held.discard(lock)
            try:
                lock.release()
            except RedlockError as exc:
                # Lost while running (lease ran out, a quorum forgot it, or force-released):
                # the core already sent lock_lost; say which task it was.
                logger.error(
                    "task %s[%s] finished without holding lock %s: %s",
                    self.name,
                    task_id,
                    name,
                    exc,
                )
            else:
                if stopped is not None:
                    logger.warning(
                        "released lock %s of task %s[%s]: the task was stopped (%r, a worker "
                        "shutdown or terminate)",
                        name,
                        self.name,
                        task_id,
                        stopped,
                    )

    def _lease_for(
        self, request: Any, opts: LockOptions, redlock: Redlock
    ) -> tuple[float, bool, float | None]:
        """``(ttl, auto_renew, renew_for)`` from the options and the task's time limits."""
        ttl = float(opts.ttl or min(DEFAULT_TTL, redlock.max_ttl))
        limit = _time_limit(self, request)
        if opts.renew:
            # Renewal stops once the task has overrun its hard (else soft) limit, so a task
            # the pool cannot kill (threads pool) cannot keep the key for ever.
            return ttl, True, limit
        if limit and limit + 1 > ttl:
            if limit + 1 <= redlock.max_ttl:
                return limit + 1, False, None
            logger.warning(
                "task %s: time limit %ss exceeds the lock's max_ttl %ss, renewing "
                "the lease instead",
                self.name,
                limit,
                redlock.max_ttl,
            )
            return ttl, True, limit
        return ttl, False, None

    def _locked_out(
        self,
        redlock: Redlock,
        lock: Any,
        request: Any,
        header: dict[str, Any],
        opts: LockOptions,
        name: str,
        lock_retries: int,
        args: Any,
        kwargs: Any,
        holder: dict[str, Any] | None,
    ) -> Any:
        """Apply ``on_locked``; ``holder`` is the holder as :meth:`_contend` just read it (None:
        read it now)."""
        policy = opts.on_locked
        if holder is None:
            holder = _holder(redlock, name)
        exc = LockNotAcquired(
            f"task {self.name}[{request.id}]: lock {name!r} is held by {_describe(holder)}",
            name,
            retry_after=lock.retry_after,
        )
        countdown = self._countdown(opts, lock_retries, holder)
        if request.id and holder.get("task_id") == request.id and not _eager(request):
            # Held under this very task id: an earlier attempt of ours (a lease left on nodes
            # that answered too late, a worker on another host that died), or another delivery
            # of this message still running (visibility_timeout shorter than the task).
            # Skipping or failing would drop the task for good: come back when that lease has
            # run out.
            logger.warning(
                "task %s[%s]: lock %s is held under this task's own id (attempt %s, now %s): "
                "an earlier attempt's lease, or a redelivery while the task still runs (the "
                "broker's visibility_timeout must exceed the longest task); retrying in %.1fs",
                self.name,
                request.id,
                name,
                holder.get("attempt"),
                f"{request.retries or 0}.{lock_retries}",
                lock.retry_after or 0.0,
            )
            countdown = max(countdown, lock.retry_after or 0.0)
            self._retry_later(request, header, opts, name, lock_retries, exc, countdown)
        if policy == "retry" and not _eager(request):
            self._retry_later(request, header, opts, name, lock_retries, exc, countdown)
        self._release_queued(redlock, request, header, final=True)
        if policy == "skip":
            self._skip(redlock, lock, request, name, holder, args, kwargs)
        if policy == "wait":
            exc = LockNotAcquired(
                f"task {self.name}[{request.id}]: lock {name!r} still held by "
                f"{_describe(holder)} after waiting {opts.effective_wait():g}s",
                name,
                retry_after=lock.retry_after,
            )
        raise exc

    def _contend(
        self, redlock: Redlock, lock: Any, request: Any, opts: LockOptions, name: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """After a refused attempt: True if the lock was taken after all, because its holder
        was this task's own earlier attempt in a process that is gone, or (``on_locked=
        "retry"`` without ``lock_wait``) because this task got the key's one waiting slot and
        the holder let go while it waited. Also the holder it read, while that is still the
        latest word (nothing was released or waited for since), else None."""
        if _eager(request):
            return False, None
        holder = _holder(redlock, name)
        if (
            request.id
            and holder.get("task_id") == request.id
            and process_gone(holder, certain=True)
        ):
            # A pool process killed mid-run: its message came back (reject_on_worker_lost)
            # while its lease still runs. Nobody is in the critical section any more.
            freed = redlock.release_token(name, holder["token"])
            logger.warning(
                "task %s[%s]: freed lock %s of this task's earlier attempt (pid %s is gone, "
                "%s nodes)",
                self.name,
                request.id,
                name,
                holder.get("pid"),
                freed,
            )
            return bool(lock.acquire(blocking=False)), None
        if opts.on_locked != "retry" or opts.wait or not holder:
            return False, holder
        waited = self._wait_in_slot(redlock, lock, request, name, holder)
        return (False, holder) if waited is None else (waited, None)

    def _wait_in_slot(
        self, redlock: Redlock, lock: Any, request: Any, name: str, holder: Mapping[str, Any]
    ) -> bool | None:
        """Block for the lock if no other task of this key is blocking for it already (one
        worker slot per key waits, woken by the release; the others are re-scheduled). The
        wait ends with the holder's current lease, and after :data:`MAX_SLOT_WAIT`: a long
        hold is waited for by re-scheduling, not by a blocked slot. Whether the lock was
        taken; None when this task did not wait (the slot is taken)."""
        slot_name = name + WAITER_SUFFIX
        if len(slot_name) > MAX_KEY_LENGTH:
            return None
        wait = min(float(holder.get("ttl") or 0.0) + SLOT_GRACE, MAX_SLOT_WAIT)
        slot = redlock.lock(
            slot_name,
            ttl=min(wait + SLOT_GRACE, redlock.max_ttl),
            reentrant=False,
            owner=("celery-waiter", request.id or id(request)),
            meta={"task_id": request.id, "task": self.name, "waiting_for": name},
        )
        try:
            if not slot.acquire(blocking=False):
                return None
        except QuorumError:
            return None
        try:
            return bool(lock.acquire(blocking=True, timeout=wait))
        finally:
            with contextlib.suppress(RedlockError):
                slot.release()

    def _countdown(self, opts: LockOptions, lock_retries: int, holder: Mapping[str, Any]) -> float:
        """Seconds until a lock retry: with ``lock_retry_delay`` a capped exponential
        backoff; by default when the key's waiting task will have taken the lock (the
        holder's expected end), spread over more typical holds on each retry so the queue of
        re-scheduled tasks keeps exactly one of them waiting without polling."""
        lease = float(holder.get("ttl") or 0.0)
        doubling = 2 ** min(lock_retries, _MAX_DOUBLINGS)
        typical = holder.get(TYPICAL_HOLD) or _hold_times.typical(self.name)
        if opts.retry_delay is not None or not typical:
            if opts.retry_delay is not None:
                base = opts.retry_delay * doubling
            else:
                base = min(UNKNOWN_HOLD_DELAY * doubling, MAX_UNKNOWN_HOLD_DELAY)
            delay = min(base, lease) if lease > 0 else base
            delay = max(delay, 0.05) * (1 + random.uniform(0, opts.retry_jitter))
        else:
            # The holder's own typical hold, else what this process saw of this task's holds:
            # a holder in a process that has not finished a hold yet publishes none, and its
            # remaining lease would send every retry far past its real end.
            estimate = {TYPICAL_HOLD: typical}
            free_in = expected_free_in(estimate, holder.get("age"), lease) if lease > 0 else 0.0
            spread = float(typical) * min(doubling, MAX_SPREAD) * (1 + opts.retry_jitter)
            delay = max(free_in + random.uniform(0, spread), 0.02)
        return round(delay, 3)

    def _retry_later(
        self,
        request: Any,
        header: dict[str, Any],
        opts: LockOptions,
        name: str,
        lock_retries: int,
        exc: LockNotAcquired,
        countdown: float,
    ) -> None:
        """Re-schedule this task in ``countdown`` seconds (raises Retry)."""
        new_header = {**header, _LOCK_RETRIES: lock_retries + 1}
        queued = header.get(_QUEUED)
        if queued:
            # Keep our place as "the queued one" through the retry.
            redlock = self.get_redlock()
            ttl = min(opts.dedupe_ttl + countdown, redlock.max_ttl)
            if not redlock.extend_token(queued[0], queued[1], ttl):
                new_header.pop(_QUEUED, None)
        headers = {**(request.headers or {}), HEADER: new_header}
        if opts.retry_counts:
            limit = self.max_retries if opts.max_retries is None else opts.max_retries
            if limit is None or (request.retries or 0) < limit:
                self.retry(exc=exc, countdown=countdown, max_retries=limit, headers=headers)
        elif opts.max_retries is None or lock_retries < opts.max_retries:
            # Task.retry would count this against the task's own max_retries; re-send the
            # same request with its retries count unchanged instead, and raise Retry like it
            # does (the worker logs it, stores RETRY and sends task_retry).
            sig = self.signature_from_request(
                request,
                countdown=countdown,
                retries=request.retries,
                headers=headers,
            )
            sig.apply_async()
            raise Retry(exc=exc, when=countdown, sig=sig)
        self._release_queued(self.get_redlock(), request, header, final=True)
        raise LockNotAcquired(
            f"{exc} (gave up after {lock_retries} lock retries)",
            name,
            retry_after=exc.retry_after,
        )

    def _skip(
        self,
        redlock: Redlock,
        lock: Any,
        request: Any,
        name: str,
        holder: dict[str, Any],
        args: Any,
        kwargs: Any,
    ) -> None:
        logger.warning(
            "task %s[%s] skipped: lock %s is held by %s",
            self.name,
            request.id,
            name,
            _describe(holder),
        )
        _django_contended(redlock, lock)
        task_skipped.send(
            sender=self, task_id=request.id, lock_name=name, holder=holder, args=args, kwargs=kwargs
        )
        if request.id and not request.called_directly and not self.ignore_result:
            try:
                self.update_state(
                    state=SKIPPED,
                    meta={
                        "lock": name,
                        "holder": holder.get("task_id"),
                        "holder_task": holder.get("task"),
                        "reason": "lock held",
                    },
                )
            except Exception:
                logger.warning(
                    "task %s[%s]: could not store the SKIPPED state",
                    self.name,
                    request.id,
                    exc_info=True,
                )
        raise Ignore()

    def _release_queued(
        self, redlock: Redlock, request: Any, header: dict[str, Any], *, final: bool
    ) -> None:
        queued = header.get(_QUEUED)
        if not queued or not final:
            return
        try:
            redlock.release_token(queued[0], queued[1])
        except Exception:
            logger.warning("could not release the queued marker %s", queued[0], exc_info=True)
        # A later self.retry() of this task is a new queued copy, not this one.
        header.pop(_QUEUED, None)
        if isinstance(request.headers, dict):
            request.headers[HEADER] = dict(header)

    # -- helpers for tasks ------------------------------------------------------------------

    @property
    def lock(self) -> Any:
        """The lock the running task holds (check ``self.lock.held`` before a write that must
        not happen twice; ``self.lock.fence`` with fencing). None outside a run."""
        return _current_lock.get()

    def release_for_request(self, request: Any) -> bool:
        """Release the lock that the task run ``request`` (a Celery request/context) holds,
        from any process (the main process of a prefork worker, say); True if released."""
        header = _header_of(request)
        redlock = self.get_redlock()
        done = False
        try:
            opts = self.lock_options(header)
            name = self.lock_name(request.args, request.kwargs, opts)
            holder = _holder(redlock, name)
            if holder.get("task_id") and holder.get("task_id") == request.id:
                done = redlock.release_token(name, holder["token"]) > 0
        except Exception:
            logger.warning(
                "could not release the lock of %s[%s]", self.name, request.id, exc_info=True
            )
        queued = header.get(_QUEUED)
        if queued:
            try:
                redlock.release_token(queued[0], queued[1])
            except Exception:
                logger.debug("could not release %s", queued[0], exc_info=True)
        return done


# ============================================================================ small helpers


def _class_attr(task: Any, name: str) -> Any:
    # A function assigned as a class attribute must not become a bound method.
    return getattr(type(task), name, None)


def _sets_itself(task: Any, name: str) -> bool:
    """Whether ``name`` is set by the task (or a base class of its own), not LockedTask."""
    for klass in type(task).__mro__:
        if name in vars(klass):
            return klass is not LockedTask
    return False


def _project_defaults() -> Mapping[str, Any]:
    """``REDLOCK["LOCKED_TASK"]`` when Django is configured (LockedTask also runs without
    Django, with an explicit ``lock_redlock``)."""
    try:
        from django.conf import settings

        if not settings.configured:
            return {}
    except ImportError:
        return {}
    from .conf import get_config

    defaults = get_config().get("LOCKED_TASK")
    return defaults if isinstance(defaults, Mapping) else {}


def _header_of(request: Any) -> dict[str, Any]:
    headers = getattr(request, "headers", None) or {}
    header = headers.get(HEADER) if isinstance(headers, Mapping) else None
    if header is None:
        header = getattr(request, HEADER, None)
    return dict(header) if isinstance(header, Mapping) else {}


def _eager(request: Any) -> bool:
    return bool(request.is_eager or request.called_directly)


def _delay_of(options: Mapping[str, Any]) -> float:
    countdown = options.get("countdown")
    if countdown:
        return max(float(countdown), 0.0)
    eta = options.get("eta")
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    now = datetime.now(timezone.utc) if eta.tzinfo else datetime.now()
    return max((eta - now).total_seconds(), 0.0)


def _time_limit(task: Any, request: Any) -> float | None:
    hard, soft = [*(request.timelimit or ()), None, None][:2]
    conf = task.app.conf
    hard = hard or task.time_limit or conf.task_time_limit
    soft = soft or task.soft_time_limit or conf.task_soft_time_limit
    limit = hard or soft
    return float(limit) if limit else None


def _summary(args: Any, kwargs: Any) -> str:
    parts = [saferepr(a, maxlen=ARGS_SUMMARY_MAX) for a in (args or ())]
    parts += [f"{k}={saferepr(v, maxlen=ARGS_SUMMARY_MAX)}" for k, v in (kwargs or {}).items()]
    text = ", ".join(parts)
    return text if len(text) <= ARGS_SUMMARY_MAX else text[: ARGS_SUMMARY_MAX - 3] + "..."


def _describe(holder: Mapping[str, Any]) -> str:
    if holder.get("task_id"):
        where = f" on {holder['worker']}" if holder.get("worker") else ""
        return f"task {holder.get('task')}[{holder['task_id']}]{where}"
    if holder.get("host"):
        return f"pid {holder.get('pid')} on {holder['host']}"
    return "another owner"


def _django_contended(redlock: Redlock, lock: Any) -> None:
    """Make sure ``lock_contended`` went out for a skipped task: the shared ``get_redlock()``
    sends it from the core's event; an explicit ``lock_redlock`` has no signal listener."""
    if any(getattr(fn, "__module__", None) == "django_redlock.signals" for fn in redlock.listeners):
        return
    try:
        from django.conf import settings

        if not settings.configured:
            return
        from . import signals as django_signals
    except Exception:
        return
    django_signals.send_event(
        LockEvent(
            "contended",
            lock.name,
            meta=lock.meta,
            retry_after=lock.retry_after,
            reason="skipped by on_locked='skip'",
        ),
        redlock,
    )


# ============================================================================ worker signals


@signals.worker_process_shutdown.connect(weak=False)
def _on_process_shutdown(**kwargs: Any) -> None:
    """A pool process is exiting: whatever it still holds will never be released otherwise."""
    release_held_locks("worker process shutdown")


def _redlocks_of(app: Any) -> list[Redlock]:
    """The distinct Redlocks the LockedTasks registered in ``app`` lock with."""
    found: dict[int, Redlock] = {}
    try:
        task_types = [t for t in app.tasks.values() if isinstance(t, LockedTask)]
    except Exception:  # pragma: no cover
        return []
    for task in task_types:
        try:
            redlock = task.get_redlock()
        except Exception:
            continue
        found.setdefault(id(redlock), redlock)
    return list(found.values())


@signals.worker_shutting_down.connect(weak=False)
def _on_worker_shutting_down(sender: Any = None, how: str = "Warm", **kwargs: Any) -> None:
    """Cold shutdown abandons running tasks: free their keys now rather than one lease later.
    A warm (or soft) shutdown lets running tasks finish; they release their own locks.

    Celery has already terminated the pool's running jobs when it sends this signal (and
    forgotten their requests), so the locks are found on the nodes: every task lock whose
    holder metadata names this worker (``sender`` is its node name)."""
    if how != "Cold":
        return
    release_held_locks("cold worker shutdown")
    if not sender:
        return
    from celery import current_app

    _release_matching(
        current_app,
        "*",
        lambda meta: bool(meta.get("task_id")) and meta.get("worker") == sender,
        "cold worker shutdown",
    )


def _release_matching(
    app: Any, pattern: str, matches: Callable[[Mapping[str, Any]], bool], why: str
) -> None:
    """Release every lock matching the glob ``pattern`` on the Redlocks of ``app``'s
    LockedTasks whose holder metadata passes ``matches`` (found by listing the nodes, as no
    handle is at hand; token-checked, so a lock taken since is never touched)."""
    for redlock in _redlocks_of(app):
        try:
            for info in redlock.live_locks(pattern):
                if matches(info.meta):
                    redlock.release_token(info.name, info.token)
                    logger.warning(
                        "released lock %s of task %s[%s] (%s)",
                        info.name,
                        info.meta.get("task"),
                        info.meta.get("task_id"),
                        why,
                    )
        except Exception:
            logger.warning("could not release the locks to free (%s)", why, exc_info=True)


@signals.task_revoked.connect(weak=False)
def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """A revoked task never takes its lock (the worker drops it before ``__call__``); one
    terminated while running had it, and its pool process may be gone: release it from here.
    A revoked task that was still queued gives up its de-duplication marker."""
    if not isinstance(sender, LockedTask) or request is None:
        return
    if terminated:
        sender.release_for_request(request)
        return
    queued = _header_of(request).get(_QUEUED)
    if queued:
        try:
            sender.get_redlock().release_token(queued[0], queued[1])
        except Exception:
            logger.debug("could not release %s", queued[0], exc_info=True)


def _free_revoked_markers(app: Any, task_ids: Any) -> None:
    """Delete the ``<key>:queued`` markers of revoked tasks, found on the nodes by the task id
    in their metadata. Celery only tells a task it was revoked when a worker reaches its
    message, which may be a long queue later; until then a marker would merge new calls into
    a task that will never run."""
    ids = {str(i) for i in (task_ids if isinstance(task_ids, (list, tuple, set)) else [task_ids])}
    _release_matching(
        app,
        f"*{QUEUED_SUFFIX}",
        lambda meta: bool(meta.get("queued")) and meta.get("task_id") in ids,
        "queued task revoked",
    )


def _hook_revoke_command() -> None:
    """Make the worker's ``revoke`` remote control command (``AsyncResult.revoke()``,
    ``app.control.revoke()``) free the revoked tasks' queued markers before it replies.

    Celery has no signal for a revoke that arrives before the message does, so the command
    itself is wrapped, in Celery's registry of control commands (``Panel``, the documented
    way to add one); the original runs first and its reply is returned unchanged."""
    from celery.worker.control import Panel

    original = Panel.data.get("revoke")
    if original is None or getattr(original, "redlock_hooked", False):
        return

    @functools.wraps(original)
    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        _free_revoked_markers(state.app, task_id)
        return reply

    revoke.redlock_hooked = True  # type: ignore[attr-defined]
    Panel.data["revoke"] = revoke


_hook_revoke_command()


@signals.task_failure.connect(weak=False)
def _on_task_failure(
    sender: Any = None, exception: BaseException | None = None, **kwargs: Any
) -> None:
    """A pool process killed by a hard time limit or lost (WorkerLostError) cannot release
    its lock; the main process reports the failure and releases it here."""
    if not isinstance(sender, LockedTask):
        return
    if type(exception).__name__ not in ("TimeLimitExceeded", "WorkerLostError"):
        return
    request = sender.request
    if getattr(request, "id", None):
        sender.release_for_request(request)
