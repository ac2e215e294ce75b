"""The lock handle a caller holds, the lease that reentrant holds share, and the table where
an acquire enters the lease it won and a reentrant owner finds it again."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from . import clock
from .errors import LockNotAcquired, LockNotOwned
from .events import Listener, LockEvent, emit, logger
from .kinds import READER_SUFFIX
from .process import ThisProcess
from .validation import check_flag, check_reentry_fence, check_retry_count, check_timeout

__all__ = ["HeldLeases", "Lease", "Lock", "LockBase", "SyncClient", "current_owner", "owner_ended"]


def current_owner() -> Hashable:
    """Who is asking: the running asyncio task, else the current thread.

    Coroutines on one thread are different owners (redis-py's thread-local token makes them one),
    so a task is preferred whenever an event loop runs the caller. The task or thread object
    itself, not its id: a thread's ident (and a collected task's id) is reused by the next one,
    which would then re-enter a lock the finished one still holds. A lease keeps its owner
    alive, so no other object can take its place meanwhile.
    """
    # Asked for the running loop first: current_task() raises outside one, and a raise costs
    # more than the rest of this (it runs twice per lock cycle, mostly in a plain thread).
    loop = asyncio._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
    if task is not None:
        return ("task", task)
    return ("thread", threading.current_thread())


class _Ended:
    """What a lease keeps as its owner once that task or thread has ended: not the task itself,
    which would keep alive what it returned (often the handle, which then looks reachable)."""

    def __init__(self, was: str) -> None:
        self.was = was

    def __repr__(self) -> str:
        return f"{self.was} (ended)"


def owner_ended(owner: Hashable) -> bool:
    """Whether ``owner`` is a task that finished (or whose loop was closed) or a thread that
    ended: nobody can ask as that owner any more. An explicit ``owner=`` never ends."""
    if owner.__class__ is _Ended:
        return True
    if owner.__class__ is not tuple or len(owner) != 2:
        return False
    kind, who = owner
    if kind == "task" and isinstance(who, asyncio.Task):
        return who.done() or who.get_loop().is_closed()
    if kind == "thread" and isinstance(who, threading.Thread):
        return not who.is_alive()
    return False  # an explicit owner= that merely looks like one of ours


def _describe(owner: Hashable) -> str:
    if owner.__class__ is _Ended:
        return repr(owner)
    if isinstance(owner, tuple) and len(owner) == 2 and owner[0] == "thread":
        return f"thread {owner[1].name!r}"
    if isinstance(owner, tuple) and len(owner) == 2 and owner[0] == "task":
        return f"task {owner[1].get_name()!r}"
    return f"owner {owner!r}"


@dataclass(eq=False)
class Lease:
    """One acquisition on the nodes; reentrant holds of the same owner share it."""

    name: str
    token: str
    ttl: float
    owner: Hashable
    valid_until: float  #: clock.monotonic() deadline
    acquired: float = field(default_factory=lambda: clock.monotonic())
    meta: dict[str, Any] = field(default_factory=dict)
    fence: int | None = None
    count: int = 1
    released: bool = False
    lost: str | None = None  #: why the lease was lost, once it was
    #: Its validity had run out when it was released (a lease nobody renews).
    ran_out: bool = False
    auto_renew: bool = False
    renew_until: float | None = None  #: monotonic cap on auto-renewal, None = no cap
    last_renewal: float = field(default_factory=lambda: clock.monotonic())
    #: Rounds of the watchdog that renewed it: the cap (renew_until) is judged on the
    #: schedule's own times (acquired + k * ttl / 3), not on when a watchdog woke (the sync
    #: wheel wakes early, a busy loop late), so both clients stop at the same renewal.
    renewed: int = 0
    #: How too few nodes answered its last renewal (None once one succeeded): why it was
    #: lost, if it runs out before the next succeeds.
    refused: str | None = None
    #: Held while a renewal is on the wire, so release never races a PEXPIRE.
    io_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: Releases this process's local queue for the name, if it used one.
    leave_queue: Any = field(default=None, repr=False)
    #: Tells that queue the lease is gone (lost): the next in line moves up at once.
    wake_queue: Any = field(default=None, repr=False)
    #: Stops listening for an operator's force release (auto-renewed leases listen).
    unwatch: Any = field(default=None, repr=False)
    #: Connections that still owed the acquire's reply when it returned (a quorum had
    #: granted it): the release goes out behind it there (see :class:`.fanout.FanOut`).
    behind: Any = field(default=None, repr=False)
    #: The process that acquired it; a forked child holds none of its parent's locks.
    pid: int = field(default_factory=lambda: ThisProcess.pid)
    #: The lease table it was entered in (the client's that took it): a hold re-entered
    #: through a partner client (:meth:`HeldLeases.share_holds`) is counted and dropped there.
    home: HeldLeases | None = field(default=None, repr=False)
    #: Weak references to the handles that took it: once its owner ended and none of them
    #: holds it any more, nobody can release it, so the watchdog lets it run out.
    handles: tuple[weakref.ref[Any], ...] = field(default=(), repr=False)

    @property
    def foreign(self) -> bool:
        """Inherited through fork: this process must never touch it on the nodes."""
        return self.pid != ThisProcess.pid

    @property
    def validity(self) -> float:
        if self.released or self.lost or self.foreign:
            return 0.0
        return max(self.valid_until - clock.monotonic(), 0.0)

    def taken_by(self, handle: LockBase) -> None:
        if not self.handles:  # a lease just won (every acquire): nothing to look through
            self.handles = (weakref.ref(handle),)
            return
        # The handles that let go are dropped: a long hold that many nested reentrant
        # handles joined keeps only those that still hold it.
        kept = tuple(
            ref for ref in self.handles if (h := ref()) is not None and h._holds_lease(self)
        )
        self.handles = (*kept, weakref.ref(handle))

    def abandoned(self) -> bool:
        """Whether nobody can release it any more: its owner (a task or a thread) ended, and
        no handle that took it still holds it."""
        if not owner_ended(self.owner):
            return False
        if self.owner.__class__ is not _Ended:
            self.owner = _Ended(_describe(self.owner))  # let the task go (see _Ended)
        for ref in self.handles:
            handle = ref()
            if handle is not None and handle._holds_lease(self):
                return False
        return True


class HeldLeases:
    """The leases this process holds, by name: where an acquire enters the lease it won,
    where a reentrant owner finds it again, and where a driver finds a win it could not hand
    back (interrupted). :class:`.leases.LeaseTable` adds what happens to a lease after: its
    release, renewal, check and loss, which take it out again.

    ``listeners`` is the client's list (shared, not copied); ``start_renewal`` hands an
    auto-renewed lease to the client's watchdog."""

    def __init__(self, listeners: list[Listener], start_renewal: Callable[[Lease], None]) -> None:
        self.listeners = listeners
        self.start_renewal = start_renewal
        #: The tables whose leases an owner may re-enter through this one (see
        #: :meth:`share_holds`), this one first.
        self.shared: list[HeldLeases] = [self]
        self.after_fork()

    def share_holds(self, other: HeldLeases) -> None:
        """Let an owner re-enter through either table a lease it holds in the other: one
        client's hold, the other's nested one, one lease on the nodes."""
        for table, partner in ((self, other), (other, self)):
            if partner not in table.shared:
                table.shared.append(partner)

    def after_fork(self) -> None:
        """Forget every lease (a forked child holds none of its parent's locks)."""
        self._leases_lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # A process's readers of one read/write lock share their hold's name, so the table
        # keeps only the latest; an operator's force release names a reader by its token.
        # Weak: a reader dropped unreleased leaves no entry behind.
        self._readers: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()

    def joinable(self, name: str, owner: Hashable) -> Lease | None:
        """The owner's live lease of ``name``, which a reentrant acquire may join (once the
        nodes said it is still there: :meth:`reenter` then joins it)."""
        for table in self.shared:
            with table._leases_lock:
                lease = table._leases.get(name)
            if lease is not None and lease.owner == owner and lease.validity > 0:
                return lease
        return None

    def reenter(self, handle: LockBase, owner: Hashable) -> Lease | None:
        """The owner's current lease of this name, one hold deeper, if reentry applies.

        A nested hold may ask for renewal the outer one did not (a long job under a view's
        lock): the lease is then renewed from now on. It cannot get a fence the outer
        acquisition did not draw, so asking for one is an error rather than a silent None.
        Asked only for a reentrant handle.
        """
        for table in self.shared:
            with table._leases_lock:
                lease = table._leases.get(handle.name)
                if lease is None or lease.owner != owner or lease.validity <= 0:
                    continue
                check_reentry_fence(handle.name, handle.fencing, lease.fence)
                lease.count += 1
                upgrade = handle.auto_renew and not lease.auto_renew
                if upgrade:
                    lease.auto_renew = True
            if upgrade:
                # This client's watchdog, even for a partner's lease: the partner's may need
                # an event loop this thread does not run. An async client renews on after the
                # loop that asked ends (async_to_sync's), as it does its own leases.
                self.start_renewal(lease)
            return lease
        return None

    def won(self, handle: LockBase, lease: Lease, start: float) -> Lease:
        """Enter a lease just granted (asked for at ``start``) in the table, tell the
        listeners, and hand it to the watchdog when it is to be renewed."""
        handle.retry_after = None
        lease.home = self
        with self._leases_lock:
            self._leases[lease.name] = lease
            # is_reader(), written out: this runs on every acquire.
            if lease.name.endswith(READER_SUFFIX) and lease.name != READER_SUFFIX:
                self._readers[lease.token] = lease
        # heard(), written out: this runs on every acquire, and "acquired" logs at DEBUG.
        if self.listeners or logger.isEnabledFor(logging.DEBUG):
            emit(self.listeners, LockEvent.of_acquisition(lease, clock.monotonic() - start))
        if lease.auto_renew:
            self.start_renewal(lease)
        return lease

    def won_unreturned(self, names: Iterable[str], owner: Hashable, since: float) -> list[Lease]:
        """The leases of ``names`` an acquire by ``owner`` that began at ``since`` won but
        never handed to its caller (interrupted or cancelled after the win: renewal may have
        started). The drivers give them back; nobody else could release them. A lease the
        owner took before (through another handle: two contenders) is not this acquire's."""
        with self._leases_lock:
            leases = [self._leases.get(name) for name in names]
        return [
            lease
            for lease in leases
            if lease is not None
            and lease.owner == owner
            and not lease.released
            and lease.acquired >= since
        ]

    def held_by(self, name: str, owner: Hashable) -> bool:
        """Whether ``owner`` holds a live lease named ``name`` through this table or one that
        shares holds with it (for a reader's name: any of the process's readers of it)."""
        for table in self.shared:
            with table._leases_lock:
                leases = [table._leases.get(name)]
                if name.endswith(READER_SUFFIX):
                    leases += table._readers.values()
            if any(
                lease is not None
                and lease.name == name
                and lease.owner == owner
                and lease.validity > 0
                for lease in leases
            ):
                return True
        return False

    def held_names(self, names: Iterable[str]) -> set[str]:
        """Which of ``names`` this process holds a lease of."""
        with self._leases_lock:
            return {name for name in names if name in self._leases}


