"""Semaphores and read/write locks, built from the mutex's own steps.

A semaphore of ``limit`` permits is ``limit`` mutexes (its slots, :mod:`.kinds`): a permit is
held when one slot's lock was granted by a quorum with validity left, so the Redlock argument
applies slot by slot and no more than ``limit`` holders can be inside at once. (Counting
permits per node instead is not safe: with 3 nodes and a limit of 2, permits A on nodes 1+2, B
on 2+3 and C on 1+3 each hold a quorum while no node holds more than 2.) Acquiring one is an
attempt on a slot that looks free: the first at random, the next after reading how long each
slot stays taken on every node (one script per node, :data:`.rwscripts.PERMIT_PTTLS`), among
the slots free on a quorum. Renewal, fencing (a fence per slot), the restart guard, undo,
release and listing are the mutex's.

A read/write lock's writer is the mutex of the lock's name, taken by a script that also
checks the node's readers; each reader is an entry with an expiry in the node's set of
readers (:mod:`.rwscripts`). A writer and a reader (or two writers) both holding a quorum
would share a node, whose script let only one in, so they exclude each other as two mutex
holders do. A writer that has to wait marks itself waiting on the nodes it asked; readers are
refused where a writer waits, so a stream of readers cannot starve it.

The steps are the drivers' (:class:`Send`, :class:`Listen`, :class:`Wait`, :class:`Finally`),
so :class:`~.redlock.Redlock` and :class:`~.asyncio.AsyncRedlock` run them unchanged.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Hashable
from typing import Any

from . import rwscripts
from .algorithm import Contender, Finally, Listen, Refusal, Send, Steps, Wait, to_every_node
from .base import RedlockBase
from .commands import AcquireRequest
from .fairness import FairLine
from .kinds import permit_name, reader_name
from .lock import Lease, Lock, LockBase, owner_ended
from .nodes import Failure, script_command
from .scripts import Script
from .validation import (
    MAX_LIMIT,
)

__all__ = [
    "MAX_LIMIT",
    "HoldBase",
    "Permits",
    "ReadLock",
    "ReaderRequest",
    "Semaphore",
    "WriteLock",
    "WriterRequest",
]


class HoldBase(LockBase):
    """A handle on a semaphore or one side of a read/write lock: a :class:`LockBase` whose
    holds are per owner, so one handle shared by threads (tasks) gives each its own permit
    (read hold). ``kind`` is ``"permit"``, ``"read"`` or ``"write"``."""

    kind = "permit"
    limit = 1

    @property
    def _lease(self) -> Lease | None:
        holds: dict[Hashable, Lease] = self.__dict__.setdefault("_by_owner", {})
        return holds.get(self._owner())

    @_lease.setter
    def _lease(self, lease: Lease | None) -> None:
        holds: dict[Hashable, Lease] = self.__dict__.setdefault("_by_owner", {})
        owner = self._owner()
        if lease is None:
            holds.pop(owner, None)
        else:
            holds[owner] = lease

    def _drop_hold(self) -> None:
        # Permits and read holds are not reentrant: the owner's one hold ends here.
        self._lease = None

    def _holds_lease(self, lease: Lease) -> bool:
        return lease in self.__dict__.get("_by_owner", {}).values()

    def _lease_of(self, owner: Hashable) -> Lease | None:
        # By the owner asked for, not the one running: an asyncio acquire may be finished
        # by another task than its caller (wait_for before 3.12).
        holds: dict[Hashable, Lease] = self.__dict__.get("_by_owner", {})
        return holds.get(owner)

    def _excluded_by(self, owner: Hashable) -> str | None:
        leases = self.redlock.leases
        if self.kind == "write" and leases.held_by(reader_name(self.name), owner):
            return f"a read hold of read lock {self.name!r}"
        if self.kind == "read" and leases.held_by(self.name, owner):
            return f"the write lock {self.name!r} (or a lock of that name)"
        return None

    def _described(self) -> str:
        what = {"permit": "semaphore", "read": "read lock", "write": "write lock"}
        return f"{what[self.kind]} {self.name!r}"

    def _take_lease(self, owner: Hashable) -> Lease:
        holds: dict[Hashable, Lease] = self.__dict__.setdefault("_by_owner", {})
        if owner not in holds:
            # An owner that ended passed its hold on with the handle (see LockBase): the
            # asking one takes it over, so that its release ends it.
            ended = next((who for who in list(holds) if owner_ended(who)), None)
            if ended is not None:
                holds[owner] = holds.pop(ended)
        return super()._take_lease(owner)

    @property
    def permit(self) -> int | None:
        """The slot of the permit this owner holds (0 .. limit-1), for a semaphore."""
        lease = self._lease
        if lease is None or self.kind != "permit":
            return None
        return int(lease.name.rpartition(":")[2])

    def hold_names(self) -> list[str]:
        """The names a hold of this handle may have in the lease table."""
        if self.kind == "permit":
            return [permit_name(self.name, slot) for slot in range(self.limit)]
        return [reader_name(self.name) if self.kind == "read" else self.name]

    def _won_for(self, owner: Hashable, lease: Lease | None) -> bool:
        """Keep a won hold for ``owner`` (the caller of ``acquire()``, which may not be the
        task that finishes it)."""
        if lease is not None:
            self.__dict__.setdefault("_by_owner", {})[owner] = lease
            lease.taken_by(self)
        return lease is not None

    #: From the last refused acquire (as ``retry_after``): the readers the nodes counted in a
    #: writer's way, 0 for a reader held back by a waiting writer, None when not told.
    _readers_in_way: int | None = None

    def _not_acquired(self) -> Any:
        error = super()._not_acquired()
        if self._waits_for_itself(self._owner()) is not None:
            return error
        readers = self._readers_in_way
        if self.kind == "permit":
            why = f"all permits of semaphore {self.name!r} are taken"
        elif self.kind == "read":
            held = "has a writer waiting for it" if readers == 0 else "is held by a writer"
            why = f"read lock {self.name!r} {held}"
        elif readers:
            # No writer anywhere: rl.locked(name) says False, live_locks lists the readers.
            why = f"write lock {self.name!r} is held by {readers} reader{'s' * (readers > 1)}"
        else:
            why = f"write lock {self.name!r} is held by another writer"
        error.args = (why,)
        return error


class ReaderRequest(AcquireRequest):
    """One attempt at a read hold: :data:`.rwscripts.READ_ACQUIRE` on every node."""

    def __init__(self, redlock: RedlockBase, handle: LockBase, base: str) -> None:
        super().__init__(redlock, handle)
        self._fast = self.hedge = None  # no plain SET: a reader is an entry in the readers' set
        self._base = base

    def _parts(self) -> tuple[Script, list[str], list[Any]]:
        return rwscripts.READ_ACQUIRE, self._redlock.keys.rw_keys(self._base), ["", 0]


class WriterRequest(AcquireRequest):
    """One attempt at the write hold: :data:`.rwscripts.WRITE_ACQUIRE` on every node, which
    marks ``waiter`` as waiting where it cannot take it yet."""

    def __init__(self, redlock: RedlockBase, handle: LockBase, waiter: str) -> None:
        super().__init__(redlock, handle)
        self._fast = self.hedge = None  # no plain SET: the readers must be checked
        self._waiter = waiter

    def _parts(self) -> tuple[Script, list[str], list[Any]]:
        redlock = self._redlock
        wait_ms = int(redlock.fair_heartbeat * 1000)
        return (
            rwscripts.WRITE_ACQUIRE,
            redlock.keys.rw_keys(self._name),
            [self._waiter, wait_ms],
        )


class Permits:
    """The steps of semaphores and read/write holds (a part of a client: :class:`.base.
    RedlockBase` holds one as ``permits``), each attempt the client's mutex attempt on one
    slot, the readers' entry or the writer."""

    def __init__(self, client: RedlockBase) -> None:
        self.client = client

    def _part(self, handle: HoldBase, name: str) -> LockBase:
        """The mutex-shaped view of one hold of ``handle`` (a slot, the readers' entry, the
        writer) that the mutex's attempt takes."""
        return LockBase(
            self.client,
            name,
            ttl=handle.ttl,
            auto_renew=handle.auto_renew,
            fencing=handle.fencing,
            reentrant=False,
            fair=handle.fair,
            blocking=False,
            timeout=None,
            meta=handle.meta,
            owner=handle.owner,
            renew_for=handle.renew_for,
        )

    def hold_steps(
        self,
        handle: HoldBase,
        owner: Hashable,
        blocking: bool,
        deadline: float | None,
        start: float,
    ) -> Steps[Lease | None]:
        """Attempts until a hold is ours or the time is up, woken by a release of any hold of
        the primitive (one channel: :mod:`.kinds`), as the mutex waits."""
        notice = None
        if handle._waits_for_itself(owner) is not None:
            # Not asked of the nodes, which would grant this owner a second permit (reader)
            # that its handle, keeping one per owner, would then forget.
            notice = yield Listen(self.client.keys.channel(handle.name))
            while (own := handle._waits_for_itself(owner)) is not None:
                now = time.monotonic()
                if deadline is None or now >= deadline:
                    why = "held by this owner through this handle"
                    nodes = self.client.nodes
                    refusal = Refusal({n.name: why for n in nodes}, len(nodes), own.validity)
                    self.client.algorithm.give_up(handle, refusal, now - start)
                    return None
                # Woken by its end: a release (by another thread of an explicit owner=),
                # its lease running out, a loss.
                yield Wait(notice, min(deadline - now, max(own.validity, 0.001)))
        waiter = secrets.token_hex(8)
        who = Contender(handle, owner)
        if handle.fair:  # one line for every slot (the mutex's)
            yield from FairLine(self.client, by_name=False).entering(who)
        line = who.line
        if handle.kind == "write" and blocking:
            leave = script_command(
                rwscripts.WRITE_LEAVE,
                [self.client.keys.rw_keys(handle.name)[5]],
                [waiter, self.client.keys.channel(handle.name)],
            )
            yield Finally(Send(to_every_node(leave)))
        attempts = 0
        while True:
            if handle.kind == "permit":
                won = yield from self._permit_attempt_steps(handle, owner, line, attempts == 0)
            else:
                won = yield from self._rw_attempt_steps(handle, owner, waiter if blocking else "")
            if isinstance(won, tuple):
                part, lease = won
                return self.client.leases.won(part, lease, start)
            attempts += 1
            now = time.monotonic()
            if self.client.algorithm.out_of_time(blocking, attempts, None, deadline, now):
                handle._readers_in_way = won.readers
                self.client.algorithm.give_up(handle, won, now - start)
                return None
            if notice is None:
                notice = yield Listen(self.client.keys.channel(handle.name))
                continue
            pause = self.client.algorithm.pause_for(handle, won, None, deadline, now)
            if handle.kind == "write":
                pause = min(pause, self.client.fair_heartbeat / 3)  # keeps its waiting mark alive
            yield Wait(notice, pause)

    def _rw_attempt_steps(
        self, handle: HoldBase, owner: Hashable, waiter: str
    ) -> Steps[tuple[LockBase, Lease] | Refusal]:
        if handle.kind == "read":
            part = self._part(handle, reader_name(handle.name))
            outcome = yield from self.client.algorithm.attempt(
                Contender(part, owner), lambda *_: ReaderRequest(self.client, part, handle.name)
            )
        else:
            part = self._part(handle, handle.name)
            outcome = yield from self.client.algorithm.attempt(
                Contender(part, owner), lambda *_: WriterRequest(self.client, part, waiter)
            )
        return (part, outcome) if isinstance(outcome, Lease) else outcome

    def _permit_attempt_steps(
        self,
        handle: HoldBase,
        owner: Hashable,
        line: tuple[str, int] | None,
        first: bool,
    ) -> Steps[tuple[LockBase, Lease] | Refusal]:
        """One attempt at a permit: a slot this process does not hold, at random, on the
        first attempt (one round trip while permits are free) and on every attempt of a fair
        waiter; otherwise (and then) the slots free on the most nodes, read first."""
        limit = handle.limit
        # A fair waiter tries a slot every time, even with none free: only an attempt refreshes
        # its place in the line, which drops a waiter whose heartbeat ran out (and then a later
        # one passes it).
        if first or line is not None:
            mine = self.client.leases.held_names(handle.hold_names())
            others = [k for k in range(limit) if permit_name(handle.name, k) not in mine]
            part = self._part(handle, permit_name(handle.name, random.choice(others or [0])))
            outcome = yield from self.client.algorithm.attempt(Contender(part, owner, line))
            if isinstance(outcome, Lease):
                return part, outcome
            if outcome.answered < self.client.quorum or limit == 1:
                return outcome
        keys = [self.client.keys.key(permit_name(handle.name, k)) for k in range(limit)]
        replies = yield Send(to_every_node(script_command(rwscripts.PERMIT_PTTLS, keys, [])))
        candidates, refusal = self._free_slots(limit, replies)
        for slot in candidates:
            part = self._part(handle, permit_name(handle.name, slot))
            outcome = yield from self.client.algorithm.attempt(Contender(part, owner, line))
            if isinstance(outcome, Lease):
                return part, outcome
            refusal = outcome
        return refusal

    def _free_slots(self, limit: int, replies: list[Any]) -> tuple[list[int], Refusal]:
        """Up to two slots free on a quorum (most free first, ties at random), and the
        refusal to give when none is: when the first slot frees up on a quorum."""
        failures: dict[str, str] = {}
        pttls: list[list[int]] = []
        for node, reply in zip(self.client.nodes, replies, strict=True):
            if isinstance(reply, list) and len(reply) == limit:
                pttls.append([int(r) for r in reply])
            else:
                failures[node.name] = str(reply) if isinstance(reply, Failure) else "no reply"
        free = [sum(1 for node in pttls if node[k] == -2) for k in range(limit)]
        order = sorted(range(limit), key=lambda k: (-free[k], random.random()))
        candidates = [k for k in order if free[k] >= self.client.quorum][:2]
        retry_after: float | None = None
        for k in range(limit):
            held = sorted(max(node[k], 0) for node in pttls if node[k] != -2)
            needed = self.client.quorum - free[k]
            if 0 < needed <= len(held):
                when = held[needed - 1] / 1000
                retry_after = when if retry_after is None else min(retry_after, when)
        for node in self.client.nodes:
            if node.name not in failures:
                failures[node.name] = "every permit taken"
        return candidates, Refusal(failures, len(pttls), retry_after)


class Semaphore(HoldBase, Lock):
    """A semaphore's handle (:meth:`Redlock.semaphore`): ``acquire()`` takes one permit for
    the calling thread, ``release()`` gives it back; ``held``, ``validity``, ``token``,
    ``fence``, ``permit``, ``extend()``, ``check()`` and ``with`` as a :class:`Lock`'s."""

    kind = "permit"

    def acquire(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
        *,
        retries: int | None = None,
    ) -> bool:
        """Take a permit (a read or write hold) for the calling thread: see
        :meth:`Lock.acquire` (``retries`` is for locks)."""
        if retries is not None:
            raise ValueError(f"{self.name!r}: retries= is for locks; give a timeout instead")
        owner = self._owner()
        prepared = self._prepare(owner, blocking, timeout, None)
        if prepared is None:
            return False
        blocking, timeout, _ = prepared
        client: Any = self.redlock
        return self._won_for(owner, client._acquire_hold(self, owner, blocking, timeout))


class ReadLock(Semaphore):
    """The read side of a read/write lock (:meth:`Redlock.read_lock`)."""

    kind = "read"


class WriteLock(Semaphore):
    """The write side of a read/write lock (:meth:`Redlock.write_lock`)."""

    kind = "write"
