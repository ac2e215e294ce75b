"""The Redlock algorithm over N independent Redis nodes, asyncio client.

:class:`AsyncRedlock` is the twin of :class:`~django_redlock.core.redlock.Redlock`: the same
names and semantics, awaitable. Every decision (quorum, validity, refusal, retry delay, lease
table, events) comes from :mod:`.base`; this module only drives those steps on an event loop.
The talking is :mod:`.aionodes` (connections pooled per node and per loop, one fan-out), the
waiting :mod:`.aiowaiting` (local queues, release notices).

Per loop. A loop's connections, subscriber and renewal task are closed when that loop shuts
down (``asyncio.run``/asgiref cancel the loop's tasks; a tiny keeper task per loop does the
cleanup) or by ``await redlock.close()``. A forked child starts with no connections.

Renewal. One task per Redlock per loop re-arms every ``auto_renew`` lease of that loop
(ttl/3, the same decisions as the sync watchdog); a release waits for a renewal already on the
wire, so no PEXPIRE ever follows the release.

Ownership. Reentrancy is per asyncio task (or the explicit ``owner=``): another task of the
same loop is another owner.

Note: this module is ``django_redlock.core.asyncio``; inside the package every module uses
absolute ``import asyncio`` (the default in Python 3), which always means the standard library.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .aionodes import (
    NOT_CONNECTED,
    SLOW_TIMEOUT,
    AsyncFanOut,
    AsyncOwing,
    AsyncWire,
    CommandBuilder,
    LoopPool,
    noscript,
    open_wire,
    relocate,
    strand_loop,
)
from .aiowaiting import AsyncReleaseNotices, Signal, TaskQueue
from .algorithm import Contender, Finally, Listen, Pause, Refusal, Send, SendBatch, Steps, Wait
from .base import RedlockBase
from .detector import connect_budget
from .fanout import batch_quorum_in, batch_wait
from .info import LockInfo, NodeHealth
from .listing import glob_escape
from .lock import Lease, LockBase
from .nodes import (
    Failure,
    ReplyError,
    WireError,
    eval_form,
    os_failure,
    reply_failure,
    reply_wait,
)
from .permits import HoldBase, Permits
from .renewal import BATCH_WINDOW, pauses
from .validation import check_name
from .waiting import HolderWatch, HolderWatches

__all__ = ["AsyncLock", "AsyncReadLock", "AsyncRedlock", "AsyncSemaphore", "AsyncWriteLock"]

_T = TypeVar("_T")


# -- per-loop state ------------------------------------------------------------------------------


def _pool_opened(pool: LoopPool, index: int, task: asyncio.Task[AsyncWire]) -> None:
    """A connection opened for a caller that stopped waiting: to the pool."""
    if not task.cancelled() and task.exception() is None:
        pool.checkin(index, task.result())


class LoopState(LoopPool):
    """What an AsyncRedlock keeps per event loop: its connections (:class:`.LoopPool`), the
    local queues, the release-notice subscriber, the renewal schedule and task."""

    def __init__(self, redlock: AsyncRedlock, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, len(redlock.nodes))
        self.redlock = redlock
        self.pid = os.getpid()
        self.queues: dict[str, TaskQueue] = {}
        self.notices = AsyncReleaseNotices(redlock.nodes, redlock.node_timeout, loop)
        self.due: list[tuple[float, int, Lease]] = []
        self.seq = itertools.count()
        self.renew_wake = Signal(loop)
        self.renewer: asyncio.Task[None] | None = None
        #: The auto-renewed holders' force-release watches (subscribed at the first one).
        self.holders: HolderWatches | None = None
        self.keeper = loop.create_task(self._keep(), name="redlock-connections")

    async def _keep(self) -> None:
        # Cancelled when the loop shuts down (asyncio.run, asgiref's async_to_sync): that is
        # when this loop's connections must be closed, while the loop can still close them.
        try:
            await self.loop.create_future()
        finally:
            if _current_task() is self.keeper:
                await self._loop_ends()
            else:
                # Not run by its loop: collected after the loop was closed without its tasks
                # cancelled, or at exit with the loop left open. That loop runs nothing again.
                self.strand(adopt=False)
            self.redlock._forget(self)

    async def _loop_ends(self) -> None:
        # Closed already: the client's close(), and the loop goes on, so do its renewals
        # (the renewer hands them to the loop's next state, over new connections).
        closed_by_client = self.closed
        if not self.closed:
            self._hand_over_renewals()
            # The loop is ending: what its idle connections still owe (a release that
            # stopped at quorum) is read first, briefly, so they can be parked for the
            # next loop (a fresh loop per request then connects nothing).
            with contextlib.suppress(BaseException):
                await self._settle_idle(self.redlock.node_timeout)
        self.close(stop_renewals=not closed_by_client)

    def _hand_over_renewals(self) -> None:
        # Auto-renewed leases still held outlive their loop (an async view under a WSGI
        # server returns a streaming response: its loop ends, the stream goes on).
        held = [entry for entry in self.due if not (entry[2].released or entry[2].lost)]
        if held:
            self.redlock._adopt_renewals(self.loop, held)

    def strand(self, adopt: bool) -> None:
        """Close this state without its loop, which will not run again (closed without its
        tasks cancelled, or left open at exit): its connections are closed and its tasks
        ended at once (:func:`.aionodes.strand_loop`), its auto-renewed leases renewed from
        the client's own loop when ``adopt`` (else they end with their TTL)."""
        if self.closed:
            return
        self.closed = True
        if adopt and not sys.is_finalizing():
            self._hand_over_renewals()
        self.due.clear()
        self.notices.strand()
        strand_loop(self.loop)  # this state's tasks (keeper, renewer, openings) end there

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether this is ``loop``'s state, still open, in this process (not a parent's)."""
        return self.loop is loop and not self.closed and self.pid == os.getpid()

    async def _settle_idle(self, timeout: float) -> None:
        deadline = self.loop.time() + timeout
        while self.loop.time() < deadline and any(
            wire.waiters for index in range(len(self.idle)) for wire in self.wires(index)
        ):
            await asyncio.sleep(0.001)

    def close(self, stop_renewals: bool = False) -> None:
        """Close this loop's connections (from the loop's thread). Renewals go on over new
        connections, as with the sync client, unless the loop itself is shutting down."""
        self.closed = True
        if stop_renewals and self.renewer is not None:
            self.renewer.cancel()
        else:
            self.renew_wake.set()  # the renewer hands its leases over at once
        self.notices.close()
        # A loop that ends leaves its idle connections to the next loop of this process.
        self.close_parking(self.redlock.nodes if stop_renewals else None)
        if not self.keeper.done() and self.keeper is not _current_task():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                self.keeper.cancel()


def _on_loop(loop: asyncio.AbstractEventLoop, function: Callable[..., None], *args: Any) -> None:
    """Run ``function(*args)`` on ``loop`` (now when called from it), wherever the caller
    runs: per-loop state is only ever touched from its own loop."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        function(*args)
    elif not loop.is_closed():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(function, *args)


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    """An adopter loop's thread (see :meth:`AsyncRedlock._adopt_renewals`)."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _shut_down() -> None:
    """End the running loop as ``asyncio.run`` ends its own: its tasks cancelled and awaited
    (the client's keeper closes the loop's connections), then the loop stops."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()


