"""``LockedTask``: a Celery base task that runs at most one task per lock key at a time.

This is the only module of the package that imports Celery (``pip install
django-redlock[celery]``). Usage and the reasoning behind every default are in docs/celery.rst::

    @app.task(base=LockedTask, bind=True, lock_key="sync:{account_id}", lock_ttl=60,
              on_locked="retry", lock_wait=30)
    def sync_account(self, account_id): ...

    install(app)  # the worker-side part (see below)

How it works, in one paragraph: the lock is taken in :meth:`LockedTask.__call__`, i.e. when a
worker starts running the task (never at enqueue time, so a queued or revoked task holds
nothing), with a short lease that the core's watchdog renews while the task runs, and it is
released in a ``finally`` whatever the task does (returns, raises, retries), wherever an
exception lands between the first attempt and the end. A worker killed with SIGKILL stops
renewing, so the key is free again within one lease. When the key is busy, ``on_locked``
decides: ``"retry"`` re-schedules the task (without eating its own ``max_retries``),
``"wait"`` blocks (woken by the holder's release), ``"skip"`` ends the task in state
``SUCCESS`` with the result ``None`` (so groups and chords complete) with a log line and
signals, ``"raise"`` fails it with :class:`~django_redlock.LockNotAcquired`.

The worker side is installed explicitly, per app, with :func:`install` (a worker bootstep
and a consumer bootstep; importing this module changes nothing in Celery): the worker keeps a
map of the locks its tasks hold or wait for (prefork pool processes report to the main
process over a pipe), which releases the lock of a pool process the main process stops
(terminate, hard time limit, cold shutdown) without listing the nodes, stops a revoked task
that waits for its lock, and keeps the lock wait out of the task's time limits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import random
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

from celery import Task, bootsteps, signals
from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded
from celery.utils.dispatch import Signal
from celery.utils.saferepr import saferepr

from .core import (
    MAX_DURATION,
    MAX_KEY_LENGTH,
    LockEvent,
    LockNotAcquired,
    QuorumError,
    Redlock,
    RedlockError,
    printable,
    process_gone,
)
from .holders import TYPICAL_HOLD, HoldTimes, expected_free_in
from .task_options import (
    CALL_OPTIONS,
    DEDUPE_POLICIES,
    HEADER_FIELDS,
    ON_LOCKED,
    check_header_fields,
    check_option_names,
    check_task_options,
    header_values,
)

__all__ = ["DEDUPE_POLICIES", "HEADER", "ON_LOCKED", "LockOptions", "LockedTask"]
__all__ += ["LockedTaskControl", "LockedTaskWorker", "dedupe_without_leases", "default_lock_key"]
__all__ += ["install", "release_held_locks", "task_dropped", "task_skipped"]

logger = logging.getLogger("django_redlock.celery")

#: Message header carrying per-call options and LockedTask's own bookkeeping.
HEADER = "redlock"

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
#: Prefix of the key a worker writes for a revoked task id (lease: as long as a queued marker
#: can live and the workers remember the revoke, :func:`_note_revoked`): a ``lock_dedupe``
#: call replaces that task's marker.
REVOKED_PREFIX = "celery:revoked:"
#: Suffix of the per-key "one waiting task" slot of ``on_locked="retry"``.
WAITER_SUFFIX = ":waiter"
#: Seconds a waiting task blocks beyond the holder's lease (and its slot outlives the wait).
SLOT_GRACE = 0.5
#: Longest block in the waiting slot: a longer hold is waited for by re-scheduling, which
#: costs little next to it, so a busy key never ties up a worker slot for long.
MAX_SLOT_WAIT = 2.0
DEFAULT_DEDUPE_TTL = 3600.0
#: Characters of the arguments summary stored with the lock (admin page).
ARGS_SUMMARY_MAX = 200
#: Exponential backoff stops doubling after this many lock retries.
_MAX_DOUBLINGS = 10

#: The reason stored with the REVOKED state of a task revoked while it waited for its lock.
_REVOKED_WAITING = "revoked while waiting for its lock"
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
    limit: int | None = None

    def effective_wait(self) -> float:
        """Seconds to block for the lock before ``on_locked`` applies."""
        if self.wait is not None:
            return self.wait
        return DEFAULT_WAIT if self.on_locked == "wait" else 0.0


# ============================================================================ keys


def default_lock_key(task_name: str, arguments: Mapping[str, Any]) -> str:
    """The key used without ``lock_key``: the task name plus its bound arguments as
    ``name=value`` in name order, each value rendered as a ``lock_key`` template renders it
    (``app.sync:account_id=42,full=%false``)."""
    from .keys import make_key

    literal = task_name.replace("{", "{{").replace("}", "}}")
    fields = ",".join(f"{name}={{{name}}}" for name in sorted(arguments))
    try:
        return make_key(f"{literal}:{fields}", **arguments)
    except TypeError as exc:
        raise TypeError(f"{exc} (task {task_name}: give it a lock_key naming a field)") from None


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
    except SoftTimeLimitExceeded:
        raise  # a time limit, or a revoke stopping a waiting task: not a failed read
    except Exception:
        logger.debug("could not read the holder of %s", printable(name), exc_info=True)
        return {}
    if info is None:
        return {}
    return {**info.meta, "token": info.token, "ttl": info.ttl, "age": info.age}


def _release_queued_marker(redlock: Redlock, queued: Any) -> None:
    """Release a task's ``<key>:queued`` marker (``[name, token]`` from its header)."""
    try:
        redlock.release_token(queued[0], queued[1])
    except Exception:
        logger.warning(
            "could not release the queued marker %s", printable(queued[0]), exc_info=True
        )


@dataclasses.dataclass(frozen=True)
class _Queued:
    """The task already queued for a key (``lock_dedupe``): its id, and the seconds its
    queued marker has left (None when unknown)."""

    task_id: str
    ttl: float | None


# ============================================================================ held locks


#: Locks this process's tasks hold right now (by ``id()``), for release at worker shutdown.
#: Only single dict operations touch it, each atomic, so threads need no lock of their own.
_held: dict[int, Any] = {}
_hold_times = HoldTimes()
#: The lock of the LockedTask run in progress in this thread / coroutine context.
_current_lock: ContextVar[Any] = ContextVar("django_redlock_celery_lock", default=None)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_held.clear)


def release_held_locks(reason: str = "worker shutdown") -> int:
    """Release every task lock this process holds (the shutdown signals call this); returns
    how many were released. Tasks still running lose their lock (their ``held`` turns False)."""
    released = 0
    for key in list(_held):
        lock = _held.pop(key, None)
        if lock is None:  # its run ended meanwhile
            continue
        name, why = _shown(lock.name, reason)
        try:
            lock.release()
        except RedlockError as exc:
            logger.debug("releasing %s at %s: %s", name, why, printable(exc))
        except Exception:
            logger.warning("could not release %s at %s", name, why, exc_info=True)
        else:
            released += 1
            logger.warning("released lock %s of a running task (%s)", name, why)
    return released


# ============================================================================ one run


class _RevokedWhileWaiting(Exception):
    """The task was revoked while it waited for its lock (seen in the worker's own process)."""


_not_installed_warned = False


