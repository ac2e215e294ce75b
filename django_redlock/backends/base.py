"""The lock-manager interface every backend offers, and the parts all backends share.

:class:`LockManager` / :class:`LockHandle` write down the interface the Redlock class has
(``lock()``, ``locked``, ``live_locks``, ``lock_info``, ``force_release``, ``health``,
``close``; a handle with ``acquire/release/extend/check/held/validity/token/fence``), so the
decorator, the Celery task base, the admin page and the management command work with any of
them. :class:`BackendLocks` implements everything that does not depend on the service (input
checks, tokens, holder metadata, held/validity bookkeeping, events, the renewal thread, the
context manager); a backend supplies six small primitives (``_take``, ``_give_back``,
``_renew``, ``_still_held``, ``_remove``, ``_infos``). :class:`AsyncLocks` turns any backend
into its asyncio twin by running the blocking calls in worker threads: the services' clients
(database drivers, kazoo, HTTP) are blocking, and one adapter beats three async copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

from ..core import (
    HOLDER_PLACE,
    MAX_DURATION,
    Lease,
    Lock,
    LockEvent,
    LockInfo,
    LockLost,
    LockNotOwned,
    NodeHealth,
    NodeLockState,
    QuorumError,
    ThisProcess,
    check_flag,
    check_handle_options,
    check_meta,
    check_pattern,
    check_positive,
    check_reentry_fence,
    check_retry_count,
    check_timeout,
    check_token,
    emit,
)
from ..core import check_name as core_check_name

__all__ = [
    "AsyncBackendLock",
    "AsyncLocks",
    "BackendLock",
    "BackendLocks",
    "Grant",
    "LockHandle",
    "LockManager",
    "ServiceNode",
    "check_name",
]


@runtime_checkable
class LockHandle(Protocol):
    """One lock name, held or not: what ``manager.lock(name)`` returns."""

    name: str

    def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool: ...
    def release(self) -> None: ...
    def extend(self, ttl: float | None = None) -> bool: ...
    def check(self) -> bool: ...
    @property
    def held(self) -> bool: ...
    @property
    def validity(self) -> float: ...
    @property
    def token(self) -> str | None: ...
    @property
    def fence(self) -> int | None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class LockManager(Protocol):
    """A lock service: :class:`~django_redlock.Redlock` and every backend here."""

    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        fencing: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Any: ...
    def locked(self, name: str) -> bool: ...
    def live_locks(self, pattern: str = "*") -> Iterable[LockInfo]: ...
    def lock_info(self, name: str) -> LockInfo | None: ...
    def force_release(self, name: str, token: str | None = None) -> int: ...
    def health(self) -> list[NodeHealth]: ...
    def close(self) -> None: ...


def check_name(name: object, *, listed: bool = False) -> str:
    """The core's lock-name rule (``listed`` as there), plus no NUL: database columns,
    ZooKeeper paths and etcd keys cannot carry one."""
    name = core_check_name(name, listed=listed)
    if "\x00" in name:
        raise ValueError(f"lock name must not contain NUL: {name!r}")
    return name


def check_root(kind: str, root: object, what: str) -> str:
    """A directory of lock names: an absolute path, not ending in "/"."""
    if not isinstance(root, str) or not root.startswith("/") or root.endswith("/"):
        raise ValueError(f"{kind}: root must {what}, got {root!r}")
    return root


def holder_meta(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Who holds the lock (shown on the admin page), plus what the caller added."""
    meta: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        **HOLDER_PLACE,  # so "holder gone" is judged as for the Redlock's holders
    }
    meta.update(extra or {})
    return meta


@dataclass(frozen=True)
class ServiceNode:
    """The service as the one "node" the admin page and the management command list."""

    name: str


@dataclass(eq=False)
class Grant(Lease):
    """One acquisition: the Redlock's lease, as a backend hands it back when it granted the
    lock (its owner is set by the acquire). ``valid_until`` is inf while a session holds it
    (ZooKeeper). Of the lease's fields, the backends use the name, token, ttl, owner,
    valid_until, acquired, meta, fence, count, released, lost, auto_renew, renew_until and
    pid (so ``foreign`` and ``validity``)."""

    #: Backend-private state (the ZooKeeper node path, the etcd lease, a held connection).
    state: Any = None
    stop_renewal: threading.Event = field(default_factory=threading.Event)

    def taken_by(self, handle: Any) -> None:
        """A handle took it: a backend's renewal does not ask which handles still hold a
        grant, so none are kept."""