class LockBase:
    """State and read-only views shared by the sync and async handles."""

    def __init__(
        self,
        redlock: Any,
        name: str,
        *,
        ttl: float,
        auto_renew: bool,
        fencing: bool,
        reentrant: bool,
        fair: bool,
        blocking: bool,
        timeout: float | None,
        meta: dict[str, Any],
        owner: Hashable | None,
        renew_for: float | None,
        retries: int | None = None,
    ) -> None:
        self.redlock = redlock
        self.name = name
        self.ttl = ttl
        self.auto_renew = auto_renew
        self.fencing = fencing
        self.reentrant = reentrant
        self.fair = fair
        self.blocking = blocking
        self.timeout = timeout
        self.meta = meta
        self.owner = owner
        self.renew_for = renew_for
        self.retries = retries
        self._lease: Lease | None = None
        #: How many of the lease's holds were taken through this handle (a reentrant owner may
        #: acquire its own handle again): the handle forgets the lease at the last release.
        self._holds = 0
        #: Seconds until the holder's lease ends, from the last failed attempt (if known).
        self.retry_after: float | None = None

    def __repr__(self) -> str:
        state = "held" if self.held else "not held"
        return f"<{type(self).__name__} {self.name!r} {state}>"

    @property
    def held(self) -> bool:
        """Local view: acquired, not released, not lost, and validity left."""
        lease = self._lease
        return lease is not None and lease.validity > 0

    @property
    def validity(self) -> float:
        """Seconds of validity left, by the local monotonic clock."""
        return self._lease.validity if self._lease is not None else 0.0

    @property
    def token(self) -> str | None:
        """Unique per acquisition (128 random bits from the OS, safe across forks)."""
        return self._lease.token if self._lease is not None else None

    @property
    def fence(self) -> int | None:
        """With ``fencing=True``: larger than the fence of every earlier holder of this name."""
        return self._lease.fence if self._lease is not None else None

    @property
    def lost(self) -> str | None:
        """Why the lock was lost while held (None while it is fine)."""
        return self._lease.lost if self._lease is not None else None

    def detach(self) -> str:
        """Hand the lock over to another process: this handle forgets it (no release, no
        renewal here) and returns the token the new owner releases it with, through
        ``release_token(name, token)`` (how an enqueue-time lock is freed by the worker). A
        reader of a read/write lock is released under its listed name,
        ``release_token(f"{name}#read:{token}", token)``."""
        lease = self._take_lease(self._owner())
        self._lease, self._holds = None, 0
        return self.redlock._detach(lease)  # type: ignore[no-any-return]

    def _owner(self) -> Hashable:
        """Who is asking: the handle's explicit ``owner=``, else the running asyncio task,
        else the current thread (:func:`current_owner`)."""
        return self.owner if self.owner is not None else current_owner()

    def _prepare(
        self, owner: Hashable, blocking: bool | None, timeout: float | None, retries: int | None
    ) -> tuple[bool, float | None, int | None] | None:
        """An acquire's arguments resolved against the handle's defaults, or None when the
        answer is False without asking the nodes: the asking owner already holds this
        handle, the lock does not re-enter, and the caller would not wait."""
        if blocking is None:
            blocking = self.blocking
        elif blocking.__class__ is not bool:  # a bool needs no check (every acquire runs this)
            check_flag("blocking", blocking)
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        retries = self.retries if retries is None else check_retry_count(retries, "retries")
        lease = self._lease
        if lease is not None and (lease.released or lease.validity <= 0):
            # a hold that ended (released elsewhere, ran out, lost)
            self._lease, self._holds = None, 0
        unbounded = (timeout is not None and math.isinf(timeout)) or (
            timeout is None and retries is None
        )
        if self._waits_for_itself(owner) is not None:
            if not blocking:
                return None
            if unbounded:
                raise RuntimeError(
                    f"{self._described()}: this owner already holds it through this handle "
                    "and it is not reentrant, so waiting for it without a timeout would wait "
                    "for itself for ever"
                )
        elif blocking and unbounded:
            excluding = self._excluded_by(owner)
            if excluding is not None:
                raise RuntimeError(
                    f"{self._described()}: this owner holds {excluding}, which excludes it "
                    "(a read hold is not upgraded, nor a write hold downgraded), so waiting "
                    "for it without a timeout would wait for itself for ever: release that "
                    "first, or give a timeout"
                )
        return blocking, timeout, retries

    def _excluded_by(self, owner: Hashable) -> str | None:
        """The hold of the other side of a read/write lock that ``owner`` has through this
        client, which this one waits for (None for a lock)."""
        return None

    def _waits_for_itself(self, owner: Hashable) -> Lease | None:
        """The hold ``owner`` has through this handle, live, when the handle does not
        re-enter: the one rule for a holder asking its own handle again (docs/guarantees.rst,
        "Owners and reentrancy"). Its ask is False at once without waiting, a
        ``RuntimeError`` for a wait with no bound, and else waits until its timeout or the
        hold's end, whichever comes first. A lock's nodes refuse that ask by themselves (the
        name is taken); a semaphore's or a reader's would grant a second permit or reader,
        so those waits never ask them while this is not None (:mod:`.permits`)."""
        if self.reentrant:
            return None
        lease = self._lease_of(owner)
        if lease is None or lease.owner != owner or lease.released or lease.validity <= 0:
            return None
        return lease

    def _lease_of(self, owner: Hashable) -> Lease | None:
        """The lease ``owner`` would hold through this handle (a lock's handle has one)."""
        return self._lease

    def _described(self) -> str:
        return f"lock {self.name!r}"

    def _won(self, lease: Lease | None) -> bool:
        # Only a win takes the handle's slot: a failed attempt never touches the holder's.
        if lease is not None:
            if lease is self._lease:
                self._holds += 1  # the owner re-entered through this very handle
            else:
                self._lease, self._holds = lease, 1
                lease.taken_by(self)
        return lease is not None

    def _holds_lease(self, lease: Lease) -> bool:
        return self._lease is lease

    def _drop_hold(self) -> None:
        """One hold taken through this handle is being released; the handle lets go of the
        lease with its last one (earlier ones leave it held, as the nodes still do)."""
        self._holds -= 1
        if self._holds <= 0:
            self._lease, self._holds = None, 0

    def _take_lease(self, owner: Hashable) -> Lease:
        """The hold ``owner`` may release or extend: the handle's, when ``owner`` took it
        or has ended (another live thread or task of a shared handle gets
        :class:`LockNotOwned`, as with redis-py's thread-local token, and nothing is sent).
        A task or thread that ended holding the lock passed it on with the handle (a loop
        that ended, a stream that goes on after its view): whoever has the handle may end it,
        else nobody could."""
        lease = self._lease
        if lease is None or lease.released:
            raise LockNotOwned(f"lock {self.name!r} is not held by this handle", self.name)
        if lease.owner != owner and not owner_ended(lease.owner):
            raise LockNotOwned(
                f"lock {self.name!r} is held through this handle by another owner "
                f"({_describe(lease.owner)}), not by {_describe(owner)}",
                self.name,
            )
        return lease

    def _not_acquired(self) -> LockNotAcquired:
        if self._waits_for_itself(self._owner()) is not None:
            why = f"{self._described()}: this owner already holds it through this handle"
        else:
            why = f"lock {self.name!r} is held by another owner"
        return LockNotAcquired(
            why,
            self.name,
            retry_after=self.retry_after,
        )


