"""The Redlock algorithm over N independent Redis nodes, asyncio client.

:class:`AsyncRedlock` is the twin of :class:`~django_redlock.core.redlock.Redlock`: the same
names and semantics, awaitable. Every decision (quorum, validity, refusal, retry delay, lease
table, events) comes from :mod:`.base`; only the talking and the waiting differ.

Talking. Each node gets lean connections (an :class:`asyncio.Protocol` parsing RESP with the
sans-IO :mod:`.resp`, the same handshake as the sync ``Wire``: AUTH, SELECT, INFO for the run
id). A fan-out writes the command to every node, then waits for the replies at once with one
deadline (``node_timeout``), or until a quorum granted an acquire or removed a released key;
a connection whose reply did not come in time is aborted (after the undo of what it carried),
never reused. Connections are pooled per node *and per event loop* (asyncio transports belong to the
loop that opened them; Django's ``async_to_sync`` runs each call in a fresh loop). A loop's
connections, subscriber and renewal task are closed when that loop shuts down
(``asyncio.run``/asgiref cancel the loop's tasks; a tiny keeper task per loop does the cleanup)
or by ``await redlock.close()``. A forked child starts with no connections.

Waiting. Tasks of one loop that want the same name line up in a local FIFO queue so only the
front one contends with the nodes; the front one subscribes to the name's release channel (one
subscriber connection per node per loop) and sleeps until a release notice or the holder's
lease end, never in a fixed polling loop.

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
import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import os
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .base import Listen, Pause, RedlockBase, Refusal, Send, SendBatch, Steps, Wait
from .info import LockInfo, NodeHealth
from .listing import glob_escape
from .lock import Lease, LockBase, current_owner
from .nodes import (
    DRAIN_FOR,
    TIMED_OUT,
    Due,
    Failure,
    Node,
    Pipelined,
    ProtocolError,
    WireError,
    as_bytes,
    as_eval,
    eval_form,
    fold,
    handshake,
    os_failure,
    parse_reply,
    reply_failure,
    run_id_of,
    unfinished,
)
from .renewal import BATCH_WINDOW
from .resp import Incomplete, ReplyError, bulk, encode
from .validation import check_name, check_timeout
from .waiting import (
    NOTICE_GRACE,
    RECONNECT_DELAY,
    HolderWatch,
    Listener,
    Tally,
    confirmations_due,
)

__all__ = ["AsyncLock", "AsyncRedlock"]

_T = TypeVar("_T")

#: Per-command timeout of the slow operations (listing, health), like the sync client's
#: redis-py socket timeout.
SLOW_TIMEOUT = 2.0

#: The reply of a node whose connection was still being opened when a fan-out ended: the
#: command never reached it (see :func:`.nodes.reached`).
_NOT_CONNECTED = Failure("timeout", "no answer while connecting")

#: Builds one node's command from the connection it will go out on (it may need the run id).
CommandBuilder = Callable[[Node, "_Wire"], Sequence[Any] | bytes | Pipelined]


# -- connections ---------------------------------------------------------------------------------


class _Wire(asyncio.Protocol):
    """One connection to a node on one event loop.

    Replies are parsed as they arrive and handed, in order, to the callbacks of the commands
    sent (no future, no extra loop turn per reply). A lost or aborted connection hands each
    outstanding callback the ``OSError`` as its reply. In push mode (a subscriber), every
    message goes to ``push`` instead.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, later: deque[bytes]) -> None:
        self.loop = loop
        #: The node's :attr:`.nodes.Node.later`: what must still reach it if this is cut.
        self.later = later
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.run_id = ""
        #: The run id as a RESP argument (every acquire sends it).
        self.run_id_arg = b""
        #: As :attr:`.nodes.Wire.vote_marker`.
        self.vote_marker: list[bytes] | None = None
        #: When the node was trusted as part of a new cluster (``time.monotonic``), or None.
        self.trusted_at: float | None = None
        #: True once it served a command: a pooled connection may have been closed by the node.
        self.reused = False
        self.closed = False
        self.waiters: deque[Callable[[Any], None]] = deque()
        #: Commands of fan-outs that stopped waiting (a quorum was reached) still to be
        #: answered, oldest first (sent on the loop's clock). As :attr:`.nodes.Wire.due`.
        self.owed: deque[Due] = deque()
        self.push: Callable[[Any], None] | None = None
        self.on_lost: Callable[[_Wire], None] | None = None

    # protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = parse_reply(buf, pos)
                if self.push is not None:
                    self.push(value)
                elif self.waiters:
                    self.waiters.popleft()(value)
                    if self.closed and not self.waiters:
                        self.close()  # given up, and now everything is answered
                else:
                    raise ProtocolError("a reply nobody asked for")
        except Incomplete:
            pass
        except ProtocolError as exc:
            # Out of step with the node: this connection can never be trusted again.
            self.abort(exc)
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        error = (
            exc
            if isinstance(exc, OSError)
            else ConnectionResetError("connection closed by the node")
        )
        self._fail(error)
        if self.on_lost is not None:
            self.on_lost(self)

    def _fail(self, error: OSError) -> None:
        self.closed = True
        waiters, self.waiters = self.waiters, deque()
        for waiter in waiters:
            waiter(error)

    # use

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(
        self, command: Sequence[Any] | bytes | Pipelined, callback: Callable[[Any], None]
    ) -> None:
        """Send one command; ``callback`` gets its reply (or the ``OSError``)."""
        if self.transport is None or self.transport.is_closing():
            callback(ConnectionResetError("connection closed"))
            return
        self.waiters.append(callback)
        self.transport.write(as_bytes(command))

    def send_many(self, data: bytes, count: int, callback: Callable[[Any], None]) -> None:
        """Send ``count`` commands encoded in ``data`` in one write; ``callback`` gets the
        list of their replies, or the ``OSError``, once."""
        if not self.usable():
            callback(ConnectionResetError("connection closed"))
            return
        replies: list[Any] = []

        def collect(reply: Any) -> None:
            if len(replies) >= count:
                return  # the group already reported an error
            if isinstance(reply, OSError):
                replies.extend([reply] * count)
                callback(reply)
                return
            replies.append(reply)
            if len(replies) == count:
                callback(replies)

        self.waiters.extend([collect] * count)
        self.transport.write(data)  # type: ignore[union-attr]

    def request_many(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[Any]]:
        """Pipeline commands in one write; the futures resolve to the replies (or the
        ``OSError``)."""
        futures: list[asyncio.Future[Any]] = [self.loop.create_future() for _ in commands]
        if not self.usable():
            for future in futures:
                future.set_result(ConnectionResetError("connection closed"))
            return futures
        self.waiters.extend(functools.partial(_settle, f) for f in futures)
        self.transport.write(b"".join(encode(c) for c in commands))  # type: ignore[union-attr]
        return futures

    def send_unowned(self, command: bytes) -> None:
        """Send a release or an undo no operation waits for; cut before it answered, it goes
        out with the next operation that reaches the node (as :attr:`.nodes.Due.again`)."""
        self.send(command, functools.partial(_again_if_cut, self.later, command))

    def undo_unwanted(self) -> None:
        """As :meth:`.nodes.Wire.undo_unwanted`."""
        for due in self.owed:
            if due.unwanted and due.late is not None:
                self.send_unowned(due.take_undo())

    def overdue(self, now: float, timeout: float) -> bool:
        """Whether a command it still owes has waited longer than ``timeout``."""
        return bool(self.owed) and self.owed[0].sent + timeout <= now

    def abandon(self, late: Callable[[], bytes] | None) -> None:
        """Give the connection up after sending the undo of every command it still owes
        (``late`` builds the current one's) behind them; it is never used again, and closed
        once the node answered everything (or after :data:`.nodes.DRAIN_FOR` seconds), not
        at once: see :meth:`.nodes.Node.abandon`."""
        if not self.usable():
            self.abort()
            return
        lates = [due.late for due in self.owed if due.late is not None]
        if late is not None:
            lates.append(late)
        for undo in lates:
            self.send_unowned(undo())
        self.closed = True  # not usable any more, but still read
        self.loop.call_later(DRAIN_FOR, self.abort)
        if not self.waiters:
            self.close()

    def abort(self, error: OSError | None = None) -> None:
        """Drop the connection at once: a reply we stopped waiting for must never be read as
        the answer to a later command."""
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):  # its loop is already closed
                self.transport.abort()
        self._fail(error or ConnectionAbortedError("connection aborted"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.transport.close()


#: A connection that still owes a reply, and that reply (as :data:`.nodes.Owing`).
_Owing = tuple[_Wire, Due]


def _again_if_cut(later: deque[bytes], command: bytes, reply: Any) -> None:
    if isinstance(reply, OSError):
        later.append(command)


def _noscript(reply: Any) -> bool:
    return isinstance(reply, ReplyError) and reply.code == "NOSCRIPT"


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


async def _open_wire(node: Node, loop: asyncio.AbstractEventLoop, timeout: float) -> _Wire:
    """Connect and shake hands (AUTH, SELECT, INFO server for the run id) within ``timeout``
    seconds. Raises :class:`WireError` (at once while the node is unreachable: see
    :meth:`.nodes.Node.connect`); cancelling aborts the connection."""
    failure = node.unreachable()
    if failure is not None:
        raise WireError(failure)
    try:
        return await asyncio.wait_for(_connect_and_shake_hands(node, loop), timeout)
    except asyncio.TimeoutError:
        node.went_silent()
        raise WireError(_NOT_CONNECTED) from None
    except WireError as exc:
        if exc.failure.reason == "timeout":
            node.went_silent()
        raise


async def _connect_and_shake_hands(node: Node, loop: asyncio.AbstractEventLoop) -> _Wire:
    params = node.params
    wire: _Wire | None = None
    try:

        def protocol() -> _Wire:
            return _Wire(loop, node.later)

        if "path" in params:
            _, wire = await loop.create_unix_connection(protocol, params["path"])
        elif params.get("ssl"):
            _, wire = await loop.create_connection(
                protocol,
                params["host"],
                params["port"],
                ssl=node.ssl_context(),
                server_hostname=params["host"],
            )
        else:
            _, wire = await loop.create_connection(protocol, params["host"], params["port"])
        replies = []
        for waiter in wire.request_many(handshake(params)):
            reply = await waiter
            if isinstance(reply, OSError):
                raise reply
            replies.append(reply)
        wire.run_id = run_id_of(replies)
        wire.run_id_arg = bulk(wire.run_id)
        return wire
    except WireError:
        if wire is not None:
            wire.abort()
        raise
    except OSError as exc:
        if wire is not None:
            wire.abort()
        if isinstance(exc, TimeoutError):
            raise WireError(_NOT_CONNECTED) from None
        raise WireError(os_failure(exc)) from None
    except BaseException:
        if wire is not None:
            wire.abort()
        raise


def _parse_info(raw: Any) -> dict[str, Any]:
    """INFO's ``key:value`` lines; numbers as int/float like redis-py's ``info()``."""
    info: dict[str, Any] = {}
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else ""
    for line in text.splitlines():
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, value = line.split(":", 1)
        try:
            info[key] = int(value)
        except ValueError:
            try:
                info[key] = float(value)
            except ValueError:
                info[key] = value
    return info


# -- small waiting primitives --------------------------------------------------------------------


def _wake(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Signal:
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


class _TaskQueue:
    """The tasks of one loop that want one name, first come first served; the one at the
    front talks to the nodes (the asyncio side of ``waiting.LocalQueue``).

    The front place is kept from the start of contention until release; if its holder's lease
    runs out (lost, or never released) the next task moves up anyway.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._line: deque[_Signal] = deque()
        self._busy = False
        self._lease: Lease | None = None
        self.users = 0  #: tasks queued or at the front; the queue is dropped at zero

    async def enter(self, deadline: float | None) -> bool:
        ticket = _Signal(self._loop)
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

    def _remove(self, ticket: _Signal) -> None:
        with contextlib.suppress(ValueError):
            self._line.remove(ticket)
        self._notify()

    def _notify(self) -> None:
        if self._line:
            self._line[0].set()

    def _holder_gone(self) -> bool:
        return self._lease is not None and self._lease.validity <= 0

    def hold(self, lease: Lease) -> None:
        self._lease = lease
        self._notify()  # the next in line now waits for this lease's end at the latest

    def leave(self, lease: Lease | None = None) -> None:
        if lease is None or self._lease is lease:
            self._busy, self._lease = False, None
            self._notify()


class _ReleaseNotice(Tally):
    """A waiting task's view of its name's release channel (see ``waiting.ReleaseNotice``)."""

    def __init__(self, quorum: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(quorum)
        self._loop = loop
        self._signal = _Signal(loop)

    def hear(self, node: int, token: bytes) -> None:
        super().hear(node, token)
        self._signal.set()

    async def wait(self, timeout: float) -> None:
        """Until a quorum announced a release (or a grace period after a partial one), or
        ``timeout`` seconds; then forget what was heard, ready for the next round."""
        deadline = self._loop.time() + timeout
        await self._until(lambda: self.heard, deadline)
        if self.heard:
            await self._until(lambda: self.freed, min(deadline, self._loop.time() + NOTICE_GRACE))
        self.reset()
        self._signal.clear()

    async def _until(self, condition: Any, deadline: float) -> None:
        while not condition():
            remaining = deadline - self._loop.time()
            if remaining <= 0 or not await self._signal.wait(remaining):
                return
            self._signal.clear()


class _Notices:
    """Release notices on one loop: one subscriber connection per node serves every waiter."""

    def __init__(self, redlock: AsyncRedlock, loop: asyncio.AbstractEventLoop) -> None:
        self._redlock = redlock
        self._loop = loop
        self._wires: dict[int, _Wire] = {}  # node index -> subscriber connection
        self._waiters: dict[bytes, list[Listener]] = {}
        self._confirmed: dict[bytes, set[int]] = {}
        self._confirm = _Signal(loop)
        self._connecting = asyncio.Lock()
        self._retry: asyncio.TimerHandle | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False

    @contextlib.asynccontextmanager
    async def listening(self, channel: str) -> AsyncIterator[_ReleaseNotice]:
        """A signal set when ``channel`` sees a release; subscribed before this yields, on every
        node that could be reached within the node timeout."""
        name = channel.encode()
        signal = _ReleaseNotice(len(self._redlock.nodes) // 2 + 1, self._loop)
        waiters = self._waiters.setdefault(name, [])
        waiters.append(signal)
        try:
            timeout = self._redlock.node_timeout
            deadline = self._loop.time() + 2 * timeout  # connecting, then confirming
            if len(waiters) == 1:
                self._confirmed[name] = set()
                fresh = await self._connect_all(timeout)
                for index, wire in self._wires.items():
                    if index not in fresh:
                        self._send(wire, ["SUBSCRIBE", name])
            due = confirmations_due(self._wires, self._redlock.nodes)
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
        if len(self._wires) < len(self._redlock.nodes) and self._retry is None:
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
            del self._waiters[name]
            self._confirmed.pop(name, None)
            for wire in self._wires.values():
                self._send(wire, ["UNSUBSCRIBE", name])

    async def _connect_all(self, timeout: float) -> set[int]:
        """Open the missing subscriber connections (concurrently); returns the new ones, which
        are already subscribed to every channel with waiters."""
        async with self._connecting:
            missing = [i for i in range(len(self._redlock.nodes)) if i not in self._wires]
            if not missing:
                return set()
            opened = await asyncio.gather(
                *(_open_wire(self._redlock.nodes[i], self._loop, timeout) for i in missing),
                return_exceptions=True,
            )
            fresh: set[int] = set()
            for index, wire in zip(missing, opened, strict=True):
                if not isinstance(wire, _Wire):
                    continue  # that node's waiters fall back to the lease timer
                wire.push = lambda message, index=index: self._on_message(index, message)
                wire.on_lost = self._on_lost
                self._wires[index] = wire
                fresh.add(index)
                if self._waiters:
                    self._send(wire, ["SUBSCRIBE", *self._waiters])
            return fresh

    def _send(self, wire: _Wire, command: list[Any]) -> None:
        if wire.transport is not None and not wire.closed:
            wire.transport.write(encode(command))

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

    def _on_lost(self, wire: _Wire) -> None:
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
        await self._connect_all(self._redlock.node_timeout)
        if len(self._wires) < len(self._redlock.nodes):
            self._reconnect_later()

    def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for wire in self._wires.values():
            wire.on_lost = None
            wire.close()
        self._wires = {}


class _FanOut:
    """One command to every node; replies are collected by the connections' callbacks as they
    arrive, and the caller is woken once, when the last one is in or the deadline passed."""

    __slots__ = (
        "build",
        "commands",
        "deadline",
        "decided",
        "enough",
        "finished",
        "idempotent",
        "late",
        "left",
        "nodes",
        "owing",
        "owing_out",
        "replies",
        "sent",
        "state",
        "tasks",
        "timeout",
        "waiter",
        "wires",
    )

    def __init__(
        self,
        nodes: Sequence[Node],
        state: _LoopState,
        build: CommandBuilder,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, _Owing] | None = None,
        idempotent: bool = False,
    ) -> None:
        self.nodes = nodes
        self.state = state
        self.build = build
        self.late = late
        self.enough = enough
        self.idempotent = idempotent  #: as :func:`.nodes.fan_out`'s
        self.decided = False  #: ``enough`` ended the wait
        #: What the connections of nodes not heard in time owe, once they went back to the
        #: pool (also listed in ``left``, for the caller).
        self.owing: dict[int, Due] = {}
        self.owing_out = left
        self.sent = 0.0
        self.replies: list[Any] = [TIMED_OUT] * len(nodes)
        self.wires: list[_Wire | None] = [None] * len(nodes)  #: awaiting a reply on it
        self.commands: list[Sequence[Any] | bytes | Pipelined] = [()] * len(nodes)
        self.tasks: dict[int, asyncio.Task[_Wire]] = {}  #: connecting
        self.left = len(nodes)
        self.finished = False
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = 0.0
        self.timeout = 0.0

    async def run(self, timeout: float, behind: Mapping[int, _Owing] | None = None) -> list[Any]:
        """``behind``: as :func:`.nodes.fan_out`'s."""
        loop = self.state.loop
        self.timeout = timeout
        self.sent = loop.time()
        # Set before sending: a pooled connection found closed while sending gets one fresh
        # try within it (see _deliver).
        self.deadline = self.sent + timeout
        # Nodes with an open connection first: their commands are in flight while we still
        # connect to the others.
        connecting = []
        for index, node in enumerate(self.nodes):
            owing = behind.get(index) if behind else None
            wire = None if owing is None else self.state.reclaim(index, owing[0])
            if owing is not None and wire is None:
                owing[1].unwanted = True
            if wire is None:
                wire = self.state.checkout(index)
            if wire is None:
                connecting.append(index)
            else:
                self._send(index, wire, self.build(node, wire))
        for index in connecting:
            self._connect(index)
        self.deadline = max(self.deadline, loop.time() + (2 * timeout if connecting else timeout))
        try:
            while self.left and not self.decided:
                remaining = self.deadline - loop.time()
                if remaining <= 0:
                    break
                self.waiter = waiter = loop.create_future()
                timer = loop.call_later(remaining, _settle, waiter, None)
                try:
                    await waiter
                finally:
                    timer.cancel()
        finally:
            self.finished = True
            now = loop.time()
            for index, wire in enumerate(self.wires):
                if wire is None:
                    continue
                if self.decided and wire.usable() and not wire.overdue(now, timeout):
                    # Its reply still comes to _deliver, which reads it and moves on.
                    wire.undo_unwanted()
                    command = self.commands[index]
                    again = as_bytes(command) if self.idempotent else None
                    due = Due(command, self.late, self.sent, again)
                    due.left = True
                    wire.owed.append(due)
                    self.owing[index] = due
                    if self.owing_out is not None:
                        self.owing_out[index] = (wire, due)
                    self.state.checkin(index, wire)
                else:
                    wire.abandon(self.late)
            for index in self.tasks:
                self.replies[index] = _NOT_CONNECTED
        return self.replies

    def _send(self, index: int, wire: _Wire, command: Sequence[Any] | bytes | Pipelined) -> None:
        self.wires[index] = wire
        self.commands[index] = command
        for kept in self.nodes[index].take_later():  # see Node.later
            wire.send_unowned(kept)
        if isinstance(command, Pipelined) and command.count > 1:
            wire.send_many(command.data, command.count, functools.partial(self._deliver, index))
        else:
            wire.send(command, functools.partial(self._deliver, index))

    def _connect(self, index: int) -> None:
        # Not cancelled when a quorum decides first: the connection goes to the pool.
        task = self.state.spawn(_open_wire(self.nodes[index], self.state.loop, self.timeout))
        self.tasks[index] = task
        task.add_done_callback(functools.partial(self._connected, index))

    def _connected(self, index: int, task: asyncio.Task[_Wire]) -> None:
        if self.tasks.get(index) is task:
            del self.tasks[index]
        if task.cancelled():
            return
        error = task.exception()
        if error is None and self.finished:
            self.state.checkin(index, task.result())  # too late for us; the next one uses it
        elif self.finished:
            return
        elif error is None:
            wire = task.result()
            self._send(index, wire, self.build(self.nodes[index], wire))
        elif isinstance(error, WireError):
            self._final(index, error.failure)
        else:
            self._final(index, Failure("error", str(error) or type(error).__name__))

    def _deliver(self, index: int, reply: Any) -> None:
        if self.finished:
            if index in self.owing:
                self._owed_reply(index, reply)
            elif self.idempotent and isinstance(reply, OSError):
                # A connection given up was cut before the node ran the command.
                self.nodes[index].later.append(as_bytes(self.commands[index]))
            return
        wire = self.wires[index]
        assert wire is not None
        if isinstance(reply, OSError):
            self.wires[index] = None
            wire.abort()
            loop = self.state.loop
            if wire.reused and loop.time() < self.deadline:
                # Closed while pooled (node restart, idle timeout): one fresh try.
                self._connect(index)
                self.deadline = max(self.deadline, loop.time() + self.timeout)
            else:
                self._final(index, os_failure(reply))
            return
        if isinstance(reply, ReplyError) and reply.code == "NOSCRIPT":
            # The node restarted or flushed its script cache: send the body once, which also
            # caches it for the next EVALSHA.
            wire.send(as_eval(self.commands[index]), functools.partial(self._deliver, index))
            return
        self.wires[index] = None
        self.state.checkin(index, wire)
        if isinstance(reply, ReplyError):
            reply = reply_failure(reply)
        self._final(index, fold(self.commands[index], wire, reply))

    def _owed_reply(self, index: int, reply: Any) -> None:
        """The reply of a node this fan-out stopped waiting for: the connection owed it."""
        wire = self.wires[index]
        assert wire is not None
        if isinstance(reply, OSError):
            # Cut before it answered: nothing queued on it runs any more.
            cut = self.owing.pop(index, None)
            if cut is not None:
                wire.owed.remove(cut)
                wire.later.extend(unfinished([cut]))
            return
        due = self.owing.pop(index)
        wire.owed.remove(due)
        if _noscript(reply):
            return  # it did not run; run now, it could outlive what the fan-out decided
        if isinstance(reply, ReplyError):
            reply = reply_failure(reply)
        # Read for what it tells the connection (a changed restart-guard marker).
        fold(self.commands[index], wire, reply)
        if due.unwanted and due.late is not None:
            # Released meanwhile on another connection, which may have overtaken it.
            wire.send_unowned(due.take_undo())

    def _final(self, index: int, reply: Any) -> None:
        self.replies[index] = reply
        self.left -= 1
        if not self.left or (self.enough is not None and self.enough(self.replies)):
            self.decided = bool(self.left)
            if self.waiter is not None:
                _settle(self.waiter, None)


class _LoopState:
    """What an AsyncRedlock keeps per event loop: idle connections per node, the local queues,
    the release-notice subscriber, the renewal schedule and task."""

    def __init__(self, redlock: AsyncRedlock, loop: asyncio.AbstractEventLoop) -> None:
        self.redlock = redlock
        self.loop = loop
        self.pid = os.getpid()
        self.idle: list[list[_Wire]] = [[] for _ in redlock.nodes]
        self.queues: dict[str, _TaskQueue] = {}
        self.notices = _Notices(redlock, loop)
        self.due: list[tuple[float, int, Lease]] = []
        self.seq = itertools.count()
        self.renew_wake = _Signal(loop)
        self.renewer: asyncio.Task[None] | None = None
        self.background: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.keeper = loop.create_task(self._keep(), name="redlock-connections")

    async def _keep(self) -> None:
        # Cancelled when the loop shuts down (asyncio.run, asgiref's async_to_sync): that is
        # when this loop's connections must be closed, while the loop can still close them.
        try:
            await self.loop.create_future()
        finally:
            self.close(stop_renewals=True)
            self.redlock._forget(self)

    def checkout(self, index: int) -> _Wire | None:
        idle = self.idle[index]
        while idle:
            wire = idle.pop()
            if not wire.closed:
                return wire
        return None

    def reclaim(self, index: int, wire: _Wire) -> _Wire | None:
        """``wire`` taken out of the pool if it is idle there."""
        idle = self.idle[index]
        if wire.closed or wire not in idle:
            return None
        idle.remove(wire)
        return wire

    def checkin(self, index: int, wire: _Wire) -> None:
        wire.reused = True
        if self.closed:
            wire.close()
        else:
            self.idle[index].append(wire)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A background task kept alive until it ends."""
        task: asyncio.Task[Any] = self.loop.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def close(self, stop_renewals: bool = False) -> None:
        """Close this loop's connections (from the loop's thread). Renewals go on over new
        connections, as with the sync client, unless the loop itself is shutting down."""
        self.closed = True
        if stop_renewals and self.renewer is not None:
            self.renewer.cancel()
        self.notices.close()
        for idle in self.idle:
            while idle:
                wire = idle.pop()
                wire.undo_unwanted()
                wire.close()
        if not self.keeper.done() and self.keeper is not _current_task():
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

    async def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool:
        """Take the lock on a quorum of nodes (see :meth:`Lock.acquire`): ``blocking=False``
        makes one attempt; a blocking call waits up to ``timeout`` seconds (``None``: the
        Redlock's retry policy, ``inf``: for ever), woken by a release or the lease's end.
        Returns False when someone else holds it; raises :class:`QuorumError` when too few
        nodes could answer."""
        blocking, timeout = self._resolve(blocking, check_timeout(timeout))
        self._lease = await self.redlock._acquire(self, blocking=blocking, timeout=timeout)
        return self._lease is not None

    async def release(self) -> None:
        """Give the lock back. Raises :class:`LockNotOwned` if it was no longer ours and
        :class:`LockLost` if we knew it was lost. A cancelled caller still has the release
        finished in the background."""
        lease = self._take_lease()
        self._lease = None
        await self.redlock._release(lease)

    async def extend(self, ttl: float | None = None) -> bool:
        """Re-arm the lease for ``ttl`` seconds (default: the lock's ttl) on a quorum."""
        return await self.redlock._extend(self._take_lease(), self.ttl if ttl is None else ttl)

    async def check(self) -> bool:
        """Ask the nodes whether our token is still on a quorum (a round trip)."""
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

    lock_class = AsyncLock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._states: dict[int, _LoopState] = {}
        self._states_lock = threading.Lock()
        #: Leases with a renewal on the wire -> set when it is done (any loop may wait).
        self._renewing: dict[Lease, concurrent.futures.Future[None]] = {}

    # -- public API -----------------------------------------------------------------------------

    async def locked(self, name: str) -> bool:
        """Whether anyone holds ``name`` (a quorum of nodes has the key)."""
        return await self._drive(self._locked_steps(name))

    async def force_release(self, name: str, token: str | None = None) -> int:
        """Remove ``name`` on every node whoever holds it (only ``token``'s copies, when
        given); returns how many nodes had it."""
        return await self._drive(self._force_release_steps(name, token))

    async def release_token(self, name: str, token: str) -> int:
        """Release ``name`` where ``token`` still holds it; nodes it was removed from."""
        return await self._drive(self._release_token_steps(name, token))

    async def extend_token(self, name: str, token: str, ttl: float) -> bool:
        """Re-arm ``name`` for ``ttl`` seconds if ``token`` still holds it on a quorum."""
        return await self._drive(self._extend_token_steps(name, token, ttl))

    async def live_locks(self, pattern: str = "*") -> list[LockInfo]:
        """Every lock some node holds whose name matches the glob ``pattern``, sorted by name
        (a list rather than the sync client's iterator; read the same way)."""
        found = await self._drive(self._list_steps(pattern))
        return [self._lock_info(name, found[name]) for name in sorted(found)]

    async def lock_info(self, name: str) -> LockInfo | None:
        """Everything the nodes know about one lock, or None when no node holds it."""
        infos = await self.live_locks(glob_escape(check_name(name)))
        return next((i for i in infos if i.name == name), None)

    async def health(self) -> list[NodeHealth]:
        """Reachability, latency, version, uptime, memory, lock keys, clock offset and
        restart-guard state of every node (probed concurrently)."""
        probes = await asyncio.gather(*(self._probe(i) for i in range(len(self.nodes))))
        return self._judge_health(list(probes))

    async def trust_cluster(self) -> int:
        """:meth:`Redlock.trust_cluster <django_redlock.Redlock.trust_cluster>`, awaitable."""
        return await self._drive(self._trust_cluster_steps())

    async def close(self) -> None:
        """Close every connection this Redlock opened, on every loop (held locks stay held
        until their lease ends). The instance stays usable: it reconnects when used again."""
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
            elif not state.loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    state.loop.call_soon_threadsafe(state.close)
        for node in self.nodes:
            node.close()
        if loop is not None:
            await asyncio.sleep(0)  # let the transports finish closing

    aclose = close

    # -- per-loop state -------------------------------------------------------------------------

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(id(loop))
        if (
            state is not None
            and state.loop is loop
            and not state.closed
            and state.pid == os.getpid()
        ):
            return state
        with self._states_lock:
            pid = os.getpid()
            for key, old in list(self._states.items()):
                if old.pid != pid or old.loop.is_closed() or old.closed or old.loop is loop:
                    del self._states[key]
            state = self._states[id(loop)] = _LoopState(self, loop)
            return state

    def _forget(self, state: _LoopState) -> None:
        with self._states_lock:
            if self._states.get(id(state.loop)) is state:
                del self._states[id(state.loop)]

    def _after_fork(self) -> None:
        super()._after_fork()
        # The parent's loops and connections are not ours; keep nothing.
        self._states = {}
        self._states_lock = threading.Lock()
        self._renewing = {}

    # -- fan-out --------------------------------------------------------------------------------

    async def _fan_out(
        self,
        build: CommandBuilder,
        timeout: float | None = None,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, _Owing] | None = None,
        behind: Mapping[int, _Owing] | None = None,
        idempotent: bool = False,
    ) -> list[Any]:
        """Send one command to every node at once and collect the replies in node order
        (``enough``, ``left``, ``behind`` and ``idempotent``: see :func:`.nodes.fan_out`).

        A node that failed or did not answer in time yields a :class:`Failure`. Pooled
        connections answer within ``timeout``; a node that needs a new connection gets another
        ``timeout`` to connect. A connection whose reply did not come in time is aborted, after
        ``late()`` was sent on it (the undo: see :func:`.nodes.fan_out`).
        """
        state = self._state()
        return await _FanOut(self.nodes, state, build, late, enough, left, idempotent).run(
            self.node_timeout if timeout is None else timeout, behind
        )

    async def _call(
        self, index: int, commands: Sequence[Sequence[Any]], timeout: float = SLOW_TIMEOUT
    ) -> list[Any]:
        """Pipeline ``commands`` to one node and return the replies; raises on any failure.
        For the slow operations (listing, health), not the lock hot path."""
        wire = await self._wire(index, timeout)
        return await self._ask(index, wire, commands, timeout)

    async def _wire(self, index: int, timeout: float = SLOW_TIMEOUT) -> _Wire:
        state = self._state()
        wire = state.checkout(index)
        if wire is None:
            try:
                wire = await _open_wire(self.nodes[index], state.loop, timeout)
            except WireError as exc:
                error = asyncio.TimeoutError if exc.failure is _NOT_CONNECTED else ConnectionError
                raise error(str(exc.failure)) from None
        return wire

    async def _ask(
        self,
        index: int,
        wire: _Wire,
        commands: Sequence[Sequence[Any]],
        timeout: float = SLOW_TIMEOUT,
    ) -> list[Any]:
        waiters = wire.request_many(commands)
        try:
            _, not_done = await asyncio.wait(waiters, timeout=timeout)
        except BaseException:
            wire.abort()
            raise
        if not_done:
            wire.abort()
            raise TimeoutError(f"no answer within {timeout}s")
        replies = [w.result() for w in waiters]
        for reply in replies:
            if isinstance(reply, OSError):
                wire.abort()
                raise reply
        self._state().checkin(index, wire)
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise reply
        return replies

    # -- acquiring ------------------------------------------------------------------------------

    async def _acquire(
        self, handle: AsyncLock, *, blocking: bool, timeout: float | None
    ) -> Lease | None:
        owner = handle.owner if handle.owner is not None else current_owner()
        lease = self._reenter(handle, owner)
        if lease is not None:
            return lease
        start = time.monotonic()
        deadline = self._deadline(start, timeout)
        courtesy = self._courtesy(handle.name) if blocking else 0.0
        if courtesy:
            await asyncio.sleep(min(courtesy, (deadline or start + 1) - start))
        state = self._state()
        first: Refusal | None = None
        if blocking and not handle.fair and handle.name not in state.queues:
            alone = await self._drive(self._alone_steps(handle, owner, start))
            if isinstance(alone, Lease):
                if alone.auto_renew:
                    await state.notices.ready()
                return alone
            first = alone
        queue = self._join_queue(state, handle.name) if blocking else None
        if queue is not None:
            try:
                entered = await queue.enter(deadline)
            except BaseException:
                self._drop_queue(state, handle.name, queue)
                raise
            if not entered:
                self._drop_queue(state, handle.name, queue)
                self._give_up(
                    handle, first or Refusal({}, len(self.nodes), None), time.monotonic() - start
                )
                return None
        try:
            lease = await self._drive(
                self._contend_steps(handle, owner, blocking, deadline, timeout, start, first)
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
        return lease

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
                    await step.notice.wait(step.seconds)
                elif isinstance(step, Pause):
                    await asyncio.sleep(step.seconds)
                else:
                    cleanup = cleanup or contextlib.AsyncExitStack()
                    if isinstance(step, Listen):
                        listening = self._state().notices.listening(step.channel)
                        reply = await cleanup.enter_async_context(listening)
                    else:
                        cleanup.push_async_callback(self._fan_out, step.send.build)
        finally:
            if cleanup is not None:
                await cleanup.aclose()

    async def _send(self, step: Send) -> list[Any]:
        try:
            return await self._fan_out(
                step.build,
                step.timeout,
                step.late,
                step.enough,
                step.left,
                step.behind,
                step.idempotent,
            )
        except asyncio.CancelledError:
            # Some SETs may have landed: take them back without making the caller wait.
            state = self._state()
            if step.undo_if_cancelled and not state.closed:
                state.spawn(self._release_everywhere(*step.undo_if_cancelled))
            raise

    def _join_queue(self, state: _LoopState, name: str) -> _TaskQueue:
        queue = state.queues.get(name)
        if queue is None:
            queue = state.queues[name] = _TaskQueue(state.loop)
        queue.users += 1
        return queue

    def _leave_queue(
        self, state: _LoopState, name: str, queue: _TaskQueue, lease: Lease | None
    ) -> None:
        queue.leave(lease)
        self._drop_queue(state, name, queue)

    def _drop_queue(self, state: _LoopState, name: str, queue: _TaskQueue) -> None:
        queue.users -= 1
        if queue.users == 0 and state.queues.get(name) is queue:
            del state.queues[name]

    def _queue_leaver(
        self, state: _LoopState, name: str, queue: _TaskQueue, lease: Lease
    ) -> Callable[[], None]:
        """``lease.leave_queue``: frees the queue on the loop that owns it, wherever the
        release runs."""
        return functools.partial(_on_loop, state.loop, self._leave_queue, state, name, queue, lease)

    # -- holding --------------------------------------------------------------------------------

    async def _release_everywhere(
        self, name: str, token: str, behind: Mapping[int, _Owing] | None = None
    ) -> list[Any]:
        command = self._release_command(name, token)
        replies = await self._fan_out(
            lambda n, w: command, enough=self._released_by_quorum, behind=behind, idempotent=True
        )
        self._keep_unreached(command, replies)
        return replies

    async def _release(self, lease: Lease) -> None:
        if not self._begin_release(lease):
            return
        try:
            replies = await self._release_after_renewal(lease)
        except asyncio.CancelledError:
            # The caller was cancelled: the release still goes out (it is idempotent).
            self._state().spawn(self._release_after_renewal(lease))
            raise
        finally:
            if lease.leave_queue is not None:
                lease.leave_queue()
        self._finish_release(lease, replies)

    async def _release_after_renewal(self, lease: Lease) -> list[Any]:
        renewing = self._renewing.get(lease)
        if renewing is not None:
            # A renewal is on the wire: let it land first, so no PEXPIRE follows the release.
            await asyncio.wrap_future(renewing)
        behind, lease.behind = lease.behind, None
        return await self._release_everywhere(lease.name, lease.token, behind)

    async def _extend(self, lease: Lease, ttl: float) -> bool:
        return await self._drive(self._extend_steps(lease, ttl))

    async def _check(self, lease: Lease) -> bool:
        return await self._drive(self._check_steps(lease))

    # -- renewal --------------------------------------------------------------------------------

    def _start_renewal(self, lease: Lease) -> None:
        state = self._state()
        self._renew_later(state, lease)
        # A long holder hears an operator's force release at once (not at its next renewal).
        name = self._channel(lease.name).encode()
        watch = HolderWatch(lease, self._mark_lost, self.quorum)
        state.notices.watch(name, watch)
        lease.unwatch = functools.partial(_on_loop, state.loop, state.notices.unwatch, name, watch)

    def _renew_later(self, state: _LoopState, lease: Lease) -> None:
        heapq.heappush(state.due, (time.monotonic() + lease.ttl / 3, next(state.seq), lease))
        if state.renewer is None:
            state.renewer = state.loop.create_task(self._renewals(state), name="redlock-renewer")
        else:
            state.renew_wake.set()

    async def _renewals(self, state: _LoopState) -> None:
        """The loop's watchdog: one task re-arms every auto-renewed lease of this loop, the
        leases due in a round together (one pipelined fan-out); it ends when none is left (the
        next one starts it again)."""
        try:
            while state.due:
                delay = state.due[0][0] - time.monotonic()
                if delay > 0:
                    await state.renew_wake.wait(delay)
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
                    self._renewal_failed(leases)
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
        try:
            return list(
                await asyncio.gather(
                    *(self._pipeline(index, step.commands) for index in range(len(self.nodes)))
                )
            )
        finally:
            for lease in step.leases:
                del self._renewing[lease]
            done.set_result(None)

    async def _pipeline(self, index: int, commands: list[list[Any]]) -> list[Any] | Failure:
        """``commands`` pipelined to one node within the node timeout (another to connect):
        the replies in order, or the node's :class:`Failure`."""
        timeout = self.node_timeout
        try:
            wire = await self._wire(index, timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            return Failure("timeout") if isinstance(exc, asyncio.TimeoutError) else os_failure(exc)
        replies = await self._pipelined(index, wire, commands, timeout)
        if isinstance(replies, Failure):
            return replies
        again = [i for i, r in enumerate(replies) if _noscript(r)]
        if again:  # the node lost its script cache: the bodies once, in one more round trip
            retried = await self._pipelined(
                index, wire, [eval_form(commands[i]) for i in again], timeout
            )
            if isinstance(retried, Failure):
                return retried
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        self._state().checkin(index, wire)
        return [reply_failure(r) if isinstance(r, ReplyError) else r for r in replies]

    async def _pipelined(
        self, index: int, wire: _Wire, commands: list[list[Any]], timeout: float
    ) -> list[Any] | Failure:
        waiters = wire.request_many(commands)
        _, late = await asyncio.wait(waiters, timeout=timeout)
        if late:
            wire.abort()
            return Failure("timeout")
        replies = [w.result() for w in waiters]
        broken = next((r for r in replies if isinstance(r, OSError)), None)
        if broken is not None:
            wire.abort()
            return os_failure(broken)
        return replies

    # -- listing and health ---------------------------------------------------------------------

    async def _count_keys(self, index: int, match: str) -> int:
        count = 0
        cursor: Any = b"0"
        while True:
            [(cursor, keys)] = await self._call(
                index, [["SCAN", cursor, "MATCH", match, "COUNT", 1000]]
            )
            count += len(keys)
            if cursor in (b"0", 0):
                return count

    async def _probe(self, index: int) -> NodeHealth:
        node = self.nodes[index]
        try:
            wire = await self._wire(index)
            sent = time.time()
            t0 = time.perf_counter()
            await self._ask(index, wire, [["PING"]])
            latency = time.perf_counter() - t0
            [server_time] = await self._call(index, [["TIME"]])
            received = time.time()
            info, marker = await self._call(
                index, [["INFO"], ["HMGET", self._node_key(), *self.MARKER_FIELDS]]
            )
            probe: Mapping[str, Any] = {
                "latency": latency,
                "sent": sent,
                "time": server_time,
                "received": received,
                "info": _parse_info(info),
                "marker": marker,
                "keys": await self._count_keys(index, f"{self.key_prefix}:lock:*"),
            }
        except Exception as exc:
            return NodeHealth(node=node.name, reachable=False, error=str(exc) or type(exc).__name__)
        return self._node_health(node, probe)