class _TaskRun:
    """The lock side of one run of a LockedTask: the lock handle, the waiting slot, and what
    the worker was told, so that :meth:`end` undoes all of it in one place whatever
    exception lands where."""

    def __init__(self, task: LockedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = self.request = task.request
        self.task, self.name, self.task_id = task, task.name, request.id
        #: The message's ``redlock`` header: per-call options and the bookkeeping below.
        self.header = header = _header_of(request, f"task {task.name} (redlock header)")
        self.opts = opts = task.lock_options(header)
        self.redlock = redlock = task.get_redlock()
        #: Re-schedules this task has had for a busy lock so far.
        self.lock_retries = int(header.get(_LOCK_RETRIES, 0) or 0)
        name = task.lock_name(args, kwargs, opts)
        ttl, renew, renew_for = task._lease_for(request, opts, redlock)
        self.attempt = f"{request.retries or 0}.{self.lock_retries}"
        meta = {"task_id": self.task_id, "task": self.name, "worker": request.hostname}
        meta.update(args=_summary(args, kwargs), attempt=self.attempt, on_locked=opts.on_locked)
        meta.update(_hold_times.meta(self.name))
        owner = ("celery", self.task_id or id(request))
        lease: dict[str, Any] = {"auto_renew": renew, "renew_for": renew_for, "meta": meta}
        if opts.limit is not None:
            # A semaphore per key: up to lock_limit runs at once, each holding a permit.
            self.lock = redlock.semaphore(name, opts.limit, ttl, owner=owner, **lease)
        else:
            self.lock = redlock.lock(name, ttl=ttl, reentrant=False, owner=owner, **lease)
        self.slot: Any = None
        #: Between the report of a wait and the report of its end: the worker's main process
        #: suspended the task's time limits, and stops the task on a revoke. ``stop_signalled``:
        #: the soft time limit signal came while this run waited (see :meth:`_hear_stops`).
        self.waiting = self.reported = self.stop_signalled = False
        self._unhear: Callable[[], None] | None = None
        self.eager = bool(request.is_eager or request.called_directly)
        # The hooks of the worker running this task's app (another app's worker may run in
        # this process too, in a test suite).
        hooks = _worker_hooks
        self.hooks = hooks if hooks is not None and hooks.app is task.app else None
        if self.hooks is None and not self.eager:
            _warn_not_installed(task)

    def warn(self, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        logger.log(level, "task %s[%s]" + msg, self.name, self.task_id, *args)

    def __call__(self, body: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        lock, opts = self.lock, self.opts
        # One try from the first attempt to the end: an exception landing anywhere (a soft
        # time limit, a revoke's signal) between taking the lock, leaving the waiting slot,
        # and the task body still releases both (end).
        current: Any = None
        began: float | None = None
        stopped: BaseException | None = None
        revoked = False
        try:
            try:
                acquired, holder = self.take()
            except QuorumError as exc:
                # Too few nodes answered: nobody knows whether the key is free. "retry" and
                # "skip" re-schedule (a skip needs a holder to skip for); "wait" and "raise"
                # fail.
                self.warn(": lock %s unavailable: %s", *_shown(lock.name, exc))
                if opts.on_locked in ("retry", "skip") and not self.eager:
                    self.retry_later(exc, self.task._countdown(opts, self.lock_retries, {}))
                self.release_queued()
                raise
            if not acquired:
                return self.locked_out(args, kwargs, holder)
            _probe("acquired", self.task_id)
            self.release_queued()
            # Not an attribute of the request: Celery copies unknown request attributes into
            # the headers of any message the task sends (retries included).
            current = _current_lock.set(lock)
            _held[id(lock)] = lock
            began = time.monotonic()
            _probe("before-run", self.task_id)
            return body(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt) as exc:
            # The pool process is being stopped (a cold shutdown, a terminate): the task did
            # not finish, and its key is freed for the next one below; operators must see it.
            stopped = exc
            raise
        except (SoftTimeLimitExceeded, _RevokedWhileWaiting) as exc:
            if not self.stopped_while_waiting(exc):
                raise
            revoked = True
            raise Ignore() from exc
        finally:
            if began is not None:
                _hold_times.record(self.name, time.monotonic() - began)
            if current is not None:
                _current_lock.reset(current)
            _held.pop(id(lock), None)
            self.end(stopped)
            if revoked:  # stored once the key is free again
                self.end_revoked()

    def acquire(self, timeout: float | None = None) -> bool:
        """One attempt, or (given a ``timeout``) a blocking one. An exception raised inside
        (a soft time limit, a revoke's signal) is the core's to undo: it releases a lease it
        won but could not hand back."""
        return bool(self.lock.acquire(blocking=timeout is not None, timeout=timeout))

    def take(self) -> tuple[bool, dict[str, Any] | None]:
        """Try for the lock; refused, free this task's own earlier attempt's lease if its
        process is gone, block up to ``lock_wait``; still refused, free such a lease again
        (read anew after a wait), and (``on_locked="retry"`` without ``lock_wait``) block in
        the key's one waiting slot if this task gets it (:meth:`wait_in_slot`). True once
        held, and the holder as last read when not, while that is still the latest word
        (nothing was released or waited for since), else None."""
        wait = self.opts.effective_wait()
        if wait > 0:
            self.begin_wait()
        acquired, holder = self.acquire(), None
        if not acquired and not self.eager:
            # Before any wait: a dead process never releases, so waiting for it would only
            # hold this redelivery back until its lease or lock_wait ran out.
            acquired, holder = self.free_dead_attempt()
        if not acquired and wait > 0:
            acquired, holder = self.acquire(wait), None
        if wait > 0:
            self.check_revoked()
        if not acquired and not self.eager:
            if holder is None:
                acquired, holder = self.free_dead_attempt()
            if not acquired and holder and self.opts.on_locked == "retry" and not self.opts.wait:
                waited = self.wait_in_slot(holder)
                acquired, holder = (False, holder) if waited is None else (waited, None)
        self.end_wait(acquired)
        return acquired, holder

    def free_dead_attempt(self) -> tuple[bool, dict[str, Any] | None]:
        """Free the lease of the key's holder when it is this task's own earlier attempt in
        a process that is gone on this host, and try for the lock again: whether it was
        taken, and the holder unless it was freed (then None: what holds the key now is
        unknown)."""
        holder = _holder(self.redlock, self.lock.name)
        mine = self.task_id and holder.get("task_id") == self.task_id
        if not (mine and process_gone(holder, certain=True)):
            return False, holder
        # A pool process killed mid-run: its message came back (reject_on_worker_lost)
        # while its lease still runs. Nobody is in the critical section any more.
        freed = self.redlock.release_token(self.lock.name, holder["token"])
        freed_of = ": freed lock %s of this task's earlier attempt (pid %s is gone, %s nodes)"
        self.warn(freed_of, *_shown(self.lock.name, holder.get("pid")), freed)
        return self.acquire(), None

    def wait_in_slot(self, holder: Mapping[str, Any]) -> bool | None:
        """Block for the lock if no other task of this key is blocking for it already (one
        worker slot per key waits, woken by the release; the others are re-scheduled). The
        wait ends with the holder's current lease, and after :data:`MAX_SLOT_WAIT`: a long
        hold is waited for by re-scheduling, not by a blocked slot. Whether the lock was
        taken; None when this task did not wait (the slot is taken)."""
        redlock, name, task_id = self.redlock, self.lock.name, self.task_id
        slot_name = name + WAITER_SUFFIX
        if len(slot_name) > MAX_KEY_LENGTH:
            return None
        wait = min(float(holder.get("ttl") or 0.0) + SLOT_GRACE, MAX_SLOT_WAIT)
        ttl = min(wait + SLOT_GRACE, redlock.max_ttl)
        owner = ("celery-waiter", task_id or id(self.request))
        meta = {"task_id": task_id, "task": self.name, "waiting_for": name}
        self.slot = redlock.lock(slot_name, ttl=ttl, reentrant=False, owner=owner, meta=meta)
        try:
            if not self.slot.acquire(blocking=False):
                return None
        except QuorumError:
            return None
        # From here to the return, every release is end()'s as well: an exception that
        # lands between two of these lines leaves neither the slot nor the lock behind.
        _probe("slot-taken", task_id)
        self.begin_wait()
        acquired = self.acquire(wait)
        _probe("slot-handoff", task_id)
        self.release_slot()
        _probe("slot-released", task_id)
        self.check_revoked()
        return acquired

    def locked_out(self, args: Any, kwargs: Any, holder: dict[str, Any] | None) -> Any:
        """Apply ``on_locked``; ``holder`` is the holder as :meth:`take` last read it (None:
        read it now)."""
        opts, lock, name, task_id = self.opts, self.lock, self.lock.name, self.task_id
        if holder is None:
            holder = _holder(self.redlock, name)
        full = opts.limit is not None
        state = f"has all {opts.limit} permits taken" if full else f"is held by {_describe(holder)}"

        def refused(state: str) -> LockNotAcquired:
            msg = f"task {self.name}[{task_id}]: lock {name!r} {state}"
            return LockNotAcquired(msg, name, retry_after=lock.retry_after)

        exc = refused(state)
        countdown = self.task._countdown(opts, self.lock_retries, holder)
        if task_id and holder.get("task_id") == task_id and not self.eager:
            # Held under this very task id: an earlier attempt of ours (a lease left on nodes
            # that answered too late, a worker on another host that died), or another delivery
            # of this message still running (visibility_timeout shorter than the task).
            # Skipping or failing would drop the task for good: come back when that lease has
            # run out.
            self.warn(
                ": lock %s is held under this task's own id (attempt %s, now %s): an earlier "
                "attempt's lease, or a redelivery while the task still runs (the broker's "
                "visibility_timeout must exceed the longest task); retrying in %.1fs",
                printable(name),
                holder.get("attempt"),
                self.attempt,
                lock.retry_after or 0.0,
            )
            self.retry_later(exc, max(countdown, lock.retry_after or 0.0))
        if opts.on_locked == "retry" and not self.eager:
            self.retry_later(exc, countdown)
        self.release_queued()
        if opts.on_locked == "skip":
            return self.skip(holder, args, kwargs)
        if opts.on_locked == "wait":
            still = "full" if full else "held by " + _describe(holder)
            exc = refused(f"still {still} after waiting {opts.effective_wait():g}s")
        raise exc

    def retry_later(self, exc: LockNotAcquired, countdown: float) -> None:
        """Re-schedule this task in ``countdown`` seconds (raises Retry)."""
        task, request, opts, retries = self.task, self.request, self.opts, self.lock_retries
        new_header = {**self.header, _LOCK_RETRIES: retries + 1}
        queued = self.header.get(_QUEUED)
        if queued:
            # Keep our place as "the queued one" through the retry.
            ttl = min(opts.dedupe_ttl + countdown, self.redlock.max_ttl)
            if not self.redlock.extend_token(queued[0], queued[1], ttl):
                new_header.pop(_QUEUED, None)
        headers = {**(request.headers or {}), HEADER: new_header}
        if opts.retry_counts:
            limit = task.max_retries if opts.max_retries is None else opts.max_retries
            if limit is None or (request.retries or 0) < limit:
                task.retry(exc=exc, countdown=countdown, max_retries=limit, headers=headers)
        elif opts.max_retries is None or retries < opts.max_retries:
            # Task.retry would count this against the task's own max_retries; re-send the
            # same request with its retries count unchanged instead, and raise Retry like it
            # does (the worker logs it, stores RETRY and sends task_retry).
            sig = task.signature_from_request(
                request, countdown=countdown, retries=request.retries, headers=headers
            )
            sig.apply_async()
            raise Retry(exc=exc, when=countdown, sig=sig)
        self.release_queued()
        msg = f"{exc} (gave up after {retries} lock retries)"
        raise LockNotAcquired(msg, self.lock.name, retry_after=exc.retry_after)

    def skip(self, holder: dict[str, Any], args: Any, kwargs: Any) -> None:
        """End the task without running it: state SUCCESS, result None, so that a group, a
        chord or a chain it is part of goes on (a chord's counter counts it, a chain's next
        task gets None). Never silently: a WARNING, ``lock_contended`` and ``task_skipped``."""
        name = self.lock.name
        self.warn(" skipped: lock %s is held by %s", *_shown(name, _describe(holder)))
        _django_contended(self.redlock, self.lock)
        task_skipped.send(
            self.task, task_id=self.task_id, lock_name=name, holder=holder, args=args, kwargs=kwargs
        )

    def release_queued(self) -> None:
        queued = self.header.pop(_QUEUED, None)
        if not queued:
            return
        _release_queued_marker(self.redlock, queued)
        # A later self.retry() of this task is a new queued copy, not this one.
        if isinstance(getattr(self.request, "headers", None), dict):
            self.request.headers[HEADER] = dict(self.header)

    def end(self, stopped: BaseException | None) -> None:
        """Release whatever the run still has (the lock, the waiting slot), however it ended,
        and tell the worker it is done."""
        self.unhear_stops()
        self.release_slot()
        lock = self.lock
        if lock.token is not None:
            try:
                lock.release()
            except RedlockError as exc:
                # Lost while running (lease ran out, a quorum forgot it, or force-released):
                # the core already sent lock_lost; say which task it was.
                shown = _shown(lock.name, exc)
                self.warn(" finished without holding lock %s: %s", *shown, level=logging.ERROR)
            except Exception:
                logger.warning("could not release lock %s", printable(lock.name), exc_info=True)
            else:
                if stopped is not None:
                    logger.warning(
                        "released lock %s of task %s[%s]: the task was stopped (%r, a worker "
                        "shutdown or terminate)",
                        printable(lock.name),
                        self.name,
                        self.task_id,
                        stopped,
                    )
        if self.reported:
            self.report("done")

    def end_revoked(self) -> None:
        """A task revoked while it waited for its lock ends in state REVOKED, never running."""
        self.warn(" revoked while it waited for lock %s: not run", printable(self.lock.name))
        request = self.request
        if request.id and not request.called_directly:
            try:
                self.task.backend.mark_as_revoked(request.id, _REVOKED_WAITING, request=request)
            except Exception:
                logger.warning("could not store REVOKED for %s", request.id, exc_info=True)

    # -- the worker's side of a wait ---------------------------------------------------------

    def begin_wait(self) -> None:
        _probe("wait-begins", self.task_id)
        self.check_revoked()  # revoked as it started: no need to wait at all
        self._hear_stops()
        self.waiting = True
        slot = self.slot
        if slot is not None and slot.token is not None:
            self.report("wait", slot=[slot.name, slot.token])
        else:
            self.report("wait")
        hooks = self.hooks
        if hooks and hooks.limits == LIMITS_CHARGED and _time_limit(self.task, self.request):
            hooks.warn_charged(self.name)

    def end_wait(self, acquired: bool) -> None:
        """The run has the lock (report it with its token) or gave up waiting for it."""
        if acquired:
            self.report("hold", token=self.lock.token)
        elif self.waiting:
            self.report("go")
        # Cleared only once the worker can know: a revoke's signal before this is still a
        # revoke (stopped_while_waiting), not a soft time limit.
        self.waiting = False
        self.unhear_stops()

    def check_revoked(self) -> None:
        """Before and after a wait, in the worker's own process (threads pool): a revoke
        that came meanwhile stops the task now. A pool process is stopped by its parent's
        signal: one whose exception was swallowed meanwhile stops it now."""
        from celery.worker import state as worker_state

        if self.task_id and self.task_id in worker_state.revoked:
            raise _RevokedWhileWaiting(self.task_id)
        if self.stop_signalled:
            # Raised again where nothing catches it; __call__ tells a revoke from a soft
            # time limit as it would have.
            self.stop_signalled = False
            raise SoftTimeLimitExceeded("stopped while waiting for its lock")

    def _hear_stops(self) -> None:
        """In a pool process, note the soft time limit signal the worker's main process
        sends a waiting task it stops (a revoke; billiard's handler raises
        SoftTimeLimitExceeded): the exception lands wherever the task is, and code that
        catches ``Exception`` (reading the holder, a lock event's listener, a logging
        handler) may swallow it, leaving the task to wait on and run after the holder.
        Noted, it is raised again once the wait ends (:meth:`check_revoked`)."""
        stop = getattr(signal, "SIGUSR1", None)
        # The worker's own process is sent no signal; only the main thread can handle one.
        pool = self.hooks is not None and self.hooks.pid != os.getpid()
        main = threading.current_thread() is threading.main_thread()
        if self._unhear is not None or stop is None or not (pool and main):
            return
        previous = signal.getsignal(stop)
        if not callable(previous):
            return

        def heard(signum: int, frame: Any) -> None:
            self.stop_signalled = True
            previous(signum, frame)

        signal.signal(stop, heard)

        def unhear() -> None:
            if signal.getsignal(stop) is heard:
                signal.signal(stop, previous)

        self._unhear = unhear

    def unhear_stops(self) -> None:
        unhear, self._unhear = self._unhear, None
        if unhear is not None:
            unhear()

    def stopped_while_waiting(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a revoke that stopped the task while it waited for its lock
        (the worker's main process sends billiard's soft time limit signal to a waiting pool
        process after storing REVOKED), rather than a time limit."""
        if isinstance(exc, _RevokedWhileWaiting):
            return True
        if not self.waiting or self.hooks is None or self.hooks.limits != LIMITS_REARMED:
            return False
        try:
            return bool(self.task.backend.get_state(self.task_id) == "REVOKED")
        except Exception:
            # No result backend to ask: with its limits suspended while it waits, a task
            # without a soft limit of its own can only have been stopped by a revoke.
            return _time_limits(self.task, self.request)[1] is None

    def release_slot(self) -> None:
        slot = self.slot
        if slot is None or slot.token is None:
            return
        try:
            slot.release()
        except RedlockError:
            pass  # a revoke freed it already, or it ran out: nothing of ours is left
        except Exception:
            logger.warning(
                "could not release the waiting slot %s", printable(slot.name), exc_info=True
            )

    def report(self, kind: str, **fields: Any) -> None:
        if self.hooks is None or not self.task_id:
            return
        report = {"kind": kind, "id": self.task_id, "task": self.name, "lock": self.lock.name}
        self.hooks.report({**report, "pid": os.getpid(), **fields})
        self.reported = True


def _warn_not_installed(task: LockedTask) -> None:
    global _not_installed_warned
    if not _not_installed_warned:
        _not_installed_warned = True
        logger.warning(
            "LockedTask %s runs in a worker without django_redlock.celery.install(app): the locks "
            "of pool processes the worker stops wait out their lease, a revoked task that waits "
            "for its lock keeps waiting, and the wait counts against time limits",
            task.name,
        )


# ============================================================================ the task class


class LockedTask(Task):
    """A Celery task that holds a Redlock lock while it runs (see docs/celery.rst).

    Attributes (all settable in ``@app.task(...)``, most overridable per call):

    ``lock_key``
        Template formatted with the task's bound arguments (``"sync:{account_id}"``; same
        rules as ``@locked``), or a callable ``(*args, **kwargs) -> str``. Default: the task
        name plus its arguments rendered by the same rules (:func:`default_lock_key`).
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
    ``lock_limit``
        None (default): one run per key. N: a semaphore per key, up to N runs at once, each
        holding a permit; the same ``on_locked`` policies apply once all N are taken.

    Every option except ``lock_key``, ``lock_limit`` and ``lock_redlock`` defaults to the project's
    ``REDLOCK["LOCKED_TASK"]`` value when the task does not set it. ``acks_late`` and
    ``reject_on_worker_lost`` are True: a task whose worker dies mid-run is delivered again
    (docs/celery.rst, "No lost task").
    """

    # Acknowledge after the run, and requeue when the pool process dies: with Celery's early
    # acknowledgement a worker killed mid-task loses the task for good. The lock keeps the
    # redelivered copy from overlapping a run that is still going (see _TaskRun.take).
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
    lock_limit: int | None = None

    # -- options ----------------------------------------------------------------------------

    def lock_options(
        self, overrides: Mapping[str, Any] | None = None, *, sending: bool = False
    ) -> LockOptions:
        """Project defaults (``REDLOCK["LOCKED_TASK"]``) overlaid with the options this task
        sets itself, then with per-call ``overrides`` (header field names); when ``sending``,
        a per-call ttl or limit the task's lock service would refuse is refused now."""
        defaults = header_values(_project_defaults())
        values = {field: _class_attr(self, option) for option, field in CALL_OPTIONS.items()}
        for option, field in CALL_OPTIONS.items():
            if field in defaults and option != "lock_key" and not _sets_itself(self, option):
                values[field] = defaults[field]
        check_task_options(values, f"task {self.name}")
        self._check_template(values["key"], f"task {self.name}")
        if overrides:
            where = f"task {self.name} (per-call options)"
            header = check_header_fields(overrides, where)
            given = {k: v for k, v in header.items() if k in HEADER_FIELDS}
            limits = self._service_limits() if sending and {"ttl", "limit"} & set(given) else {}
            limits.pop("without_leases", None)  # judged where a marker is taken
            check_task_options(given, where, per_call=True, **limits)
            self._check_template(given.get("key"), where)
            values.update(given)
        if values["dedupe"] is True:
            values["dedupe"] = "merge"
        return LockOptions(**values)

    def _service_limits(self) -> dict[str, Any]:
        """What the lock service refuses at every run: a lease past its ``max_ttl``, and a
        semaphore on a backend that offers none; and what it cannot honour at send time: a
        queued marker that ends after ``lock_dedupe_ttl`` on a service without leases."""
        from django.core.exceptions import ImproperlyConfigured

        from .backends.base import BackendLocks

        try:
            service = self.get_redlock()
        except ImproperlyConfigured:  # sending never needed the setting: the worker says so
            return {}
        kind = type(service)
        plain = isinstance(service, BackendLocks) and kind.semaphore is BackendLocks.semaphore
        return {
            "max_ttl": getattr(service, "max_ttl", None),
            "without_semaphores": kind.__name__ if plain else None,
            "without_leases": None if _leased(service) else kind.__name__,
        }

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
        signature = self._signature()
        if signature is None or not (missing := template.unknown_fields(signature)):
            return
        names = ", ".join(sorted(signature.parameters)) or "none"
        raise ValueError(
            f"{where}: lock_key {key!r} names {', '.join(missing)}, not an argument of the "
            f"task (arguments: {names})"
        )

    def _signature(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self.run)
        except (TypeError, ValueError):
            return None

    def get_redlock(self) -> Redlock:
        """The Redlock this task locks with (``lock_redlock``, else ``get_redlock()``)."""
        source = _class_attr(self, "lock_redlock")
        if source is None:
            from .backends.registry import get_locks

            return get_locks(self.lock_using)
        return source if isinstance(source, Redlock) or hasattr(source, "lock") else source()

    def lock_name(
        self, args: Any = None, kwargs: Any = None, options: LockOptions | None = None
    ) -> str:
        """The lock name a call with these arguments uses."""
        key = (options or self.lock_options()).key
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if callable(key):
            name = key(*args, **kwargs)
            if not isinstance(name, str):
                raise TypeError(f"task {self.name}: lock_key returned {name!r}, not a str")
            return name
        signature = self._signature()
        if signature is None:
            arguments, extra = {"args": list(args), "kwargs": kwargs}, {}
        else:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"task {self.name}: cannot bind the arguments for its lock key: {exc}"
                ) from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            var_kw = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
            extra = dict(arguments[var_kw[0]]) if var_kw else {}
        if key is None:
            return default_lock_key(self.name, arguments)
        if "{" not in key:
            return str(key)
        from .keys import make_key

        # **kwargs entries are addressable by their own names in templates too.
        return make_key(key, **{**extra, **arguments})

    # -- enqueueing -------------------------------------------------------------------------

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """``apply_async`` taking LockedTask's per-call options (``lock_key=...``,
        ``on_locked=...``, ...; also through ``sig.set(...)``), carried in the ``redlock``
        message header; with ``lock_dedupe`` it may return the already queued task's result
        instead of sending a new message."""
        header, opts = self._call_options(options)
        queued = None
        # The task's own self.retry() sends the running request's id again: the same task
        # going on, never a duplicate of the one queued behind it.
        retry = task_id is not None and task_id == getattr(self.request, "id", None)
        if opts.dedupe and not (retry or _QUEUED in header or self.app.conf.task_always_eager):
            from celery.utils import uuid

            without_leases = self._service_limits().get("without_leases")
            if without_leases is not None:
                # Its queued marker would follow this process's session, not
                # lock_dedupe_ttl (system check E107).
                where = f"task {self.name}" + (" (per-call options)" if "dedupe" in header else "")
                check_task_options({"dedupe": opts.dedupe}, where, without_leases=without_leases)
            task_id = task_id or uuid()
            name = self.lock_name(args, kwargs, opts)
            queued = self._take_queued(name, task_id, opts, _delay_of(options), args, kwargs)
            if isinstance(queued, _Queued):
                return self._duplicate(opts, name, task_id, queued, args, kwargs)
            if queued is not None:
                header[_QUEUED] = list(queued)
                options.setdefault("headers", {})[HEADER] = header
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except BaseException:
            if isinstance(queued, tuple):
                _release_queued_marker(self.get_redlock(), queued)
            raise

    def apply(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """``apply`` (the task run here and now, eagerly) taking the per-call options as
        :meth:`apply_async` does, checked the same way; they reach the run in the
        ``redlock`` header, as a worker's run gets them."""
        self._call_options(options)
        return super().apply(args, kwargs, *rest, **options)

    def _call_options(self, options: dict[str, Any]) -> tuple[dict[str, Any], LockOptions]:
        """Move the per-call options of a call (``lock_key=...``) out of ``options`` into its
        ``redlock`` header, over what that header carried (a header given as such is judged
        as the worker would judge it), and check them as the lock service would: the header
        and the options of this call."""
        check_option_names(options, f"task {self.name}")
        where = f"task {self.name} (per-call options)"
        overrides = {CALL_OPTIONS[k]: options.pop(k) for k in list(options) if k in CALL_OPTIONS}
        headers = dict(options.pop("headers", None) or {})
        given = headers.get(HEADER)
        header = {} if given is None else dict(check_header_fields(given, where))
        header.update(overrides)
        opts = self.lock_options(header, sending=True)
        if header:
            headers[HEADER] = header
        if headers:
            options["headers"] = headers
        return header, opts

    def _duplicate(
        self, opts: LockOptions, name: str, task_id: str, queued: _Queued, args: Any, kwargs: Any
    ) -> Any:
        """Apply the ``lock_dedupe`` policy to a call whose key already has a queued task."""
        queued_id = queued.task_id
        if opts.dedupe == "raise":
            msg = f"task {self.name} not sent: {self.name}[{queued_id}] is already queued for lock"
            raise LockNotAcquired(f"{msg} {name!r}", name, retry_after=queued.ttl)
        shown = (self.name, *_shown(queued_id, name))
        if opts.dedupe == "drop":
            dropped = "task %s[%s] dropped: %s[%s] is already queued for lock %s"
            logger.warning(dropped, self.name, task_id, *shown)
            named = {"task_id": task_id, "lock_name": name, "queued_id": queued_id}
            task_dropped.send(self, **named, args=args, kwargs=kwargs)
            from celery import states
            from celery.result import EagerResult

            return EagerResult(task_id, None, states.REJECTED)
        logger.info("task %s merged into %s[%s], already queued for lock %s", self.name, *shown)
        return self.AsyncResult(queued_id)

    def _take_queued(
        self, name: str, task_id: str, opts: LockOptions, delay: float, args: Any, kwargs: Any
    ) -> tuple[str, str] | _Queued | None:
        """Take ``<name>:queued`` for this task id: ``(queued name, token)``, or the task
        already queued for the key, or None when de-duplication could not tell (nodes down:
        the task is sent anyway, never lost). The marker of a task a worker revoked (one
        point look-up, :data:`REVOKED_PREFIX`) is replaced, not merged into."""
        redlock = self.get_redlock()
        queued_name = f"{name}{QUEUED_SUFFIX}"
        ttl = min(opts.dedupe_ttl + delay, _longest_marker(redlock))
        meta = {"task_id": task_id, "task": self.name, "queued": True}
        meta["args"] = _summary(args, kwargs)
        owner = ("celery-queued", task_id)
        lock = redlock.lock(queued_name, ttl=ttl, reentrant=False, owner=owner, meta=meta)
        try:
            acquired = lock.acquire(blocking=False)
        except QuorumError:
            unavailable = (
                "task %s[%s]: de-duplication unavailable (too few lock nodes), sending it anyway"
            )
            logger.warning(unavailable, self.name, task_id, exc_info=True)
            return None
        # The worker that runs the task frees the marker by token (Redlock.release_token).
        for attempt in (1, 2):
            if acquired:
                return (queued_name, lock.detach())
            holder = _holder(redlock, queued_name)
            other = holder.get("task_id")
            if not other:
                return None  # freed in between; send it (at worst two queued, never zero)
            if attempt == 2 or not _was_revoked(redlock, str(other)):
                break
            # Revoked while queued: its message may be a long queue away from any worker,
            # which would only then free the marker. This call takes the key's place.
            redlock.release_token(queued_name, holder["token"])
            replaced = "task %s[%s]: replaced the queued marker %s of revoked task %s"
            logger.info(replaced, self.name, task_id, *_shown(queued_name, other))
            acquired = lock.acquire(blocking=False)
        return _Queued(str(other), holder.get("ttl"))

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _TaskRun(self, args, kwargs)(super().__call__, args, kwargs)

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
        if not limit or limit + 1 <= ttl:
            return ttl, False, None
        if limit + 1 <= redlock.max_ttl:
            return limit + 1, False, None
        exceeds = (
            "task %s: time limit %ss exceeds the lock's max_ttl %ss, renewing the lease instead"
        )
        logger.warning(exceeds, self.name, limit, redlock.max_ttl)
        return ttl, True, limit

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
            name = self.lock_name(request.args, request.kwargs, self.lock_options(header))
            holder = _holder(redlock, name)
            if holder.get("task_id") and holder.get("task_id") == request.id:
                done = redlock.release_token(name, holder["token"]) > 0
        except Exception:
            logger.warning(
                "could not release the lock of %s[%s]", self.name, request.id, exc_info=True
            )
        if header.get(_QUEUED):
            _release_queued_marker(redlock, header[_QUEUED])
        return done


# ============================================================================ small helpers


def _class_attr(task: Any, name: str) -> Any:
    # A function assigned as a class attribute must not become a bound method.
    return getattr(type(task), name, None)


def _sets_itself(task: Any, name: str) -> bool:
    """Whether ``name`` is set by the task (or a base class of its own), not LockedTask."""
    klass = next((k for k in type(task).__mro__ if name in vars(k)), LockedTask)
    return klass is not LockedTask


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


def _header_of(request: Any, where: str | None = None) -> dict[str, Any]:
    """The request's ``redlock`` header. For a run (``where`` names it) a header that is not
    a dict of known fields fails the task, as a bad value in it does; read for clean-up, a
    malformed one reads as empty (the run already failed on it)."""
    headers = getattr(request, "headers", None) or {}
    header = headers.get(HEADER) if isinstance(headers, Mapping) else None
    header = getattr(request, HEADER, None) if header is None else header
    if where is not None and header is not None:
        return dict(check_header_fields(header, where))
    return dict(header) if isinstance(header, Mapping) else {}


def _leased(service: Any) -> bool:
    """Whether the locks of ``service`` end with their lease (a ZooKeeper lock lives as long as
    its holder's session instead)."""
    return bool(getattr(service, "leased", True))


def _delay_of(options: Mapping[str, Any]) -> float:
    if options.get("countdown"):
        return max(float(options["countdown"]), 0.0)
    eta = options.get("eta")
    if eta is None:
        return 0.0
    eta = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    now = datetime.now(timezone.utc) if eta.tzinfo else datetime.now()
    return max((eta - now).total_seconds(), 0.0)


def _time_limits(task: Any, request: Any) -> tuple[float | None, float | None]:
    """``(hard, soft)`` time limits of this run: per call, else the task's, else the app's."""
    hard, soft = [*(request.timelimit or ()), None, None][:2]
    conf = task.app.conf
    hard = hard or task.time_limit or conf.task_time_limit
    soft = soft or task.soft_time_limit or conf.task_soft_time_limit
    return (float(hard) if hard else None, float(soft) if soft else None)


def _time_limit(task: Any, request: Any) -> float | None:
    """The limit that ends the run: the hard one, else the soft one."""
    hard, soft = _time_limits(task, request)
    return hard or soft


def _summary(args: Any, kwargs: Any) -> str:
    parts = [saferepr(a, maxlen=ARGS_SUMMARY_MAX) for a in (args or ())]
    parts += [f"{k}={saferepr(v, maxlen=ARGS_SUMMARY_MAX)}" for k, v in (kwargs or {}).items()]
    text = ", ".join(parts)
    return text if len(text) <= ARGS_SUMMARY_MAX else text[: ARGS_SUMMARY_MAX - 3] + "..."


def _shown(*values: Any) -> tuple[str, ...]:
    """Values as a log line shows them (control characters escaped)."""
    return tuple(printable(v) for v in values)


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
    skipped = {"retry_after": lock.retry_after, "reason": "skipped by on_locked='skip'"}
    django_signals.send_event(LockEvent("contended", lock.name, meta=lock.meta, **skipped), redlock)


# ============================================================================ the worker side
# Nothing below runs on import: install(app) adds the two bootsteps, the worker bootstep
# connects the signal receivers (they act only for a worker that installed the hooks).

#: Test hook: called as ``probe(point, task_id)`` as a run begins to wait (``"wait-begins"``)
#: and at each point of the hand-off from waiting to holding (``"slot-taken"``,
#: ``"slot-handoff"``, ``"slot-released"``, ``"acquired"``, ``"before-run"``), so that a test
#: can make an exception land, or a revoke arrive, exactly there. None outside the test suite.
_handoff_probe: Callable[[str, str | None], None] | None = None


def _probe(point: str, task_id: str | None) -> None:
    if (probe := _handoff_probe) is not None:
        probe(point, task_id)


@dataclasses.dataclass
class TaskLockEntry:
    """The lock one running task holds or waits for, as its worker's main process knows it."""

    task_id: str
    task: str  #: the task's name
    lock: str  #: the lock name
    pid: int  #: the process running the task
    token: str | None = None  #: while it holds the lock
    slot: tuple[str, str] | None = None  #: (name, token) of its waiting slot while in one
    waiting: bool = False


class WorkerLocks(dict[str, TaskLockEntry]):
    """The worker's map, task id -> :class:`TaskLockEntry`, the lock its run holds or waits
    for. Fed by the tasks' reports: directly in an in-process pool (threads, solo, gevent),
    through a pipe from the processes of a prefork pool. A revoke, a terminate or a cold
    shutdown looks here instead of listing the lock nodes. Only single dict operations touch
    it, each atomic, and one task's reports come one after another: no lock of its own."""

    def record(self, report: Mapping[str, Any]) -> TaskLockEntry | None:
        """Apply one report (``kind`` = ``"wait"``, ``"hold"``, ``"go"`` (a wait that ended
        without the lock) or ``"done"``); returns the entry as it was before."""
        kind, task_id, slot = report["kind"], str(report["id"]), report.get("slot")
        before = self.pop(task_id, None)
        if kind in ("wait", "hold"):
            token = report.get("token") if kind == "hold" else None
            slot = (str(slot[0]), str(slot[1])) if kind == "wait" and slot else None
            task, lock, pid = str(report["task"]), str(report["lock"]), int(report["pid"])
            self[task_id] = TaskLockEntry(task_id, task, lock, pid, token, slot, kind == "wait")
        return before

    def holders(self) -> list[TaskLockEntry]:
        return [e for e in list(self.values()) if e.token]


#: How a worker's pool treats the time limits of a task that waits for its lock.
LIMITS_REARMED = "rearmed"  # prefork with the event loop: the wait is not charged
LIMITS_NOT_ENFORCED = "not enforced"  # threads, solo: Celery enforces no time limit
LIMITS_CHARGED = "charged"  # gevent, eventlet, prefork without the event loop


class WorkerHooks:
    """LockedTask's side of one worker: its :class:`WorkerLocks`, the pipe its prefork pool
    processes report on, and what the main process does with the reports (time limits) and
    on a revoke, a terminate, a hard time limit, a lost pool process or a cold shutdown."""

    #: Times a report waits for Celery to take the pool process's acknowledgement of the
    #: job (both arrive on the event loop, in either order) before its limits can be moved:
    #: the next turns of the loop first, then every 10 ms, for about 3 s in all.
    MAX_DEFERRALS = 300
    _SOON = 20
    #: Seconds the main process waits for a pool process stopped by a hard time limit to
    #: exit before it frees the task's lock. billiard sends SIGKILL 0.1 s after SIGTERM, so
    #: only a process that outlives SIGKILL (stuck in the kernel) gets this far; its lock is
    #: then left to the process itself or to its lease.
    EXIT_PATIENCE = 10.0
    #: Seconds between two looks at whether such a process has exited.
    EXIT_POLL = 0.01

    def __init__(self, worker: Any) -> None:
        self.app, self.worker, self.pid = worker.app, worker, os.getpid()
        self.locks = WorkerLocks()
        self.limits = _limits_mode(worker)
        self.hub: Any = None
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._partial = b""
        self._warned: set[str] = set()
        #: Task ids whose lock is freed once their stopped pool process has exited.
        self._awaiting_exit: set[str] = set()
        if self.limits == LIMITS_REARMED:
            # Created before the pool forks, so every pool process (replacements too)
            # inherits the write end. Writes up to PIPE_BUF bytes are atomic, so the pool
            # processes share it; a full pipe drops the report rather than block a task.
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)

    # -- in the task's process --------------------------------------------------------------

    def report(self, report: dict[str, Any]) -> None:
        """Tell the worker's main process what a task's run now holds or waits for."""
        if os.getpid() == self.pid:
            self.locks.record(report)  # an in-process pool: nothing else to move
            return
        if self._write_fd is None:
            return
        data = json.dumps(report, separators=(",", ":")).encode() + b"\n"
        if len(data) > _PIPE_BUF:
            logger.debug("report for %s too long for the pipe (%d bytes)", report["id"], len(data))
            return
        try:
            try:
                os.write(self._write_fd, data)
            except BlockingIOError:
                # The main process is behind: give it a moment rather than lose a report
                # (a lost end-of-wait would leave the task's limits suspended).
                select.select([], [self._write_fd], [], REPORT_PATIENCE)
                os.write(self._write_fd, data)
        except OSError as exc:
            logger.warning("could not report %s to the worker: %s", report["kind"], printable(exc))

    def warn_charged(self, task_name: str) -> None:
        """Once per task: this pool counts the lock wait against the time limits."""
        if task_name in self._warned:
            return
        self._warned.add(task_name)
        logger.warning(
            "task %s waits for its lock in a %s pool, which counts the wait against the task's "
            "time limits: size time_limit/soft_time_limit as lock_wait plus the run time "
            "(docs/celery.rst, 'Time limits')",
            task_name,
            getattr(self.worker.pool_cls, "__module__", "this"),
        )

    # -- in the worker's main process ---------------------------------------------------------

    def listen(self, hub: Any) -> None:
        self.hub = hub
        if self._read_fd is not None:
            hub.add_reader(self._read_fd, self.read_reports)

    def close(self) -> None:
        if self._read_fd is None:
            return
        if self.hub is not None:
            with contextlib.suppress(Exception):
                self.hub.remove_reader(self._read_fd)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)  # type: ignore[arg-type]
        self._read_fd = self._write_fd = None

    def read_reports(self, *args: Any) -> None:
        """Take every report waiting in the pipe (the event loop calls this when readable)."""
        from celery.worker import state as worker_state

        while self._read_fd is not None:
            try:
                chunk = os.read(self._read_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                return
            if not chunk:
                break
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                try:
                    report = json.loads(line)
                except ValueError:
                    logger.debug("unreadable report %r", line[:200])
                    continue
                before, task_id, kind = self.locks.record(report), str(report["id"]), report["kind"]
                entry = self.locks.get(task_id)
                if kind == "wait" and entry is not None and task_id in worker_state.revoked:
                    self._stop_waiting(entry)  # revoked before it reported the wait
                elif kind == "wait":
                    self._suspend_limits(task_id, 0)
                elif kind in ("hold", "go") and before is not None and before.waiting:
                    self._rearm_limits(task_id)

    def _job_of(self, task_id: str) -> tuple[Any, Any]:
        """The worker's request for ``task_id`` and its pool job (None, None if gone)."""
        from celery.worker import state as worker_state

        for request in list(worker_state.reserved_requests):
            if request.id == task_id:
                ref = getattr(request, "_apply_result", None)
                return request, (ref() if ref is not None else None)
        return None, None

    def _timers(self, task_id: str) -> tuple[Any, Any, Any]:
        """The pool job of ``task_id``, and the pool's functions that arm and cancel a job's
        time limits (None each when missing)."""
        _, job = self._job_of(task_id)
        pool = getattr(getattr(self.worker, "pool", None), "_pool", None)
        return job, getattr(pool, "on_timeout_set", None), getattr(pool, "on_timeout_cancel", None)

    def _suspend_limits(self, task_id: str, deferrals: int) -> None:
        """Stop the time limits of a task that waits for its lock. Celery arms them when it
        takes the pool process's acknowledgement of the job, which may come after this
        report: then try again on the next turn of the event loop."""
        entry = self.locks.get(task_id)
        if entry is None or not entry.waiting:
            return  # the wait is already over
        job, _, cancel = self._timers(task_id)
        if job is None or cancel is None:
            return
        if job.accepted():
            cancel(job)
        elif deferrals < self.MAX_DEFERRALS and self.hub is not None:
            if deferrals < self._SOON:
                self.hub.call_soon(self._suspend_limits, task_id, deferrals + 1)
            else:
                self.hub.call_later(0.01, self._suspend_limits, task_id, deferrals + 1)

    def _rearm_limits(self, task_id: str) -> None:
        """Arm the full time limits again, from now: the wait is over."""
        job, arm, cancel = self._timers(task_id)
        if job is None or arm is None or cancel is None or not job.accepted() or job.ready():
            return
        cancel(job)
        soft, hard = getattr(job, "_soft_timeout", None), getattr(job, "_timeout", None)
        if soft or hard:
            arm(job, soft, hard)

    def on_revoked(self, task_ids: Any) -> None:
        """After Celery's own ``revoke``: a revoked task that waits for its lock gives up its
        waiting slot at once and is stopped; a revoked queued task's marker stops merging
        calls. Point operations only: the map, and one key written per task id."""
        many = isinstance(task_ids, (list, tuple, set))
        ids = [str(i) for i in (task_ids if many else [task_ids])]
        self.read_reports()  # a task that got its lock meanwhile is no longer waiting
        for task_id in ids:
            entry = self.locks.get(task_id)
            if entry is not None and entry.waiting:
                self._stop_waiting(entry)
        _note_revoked(self.app, ids)

    def _stop_waiting(self, entry: TaskLockEntry) -> None:
        if entry.slot is not None:
            redlock = _redlock_of_task(self.app, entry.task)
            if redlock is not None:
                with contextlib.suppress(Exception):
                    redlock.release_token(*entry.slot)
        logger.warning(
            "task %s[%s] revoked while it waited for lock %s: stopped",
            entry.task,
            entry.task_id,
            printable(entry.lock),
        )
        if entry.pid == self.pid:
            return  # an in-process pool: the task looks at the revoked ids when its wait ends
        request, _ = self._job_of(entry.task_id)
        if request is None or getattr(request, "worker_pid", None) != entry.pid:
            return
        # REVOKED first (the state only: the pool process adds the chord's count when it
        # ends), so that the process tells this stop from a soft time limit; then billiard's
        # soft time limit signal, SoftTimeLimitExceeded in the waiting task (its limits are
        # suspended while it waits), which LockedTask.__call__ ends as REVOKED.
        try:
            request.task.backend.mark_as_revoked(entry.task_id, _REVOKED_WAITING)
        except Exception:
            logger.warning("could not store REVOKED for %s", entry.task_id, exc_info=True)
        with contextlib.suppress(OSError):
            os.kill(entry.pid, signal.SIGUSR1)

    def release_for(self, task_id: str, why: str) -> bool | None:
        """Release the lock (and waiting slot) that the map holds for ``task_id``, by token;
        None when the map knows nothing of it."""
        entry = self.locks.pop(task_id, None)
        redlock = None if entry is None else _redlock_of_task(self.app, entry.task)
        if entry is None or redlock is None:
            return None
        try:
            if entry.slot is not None:
                redlock.release_token(*entry.slot)
            released = bool(entry.token) and redlock.release_token(entry.lock, str(entry.token)) > 0
        except Exception:
            logger.warning(
                "could not release lock %s (%s)", *_shown(entry.lock, why), exc_info=True
            )
            return False
        if released:
            lock, shown_why = _shown(entry.lock, why)
            logger.warning(
                "released lock %s of task %s[%s] (%s)", lock, entry.task, task_id, shown_why
            )
        return released

    def release_once_exited(self, task_id: str, why: str) -> bool:
        """Release what the map holds for ``task_id`` once the pool process that ran it has
        exited (at once for an in-process pool); False when the map knows nothing of it.

        Celery reports a hard time limit (task_failure) before billiard stops the process:
        SIGTERM, then SIGKILL 0.1 s later. Until the process is gone its body may still run,
        so a release any earlier would let the key's next task start beside it."""
        entry = self.locks.get(task_id)
        if entry is None:
            return False
        if entry.pid == self.pid or self.hub is None:
            self.release_for(task_id, why)
        elif task_id not in self._awaiting_exit:  # Celery sends task_failure twice for one limit
            self._awaiting_exit.add(task_id)
            # Checked from the event loop, after billiard's own wait for the process (SIGTERM,
            # up to 0.1 s, SIGKILL) that follows this signal on it: the release never runs
            # beside the loop's forks of replacement pool processes.
            deadline = time.monotonic() + self.EXIT_PATIENCE
            self.hub.call_soon(self._release_when_exited, task_id, entry.pid, deadline, why)
        return True

    def _release_when_exited(self, task_id: str, pid: int, deadline: float, why: str) -> None:
        entry = self.locks.get(task_id)
        # None (or another run's): the run ended on its own and reported it (a body that went
        # on after SIGTERM and then returned released its lock itself): nothing is left.
        if entry is not None and entry.pid == pid:
            if _process_exited(pid):
                self.release_for(task_id, why)
            elif time.monotonic() < deadline:
                self.hub.call_later(
                    self.EXIT_POLL, self._release_when_exited, task_id, pid, deadline, why
                )
                return
            else:
                self.locks.pop(task_id, None)
                self.left_running(
                    entry, f"{self.EXIT_PATIENCE:.0f} s after it was stopped ({printable(why)})"
                )
        self._awaiting_exit.discard(task_id)

    @staticmethod
    def left_running(entry: TaskLockEntry, when: str) -> None:
        where = (entry.pid, entry.task, entry.task_id, when, printable(entry.lock))
        logger.warning(
            "pool process %s of task %s[%s] still runs %s: lock %s is left to it or to its lease",
            *where,
        )


#: Longest wait at a cold shutdown for the terminated pool processes to be gone.
COLD_EXIT_PATIENCE = 3.0
#: Seconds a pool process waits for room in a full report pipe before giving a report up.
REPORT_PATIENCE = 1.0
#: Longest write to a pipe that POSIX keeps in one piece.
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)

#: The hooks of the worker running in this process (a pool process inherits its parent's).
_worker_hooks: WorkerHooks | None = None


def _process_exited(pid: int) -> bool:
    """Whether ``pid``, a pool process (a child of this process), has exited. It is left
    unreaped: billiard reaps its own processes."""
    if hasattr(os, "waitid"):
        try:
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped already
    try:
        os.kill(pid, 0)  # without waitid a zombie counts as alive until billiard reaps it
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _limits_mode(worker: Any) -> str:
    pool_cls = getattr(worker, "pool_cls", None)
    if (getattr(pool_cls, "__module__", "") or "").endswith(".prefork"):
        return LIMITS_REARMED if getattr(worker, "use_eventloop", False) else LIMITS_CHARGED
    return LIMITS_CHARGED if getattr(pool_cls, "is_green", False) else LIMITS_NOT_ENFORCED


def _locked_tasks(app: Any) -> list[LockedTask]:
    return [t for t in app.tasks.values() if isinstance(t, LockedTask)]


def _redlock_of_task(app: Any, task_name: str) -> Redlock | None:
    task = app.tasks.get(task_name)
    if not isinstance(task, LockedTask):
        return None
    try:
        return task.get_redlock()
    except Exception:
        logger.warning("no lock service for task %s", task_name, exc_info=True)
        return None


def dedupe_without_leases(apps: Any = None) -> list[tuple[str, str, str]]:
    """``(task name, lock_using, service class)`` of each LockedTask that de-duplicates
    (``lock_dedupe``, its own or ``REDLOCK["LOCKED_TASK"]``'s) on a lock service without
    leases, whose queued marker would follow the sending process's session instead of
    ``lock_dedupe_ttl`` (system check ``django_redlock.E107``; ``apply_async`` refuses such a
    call with the same reason). ``apps``: the Celery apps to look at, default every app
    created in this process (finalized, as its first call would)."""
    from celery import _state

    found: list[tuple[str, str, str]] = []
    for app in list(apps if apps is not None else _state._get_active_apps()):
        for task in _locked_tasks(app) if app.finalized or app.autofinalize else []:
            try:
                service = task.get_redlock() if task.lock_options().dedupe else None
            except Exception:  # broken options or settings: other checks say so
                continue
            if service is not None and not _leased(service):
                found.append((task.name, str(task.lock_using), type(service).__name__))
    return sorted(set(found))


def _revoked_name(task_id: str) -> str:
    return f"{REVOKED_PREFIX}{task_id}"


def _was_revoked(redlock: Redlock, task_id: str) -> bool:
    try:
        return bool(redlock.locked(_revoked_name(task_id)))
    except Exception:
        logger.debug("could not tell whether %s was revoked", task_id, exc_info=True)
        return False


def _longest_marker(redlock: Any) -> float:
    """The longest lease a queued marker takes on ``redlock``: its ``max_ttl``, and on a
    backend without one (``max_ttl`` infinite) the longest lease any lock may have. A revoke's
    note lives that long, so it outlives the marker it stands for."""
    return min(float(redlock.max_ttl), MAX_DURATION)


def _note_revoked(app: Any, task_ids: list[str]) -> None:
    """Write :data:`REVOKED_PREFIX` + id for each revoked task (a point write per id, no
    read) on every lock service the app's LockedTasks use (``lock_using``): a later
    ``lock_dedupe`` call replaces such a task's queued marker instead of merging into a task
    that will never run. Celery only tells a task it was revoked when a worker reaches its
    message, which may be a long queue later. A service without leases holds no markers
    (lock_dedupe is refused there). A service that fails is logged; the revoke's reply, and
    the notes on the other services, still go out.

    A note lives as long as the queued marker it stands for can (:func:`_longest_marker`),
    and no longer than Celery's workers remember the revoke
    (``celery.worker.state.REVOKE_EXPIRES``, three hours unless
    ``CELERY_WORKER_REVOKE_EXPIRES`` says otherwise): past that, a worker that reaches the
    task's message runs it, so a call merged into it is no longer lost. A backend that keeps
    a lease as long as it is asked (a database, etcd) once kept every note for a year."""
    from celery.worker import state as worker_state

    redlocks: dict[int, Redlock] = {}
    for task in _locked_tasks(app):
        with contextlib.suppress(Exception):
            redlock = task.get_redlock()
            redlocks.setdefault(id(redlock), redlock)
    for redlock in [r for r in redlocks.values() if _leased(r)]:
        for task_id in task_ids:
            try:
                ttl = min(_longest_marker(redlock), float(worker_state.REVOKE_EXPIRES))
                owner, meta = ("celery-revoked", task_id), {"task_id": task_id, "revoked": True}
                note = redlock.lock(
                    _revoked_name(task_id), ttl=ttl, reentrant=False, owner=owner, meta=meta
                )
                if note.acquire(blocking=False):
                    note.detach()  # it lives out its lease
            except Exception:
                kind = type(redlock).__name__
                logger.warning(
                    "could not note the revoke of %s on %s", task_id, kind, exc_info=True
                )


def _revoke_with_locks(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        hooks = _worker_hooks
        if hooks is not None and hooks.app is state.app:
            hooks.on_revoked(task_id)
        return reply

    revoke.redlock_hooked = True  # type: ignore[attr-defined]
    return revoke


class LockedTaskWorker(bootsteps.StartStopStep):
    """Worker bootstep (:func:`install` adds it): LockedTask's map of the locks this worker's
    tasks hold or wait for, the pipe its prefork pool processes report on (created here,
    before the pool forks), the time limits a lock wait must not use up, and the release of
    the locks of pool processes the main process stops."""

    label = "LockedTask"

    def __init__(self, w: Any, **kwargs: Any) -> None:
        global _worker_hooks
        super().__init__(w, **kwargs)
        self.hooks = _worker_hooks = WorkerHooks(w)
        # Connected once per process; each receiver acts only for the worker whose hooks
        # are installed here.
        for celery_signal, receiver in (
            (signals.worker_process_shutdown, _on_process_shutdown),
            (signals.worker_shutting_down, _on_worker_shutting_down),
            (signals.task_revoked, _on_task_revoked),
            (signals.task_failure, _on_task_failure),
            (signals.worker_shutdown, _on_worker_shutdown),
        ):
            uid = f"django_redlock{receiver.__name__}"
            celery_signal.connect(receiver, weak=False, dispatch_uid=uid)

    # No start or stop of its own: the hooks outlive the other steps (a pool that stops
    # reports its tasks' failures, and a cold shutdown its abandoned locks, after this step's
    # turn); worker_shutdown ends them.
    def register_with_event_loop(self, w: Any, hub: Any) -> None:
        self.hooks.listen(hub)


class LockedTaskControl(bootsteps.StartStopStep):
    """Consumer bootstep (:func:`install` adds it): this worker's ``revoke`` remote control
    command also frees what a revoked task waits with (its waiting slot, its queued marker).

    Celery has no signal for a revoke that arrives before the task does, so the command is
    wrapped, in this worker's own mailbox (its handler table), after Celery's own handling;
    Celery's registry of commands (``Panel.data``) and other apps are left alone."""

    label = "LockedTask revoke"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        control = c.blueprint.steps.get("celery.worker.consumer.control.Control")
        node: Any = getattr(getattr(control, "box", None), "node", None)
        handlers: Any = getattr(node, "handlers", None)
        original = handlers.get("revoke") if isinstance(handlers, dict) else None
        if original is not None and not getattr(original, "redlock_hooked", False):
            node.handlers = {**handlers, "revoke": _revoke_with_locks(original)}


def install(app: Any) -> None:
    """Install LockedTask's worker side in the workers of ``app`` (idempotent; call it where
    the app is defined). Without it tasks lock and release as usual, but the locks of pool
    processes the worker stops (terminate, hard time limit, cold shutdown) wait out their
    lease, a revoked task waiting for its lock keeps waiting, queued markers of revoked
    tasks stay until a worker reaches the message, and the lock wait counts against the
    task's time limits. Adds :class:`LockedTaskWorker` to ``app.steps["worker"]`` and
    :class:`LockedTaskControl` to ``app.steps["consumer"]``; nothing else changes."""
    app.steps["worker"].add(LockedTaskWorker)
    app.steps["consumer"].add(LockedTaskControl)


def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    """The worker has stopped: its hooks end with it."""
    global _worker_hooks
    if _worker_hooks is not None and _worker_hooks.worker is sender:
        _worker_hooks.close()
        _worker_hooks = None


def _on_process_shutdown(**kwargs: Any) -> None:
    """A pool process is exiting: whatever it still holds will never be released otherwise."""
    if _worker_hooks is not None:
        release_held_locks("worker process shutdown")


def _on_worker_shutting_down(sender: Any = None, how: str = "Warm", **kwargs: Any) -> None:
    """Cold shutdown abandons running tasks: free their keys now rather than one lease later.
    A warm (or soft) shutdown lets running tasks finish; they release their own locks.
    Celery has already terminated the pool's running jobs when it sends this signal, so the
    locks are the ones the worker's map still holds for its tasks."""
    hooks = _worker_hooks
    if how != "Cold" or hooks is None:
        return
    release_held_locks("cold worker shutdown")
    # The terminated pool processes may still run their bodies (a C call delays the signal):
    # each key is freed once its process is gone, waiting at most a few seconds in all, as
    # the worker is going away and its event loop with it.
    deadline = time.monotonic() + COLD_EXIT_PATIENCE
    for entry in hooks.locks.holders():
        while entry.pid != hooks.pid and not _process_exited(entry.pid):
            if time.monotonic() >= deadline:
                break
            time.sleep(WorkerHooks.EXIT_POLL)
        if entry.pid == hooks.pid or _process_exited(entry.pid):
            hooks.release_for(entry.task_id, "cold worker shutdown")
        else:
            hooks.left_running(entry, "at cold shutdown")


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """A revoked task never takes its lock (the worker drops it before ``__call__``); one
    terminated while running had it, and its pool process may be gone: release it from here.
    A revoked task that was still queued gives up its de-duplication marker."""
    hooks = _worker_hooks
    if hooks is None or not isinstance(sender, LockedTask) or request is None:
        return
    if terminated:
        # Celery signals the terminate as it sends the signal; the body runs until the signal
        # lands (not inside a C call, and never if it catches it), so the lock is freed once
        # the process is gone, not now.
        if not hooks.release_once_exited(str(request.id), "task terminated"):
            sender.release_for_request(request)
    elif queued := _header_of(request).get(_QUEUED):
        _release_queued_marker(sender.get_redlock(), queued)


def _on_task_failure(
    sender: Any = None, task_id: str | None = None, exception: Any = None, **kwargs: Any
) -> None:
    """A pool process killed by a hard time limit or lost (WorkerLostError) cannot release
    its lock; the main process reports the failure and releases it here, once the process
    has exited."""
    hooks, name = _worker_hooks, type(exception).__name__
    if hooks is None or not isinstance(sender, LockedTask):
        return
    task_id = task_id or getattr(sender.request, "id", None)
    if name not in ("TimeLimitExceeded", "WorkerLostError") or not task_id:
        return
    if hooks.release_once_exited(str(task_id), f"task failed: {name}"):
        return
    # Without the map (no report pipe) only the run's own request names its lock; Celery
    # also sends this signal without it (after its timeout handler), and then the map's
    # release, if any, has already been made.
    if getattr(sender.request, "id", None) == task_id:
        sender.release_for_request(sender.request)