class SyncClient(Protocol):
    """What a :class:`Lock` asks of the client that made it (:class:`~.redlock.Redlock`);
    named here so the handle does not import the client that imports it."""

    def _acquire(
        self,
        handle: Lock,
        owner: Hashable,
        *,
        blocking: bool,
        timeout: float | None,
        retries: int | None,
    ) -> Lease | None: ...

    def _release(self, lease: Lease) -> None: ...

    def _extend(self, lease: Lease, ttl: float) -> bool: ...

    def _check(self, lease: Lease) -> bool: ...


class Lock(LockBase):
    """A handle on one lock name. Acquire it, use it, release it (or use ``with``).

    The handle is cheap; it talks to the nodes only in :meth:`acquire`, :meth:`release`,
    :meth:`extend` and :meth:`check`.
    """

    redlock: SyncClient

    def acquire(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
        *,
        retries: int | None = None,
    ) -> bool:
        """Take the lock on a quorum of nodes.

        ``blocking=False`` makes one attempt. A blocking call waits until the lock is taken
        (as ``threading.Lock``, redis-py and kazoo do), at most ``timeout`` seconds when given,
        woken when the holder releases or its lease runs out. ``retries=N`` bounds it by
        attempts instead: the Redlock spec's client, N retries ``retry_delay`` apart with
        jitter. Returns False when someone else holds the lock; raises :class:`QuorumError`
        when too few nodes could answer at all.
        """
        owner = self.owner
        if owner is None:
            # current_owner(), written out: this runs on every acquire.
            loop = asyncio._get_running_loop()
            task = None if loop is None else asyncio.current_task(loop)
            owner = ("thread", threading.current_thread()) if task is None else ("task", task)
        if self._lease is None and timeout is None and retries is None:
            # _prepare()'s common case, written out (this runs on every acquire): nothing
            # held through this handle, and no argument to check but a flag.
            if blocking is None:
                blocking = self.blocking
            elif blocking.__class__ is not bool:
                check_flag("blocking", blocking)
            timeout, retries = self.timeout, self.retries
        else:
            prepared = self._prepare(owner, blocking, timeout, retries)
            if prepared is None:
                return False
            blocking, timeout, retries = prepared
        lease = self.redlock._acquire(
            self, owner, blocking=blocking, timeout=timeout, retries=retries
        )
        # _won(), written out: this runs on every acquire.
        if lease is None:
            return False
        if lease is self._lease:
            self._holds += 1  # the owner re-entered through this very handle
        else:
            self._lease, self._holds = lease, 1
            lease.taken_by(self)
        return True

    def release(self) -> None:
        """Give the lock back. Raises :class:`LockNotOwned` if it was no longer ours, or if
        the asking thread (task) is not the one that took it (nothing is sent then), and
        :class:`LockLost` if we knew it was lost."""
        # _owner() and _take_lease()'s common case, written out: this runs on every release.
        owner = self.owner
        if owner is None:
            owner = current_owner()
        lease = self._lease
        if lease is None or lease.released or lease.owner != owner:
            lease = self._take_lease(owner)  # LockNotOwned, unless that owner ended
        self._drop_hold()
        self.redlock._release(lease)

    def extend(self, ttl: float | None = None) -> bool:
        """Re-arm the lease for ``ttl`` seconds (default: the lock's ttl) on a quorum: the
        lease then ends ``ttl`` from now (redis-py's ``extend`` adds to what is left). False
        when it could not be re-armed on a quorum (when the nodes no longer hold our token,
        the handle is also marked lost); another owner's call raises :class:`LockNotOwned`
        and sends nothing."""
        lease = self._take_lease(self._owner())
        return self.redlock._extend(lease, self.ttl if ttl is None else ttl)

    def check(self) -> bool:
        """Ask the nodes whether our token is still on a quorum (a round trip). False also
        when too few nodes answered to say: then :attr:`lost` stays None (it is set when
        the nodes said the token is gone)."""
        lease = self._lease
        return lease is not None and self.redlock._check(lease)

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise self._not_acquired()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