#: Every AsyncRedlock alive (see :func:`_strand_at_exit`).
_clients: weakref.WeakSet[AsyncRedlock] = weakref.WeakSet()


@atexit.register
def _strand_at_exit() -> None:
    # A loop left open at exit (or closed without its tasks cancelled) never runs its
    # keeper: its connections are closed here rather than reported unclosed by the collector.
    for client in list(_clients):
        for state in list(client._states.values()):
            if state.pid == os.getpid() and not state.loop.is_running():
                state.strand(adopt=False)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


# -- the client ----------------------------------------------------------------------------------


class AsyncLock(LockBase):
    """A handle on one lock name for asyncio code: ``await lock.acquire()`` or
    ``async with rl.lock(name): ...``. Same semantics as the sync :class:`Lock`."""

    redlock: AsyncRedlock

    def acquire(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
        *,
        retries: int | None = None,
    ) -> Coroutine[Any, Any, bool]:
        """:meth:`Lock.acquire`, awaitable. The owner is the task that *calls* ``acquire()``,
        so ``await asyncio.wait_for(lock.acquire(), 5)`` is owned by the caller on every
        Python (before 3.12 wait_for runs the coroutine in a task of its own)."""
        owner = self._owner()
        prepared = self._prepare(owner, blocking, timeout, retries)
        return self._acquire_for(owner, prepared)

    async def _acquire_for(
        self, owner: Hashable, prepared: tuple[bool, float | None, int | None] | None
    ) -> bool:
        if prepared is None:
            return False
        blocking, timeout, retries = prepared
        return self._won(
            await self.redlock._acquire(
                self, owner, blocking=blocking, timeout=timeout, retries=retries
            )
        )

    def release(self) -> Coroutine[Any, Any, None]:
        """:meth:`Lock.release`, awaitable: a cancelled caller still has the release finished
        in the background."""
        lease = self._take_lease(self._owner())
        self._drop_hold()
        return self.redlock._release(lease)

    def extend(self, ttl: float | None = None) -> Coroutine[Any, Any, bool]:
        """:meth:`Lock.extend`, awaitable."""
        lease = self._take_lease(self._owner())
        return self.redlock._extend(lease, self.ttl if ttl is None else ttl)

    async def check(self) -> bool:
        """:meth:`Lock.check`, awaitable."""
        lease = self._lease
        return lease is not None and await self.redlock._check(lease)

    async def __aenter__(self) -> AsyncLock:
        if not await self.acquire():
            raise self._not_acquired()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class AsyncSemaphore(HoldBase, AsyncLock):
    """A semaphore's handle for asyncio code (:meth:`AsyncRedlock.semaphore`): the calling
    task takes one permit; the rest as :class:`AsyncLock`."""

    kind = "permit"

    async def _acquire_for(
        self, owner: Hashable, prepared: tuple[bool, float | None, int | None] | None
    ) -> bool:
        if prepared is None:
            return False
        blocking, timeout, retries = prepared
        if retries is not None:
            raise ValueError(f"{self.name!r}: retries= is for locks; give a timeout instead")
        return self._won_for(
            owner, await self.redlock._acquire_hold(self, owner, blocking, timeout)
        )