class BackendLock(Lock):
    """The handle every backend returns: the Redlock's :class:`~django_redlock.Lock` (the
    same surface, bookkeeping and handle rules: whoever acquired the handle releases and
    extends it; a failed attempt leaves the holder's grant alone), talking to a
    :class:`BackendLocks` instead of the nodes. Its lease is the backend's :class:`Grant`."""


class BackendLocks:
    """Everything a backend shares; subclasses implement the service primitives below."""

    lock_class = BackendLock
    #: Whether waiters are served in arrival order (``lock(fair=True)`` is accepted).
    fair = False
    #: Longest lease a lock may ask for (Redlock caps it for its restart guard; these
    #: services keep their state through restarts, so nothing caps it here).
    max_ttl = math.inf
    #: What the management command and the admin page read of a Redlock: one service that
    #: decides alone (its own replication is its business), no restart guard.
    quorum = 1

    #: Redlock's clock-drift allowance; these services time leases themselves.
    drift_factor = 0.0

    #: Whether a lock runs out with its lease (a ZooKeeper lock lives as its session does).
    leased = True

    def semaphore(self, name: str, *args: Any, **options: Any) -> Any:
        raise self._refuse("semaphore", name)

    def read_lock(self, name: str, *args: Any, **options: Any) -> Any:
        raise self._refuse("read_lock", name)

    def write_lock(self, name: str, *args: Any, **options: Any) -> Any:
        raise self._refuse("write_lock", name)

    def _refuse(self, primitive: str, name: str) -> NotImplementedError:
        """Semaphores and read/write locks exist on the Redlock only (for now): said before
        anything is sent, naming the backend, the primitive and where to find it."""
        return NotImplementedError(
            f"{type(self).__name__} ({self.service}) has no {primitive}() for {name!r}: "
            "semaphores and read/write locks are offered by the Redlock over REDLOCK['NODES'] "
            "(using='default'); this backend offers lock() only"
        )

    @property
    def nodes(self) -> list[ServiceNode]:
        return [ServiceNode(self.node_name)]

    @staticmethod
    def _record(token: str, meta: dict[str, Any]) -> str:
        """What ZooKeeper and etcd keep of a holder, as JSON (read back by :meth:`_info`)."""
        return json.dumps({"token": token, "meta": meta, "acquired_us": int(time.time() * 1e6)})

    def _info(
        self, name: str, held: Mapping[str, Any], ttl: float, lease: float | None, fence: int | None
    ) -> LockInfo:
        """A LockInfo for this single-authority service (one "node", quorum one), from what
        the service keeps of its holder: ``token``, ``meta``, ``acquired_us`` (microseconds
        since the epoch, or None) and ``renewals`` (0 when it does not count them)."""
        token, renewals, micros = held["token"], held.get("renewals", 0), held.get("acquired_us")
        at = None if micros is None else datetime.fromtimestamp(micros / 1e6, timezone.utc)
        state = NodeLockState(self.node_name, token, ttl, renewals, fence, at, lease)
        meta = dict(held["meta"])
        return LockInfo(name, token, meta, at, ttl, 1, 1, 1, fence, renewals, (state,), lease)

    #: Shown in NodeHealth and error messages.
    service = "lock service"

    def __init__(
        self, *, ttl: float = 30.0, retry_count: int = 3, retry_delay: float = 0.2
    ) -> None:
        self.ttl = check_positive("ttl", ttl)
        self.retry_count = check_retry_count(retry_count)
        self.retry_delay = check_positive("retry_delay", retry_delay, allow_zero=True)
        if retry_count * self.retry_delay > MAX_DURATION:
            raise ValueError(
                f"retry_count {retry_count!r} x retry_delay {retry_delay!r} is longer than a year "
                "(for a longer wait pass a timeout)"
            )
        #: How the service is named in listings (the one "node" of LockInfo/NodeHealth),
        #: and in errors.
        self.node_name = self.label = self.service
        self.listeners: list[Any] = []
        #: What ``lock(reentrant=None)`` means and the metadata stored with every lock, as
        #: the Redlock's ``reentrant``/``meta``; the registry sets them from ``REDLOCK``.
        self.reentrant = False
        self.meta: dict[str, Any] = {}
        #: The grant of each name held through this manager, for reentrant holds.
        self._holds: dict[str, Grant] = {}
        self._holds_lock = threading.Lock()
        #: The process whose connections this manager holds (see :meth:`_this_process`).
        self._pid = ThisProcess.pid

    # -- fork -----------------------------------------------------------------------------------

    def _this_process(self) -> None:
        """Called before any use of the service: in a process forked since the last use,
        let go of everything inherited (:meth:`_after_fork`) before anything is sent. The
        parent's connections, sessions and watch threads stay the parent's: a child that
        talked on them would read the parent's replies (and the parent the child's)."""
        if self._pid == ThisProcess.pid:
            return
        with _fork_guard:
            if self._pid != ThisProcess.pid:
                # Locks other threads of the parent held at the fork stay held here for ever.
                self._holds = {}
                self._holds_lock = threading.Lock()
                self._after_fork()
                self._pid = ThisProcess.pid

    def _after_fork(self) -> None:
        """Drop the parent's connections, sessions and watch state WITHOUT ending them at
        the protocol level (that would end the parent's), and start afresh. Each backend
        replaces what it has; nothing here."""

    # -- the primitives a backend implements ----------------------------------------------------

    def _take(
        self, handle: BackendLock, token: str, blocking: bool, deadline: float | None
    ) -> Grant | None:
        """Take ``handle.name`` for ``token`` (waiting until ``deadline`` when blocking),
        or None. Sets ``handle.retry_after`` when it knows when the holder's lease ends."""
        raise NotImplementedError

    def _give_back(self, grant: Grant) -> bool:
        """Delete the lock if ``grant.token`` still holds it; whether it did."""
        raise NotImplementedError

    def _renew(self, grant: Grant, ttl: float) -> bool | float:
        """Re-arm the lease for ``ttl`` seconds if the token still holds it: True, or the
        seconds the service granted when it cannot grant ``ttl``; False when not held."""
        raise NotImplementedError

    def _still_held(self, grant: Grant) -> bool:
        raise NotImplementedError

    def _adopt(self, name: str, token: str) -> Grant | None:
        """A Grant for the current hold of ``name`` if ``token`` is its holder (a lock
        detached in another process), else None."""
        raise NotImplementedError

    def _remove(self, name: str, token: str | None) -> int:
        """Delete ``name`` whoever holds it (only ``token``'s hold, when given): 1 or 0."""
        raise NotImplementedError

    def _infos(self, wanted: Callable[[str], bool]) -> Iterable[LockInfo]:
        """The live locks whose name is ``wanted`` (any order): asked before anything else
        is read of a lock."""
        raise NotImplementedError

    def _watch(self, grant: Grant) -> None:
        """Start telling the holder of ``grant`` at once when anyone else removes its lock
        (a force release, a take-over): then mark it lost. Nothing by default (ZooKeeper's
        node watch does it itself)."""

    def _unwatch(self, grant: Grant) -> None:
        """Stop watching ``grant``: it is being released, was lost, or was handed over.
        Called before our own release removes the lock, so that is never read as a loss."""

    def locked(self, name: str) -> bool:
        return self.lock_info(name) is not None

    @contextlib.contextmanager
    def _verdict(
        self, name: str, verb: str, errors: tuple[type[BaseException], ...], after: str = ""
    ) -> Iterator[None]:
        """The service gave no verdict on ``verb``-ing lock ``name`` (one of ``errors``):
        raised as the Redlock's :class:`QuorumError`, the one error its acquire, release and
        extend raise for "no verdict" (a view answers 503, a LockedTask treats it as
        unavailable lock nodes), naming the lock, the service (:attr:`label`) and the cause."""
        try:
            yield
        except errors as exc:
            raise QuorumError(
                f"lock {name!r}: {self.label} could not {verb} it{after}",
                name,
                failures={self.node_name: str(exc) or type(exc).__name__},
            ) from exc

    def unavailable(self) -> tuple[type[BaseException], ...]:
        """The errors that mean the service could not answer (lazily: a backend's client
        library is imported on first use)."""
        return ()

    def unusable_reason(self) -> str | None:
        """Why the configured service can never hold a lock, or None (system check E106)."""
        return None

    def health(self) -> list[NodeHealth]:
        raise NotImplementedError

    def close(self) -> None:
        """Close the connections this manager opened."""

    # -- the interface --------------------------------------------------------------------------

    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        fencing: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
        reentrant: bool | None = None,
        fair: bool = False,
        owner: Hashable | None = None,
        renew_for: float | None = None,
        retries: int | None = None,
    ) -> BackendLock:
        """A handle on lock ``name``; nothing is sent until it is acquired.

        The Redlock options are accepted where the service can honour them: ``fair=True``
        where waiters are served in arrival order (:attr:`fair`), ``renew_for`` caps
        auto-renewal, ``owner`` names who holds the handle, ``retries`` bounds a blocking
        acquire without a timeout (at most ``retries`` x ``retry_delay`` seconds here).
        ``reentrant=True``: the owner that holds ``name`` through this manager takes it
        again as one more hold of the same grant (released at the last release), as on the
        Redlock; without it (None: :attr:`reentrant`, False unless the registry built this
        manager from ``REDLOCK["REENTRANT"]``) a second acquire by the holder contends.
        """
        check_name(name)
        self._this_process()
        lease = self.ttl if ttl is None else check_positive("ttl", ttl)
        timeout = check_timeout(timeout)
        details = {**self.meta, **check_meta(meta, besides=self.meta)}
        reentrant = self.reentrant if reentrant is None else check_flag("reentrant", reentrant)
        cap = check_handle_options(name, auto_renew, fencing, fair, blocking, owner, renew_for)
        if fair and not self.fair:
            raise ValueError(f"{type(self).__name__} does not serve waiters in order (fair=True)")
        if retries is not None:
            retries = check_retry_count(retries, "retries")
        return self.lock_class(
            self, name, ttl=lease, auto_renew=auto_renew, fencing=fencing, blocking=blocking,
            timeout=timeout, meta=details, owner=owner, renew_for=cap, retries=retries,
            reentrant=reentrant, fair=False,
        )  # fmt: skip

    def release_token(self, name: str, token: str) -> int:
        """Release ``name`` if ``token`` still holds it (a lock handed over with
        :meth:`BackendLock.detach`): 1, or 0 when another holder has it by now."""
        check_name(name, listed=True)
        self._this_process()
        return self._remove(name, check_token(token))

    def extend_token(self, name: str, token: str, ttl: float) -> bool:
        """Re-arm ``name`` for ``ttl`` seconds if ``token`` still holds it."""
        check_name(name, listed=True)
        ttl = check_positive("ttl", ttl)
        self._this_process()
        grant = self._adopt(name, check_token(token))
        return grant is not None and bool(self._renew(grant, ttl))

    def live_locks(self, pattern: str = "*") -> Iterator[LockInfo]:
        """Every live lock whose name matches the glob ``pattern``, by name."""
        pattern = check_pattern(pattern)
        self._this_process()
        infos = self._infos(lambda name: fnmatch.fnmatchcase(name, pattern))
        return iter(sorted(infos, key=lambda info: info.name))

    def lock_info(self, name: str) -> LockInfo | None:
        check_name(name, listed=True)
        self._this_process()
        return next(iter(self._infos(name.__eq__)), None)

    def force_release(self, name: str, token: str | None = None) -> int:
        """Remove ``name`` whoever holds it (only ``token``'s hold, when given); 1 or 0.
        The former holder learns it lost the lock at its next renewal, check or release."""
        check_name(name, listed=True)
        self._this_process()
        removed = self._remove(name, None if token is None else check_token(token))
        if removed:
            self._emit(LockEvent("force_released", name, token=token, nodes=removed))
            with self._holds_lock:
                grant = self._holds.get(name)
            if grant is not None and token in (None, grant.token):
                # This process's own hold: lost now, not when its watch hears of it (a
                # reentrant acquire meanwhile would join a hold nobody has any more).
                self._mark_lost(grant, "force-released by this process")
        return removed

    # -- shared logic ---------------------------------------------------------------------------

    def _acquire(
        self,
        handle: BackendLock,
        owner: Hashable,
        *,
        blocking: bool,
        timeout: float | None,
        retries: int | None,
    ) -> Grant | None:
        start = time.monotonic()
        self._this_process()
        held = self._reenter(handle, owner)
        if held is not None:
            return held
        if timeout is None and retries is not None:
            # The Redlock's retry policy: it pauses at most retry_delay before each of its
            # retries. A waiter here is woken by the release instead of retrying, so it
            # waits that long at most; no retries means one attempt.
            timeout = retries * self.retry_delay
            blocking = blocking and timeout > 0
        deadline = None if timeout is None or math.isinf(timeout) else start + timeout
        handle.retry_after = None
        try:
            grant = self._take_valid(handle, blocking, deadline)
        except self.unavailable() as exc:
            # Refused as a Redlock's acquire with too few nodes answering: a view answers 503
            # and a LockedTask treats it as unavailable lock nodes.
            raise QuorumError(
                f"lock {handle.name!r}: {exc}", handle.name, failures={self.node_name: str(exc)}
            ) from exc
        waited = time.monotonic() - start
        if grant is None:
            retry_after = handle.retry_after
            self._emit(LockEvent("contended", handle.name, waited=waited, retry_after=retry_after))
            return None
        grant.owner = owner
        with self._holds_lock:
            self._holds[grant.name] = grant
        self._emit(LockEvent.of_acquisition(grant, waited))
        self._watch(grant)
        if handle.auto_renew:
            self._start_renewal(grant, handle.renew_for)
        return grant

    def _take_valid(
        self, handle: BackendLock, blocking: bool, deadline: float | None
    ) -> Grant | None:
        """A grant with validity left, as the Redlock refuses a lease whose validity ran
        out while the nodes answered: a grant that took longer than its ttl (a service slow
        to answer, a paused process) is given back, and taken anew while the caller waits."""
        while True:
            grant = self._take(handle, secrets.token_hex(16), blocking, deadline)
            if grant is None or grant.validity > 0:
                return grant
            with contextlib.suppress(Exception):  # its lease ends it otherwise
                self._give_back(grant)
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return None

    def _start_renewal(self, grant: Grant, renew_for: float | None) -> None:
        grant.auto_renew = True
        until = None if renew_for is None else time.monotonic() + renew_for
        grant.renew_until = until
        spawn(f"lock-renew:{grant.name}", self._keep_renewing, grant, until)

    def _reenter(self, handle: BackendLock, owner: Hashable) -> Grant | None:
        """The owner's grant of this name, one hold deeper, when reentry applies (as the
        Redlock's: a nested hold may start renewal, it cannot add a fence)."""
        if not handle.reentrant:
            return None
        with self._holds_lock:
            grant = self._holds.get(handle.name)
        if grant is None or grant.owner != owner or grant.validity <= 0:
            return None
        # The hold may have been removed by someone else (an operator's force release, heard
        # by its watch within a second): joining it then would make a second holder. Asked of
        # the service; unreachable, the hold stands as far as this process knows.
        try:
            gone = not self._still_held(grant)
        except self.unavailable():
            gone = False
        if gone:
            self._mark_lost(grant, "the lock was removed by someone else")
            return None
        with self._holds_lock:
            if self._holds.get(handle.name) is not grant or grant.validity <= 0:
                return None
            check_reentry_fence(handle.name, handle.fencing, grant.fence)
            grant.count += 1
            upgrade = handle.auto_renew and not grant.auto_renew
        if upgrade:
            self._start_renewal(grant, handle.renew_for)
        return grant

    def _forget_hold(self, grant: Grant) -> None:
        with self._holds_lock:
            if self._holds.get(grant.name) is grant:
                del self._holds[grant.name]

    def _release(self, grant: Grant) -> None:
        if grant.foreign:
            # The parent's lock, seen from a forked child: the parent still holds it.
            return
        self._this_process()
        with self._holds_lock:
            if grant.count > 1 and not grant.released:  # an inner reentrant hold
                grant.count -= 1
                return
            if self._holds.get(grant.name) is grant:
                del self._holds[grant.name]
        grant.stop_renewal.set()
        if grant.released:
            return
        held = time.monotonic() - grant.acquired
        self._unwatch(grant)
        if self.leased and grant.lost is None and grant.validity <= 0:
            self._release_run_out(grant)
        if grant.lost is None and self._give_back(grant):
            grant.released = True
            self._emit(
                LockEvent("released", grant.name, token=grant.token, meta=grant.meta, held=held)
            )
            return
        self._mark_lost(grant, "the lock was no longer ours at release")
        grant.released = True
        raise LockLost(f"lock {grant.name!r} was lost before release: {grant.lost}", grant.name)

    def _release_run_out(self, grant: Grant) -> None:
        """The release of a grant whose lease ran out by our clock, as the Redlock's: its
        leftover lock is removed (by token, never another holder's), and the release raises
        LockLost when the lease was to be renewed (the process was frozen past it), else
        LockNotOwned (it simply ran out: the lock was not exclusive the whole time)."""
        renewing = grant.auto_renew and (
            grant.renew_until is None or grant.valid_until < grant.renew_until
        )
        with contextlib.suppress(*self.unavailable()):  # else the service ends it itself
            self._give_back(grant)
        why = "the lease ran out before it could be renewed" if renewing else "its lease ran out"
        self._mark_lost(grant, why)
        grant.released = True
        if renewing:
            raise LockLost(f"lock {grant.name!r} was lost before release: {why}", grant.name)
        raise LockNotOwned(
            f"lock {grant.name!r}: {why} before release; it was not exclusive the whole time",
            grant.name,
        )

    def _extend(self, grant: Grant, ttl: float) -> bool:
        ttl = check_positive("ttl", ttl)
        if grant.released or grant.lost or grant.foreign:
            return False
        self._this_process()
        started = time.monotonic()
        renewed = self._renew(grant, ttl)
        if renewed:
            if not math.isinf(grant.valid_until):  # a session lock has no lease end
                grant.valid_until = started + (ttl if renewed is True else float(renewed))
            grant.ttl = ttl  # as the Redlock's: auto-renewal goes on with the new lease
            return True
        self._mark_lost(grant, "the lock was taken or removed before it could be extended")
        return False

    def _check(self, grant: Grant) -> bool:
        if grant.lost or grant.foreign:
            return False
        self._this_process()
        try:
            held = self._still_held(grant)
        except self.unavailable():
            # Not known to be ours, as a Redlock's check() is False with its nodes down.
            return False
        if not held:  # the service says it is not ours: lost, as a Redlock's check() finds
            self._mark_lost(grant, "the lock was no longer ours when checked")
        return held

    def _detach(self, grant: Grant) -> str:
        """Forget a grant handed to another process (no release, no renewal here)."""
        grant.stop_renewal.set()
        grant.released = True
        self._forget_hold(grant)
        self._unwatch(grant)
        return grant.token

    def _keep_renewing(self, grant: Grant, until: float | None) -> None:
        """Re-arm the lease every ttl/3 while held (one thread per auto-renewed lock), until
        ``until`` (monotonic) when renewal is capped."""
        while not grant.stop_renewal.wait(grant.ttl / 3):
            if grant.released or grant.lost or (until is not None and time.monotonic() >= until):
                return
            if grant.validity <= 0:
                self._mark_lost(grant, "the lease ran out before it could be renewed")
                return
            try:
                self._extend(grant, grant.ttl)
            except Exception as exc:  # the service is unreachable: retry while validity lasts
                if grant.validity <= 0:
                    self._mark_lost(grant, f"renewal failed: {exc}")
                    return

    def _mark_lost(self, grant: Grant, reason: str) -> None:
        if grant.lost is not None or grant.released:
            return
        grant.lost = reason
        grant.stop_renewal.set()
        self._forget_hold(grant)
        self._unwatch(grant)
        self._emit(LockEvent.of_end("lost", grant, reason))

    def _emit(self, event: LockEvent) -> None:
        emit(self.listeners, event)


