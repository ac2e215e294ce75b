"""Waiting without polling, for the asyncio client (the twin of :mod:`.waiting`).

Tasks of one loop that want the same name line up in a local FIFO queue (:class:`TaskQueue`)
so only the front one contends with the nodes; the front one subscribes to the name's release
channel (:class:`AsyncReleaseNotices`: one subscriber connection per node per loop) and sleeps
until a quorum announced a release or the holder's lease ends, never in a fixed polling loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .aionodes import AsyncWire, open_wire
from .lock import Lease
from .nodes import Node, pack
from .waiting import (
    LINGER,
    NOTICE_GRACE,
    RECONNECT_DELAY,
    Listener,
    Tally,
    Waiters,
    confirmations_due,
    lingered_out,
)

__all__ = ["AsyncReleaseNotice", "AsyncReleaseNotices", "Signal", "TaskQueue"]


def _wake(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Signal:
    """An asyncio.Event whose ``wait`` takes a timeout (without ``wait_for``'s extra task)."""

    __slots__ = ("_flag", "_loop", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._flag = False
        self._waiters: list[asyncio.Future[None]] = []

    def set(self) -> None:
        self._flag = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _wake(waiter)

    def clear(self) -> None:
        self._flag = False

    async def wait(self, timeout: float | None) -> bool:
        """True when set, False when ``timeout`` seconds passed first."""
        if self._flag:
            return True
        if timeout is not None and timeout <= 0:
            return False
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(waiter)
        timer = None if timeout is None else self._loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return self._flag


class TaskQueue:
    """The tasks of one loop that want one name, first come first served; the one at the
    front talks to the nodes (the asyncio side of ``waiting.LocalQueue``).

    The front place is kept from the start of contention until release; if its holder's lease
    runs out (lost, or never released) the next task moves up anyway.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._line: deque[Signal] = deque()
        self._busy = False
        self._lease: Lease | None = None
        self.users = 0  #: tasks queued or at the front; the queue is dropped at zero

    async def enter(self, deadline: float | None) -> bool:
        ticket = Signal(self._loop)
        self._line.append(ticket)
        try:
            while self._line[0] is not ticket or (self._busy and not self._holder_gone()):
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    self._remove(ticket)
                    return False
                if self._line[0] is ticket and self._lease is not None:
                    validity = self._lease.validity
                    wait = validity if wait is None else min(wait, validity)
                await ticket.wait(wait)
                ticket.clear()
        except BaseException:
            self._remove(ticket)
            raise
        self._line.popleft()
        self._busy, self._lease = True, None
        return True

    def _remove(self, ticket: Signal) -> None:
        with contextlib.suppress(ValueError):
            self._line.remove(ticket)
        self._notify()

    def _notify(self) -> None:
        if self._line:
            self._line[0].set()

    def _holder_gone(self) -> bool:
        return self._lease is not None and self._lease.validity <= 0

    def holder_left(self) -> float | None:
        """Seconds left of the lease this process's holder at the front has (None when the
        front is not holding): what a waiter that gave up in line is told to wait."""
        lease = self._lease
        return None if lease is None else lease.validity

    def hold(self, lease: Lease) -> None:
        self._lease = lease
        self._notify()  # the next in line now waits for this lease's end at the latest

    def leave(self, lease: Lease | None = None) -> None:
        if lease is None or self._lease is lease:
            self._busy, self._lease = False, None
            self._notify()

    def wake(self) -> None:
        """The front's lease is gone (lost): whoever is next looks again now."""
        self._notify()


class AsyncReleaseNotice(Tally):
    """A waiting task's view of its name's release channel (see ``waiting.ReleaseNotice``)."""

    def __init__(self, quorum: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(quorum)
        self._loop = loop
        self._signal = Signal(loop)

    def hear(self, node: int, token: bytes) -> None:
        super().hear(node, token)
        self._signal.set()

    async def wait(self, timeout: float) -> int:
        """Until a quorum announced a release (or a grace period after a partial one), or
        ``timeout`` seconds; then forget what was heard, ready for the next round. Returns
        how many releases (distinct tokens) some node announced: 0 for none."""
        deadline = self._loop.time() + timeout
        await self._until(lambda: self.heard, deadline)
        if self.heard:
            await self._until(lambda: self.freed, min(deadline, self._loop.time() + NOTICE_GRACE))
        releases = self.releases
        self.reset()
        self._signal.clear()
        return releases

    async def _until(self, condition: Any, deadline: float) -> None:
        while not condition():
            remaining = deadline - self._loop.time()
            if remaining <= 0 or not await self._signal.wait(remaining):
                return
            self._signal.clear()


class AsyncReleaseNotices:
    """Release notices on one loop: one subscriber connection per node serves every waiter."""

    def __init__(
        self, nodes: Sequence[Node], node_timeout: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._nodes = nodes
        self._timeout = node_timeout
        self._loop = loop
        self._wires: dict[int, AsyncWire] = {}  # node index -> subscriber connection
        self._waiters: dict[bytes, list[Listener]] = {}
        self._confirmed: dict[bytes, set[int]] = {}
        self._confirm = Signal(loop)
        self._connecting = asyncio.Lock()
        self._retry: asyncio.TimerHandle | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False
        self._ids = Waiters()
        #: As ``waiting.ReleaseNotices._lingering``; swept by a timer while any lingers.
        self._lingering: dict[bytes, float] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def waiter_id(self, name: str, channel: Callable[[str], str]) -> str:
        """The id this loop waits for ``name`` under, the same from one acquire to the next
        (see :class:`.waiting.Waiters`); ``channel`` makes an id's channel."""
        waiter, dropped = self._ids.waiter(name, channel)
        # Its channel stops lingering: dropped now unless someone listens (then at unwatch).
        lingered = dropped is not None and self._lingering.pop(dropped, None) is not None
        if lingered and dropped is not None and not self._waiters.get(dropped):
            self._drop(dropped)
        return waiter

    @contextlib.asynccontextmanager
    async def listening(self, channel: str) -> AsyncIterator[AsyncReleaseNotice]:
        """A signal set when ``channel`` sees a release; subscribed before this yields, on every
        node that could be reached within the node timeout."""
        name = channel.encode()
        signal = AsyncReleaseNotice(len(self._nodes) // 2 + 1, self._loop)
        first = name not in self._waiters
        waiters = self._waiters.setdefault(name, [])
        waiters.append(signal)
        try:
            timeout = self._timeout
            deadline = self._loop.time() + 2 * timeout  # connecting, then confirming
            if first:
                self._confirmed[name] = set()
                fresh = await self._connect_all(timeout)
                for index, wire in self._wires.items():
                    if index not in fresh:
                        self._send(wire, ["SUBSCRIBE", name])
            elif len(waiters) == 1 and len(self._wires) < len(self._nodes):
                await self._connect_all(timeout)  # lingered, with no one to reconnect it for
            due = confirmations_due(self._wires, self._nodes)
            while len(self._confirmed.get(name, ())) < due:
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    break
                await self._confirm.wait(remaining)
                self._confirm.clear()
            yield signal
        finally:
            self.unwatch(name, signal)

    def watch(self, name: bytes, listener: Listener) -> None:
        """Pass what channel ``name`` announces to ``listener`` until :meth:`unwatch`,
        without waiting for the subscription (a holder listening for a force release)."""
        waiters = self._waiters.setdefault(name, [])
        waiters.append(listener)
        if len(waiters) == 1:
            for wire in self._wires.values():
                self._send(wire, ["SUBSCRIBE", name])
        if len(self._wires) < len(self._nodes) and self._retry is None:
            self._reconnect()

    async def ready(self) -> None:
        """Until the connections being opened now are open (and subscribed)."""
        if self._reconnecting is not None and not self._reconnecting.done():
            await asyncio.shield(self._reconnecting)

    def unwatch(self, name: bytes, listener: Listener) -> None:
        waiters = self._waiters.get(name, [])
        if listener in waiters:
            waiters.remove(listener)
        if not waiters and name in self._waiters:
            if name in self._ids.channels and not self._closed:
                # Kept subscribed for this loop's next waiter of the name (as the sync twin).
                self._lingering[name] = self._loop.time()
                if self._sweeper is None:
                    self._sweeper = self._loop.call_later(LINGER, self._sweep)
            else:
                self._drop(name)

    def _sweep(self) -> None:
        """Unsubscribe the lingering channels nobody listened to for :data:`LINGER` seconds;
        again later while any lingers."""
        self._sweeper = None
        done, due = lingered_out(self._lingering, self._waiters, self._loop.time(), LINGER)
        for name in done:
            self._drop(name)
        if self._lingering and not self._closed:
            self._sweeper = self._loop.call_at(due, self._sweep)

    def _drop(self, name: bytes) -> None:
        """Unsubscribe ``name``, which nobody listens to any more."""
        self._lingering.pop(name, None)
        del self._waiters[name]
        self._confirmed.pop(name, None)
        for wire in self._wires.values():
            self._send(wire, ["UNSUBSCRIBE", name])

    async def _connect_all(self, timeout: float) -> set[int]:
        """Open the missing subscriber connections (concurrently); returns the new ones, which
        are already subscribed to every channel with waiters."""
        async with self._connecting:
            missing = [i for i in range(len(self._nodes)) if i not in self._wires]
            if not missing:
                return set()
            opened = await asyncio.gather(
                *(open_wire(self._nodes[i], self._loop, timeout) for i in missing),
                return_exceptions=True,
            )
            fresh: set[int] = set()
            for index, wire in zip(missing, opened, strict=True):
                if not isinstance(wire, AsyncWire):
                    continue  # that node's waiters fall back to the lease timer
                wire.push = lambda message, index=index: self._on_message(index, message)
                wire.on_lost = self._on_lost
                self._wires[index] = wire
                fresh.add(index)
                if self._waiters:
                    self._send(wire, ["SUBSCRIBE", *self._waiters])
            return fresh

    def _send(self, wire: AsyncWire, command: list[Any]) -> None:
        if wire.transport is not None and not wire.closed:
            wire.transport.write(pack(command))

    def _on_message(self, index: int, message: Any) -> None:
        if not isinstance(message, list) or len(message) < 3:
            return
        kind, channel = message[0], message[1]
        if kind == b"message":
            # A copy: a listener may unwatch itself while hearing (a holder marking its lock
            # lost), which must not hide the next one.
            for notice in list(self._waiters.get(channel, ())):
                notice.hear(index, message[2])
        elif kind == b"subscribe":
            confirmed = self._confirmed.get(channel)
            if confirmed is not None:
                confirmed.add(index)
                self._confirm.set()

    def _on_lost(self, wire: AsyncWire) -> None:
        for index, mine in list(self._wires.items()):
            if mine is wire:
                del self._wires[index]
        self._confirm.set()
        self._reconnect_later()

    def _reconnect_later(self) -> None:
        """Open dropped subscriber connections again while anyone listens (a reset must not
        leave waiters sleeping through releases)."""
        if self._closed or self._retry is not None or not self._waiters:
            return
        self._retry = self._loop.call_later(RECONNECT_DELAY, self._reconnect)

    def _reconnect(self) -> None:
        self._retry = None
        if not self._closed and self._waiters:
            # Kept referenced: the loop holds tasks only weakly.
            self._reconnecting = self._loop.create_task(self._reconnect_all())

    async def _reconnect_all(self) -> None:
        await self._connect_all(self._timeout)
        if len(self._wires) < len(self._nodes):
            self._reconnect_later()

    def strand(self) -> None:
        """:meth:`close` for a loop that will not run again (its connections are closed
        without it: ``aionodes.strand_loop``)."""
        self._closed = True
        self._retry = self._sweeper = None
        self._wires = {}

    def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for name in list(self._lingering):
            if not self._waiters.get(name):
                self._lingering.pop(name)
                del self._waiters[name]
                self._confirmed.pop(name, None)
        for wire in self._wires.values():
            wire.on_lost = None
            wire.close()
        self._wires = {}