class AsyncReadLock(AsyncSemaphore):
    """The read side of a read/write lock, for asyncio code."""

    kind = "read"


class AsyncWriteLock(AsyncSemaphore):
    """The write side of a read/write lock, for asyncio code."""

    kind = "write"


class AsyncRedlock(RedlockBase):
    """A lock manager over independent Redis nodes, for asyncio code.

    The same constructor, names and semantics as :class:`Redlock`, awaitable::

        rl = AsyncRedlock(urls)
        async with rl.lock("invoice:42", ttl=10):
            ...
        await rl.locked("invoice:42")
        infos = await rl.live_locks("invoice:*")   # a list of LockInfo, sorted by name
        await rl.close()

    One instance may serve several event loops (each gets its own connections, waiters and
    renewal task) and several threads; it is fork-safe like the sync client.
    """

    asyncio_transport = True

    lock_class = AsyncLock
    semaphore_class = AsyncSemaphore
    read_lock_class = AsyncReadLock
    write_lock_class = AsyncWriteLock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.permits = Permits(self)
        self._states: dict[int, LoopState] = {}
        self._states_lock = threading.Lock()
        #: Leases with a renewal on the wire -> set when it is done (any loop may wait).
        self._renewing: dict[Lease, concurrent.futures.Future[None]] = {}
        #: The loop (on a thread of its own) that renews the leases whose loop ended.
        self._adopter: asyncio.AbstractEventLoop | None = None
        self._adopter_pid = 0
        _clients.add(self)

    # -- public API -----------------------------------------------------------------------------

    async def locked(self, name: str) -> bool:
        """:meth:`Redlock.locked`, awaitable."""
        return await self._drive(self._locked_steps(name))

    async def force_release(self, name: str, token: str | None = None) -> int:
        """:meth:`Redlock.force_release`, awaitable."""
        return await self._drive(self._force_release_steps(name, token))

    async def release_token(self, name: str, token: str) -> int:
        """:meth:`Redlock.release_token`, awaitable."""
        return await self._drive(self._release_token_steps(name, token))

    async def extend_token(self, name: str, token: str, ttl: float) -> bool:
        """:meth:`Redlock.extend_token`, awaitable."""
        return await self._drive(self._extend_token_steps(name, token, ttl))

    async def live_locks(self, pattern: str = "*") -> list[LockInfo]:
        """:meth:`Redlock.live_locks`, awaitable: a list rather than an iterator."""
        return await self._drive(self._live_locks_steps(pattern))

    async def lock_info(self, name: str) -> LockInfo | None:
        """:meth:`Redlock.lock_info`, awaitable."""
        infos = await self.live_locks(glob_escape(check_name(name, listed=True)))
        return next((i for i in infos if i.name == name), None)

    async def health(self) -> list[NodeHealth]:
        """:meth:`Redlock.health`, awaitable (the nodes probed concurrently)."""
        probes = await asyncio.gather(*(self._probe(i) for i in range(len(self.nodes))))
        return self.listing.judge_health(list(probes))

    async def trust_cluster(self) -> int:
        """:meth:`Redlock.trust_cluster`, awaitable."""
        return await self._drive(self._trust_cluster_steps())

    async def close(self) -> None:
        """Close every connection this Redlock opened, on every loop; one that carries other
        tasks' operations closes once they have their replies. Held locks stay held: an
        auto-renewed one is still renewed (over new connections) until it is released, any
        other until its lease ends. The instance stays usable: it reconnects when used
        again."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._states_lock:
            states = list(self._states.values())
            self._states = {}
        for state in states:
            if state.loop is loop:
                state.close()
            elif state.loop.is_closed():
                state.strand(adopt=True)
            else:
                with contextlib.suppress(RuntimeError):
                    state.loop.call_soon_threadsafe(state.close)
        adopter = self._adopter
        if adopter is not None and not adopter.is_closed():
            ended = [state for state in states if state.loop is adopter]
            with contextlib.suppress(RuntimeError):
                adopter.call_soon_threadsafe(self._retire_adopter, adopter, ended)
        for node in self.nodes:
            node.close()
        if loop is not None:
            await asyncio.sleep(0)  # let the transports finish closing

    aclose = close

    # -- per-loop state -------------------------------------------------------------------------

    def waiter_id(self, name: str) -> str:
        # Per loop: each loop's front task of a name waits on its own.
        channel = functools.partial(self.keys.waiter_channel, name)
        return self._state().notices.waiter_id(name, channel)

    def _state(self) -> LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(id(loop))
        if state is not None and state.serves(loop):
            return state
        stranded: list[LoopState] = []
        with self._states_lock:
            pid = os.getpid()
            for key, old in list(self._states.items()):
                if old.pid != pid or old.loop.is_closed() or old.closed or old.loop is loop:
                    del self._states[key]
                    if old.pid == pid and old.loop.is_closed():
                        stranded.append(old)
            state = self._states[id(loop)] = LoopState(self, loop)
        for old in stranded:
            # A loop closed without its tasks cancelled: its keeper never ran.
            old.strand(adopt=True)
        return state

    def _in_background(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``make()`` as a task of this loop, for cleanup after a cancellation (a lease
        the caller never got, a release it stopped waiting for): unless the loop is shutting
        down (``asyncio.run`` cancels every task, then closes the loop, and a task started
        meanwhile is destroyed pending). Then nothing starts: the lease ends with its TTL."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        state = self._states.get(id(loop))
        if state is None or not state.serves(loop):
            return  # no connections here (the loop's keeper closed them: it is ending)
        # The loop is shutting down once its keeper (a task nothing else cancels) is being
        # cancelled (``Task.cancelling``: Python 3.11+; on 3.10, once it has ended).
        cancelling = getattr(state.keeper, "cancelling", None)
        if state.keeper.done() or (cancelling is not None and cancelling()):
            return
        state.spawn(make())

    def _adopt_renewals(
        self, ended: asyncio.AbstractEventLoop, due: list[tuple[float, int, Lease]]
    ) -> None:
        """Renew ``due`` (auto-renewed leases still held whose loop, ``ended``, is ending)
        from this client's own loop, on a daemon thread started the first time: the lease is
        kept until it is released (from any loop, or from no loop through ``async_to_sync``),
        as a sync client's watchdog keeps it. Its holder no longer hears a force release
        within a second; its next renewal finds it out."""
        with self._states_lock:
            adopter = self._adopter
            if adopter is ended:
                return  # the adopter itself is ending
            if adopter is None or adopter.is_closed() or self._adopter_pid != os.getpid():
                adopter = self._adopter = asyncio.new_event_loop()
                self._adopter_pid = os.getpid()
                threading.Thread(
                    target=_run_until_stopped,
                    args=(adopter,),
                    name="redlock-async-renewer",
                    daemon=True,
                ).start()
            # Under the lock: the adopter is not retired between this check and the call.
            adopter.call_soon_threadsafe(self._renew_adopted, due)

    def _retire_adopter(self, adopter: asyncio.AbstractEventLoop, ended: list[LoopState]) -> None:
        """On the adopter's loop, after ``close()`` closed its states (``ended``): stop it
        unless it still renews something (closing keeps held locks held); the next loop that
        ends holding a lease starts another."""
        with self._states_lock:
            current = self._states.get(id(adopter))
            states = [*ended, *([current] if current is not None else [])]
            if self._adopter is not adopter or any(s.renewer is not None for s in states):
                return
            self._adopter = None
        adopter.create_task(_shut_down())

    def _renew_adopted(self, due: list[tuple[float, int, Lease]]) -> None:
        state = self._state()
        for when, _, lease in due:
            if not (lease.released or lease.lost):
                self._renew_later(state, lease, when)

    def _forget(self, state: LoopState) -> None:
        with self._states_lock:
            if self._states.get(id(state.loop)) is state:
                del self._states[id(state.loop)]

    def _after_fork(self) -> None:
        super()._after_fork()
        # The parent's loops and connections are not ours; keep nothing.
        self._states = {}
        self._states_lock = threading.Lock()
        self._renewing = {}
        self._adopter = None

    # -- fan-out --------------------------------------------------------------------------------

    async def _fan_out(
        self,
        build: CommandBuilder,
        timeout: float | None = None,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, AsyncOwing] | None = None,
        behind: Mapping[int, AsyncOwing] | None = None,
        idempotent: bool = False,
        *,
        hedge: CommandBuilder | None = None,
    ) -> list[Any]:
        """Send one command to every node at once and collect the replies in node order
        (``enough``, ``left``, ``behind`` and ``idempotent``: see :class:`.fanout.FanOut`;
        ``hedge`` builds the copy a late node gets on another connection, an idempotent
        command's is itself: see :mod:`.hedging`).

        A node that failed or did not answer in time yields a :class:`Failure`. Pooled
        connections answer within ``timeout``; a node that needs a new connection gets another
        ``timeout`` to connect. A connection whose reply did not come in time takes no more
        commands until it answered, after ``late()`` was sent on it (the undo: see
        :class:`.fanout.FanOut`); then it is pooled again.
        """
        state = self._state()
        hedge = hedge if hedge is not None or not idempotent else build
        fan_out = AsyncFanOut(self.nodes, state, build, late, enough, left, idempotent, hedge)
        if timeout is None:
            timeout = reply_wait(self.nodes, self.node_timeout)
        return await fan_out.run(timeout, behind)

    async def _call(
        self, index: int, commands: Sequence[Sequence[Any]], timeout: float = SLOW_TIMEOUT
    ) -> list[Any]:
        """Pipeline ``commands`` to one node and return the replies; raises on any failure.
        For the slow operations (listing, health), not the lock hot path."""
        wire = await self._wire(index, timeout)
        return await self._ask(index, wire, commands, timeout)

    async def _wire(
        self, index: int, timeout: float = SLOW_TIMEOUT, *, keep_opening: bool = False
    ) -> AsyncWire:
        """An idle connection to node ``index``, or a new one within ``timeout``.
        ``keep_opening``: a caller that stops waiting leaves the new connection to open on
        its own budget and go to the pool (as the fan-out's do): whether the node answers
        it is the node's evidence, not the caller's impatience."""
        state = self._state()
        wire = state.checkout(index)
        if wire is None:
            try:
                opening = open_wire(self.nodes[index], state.loop, timeout)
                if keep_opening:
                    task: asyncio.Task[AsyncWire] = state.spawn(opening)
                    try:
                        wire = await asyncio.shield(task)
                    except asyncio.CancelledError:
                        task.add_done_callback(functools.partial(_pool_opened, state, index))
                        raise
                else:
                    wire = await opening
            except WireError as exc:
                error = asyncio.TimeoutError if exc.failure is NOT_CONNECTED else ConnectionError
                raise error(str(exc.failure)) from None
        return wire

    async def _ask(
        self,
        index: int,
        wire: AsyncWire,
        commands: Sequence[Sequence[Any]],
        timeout: float = SLOW_TIMEOUT,
    ) -> list[Any]:
        future = wire.request(commands)
        try:
            done, _ = await asyncio.wait([future], timeout=timeout)
        except BaseException:
            wire.abort()
            raise
        if not done:
            wire.abort()
            raise TimeoutError(f"no answer within {timeout}s")
        replies = future.result()
        if isinstance(replies, OSError):
            wire.abort()
            raise replies
        self._state().checkin(index, wire)
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise reply
        return replies

    # -- acquiring ------------------------------------------------------------------------------

    async def _acquire(
        self,
        handle: AsyncLock,
        owner: Hashable,
        *,
        blocking: bool,
        timeout: float | None,
        retries: int | None,
    ) -> Lease | None:
        if handle.reentrant:
            # Asked of the nodes before the hold count goes up: a cancellation meanwhile
            # leaves no hold that nobody will release.
            held = self.leases.joinable(handle.name, owner)
            if held is not None and await self._drive(self._rejoined_steps(held)):
                lease = self.leases.reenter(handle, owner)
                if lease is not None:
                    return lease
        begun = time.monotonic()
        try:
            return await self._acquire_new(handle, owner, blocking, timeout, retries, begun)
        except BaseException:
            for won in self.leases.won_unreturned([handle.name], owner, begun):
                self._in_background(functools.partial(self._give_back, won))
            raise

    async def _give_back(self, lease: Lease) -> None:
        """Release a lease its acquire's caller never got (cancelled after the win)."""
        with contextlib.suppress(Exception):
            await self._release(lease)

    async def _acquire_new(
        self,
        handle: AsyncLock,
        owner: Hashable,
        blocking: bool,
        timeout: float | None,
        retries: int | None,
        start: float,
    ) -> Lease | None:
        deadline = self.algorithm.deadline(start, timeout, retries)
        courtesy = self.leases.courtesy(handle.name) if blocking else 0.0
        if courtesy:
            await asyncio.sleep(min(courtesy, (deadline or start + 1) - start))
        state = self._state()
        # Every blocking acquire lines up, the first of a name included (it finds the line
        # empty and goes on at once): tasks are started faster than an attempt answers, so
        # a first attempt made outside the line would be made by every task at once, each
        # on connections of its own (a thousand tasks on one name: a thousand per node).
        queue = self._join_queue(state, handle.name) if blocking else None
        if queue is not None:
            try:
                entered = await queue.enter(deadline)
            except BaseException:
                self._drop_queue(state, handle.name, queue)
                raise
            if not entered:
                self._drop_queue(state, handle.name, queue)
                refusal = Refusal({}, len(self.nodes), queue.holder_left())
                self.algorithm.give_up(handle, refusal, time.monotonic() - start)
                return None
        try:
            lease = await self._drive(
                self.algorithm.contend(
                    Contender(handle, owner), blocking, deadline, retries, start, None, courtesy > 0
                )
            )
            if lease is not None and lease.auto_renew:
                # Its force-release watch is subscribed before the holder goes on.
                await state.notices.ready()
        except BaseException:
            if queue is not None:
                self._leave_queue(state, handle.name, queue, None)
            raise
        if queue is not None:
            if lease is None:
                self._leave_queue(state, handle.name, queue, None)
            else:
                queue.hold(lease)
                lease.leave_queue = self._queue_leaver(state, handle.name, queue, lease)
                lease.wake_queue = functools.partial(_on_loop, state.loop, queue.wake)
        return lease

    async def _acquire_hold(
        self, handle: HoldBase, owner: Hashable, blocking: bool, timeout: float | None
    ) -> Lease | None:
        """A permit or a read/write hold (:mod:`.permits`)."""
        start = time.monotonic()
        deadline = self.algorithm.deadline(start, timeout, None)
        try:
            lease = await self._drive(
                self.permits.hold_steps(handle, owner, blocking, deadline, start)
            )
            if lease is not None and lease.auto_renew:
                await self._state().notices.ready()
            return lease
        except BaseException:
            state = self._state()
            for won in self.leases.won_unreturned(handle.hold_names(), owner, start):
                if not state.closed:
                    state.spawn(self._give_back(won))
            raise

    async def _drive(self, steps: Steps[_T]) -> _T:
        """Run the algorithm's steps on this loop: each :class:`Send` is one fan-out, a
        :class:`Listen` a subscription kept until the operation ends."""
        reply: Any = None
        cleanup: contextlib.AsyncExitStack | None = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                reply = None
                if isinstance(step, Send):
                    reply = await self._send(step)
                elif isinstance(step, SendBatch):
                    reply = await self._send_batch(step)
                elif isinstance(step, Wait):
                    reply = await step.notice.wait(step.seconds)
                elif isinstance(step, Pause):
                    await asyncio.sleep(step.seconds)
                else:
                    cleanup = cleanup or contextlib.AsyncExitStack()
                    if isinstance(step, Listen):
                        listening = self._state().notices.listening(step.channel)
                        reply = await cleanup.enter_async_context(listening)
                    else:
                        cleanup.push_async_callback(self._finally, step)
        finally:
            if cleanup is not None:
                await cleanup.aclose()

    async def _finally(self, step: Finally) -> None:
        if not step.cancelled:
            await self._fan_out(step.send.build)

    async def _send(self, step: Send) -> list[Any]:
        step.started = time.monotonic()
        try:
            replies = await self._fan_out(*step.args, hedge=step.hedge)
        except asyncio.CancelledError:
            # Some SETs may have landed: take them back without making the caller wait.
            if step.undo_if_cancelled:
                undo = step.undo_if_cancelled
                self._in_background(lambda: self._release_everywhere(*undo))
            raise
        step.ended = time.monotonic()
        return replies

    def _join_queue(self, state: LoopState, name: str) -> TaskQueue:
        queue = state.queues.get(name)
        if queue is None:
            queue = state.queues[name] = TaskQueue(state.loop)
        queue.users += 1
        return queue

    def _leave_queue(
        self, state: LoopState, name: str, queue: TaskQueue, lease: Lease | None
    ) -> None:
        queue.leave(lease)
        self._drop_queue(state, name, queue)

    def _drop_queue(self, state: LoopState, name: str, queue: TaskQueue) -> None:
        queue.users -= 1
        if queue.users == 0 and state.queues.get(name) is queue:
            del state.queues[name]

    def _queue_leaver(
        self, state: LoopState, name: str, queue: TaskQueue, lease: Lease
    ) -> Callable[[], None]:
        """``lease.leave_queue``: frees the queue on the loop that owns it, wherever the
        release runs."""
        return functools.partial(_on_loop, state.loop, self._leave_queue, state, name, queue, lease)

    # -- holding --------------------------------------------------------------------------------

    async def _release_everywhere(
        self, name: str, token: str, behind: Mapping[int, AsyncOwing] | None = None
    ) -> list[Any]:
        command = self.keys.release_command(name, token)
        replies = await self._fan_out(
            lambda n, w: command, enough=self._release_ends(), behind=behind, idempotent=True
        )
        self._keep_unreached(command, replies)
        return replies

    async def _release(self, lease: Lease) -> None:
        if not self.leases.begin_release(lease):
            return
        try:
            replies = await self._release_after_renewal(lease)
        except asyncio.CancelledError:
            # The caller was cancelled: the release still goes out (it is idempotent).
            self._in_background(functools.partial(self._release_after_renewal, lease))
            raise
        finally:
            if lease.leave_queue is not None:
                lease.leave_queue()
        self.leases.finish_release(lease, replies)

    async def _release_after_renewal(self, lease: Lease) -> list[Any]:
        renewing = self._renewing.get(lease)
        if renewing is not None:
            # A renewal is on the wire: let it land first, so no PEXPIRE follows the release.
            await asyncio.wrap_future(renewing)
        behind, lease.behind = lease.behind, None
        if lease.home is not self.leases:
            # The last hold of a lease the partner client took (share_holds: its owner
            # re-entered it here and outlived the outer hold, a view cancelled while its
            # sync_to_async call ran on) goes out here, by token: the partner's connections
            # that owed the acquire's reply are not this client's (or this loop's).
            behind = None
        return await self._release_everywhere(lease.name, lease.token, behind)

    async def _extend(self, lease: Lease, ttl: float) -> bool:
        return await self._drive(self._extend_steps(lease, ttl))

    async def _check(self, lease: Lease) -> bool:
        return await self._drive(self._check_steps(lease))

    # -- renewal --------------------------------------------------------------------------------

    def _start_renewal(self, lease: Lease) -> None:
        state = self._state()
        self._renew_later(state, lease)
        # A long holder hears an operator's force release at once (not at its next renewal),
        # on the holders' channel: subscribed once per node for all of this loop's holders.
        watch = HolderWatch(lease, self.leases.mark_lost, self.quorum)
        if state.holders is None:
            state.holders = HolderWatches()
            state.notices.watch(self.keys.holders_channel().encode(), state.holders)
        state.holders.add(watch)
        lease.unwatch = functools.partial(state.holders.remove, watch)

    def _renew_later(self, state: LoopState, lease: Lease, when: float | None = None) -> None:
        """Renew ``lease`` from ``state``'s loop at ``when`` (a third of its ttl from now)."""
        when = time.monotonic() + lease.ttl / 3 if when is None else when
        heapq.heappush(state.due, (when, next(state.seq), lease))
        if state.renewer is None:
            state.renewer = state.loop.create_task(self._renewals(state), name="redlock-renewer")
        else:
            state.renew_wake.set()

    async def _renewals(self, state: LoopState) -> None:
        """The loop's watchdog: one task re-arms every auto-renewed lease of this loop, the
        leases due in a round together (one pipelined fan-out); it ends when none is left (the
        next one starts it again)."""
        try:
            while state.due:
                if state.closed:
                    # The client was closed (its connections), not the loop: renewal goes on
                    # from this loop's next state, as the sync client's goes on reconnecting.
                    fresh = self._state()
                    for due, _, held in state.due:
                        if not (held.released or held.lost):
                            self._renew_later(fresh, held, due)
                    state.due.clear()
                    return
                delay = state.due[0][0] - time.monotonic()
                if delay > 0:
                    asked = time.monotonic()
                    await state.renew_wake.wait(delay)
                    if delay is not None:
                        now = time.monotonic()
                        pauses.note(delay, now - asked, now)
                    state.renew_wake.clear()
                    continue
                horizon = time.monotonic() + BATCH_WINDOW
                leases: list[Lease] = []
                while state.due and state.due[0][0] <= horizon:
                    lease = heapq.heappop(state.due)[2]
                    if not (lease.released or lease.lost):
                        leases.append(lease)
                try:
                    whens = await self._renew(leases)
                except Exception:
                    self.leases.renewal_failed(leases)
                    continue
                for lease, when in zip(leases, whens, strict=True):
                    if when is not None:
                        heapq.heappush(state.due, (when, next(state.seq), lease))
        finally:
            state.renewer = None

    async def _renew(self, leases: list[Lease]) -> list[float | None]:
        return await self._drive(self._renew_steps(leases))

    async def _send_batch(self, step: SendBatch) -> list[Any]:
        # A release waits for a renewal on the wire (``_release_after_renewal``), so no
        # PEXPIRE follows it.
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        for lease in step.leases:
            self._renewing[lease] = done
        step.answered = [None] * len(self.nodes)
        try:
            return await self._batch(step.commands, step.until, step.answered)
        finally:
            for lease in step.leases:
                del self._renewing[lease]
            done.set_result(None)

    async def _batch(
        self, commands: list[list[Any]], until: float, answered: list[float | None]
    ) -> list[Any]:
        """``commands`` pipelined to every node at once; each node's replies, or its
        :class:`Failure`. Waited for as the sync client's round is (:func:`.fanout.batch_wait`):
        until the leases' validity ``until``, not beyond a quorum's answer and its straggler's
        grace (a round counted out after one node timeout on nodes merely busy fails the next
        rounds too, until the leases run out)."""
        timeout = reply_wait(self.nodes, self.node_timeout)  # one budget for the round
        start = time.monotonic()
        wait = batch_wait(timeout, until, start, start)
        state = self._state()
        asked = {
            state.spawn(self._pipeline(i, commands, timeout)): i for i in range(len(self.nodes))
        }
        results: list[Any] = [Failure("timeout")] * len(self.nodes)
        pending = set(asked)
        complete = 0
        try:
            while pending:
                remaining = wait.remaining(time.monotonic())
                if remaining <= 0:
                    break
                finished, pending = await asyncio.wait(
                    pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                now = time.monotonic()
                for task in finished:
                    index = asked[task]
                    results[index] = replies = task.result()
                    if isinstance(replies, Failure):
                        continue
                    answered[index] = now
                    complete += 1
                    if complete == self.quorum and pending:
                        batch_quorum_in(wait, start, now, timeout)
        finally:
            for task in pending:
                task.cancel()  # its connection is aborted (_pipelined)
        return results

    async def _pipeline(
        self, index: int, commands: list[list[Any]], timeout: float
    ) -> list[Any] | Failure:
        """``commands`` pipelined to one node: the replies in order, or the node's
        :class:`Failure`. The round's wait ends it (:meth:`_batch`); connecting has its own
        budget, as the sync round's (:func:`.detector.connect_budget`): a node merely busy
        answers a handshake later than the node timeout too."""
        try:
            wire = await self._wire(index, connect_budget(timeout), keep_opening=True)
        except (OSError, asyncio.TimeoutError) as exc:
            return Failure("timeout") if isinstance(exc, asyncio.TimeoutError) else os_failure(exc)
        replies = await self._pipelined(wire, commands)
        if isinstance(replies, Failure):
            return replies
        again = [i for i, r in enumerate(replies) if noscript(r)]
        if again:  # the node lost its script cache: the bodies once, in one more round trip
            retried = await self._pipelined(wire, [eval_form(commands[i]) for i in again])
            if isinstance(retried, Failure):
                return retried
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        self._state().checkin(index, wire)
        return [reply_failure(r) if isinstance(r, ReplyError) else r for r in replies]

    async def _pipelined(self, wire: AsyncWire, commands: list[list[Any]]) -> list[Any] | Failure:
        future = wire.request(commands)
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            # The round stopped waiting: the replies still due would answer a later user.
            wire.abort()
            raise
        replies = future.result()
        if isinstance(replies, OSError):
            wire.abort()
            return os_failure(replies)
        return replies

    # -- listing and health ---------------------------------------------------------------------

    async def _probe(self, index: int) -> NodeHealth:
        node = self.nodes[index]
        try:
            await relocate(node, self._state(), index)
            self._state().checkin(index, await self._wire(index))
            steps = self._probe_steps(node)
            commands = next(steps)
            while True:
                try:
                    replies = await self._call(index, commands)
                except ReplyError as exc:
                    commands = steps.throw(exc)
                else:
                    commands = steps.send(replies)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except Exception as exc:
            return self.listing.failed_health(node, exc)