#: Serialises the first use of managers in a new process (made anew in each child: another
#: thread of the parent may have held it at the fork).
_fork_guard = threading.Lock()


def _new_fork_guard() -> None:
    global _fork_guard
    _fork_guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_fork_guard)


def spawn(name: str | None, target: Callable[..., None], *args: Any) -> threading.Thread:
    """A daemon thread running ``target(*args)``, started."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def unreachable(node: str, exc: BaseException) -> NodeHealth:
    """The health of a service that could not be asked, with the reason."""
    return NodeHealth(node=node, reachable=False, error=str(exc) or type(exc).__name__)


def glob_escape(name: str) -> str:
    """``name`` as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in name)


# -- asyncio ------------------------------------------------------------------------------------


class AsyncBackendLock:
    """The asyncio handle: ``await lock.acquire()``, ``async with manager.lock(name):``.

    The blocking calls run in worker threads, but the owner is the task that calls (as with
    the AsyncRedlock's handle): taken when ``acquire()``/``release()``/``extend()`` is
    called, in the event loop, never the worker thread that happens to run the request.
    """

    def __init__(self, handle: BackendLock) -> None:
        self._handle = handle
        self.name = handle.name

    def __getattr__(self, attribute: str) -> Any:
        # held, validity, token, fence, lost, retry_after, ttl, meta: local reads.
        return getattr(self._handle, attribute)

    def __repr__(self) -> str:
        return f"<Async{self._handle!r}"[:-1] + ">"

    def acquire(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
        *,
        retries: int | None = None,
    ) -> Coroutine[Any, Any, bool]:
        """See :meth:`BackendLock.acquire`; owned by the task that calls it."""
        handle = self._handle
        owner = handle._owner()
        prepared = handle._prepare(owner, blocking, check_timeout(timeout), retries)
        return self._acquire_for(owner, prepared)

    async def _acquire_for(
        self, owner: Hashable, prepared: tuple[bool, float | None, int | None] | None
    ) -> bool:
        if prepared is None:
            return False
        blocking, timeout, retries = prepared
        handle = self._handle
        manager: BackendLocks = handle.redlock  # type: ignore[assignment]
        call = asyncio.to_thread(
            manager._acquire, handle, owner, blocking=blocking, timeout=timeout, retries=retries
        )
        attempt = asyncio.ensure_future(call)
        try:
            grant = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            # The worker thread goes on: a grant it wins after the caller gave up is
            # released, not left held by nobody until its lease ends.
            attempt.add_done_callback(lambda done: _give_up(manager, done))
            raise
        return handle._won(grant)

    def release(self) -> Coroutine[Any, Any, None]:
        """See :meth:`BackendLock.release`; only the task that acquired may release."""
        handle = self._handle
        grant = handle._take_lease(handle._owner())
        handle._drop_hold()
        return asyncio.to_thread(handle.redlock._release, grant)

    def extend(self, ttl: float | None = None) -> Coroutine[Any, Any, bool]:
        """See :meth:`BackendLock.extend`; only the task that acquired may extend."""
        handle = self._handle
        grant = handle._take_lease(handle._owner())
        return asyncio.to_thread(handle.redlock._extend, grant, handle.ttl if ttl is None else ttl)

    async def check(self) -> bool:
        return await asyncio.to_thread(self._handle.check)

    async def __aenter__(self) -> AsyncBackendLock:
        if not await self.acquire():
            raise self._handle._not_acquired()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


def _give_up(manager: BackendLocks, attempt: asyncio.Future[Grant | None]) -> None:
    """Release a grant won for a caller that was cancelled meanwhile (in a thread: the
    release talks to the service)."""
    if attempt.cancelled() or attempt.exception() is not None:
        return
    grant = attempt.result()
    if grant is not None:
        spawn("lock-give-up", _release_quietly, manager, grant)


def _release_quietly(manager: BackendLocks, grant: Grant) -> None:
    with contextlib.suppress(Exception):  # gone already, or the service is down: its lease ends
        manager._release(grant)


class AsyncLocks:
    """The asyncio twin of a backend: the same names, awaitable (blocking calls run in worker
    threads, so the event loop never waits on the service)."""

    def __init__(self, manager: BackendLocks) -> None:
        self.manager = manager
        self.listeners = manager.listeners
        # Refused as the backend refuses them (no service is asked): not awaitable.
        self.semaphore = manager.semaphore
        self.read_lock = manager.read_lock
        self.write_lock = manager.write_lock

    def lock(self, name: str, ttl: float | None = None, **options: Any) -> AsyncBackendLock:
        return AsyncBackendLock(self.manager.lock(name, ttl, **options))

    async def locked(self, name: str) -> bool:
        return await asyncio.to_thread(self.manager.locked, name)

    async def live_locks(self, pattern: str = "*") -> list[LockInfo]:
        return await asyncio.to_thread(lambda: list(self.manager.live_locks(pattern)))

    async def lock_info(self, name: str) -> LockInfo | None:
        return await asyncio.to_thread(self.manager.lock_info, name)

    async def force_release(self, name: str, token: str | None = None) -> int:
        return await asyncio.to_thread(self.manager.force_release, name, token)

    async def health(self) -> list[NodeHealth]:
        return await asyncio.to_thread(self.manager.health)

    async def close(self) -> None:
        await asyncio.to_thread(self.manager.close)
