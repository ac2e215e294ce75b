"""Connections to the nodes for the asyncio client (the twin of :mod:`.nodes`).

Each node gets connections opened by ``redis.asyncio`` (TLS, AUTH, SELECT as redis-py does
them, then INFO for the run id), whose transport is then driven by an :class:`asyncio.Protocol`
that hands hiredis's parsed replies to the fan-out's callbacks (no read task per connection). A
fan-out writes the command to every node, then waits for the replies at once with one
deadline (``node_timeout``), or until a quorum granted an acquire or removed a released key;
a connection whose reply did not come in time takes no command until it answered (the undo of
what it carried goes behind it), then is pooled again, and a node late to answer gets copies
of the command on other connections (:mod:`.hedging`), as with the sync client. Connections
are pooled per node *and per event loop* (asyncio
transports belong to the loop that opened them; Django's ``async_to_sync`` runs each call in a
fresh loop): :class:`LoopPool`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import socket
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from .detector import connect_budget, overrun
from .fanout import Wait, linger_for, node_linger, suspect_linger
from .hedging import copies_allowed, first_word, granted, hedge_at
from .nodes import (
    DRAIN_FOR,
    HANDSHAKE,
    NOT_CONNECTED,
    NOTHING_LEFT,
    SPARES,
    TIMED_OUT,
    Due,
    Failure,
    Link,
    Node,
    Pipelined,
    ProtocolError,
    ReplyError,
    WireError,
    address_of,
    as_bytes,
    as_eval,
    connect_failure,
    fold,
    leave,
    list_left,
    on_replica,
    os_failure,
    pack_many,
    reader,
    reply_failure,
    settled,
    shake_hands,
    undos,
    unfinished,
    unwanted_undos,
)
from .sentinel import SentinelGroup, SentinelUnavailable, Where

__all__ = [
    "NOT_CONNECTED",
    "PARK_AT_MOST",
    "SLOW_TIMEOUT",
    "AsyncFanOut",
    "AsyncOwing",
    "AsyncWire",
    "CommandBuilder",
    "LoopPool",
    "Parked",
    "noscript",
    "open_wire",
    "park",
    "relocate",
    "strand_loop",
]

#: Per-command timeout of the slow operations (listing, health), like the sync client's
#: redis-py socket timeout.
SLOW_TIMEOUT = 2.0

#: Builds one node's command from the connection it will go out on (it may need the run id).
CommandBuilder = Callable[[Node, "AsyncWire"], Sequence[Any] | bytes | Pipelined]


class AsyncWire(Link, asyncio.Protocol):
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
        #: hiredis's parser: replies are handed on as soon as they are whole.
        self.reader = reader()
        self.closed = False
        self.waiters: deque[Callable[[Any], None]] = deque()
        #: Commands of fan-outs that stopped waiting (a quorum was reached) still to be
        #: answered, oldest first (sent on the loop's clock). As :attr:`.nodes.Wire.due`.
        self.owed: deque[Due] = deque()
        self.push: Callable[[Any], None] | None = None
        self.on_lost: Callable[[AsyncWire], None] | None = None
        #: The stream writer redis-py opened the connection with (see :func:`open_wire`).
        self.stream: asyncio.StreamWriter | None = None
        #: Commands written in this loop tick after its first write, sent together by
        #: :meth:`flush` at the start of the next one (None: no flush is due).
        self.pending: list[bytes] | None = None
        #: Set aside owing late replies: called once they are all in (see :meth:`set_aside`).
        self.drained: Callable[[AsyncWire], None] | None = None
        self.drain_timer: asyncio.TimerHandle | None = None
        _alive.add(self)

    # protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self.reader
        parser.feed(data)
        try:
            while (value := parser.gets()) is not False:
                if self.push is not None:
                    self.push(value)
                elif self.waiters:
                    self.waiters.popleft()(value)
                    if self.closed and not self.waiters:
                        self._answered_all()
                else:
                    raise ProtocolError("a reply nobody asked for")
        except ProtocolError as exc:
            # Out of step with the node: this connection can never be trusted again.
            self.abort(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        error = (
            exc
            if isinstance(exc, OSError)
            else ConnectionResetError("connection closed by the node")
        )
        self._fail(error)
        if self.on_lost is not None:
            self.on_lost(self)

    def _answered_all(self) -> None:
        """Every reply it owed is in: a connection set aside is back in use, one given up
        is closed."""
        drained, self.drained = self.drained, None
        if drained is None:
            self.close()
            return
        if self.drain_timer is not None:
            self.drain_timer.cancel()
            self.drain_timer = None
        self.closed = False
        drained(self)

    def _fail(self, error: OSError) -> None:
        self.closed = True
        self.drained = None
        waiters, self.waiters = self.waiters, deque()
        for waiter in waiters:
            waiter(error)

    # use

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def _write(self, data: bytes) -> None:
        """Write ``data`` behind everything written before it. Every send is a syscall and,
        on loopback, a wake-up of the node: the first write of a loop tick goes out at once
        (a lone caller waits no extra turn), the others of that tick (the tasks a batch of
        replies woke, each sending its next command) go out together in one write when the
        loop turns (:meth:`flush`)."""
        pending = self.pending
        if pending is not None:
            pending.append(data)
            return
        self.pending = []
        self.loop.call_soon(self.flush)
        self.transport.write(data)  # type: ignore[union-attr]

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(pending))
        # A transport closed meanwhile fails the waiters of what it never sent (_fail).

    def send(
        self, command: Sequence[Any] | bytes | Pipelined, callback: Callable[[Any], None]
    ) -> None:
        """Send one command; ``callback`` gets its reply (a list of them for a
        :class:`Pipelined` command of several), or the ``OSError``."""
        if isinstance(command, Pipelined) and command.count > 1:
            self.send_many(command.data, command.count, callback)
            return
        if self.transport is None or self.transport.is_closing():
            callback(ConnectionResetError("connection closed"))
            return
        self.waiters.append(callback)
        self._write(as_bytes(command))

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
        self._write(data)

    def request(self, commands: Sequence[Sequence[Any]]) -> asyncio.Future[list[Any] | OSError]:
        """Pipeline commands in one write; the future resolves to the list of their replies,
        or the ``OSError``."""
        future: asyncio.Future[list[Any] | OSError] = self.loop.create_future()
        self.send_many(pack_many(commands), len(commands), functools.partial(settle, future))
        return future

    def send_unowned(self, command: bytes) -> None:
        """Send a release or an undo no operation waits for; cut before it answered, it goes
        out with the next operation that reaches the node (as :attr:`.nodes.Due.again`)."""
        self.send(command, functools.partial(_again_if_cut, self, command))

    def undo_unwanted(self) -> None:
        """As :meth:`.nodes.Wire.undo_unwanted`."""
        for undo in unwanted_undos(self.owed):
            self.send_unowned(undo)

    def overdue(self, now: float, timeout: float) -> bool:
        """Whether a command it still owes has waited longer than ``timeout``."""
        return bool(self.owed) and self.owed[0].sent + timeout <= now

    def abandon(
        self,
        late: Callable[[], bytes] | None,
        drained: Callable[[AsyncWire], None] | None = None,
    ) -> None:
        """Stop waiting on the connection after sending the undo of every command it still
        owes (``late`` builds the current one's) behind them; it takes no command until the
        node answered everything, then ``drained`` gets it back (a late reply is not a dead
        connection: see :meth:`.nodes.Node.abandon`), or it is closed without ``drained``
        (or after :data:`.nodes.DRAIN_FOR` seconds), not at once.

        A connection shared by several fan-outs (:attr:`LoopPool.shared`) that another one
        already gave up is still read until it answered what it carries: this one's undo
        goes behind its own command there, and the connection is left to drain."""
        transport = self.transport
        if transport is None or transport.is_closing():
            self.abort()
            return
        if self.closed:
            if late is not None:
                self.send_unowned(late())
            self.flush()
            return
        for undo in [*undos(self.owed), *([] if late is None else [late()])]:
            self.send_unowned(undo)
        if drained is None:
            self.retire()
        else:
            self.set_aside(drained)

    def set_aside(self, drained: Callable[[AsyncWire], None]) -> None:
        """Take no more commands until every reply it owes is in, then hand it to ``drained``
        (back to the pool); closed if that takes :data:`.nodes.DRAIN_FOR` seconds."""
        if self.closed:
            return
        self.flush()
        if not self.waiters:
            drained(self)
            return
        self.closed = True  # not usable meanwhile, but read
        self.drained = drained
        self.drain_timer = self.loop.call_later(DRAIN_FOR, self.abort)

    def retire(self) -> None:
        """Take no more commands, but read what it carries (other fan-outs' replies, on a
        shared connection), then close: once everything is answered, or after
        :data:`.nodes.DRAIN_FOR` seconds. What was written goes out now, not when the loop
        turns: it may not turn again (it ends, or a blocking call holds it) while the node
        could run what it was sent."""
        if self.closed:
            return
        self.flush()
        self.closed = True  # not usable any more, but still read
        if self.waiters:
            self.loop.call_later(DRAIN_FOR, self.abort)
        else:
            self.close()

    def abort(self, error: OSError | None = None) -> None:
        """Drop the connection at once: a reply we stopped waiting for must never be read as
        the answer to a later command."""
        self.pending = None
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):  # its loop is already closed
                self.transport.abort()
        self._fail(error or ConnectionAbortedError("connection aborted"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.flush()  # what was written goes out before the close
            with contextlib.suppress(RuntimeError):
                self.transport.close()

    def strand(self) -> None:
        """Close the connection without its loop, which will not run again (closed without
        its tasks cancelled, or left open at exit): a transport's ``close()`` only asks that
        loop to close the socket later, and the socket left open is reported as unclosed
        when collected. asyncio has no public way to do it at once; a transport without the
        selector transports' own step is left as it is."""
        self.closed = True
        self.pending = None
        self.waiters.clear()
        self.owed.clear()
        self.push = self.on_lost = self.drained = None
        transport, self.transport = self.transport, None
        if transport is not None:
            _close_stranded(transport)


def _close_stranded(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` now, without its loop (see :meth:`AsyncWire.strand`)."""
    transport.set_protocol(asyncio.Protocol())  # nothing of ours hears of it any more
    with contextlib.suppress(RuntimeError):  # closing; on a closed loop, no more
        transport.close()
    lost = getattr(transport, "_call_connection_lost", None)
    if callable(lost) and getattr(transport, "_sock", None) is not None:
        with contextlib.suppress(Exception):
            lost(None)


#: Every AsyncWire alive (see :func:`strand_loop`).
_alive: weakref.WeakSet[AsyncWire] = weakref.WeakSet()
#: The nodes that parked a connection (see :func:`park`), closed at exit.
_parking: weakref.WeakSet[Node] = weakref.WeakSet()


#: The source files of the core: a pending task running one of their coroutines is ours.
_CORE = os.path.dirname(os.path.abspath(__file__))


def strand_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close every connection of ``loop``, which will not run again (:meth:`AsyncWire.strand`),
    and end the tasks still pending there that run the core's coroutines (a connection being
    opened, a renewal, a cleanup): closed now, their cleanup runs here, quietly, rather than
    when the collector closes them ("Task was destroyed but it is pending", and the
    tracebacks of a cleanup that finds no running loop)."""
    for task in list(asyncio.all_tasks(loop)):
        coro = task.get_coro()
        code = getattr(coro, "cr_code", None)
        if code is None or os.path.dirname(code.co_filename) != _CORE:
            continue  # the application's own task: asyncio reports it, as it should
        # asyncio's own switch for a task its loop may drop on purpose.
        task._log_destroy_pending = False  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            coro.close()
    for wire in list(_alive):
        if wire.loop is loop:
            wire.strand()


@atexit.register
def _close_parked() -> None:
    # An idle connection parked for a next loop that never came: closed, not left to the
    # collector (which reports it as an unclosed socket).
    for node in list(_parking):
        while node.parked:
            with contextlib.suppress(IndexError, OSError):
                node.parked.popleft().sock.close()


#: A connection that still owes a reply, and that reply (as :data:`.nodes.Owing`).
AsyncOwing = tuple[AsyncWire, Due]


def _again_if_cut(wire: AsyncWire, command: bytes, reply: Any) -> None:
    """The reply to a release or undo no operation waits for: cut before it answered, it
    goes out with the next operation that reaches the node; ``NOSCRIPT`` (the node lost its
    script cache), it goes again with its body on the same connection, behind what it
    carries (it runs the same however late)."""
    if isinstance(reply, OSError):
        wire.later.append(command)
    elif noscript(reply):
        wire.send_unowned(as_eval(command))


def noscript(reply: Any) -> bool:
    return isinstance(reply, ReplyError) and reply.code == "NOSCRIPT"


def settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


async def open_wire(
    node: Node, loop: asyncio.AbstractEventLoop, timeout: float, spare: bool = False
) -> AsyncWire:
    """:meth:`.nodes.Node.connect` through ``redis.asyncio``, or a parked connection adopted
    (:func:`park`); cancelling aborts the connection. A ``spare`` (opened in the background,
    no operation waits for it) is tried while a miss is being probed too, and is no miss
    when late (:meth:`.nodes.Node.connect_failed`)."""
    failure = node.unreachable()
    if failure is not None:
        raise WireError(failure)
    if node.group is not None:
        # Where its master is now; a parked connection to a former one is not adopted.
        node.locate(await asyncio.wait_for(_resolve(node.group), timeout))
    adopted = await _adopt(node, loop)
    if adopted is not None:
        return adopted
    # A node that missed an answer lately is connected to only where its late reply is held
    # up (near: see Node.near), as the sync client opens one; a far one's is on its way.
    failure = node.unreachable() if spare or node.near() else node.not_now()
    if failure is not None:
        raise WireError(failure)
    started = loop.time()
    try:
        wire = await asyncio.wait_for(_connect_and_shake_hands(node, loop, timeout), timeout)
    except asyncio.TimeoutError:
        node.connect_failed(NOT_CONNECTED, timeout, loop.time() - started, miss=not spare)
        raise WireError(NOT_CONNECTED) from None
    except WireError as exc:
        node.connect_failed(exc.failure, timeout, loop.time() - started, miss=not spare)
        raise
    node.connected()
    return wire


#: Most connections parked per node (beyond it, a loop's idle connections are closed).
PARK_AT_MOST = 32


class Parked(Link):
    """An idle connection of an event loop that ended (see :func:`park`): its socket, the
    process that parked it, and what it knew of its server."""

    def __init__(self, sock: socket.socket, wire: AsyncWire) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.learn(wire)


def park(node: Node, wire: AsyncWire) -> bool:
    """Keep the socket of ``wire``, an idle connection of a loop that is ending, for the next
    loop of this process to adopt (:func:`_adopt`): an async view run by a WSGI server gets a
    fresh event loop per request, and connecting anew inside each request's node timeout is
    what made a busy host answer 503. Only a connection that owes nothing and is not TLS
    (a TLS session cannot move to another transport); whether it was kept (the caller closes
    the transport either way: the socket kept is a duplicate, so the connection stays open)."""
    transport = wire.transport
    if (
        transport is None
        or not wire.usable()
        or wire.owed
        or wire.waiters
        or wire.push is not None
        or transport.get_extra_info("sslcontext") is not None
        or len(node.parked) >= PARK_AT_MOST
    ):
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        kept = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return False
    node.parked.append(Parked(kept, wire))
    _parking.add(node)
    return True


async def _adopt(node: Node, loop: asyncio.AbstractEventLoop) -> AsyncWire | None:
    """A connection parked by a loop that ended (:func:`park`), on ``loop``; None when there
    is none. It counts as reused: if the node closed it meanwhile, the fan-out's one fresh try
    for a stale pooled connection applies."""
    while node.parked:
        try:
            parked = node.parked.popleft()
        except IndexError:  # another thread took it
            return None
        if parked.pid != os.getpid() or not node.current(parked):
            # The parent's conversation with the node (not ours to use: closing this
            # process's copy of the descriptor leaves the parent's connection open), or one
            # to a group's former master.
            parked.sock.close()
            continue
        try:
            parked.sock.setblocking(False)
            unix = parked.sock.family == socket.AF_UNIX
            adopt = loop.create_unix_connection if unix else loop.create_connection
            _, wire = await adopt(lambda: AsyncWire(loop, node.later), sock=parked.sock)
        except OSError:
            parked.sock.close()
            continue
        wire.learn(parked)
        wire.reused = True
        return wire
    return None


async def relocate(node: Node, pool: LoopPool, index: int) -> None:
    """A group node: ask the Sentinels where its master is now (health shows it); idle
    connections to a former master are closed."""
    if node.group is None:
        return
    try:
        node.locate(await _resolve(node.group))
    except WireError:
        return  # no master known: connecting reports it
    for wire in pool.wires(index):
        if not node.current(wire):
            wire.retire()


async def _resolve(group: SentinelGroup) -> Where:
    try:
        return await group.afind()
    except SentinelUnavailable as exc:
        raise WireError(Failure("error", str(exc))) from None


async def _connect_and_shake_hands(
    node: Node, loop: asyncio.AbstractEventLoop, timeout: float
) -> AsyncWire:
    where = node.where
    conn = node.connection(timeout, asyncio=True, where=where)
    try:
        await conn.connect()
        asked = time.monotonic()
        await conn.send_packed_command([HANDSHAKE])
        info = await conn.read_response()
        node.detector.round_trip(time.monotonic() - asked)  # as the sync Wire's
        try:
            replication = await conn.read_response()
        except redis.ResponseError:  # INFO's replication section withheld: not judged
            replication = None
        with contextlib.suppress(redis.ResponseError):  # a user not allowed SCRIPT LOAD
            await conn.read_response()
        run_id, started, replid = shake_hands(node, info, replication)
        # The connected transport is handed to an AsyncWire: replies are parsed as they
        # arrive and handed to the fan-out's callbacks, with no read task per connection.
        writer = conn._writer
        assert writer is not None
        transport = writer.transport
        conn._reader = conn._writer = None
        wire = AsyncWire(loop, node.later)
        wire.address = address_of(conn)
        # Kept with the wire: a stream writer closes its transport when it is collected.
        wire.stream = writer
        transport.set_protocol(wire)
        wire.connection_made(transport)
    except BaseException as exc:
        _abort(conn)
        if isinstance(exc, (redis.RedisError, OSError)):
            raise WireError(connect_failure(exc)) from None
        raise
    wire.run_id, wire.started, wire.replid = run_id, started, replid
    wire.epoch = None if where is None else where[1]
    return wire


def _abort(conn: Any) -> None:
    """Close a redis.asyncio connection that failed to open, without awaiting (and without
    its loop when that no longer runs: :func:`strand_loop` ended the opening)."""
    writer = getattr(conn, "_writer", None)
    if writer is not None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            _close_stranded(writer.transport)
        else:
            writer.transport.abort()
    conn._reader = conn._writer = None


class LoopPool:
    """One event loop's connections per node, and the background tasks that use them (kept
    referenced: the loop holds tasks only weakly).

    The fan-outs of a loop share one connection per node (:attr:`shared`), pipelined: the
    commands its tasks send in one loop tick leave in one write per node and the node's
    replies come back in one read, each handed to its fan-out in order. A connection per task
    would cost a send and a receive per command per node, and on loopback those syscalls are
    most of a lock's cost (three nodes pay three times what one Redis pays). Sharing keeps
    what the transport promises: a fan-out's undo goes behind its own command on the same
    connection; a fan-out that stops waiting (quorum, deadline, cancellation) leaves the
    others' replies to be read, since each command has its own callback in the connection's
    queue; a connection given up is only closed once it answered what it carries.
    :meth:`checkout` hands out the other, idle connections for exclusive use (renewal
    batches, listing, health)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, nodes: int) -> None:
        self.loop = loop
        self.idle: list[list[AsyncWire]] = [[] for _ in range(nodes)]
        #: The connection per node the fan-outs pipeline on, or None (see the class).
        self.shared: list[AsyncWire | None] = [None] * nodes
        #: A connection being opened to become a node's shared one, its budget and when it
        #: began (on the loop's clock): the fan-outs that find none wait for the same one.
        self.connecting: list[tuple[asyncio.Task[AsyncWire], float, float] | None] = [None] * nodes
        self.background: set[asyncio.Task[Any]] = set()
        #: Spare connections being opened per node (see :meth:`want_spare`).
        self.spares = [0] * nodes
        #: Connections set aside until they answered (see :meth:`set_aside`).
        self.aside: set[AsyncWire] = set()
        self.closed = False

    def share(self, index: int, node: Node) -> AsyncWire | None:
        """The node's shared connection (an idle one becomes it when there is none), or None
        when there is no usable one to the node's current server."""
        wire = self.shared[index]
        if wire is not None and wire.usable() and node.current(wire):
            if not wire.owed:
                return wire
            owed = wire.owed[0].sent
            budget = node.detector.budget()
            if owed + budget / 4 > self.loop.time():
                return wire
            # It owes a reply held up on the link (a lost packet waits for TCP's
            # retransmission): a command behind it would wait too. It is read as the reply
            # comes and pooled again (as the sync client's checkout sets such one aside);
            # past the node timeout, what it carries is undone behind it.
            now = time.monotonic()
            node.mark_late(now)
            since = now - (self.loop.time() - owed)
            given_up = wire.overdue(self.loop.time(), budget)
            late = wire.owed[0]
            self.set_aside(node, index, wire, since, abandon=given_up)
            self.want_spare(node, index)
            self._miss_unless_answered(node, wire, late, since, owed + budget)
        if wire is not None and wire.usable():
            wire.retire()  # to a group's former master
        self.shared[index] = None
        wire = self.checkout(index)
        while wire is not None and not node.current(wire):
            wire.close()
            wire = self.checkout(index)
        self.shared[index] = wire
        return wire

    def _miss_unless_answered(
        self, node: Node, wire: AsyncWire, late: Due, since: float, at: float
    ) -> None:
        """A connection set aside while it owes ``late`` (sent at ``since`` on the monotonic
        clock): no fan-out waits on it any more, so its silence past the node's budget (at
        ``at``, on the loop's clock) is told here, as the sync fan-out tells the silence of
        a connection it used, whichever decided the operation: else a frozen node's first
        miss would come only from its new connection's handshake, after the connect budget,
        and each release meanwhile would wait for it. Checked once the loop has read what
        arrived (a timer runs after the reads of its turn): a reply unread because the loop
        did not run is no silence. A check the loop ran late for is an excused miss, and
        the silence is checked again a budget later: on a busy host, where timers run late,
        a frozen node is still found out."""
        asked = max(at - self.loop.time(), 0.0)
        set_at = self.loop.time()

        def check() -> None:
            if late not in wire.owed:
                return  # answered (or the connection was cut)
            excused = overrun(asked, self.loop.time() - set_at) > 0
            node.went_silent(excused, since)
            if excused and not self.closed:
                self._miss_unless_answered(
                    node, wire, late, since, self.loop.time() + node.detector.budget()
                )

        self.loop.call_at(at, check)

    def connect_shared(self, node: Node, index: int, budget: float) -> asyncio.Task[AsyncWire]:
        """A task opening a connection to the node within ``budget`` seconds, which becomes
        its shared one; one at a time per node and budget."""
        pending = self.connecting[index]
        if pending is not None and pending[1] == budget and not pending[0].done():
            return pending[0]
        task = self.spawn(open_wire(node, self.loop, budget))
        self.connecting[index] = (task, budget, self.loop.time())
        task.add_done_callback(functools.partial(self._opened, index))
        return task

    def connecting_since(self, index: int, task: asyncio.Task[AsyncWire]) -> float | None:
        """When ``task`` (of :meth:`connect_shared`) began to open node ``index``'s
        connection, on the loop's clock; None when it is not the one being opened."""
        pending = self.connecting[index]
        return pending[2] if pending is not None and pending[0] is task else None

    def _opened(self, index: int, task: asyncio.Task[AsyncWire]) -> None:
        pending = self.connecting[index]
        if pending is not None and pending[0] is task:
            self.connecting[index] = None
        if task.cancelled() or task.exception() is not None:
            return
        wire = task.result()
        shared = self.shared[index]
        if self.closed:
            wire.close()
        elif shared is None or not shared.usable():
            self.shared[index] = wire
        elif wire is not shared:
            self.idle[index].append(wire)

    def spare(self, index: int, node: Node) -> AsyncWire | None:
        """An idle connection to the node's server that owes nothing, for a copy of a command
        late on another one (a hedged request); None when there is none (one is then opened
        in the background: it never connects for the copy, which would come too late)."""
        for wire in self.idle[index]:
            if wire.usable() and not wire.owed and not wire.waiters and node.current(wire):
                self.idle[index].remove(wire)
                return wire
        self.want_spare(node, index)
        return None

    def want_spare(self, node: Node, index: int) -> None:
        """Open one more connection to the node for the pool, in the background (at most
        :data:`.nodes.SPARES` at a time): replies are late on its link, and the connections
        that wait for theirs take no command meanwhile."""
        if self.spares[index] >= SPARES or self.closed:
            return
        self.spares[index] += 1
        task = self.spawn(open_wire(node, self.loop, connect_budget(node.node_timeout), True))
        task.add_done_callback(functools.partial(self._spare_opened, index))

    def _spare_opened(self, index: int, task: asyncio.Task[AsyncWire]) -> None:
        self.spares[index] -= 1
        if not task.cancelled() and task.exception() is None:
            self.checkin(index, task.result())

    def set_aside(
        self,
        node: Node,
        index: int,
        wire: AsyncWire,
        sent: float,
        late: Callable[[], bytes] | None = None,
        abandon: bool = False,
    ) -> None:
        """Take ``wire`` out of use while it owes replies of commands sent at ``sent`` (on
        the monotonic clock; ``abandon``: after the undo of each, ``late`` building the
        current one's: :meth:`AsyncWire.abandon`); once they are in, the node answered (see
        :meth:`.nodes.NodeDetector.answered`) and the connection is pooled again. A late
        reply is not a dead connection."""

        def back(wire: AsyncWire) -> None:
            self.aside.discard(wire)
            node.detector.answered(time.monotonic(), sent)
            if node.current(wire):
                self.checkin(index, wire)
            else:
                wire.close()

        self.aside.add(wire)
        if abandon:
            wire.abandon(late, back)
        else:
            wire.set_aside(back)
        if wire.drained is None:
            self.aside.discard(wire)  # answered everything already, or given up

    def checkout(self, index: int) -> AsyncWire | None:
        idle = self.idle[index]
        while idle:
            wire = idle.pop()
            if not wire.closed:
                return wire
        return None

    def reclaim(self, index: int, wire: AsyncWire) -> AsyncWire | None:
        """``wire`` taken out of the pool if it is idle there, or the node's shared
        connection if it is that one and still usable."""
        if wire is self.shared[index]:
            return wire if wire.usable() else None
        idle = self.idle[index]
        if wire.closed or wire not in idle:
            return None
        idle.remove(wire)
        return wire

    def checkin(self, index: int, wire: AsyncWire) -> None:
        wire.reused = True
        if self.closed:
            wire.retire()  # the shared one may still carry other fan-outs' commands
            return
        if wire is self.shared[index] or wire.closed:
            return
        shared = self.shared[index]
        if shared is None or not shared.usable():
            self.shared[index] = wire
        else:
            self.idle[index].append(wire)

    def wires(self, index: int) -> list[AsyncWire]:
        """The node's pooled connections: idle ones and the shared one."""
        shared = self.shared[index]
        return [*self.idle[index], *([shared] if shared is not None else [])]

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A background task kept alive until it ends."""
        task: asyncio.Task[Any] = self.loop.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def close(self) -> None:
        """Close the idle connections (from the loop's thread), after the undos they owe;
        connections checked in later are closed at once."""
        self.close_parking(None)

    def close_parking(self, park_on: Sequence[Node] | None) -> None:
        """:meth:`close`; ``park_on``: the loop is ending, and its connections that owe
        nothing are parked on these nodes for the next loop (:func:`park`)."""
        self.closed = True
        for wire in list(self.aside):
            # Read until they answered, as before; what was given up meanwhile is undone.
            wire.undo_unwanted()
            wire.flush()
        for index, idle in enumerate(self.idle):
            shared, self.shared[index] = self.shared[index], None
            if shared is not None and park_on is None and shared.waiters:
                # Closed while other tasks' operations are on it (the loop goes on): they
                # get their replies; it closes once they are in.
                shared.undo_unwanted()
                shared.retire()
            elif shared is not None:
                idle.append(shared)
            while idle:
                wire = idle.pop()
                wire.undo_unwanted()
                if park_on is not None:
                    park(park_on[index], wire)
                wire.close()


class AsyncFanOut:
    """One command to every node; replies are collected by the connections' callbacks as they
    arrive, and the caller is woken once, when the last one is in or the deadline passed."""

    __slots__ = (
        "answered",
        "build",
        "commands",
        "connect_until",
        "copies",
        "counted",
        "cut",
        "cut_on",
        "decided",
        "enough",
        "every",
        "finished",
        "hedge",
        "idempotent",
        "late",
        "left",
        "lingering",
        "nodes",
        "owing",
        "owing_out",
        "pool",
        "replies",
        "reply_until",
        "sent",
        "since",
        "slowest_open",
        "tasks",
        "timeout",
        "undone",
        "unmeasured",
        "wait",
        "waiter",
        "wires",
    )

    def __init__(
        self,
        nodes: Sequence[Node],
        pool: LoopPool,
        build: CommandBuilder,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, AsyncOwing] | None = None,
        idempotent: bool = False,
        hedge: CommandBuilder | None = None,
    ) -> None:
        self.nodes = nodes
        self.pool = pool
        self.build = build
        self.late = late
        self.enough = enough
        self.idempotent = idempotent  #: as :class:`.fanout.FanOut`'s
        #: Builds the copy of the command a node late to answer gets on another connection
        #: (a hedged request: see :mod:`.hedging`); None: no copies.
        self.hedge = hedge
        #: Node index -> the copies of the command out to it, on other connections.
        self.copies: dict[int, list[tuple[AsyncWire, Due]]] = {}
        #: Nodes whose answer is in (with copies out, a node's later replies only read).
        self.answered: set[int] = set()
        #: Nodes that granted an acquire on one of its connections: counted in the quorum.
        self.counted: set[int] = set()
        #: When the command went out, on the monotonic clock the detector uses.
        self.since = 0.0
        #: Seconds between rounds of copies (0: no copies for this command).
        self.every = 0.0
        self.cut: set[int] = set()  #: as :class:`.fanout.FanOut`'s
        self.undone: set[int] = set()  #: as :class:`.fanout.FanOut`'s
        #: Nodes whose reply is no round trip sample from :attr:`since` (Karn's rule: sent
        #: again after NOSCRIPT; or sent only once connected).
        self.unmeasured: frozenset[int] = frozenset()
        #: Node index -> run id of a connection cut with the command out, until the fresh
        #: try's connection is open (the same server may have run it).
        self.cut_on: dict[int, str] = {}
        self.decided = False  #: ``enough`` ended the wait
        #: ``enough`` held while nodes were still being connected to: the wait goes on for
        #: those connections only (see :meth:`_enough`).
        self.lingering = False
        #: The longest a connection opened for this fan-out took (from its start).
        self.slowest_open = 0.0
        #: What the connections of nodes not heard in time owe, once they went back to the
        #: pool (also listed in ``left``, for the caller).
        self.owing: dict[int, Due] = {}
        self.owing_out = left
        self.sent = 0.0
        self.replies: list[Any] = [TIMED_OUT] * len(nodes)
        self.wires: list[AsyncWire | None] = [None] * len(nodes)  #: awaiting a reply on it
        self.commands: list[Sequence[Any] | bytes | Pipelined] = [()] * len(nodes)
        self.tasks: dict[int, asyncio.Task[AsyncWire]] = {}  #: connecting
        self.left = len(nodes)
        self.finished = False
        self.waiter: asyncio.Future[None] | None = None
        #: The wait for the replies (its deadline moves out for a node's fresh try).
        self.wait = Wait(0.0, 0.0)
        self.timeout = 0.0
        #: Until when the nodes whose command is out get to answer (moved out for a node
        #: whose command goes out once its connection is open), and until when a node being
        #: connected to is waited for while the operation cannot be decided without it
        #: (see :meth:`_retime`), on the loop's clock.
        self.reply_until = 0.0
        self.connect_until = 0.0

    async def run(
        self, timeout: float, behind: Mapping[int, AsyncOwing] | None = None
    ) -> list[Any]:
        """``behind``: as :class:`.fanout.FanOut`'s."""
        loop = self.pool.loop
        self.timeout = timeout
        self.sent = loop.time()
        self.since = time.monotonic()
        # Set before sending: a pooled connection found closed while sending gets one fresh
        # try within it (see _deliver).
        self.wait = Wait(timeout, self.sent)
        self.reply_until = self.sent + timeout
        self.connect_until = self.sent + connect_budget(timeout)
        # Nodes with an open connection first: their commands are in flight while we still
        # connect to the others.
        connecting = []
        # A group node whose master is due to be confirmed (see sentinel.CONFIRM_EVERY).
        confirm = [
            i for i, node in enumerate(self.nodes) if node.group and node.group.due(node.where)
        ]
        if confirm:
            await asyncio.gather(*(relocate(self.nodes[i], self.pool, i) for i in confirm))
        for index, node in enumerate(self.nodes):
            owing = behind.get(index) if behind else None
            wire = None if owing is None else self.pool.reclaim(index, owing[0])
            if owing is not None and self.idempotent and owing[1].twins:
                # What this ends ends the copies of the earlier command too: whoever reads
                # a copy's reply sends the undo behind it, which may reach the node first
                # (this command then finds nothing: not a key that was not ours).
                for twin in owing[1].twins:
                    twin.unwanted = True
                self.undone.add(index)
            if owing is not None and wire is None:
                # Whoever reads the earlier command's reply sends its undo, which may reach
                # the node first, as a copy's may.
                owing[1].unwanted = True
                if self.idempotent:
                    self.undone.add(index)
            if wire is None:
                wire = self.pool.share(index, node)
            if wire is None:
                connecting.append(index)
            else:
                self._send(index, wire, self.build(node, wire))
        for index in connecting:
            self._connect(index)
        if self.hedge is not None:
            now = time.monotonic()
            at = hedge_at(self.nodes, now, now, timeout)
            if at is not None:
                self.every = at - now
                loop.call_later(self.every, self._send_copies, self.every)
        # Connecting has a budget of its own; a node's reply budget starts once its command
        # is out (see _connected). A wait that overran by far is time in which the loop did
        # not run (a blocking call, a stalled process), not the nodes' silence: given back.
        now = loop.time()
        self.reply_until = max(self.reply_until, now + timeout)
        self.wait = wait = Wait(timeout, now)
        self._retime()
        expired = False  # the deadline passed with nodes not heard (not: the caller cancelled)
        try:
            while self.left and not self.decided:
                remaining = wait.remaining(loop.time())
                if remaining <= 0:
                    # Lingering: decided already, only a connection was waited for.
                    self.decided = self.lingering
                    expired = not self.lingering
                    break
                self.waiter = waiter = loop.create_future()
                timer = loop.call_later(remaining, settle, waiter, None)
                try:
                    await waiter
                finally:
                    timer.cancel()
        finally:
            self.finished = True
            now = loop.time()
            # Ended by a quorum's answers, or by every node's: what it decided stands.
            in_time = self.decided or not self.left
            stalled, excused = wait.stalled, wait.excused
            for index, wire in enumerate(self.wires):
                if wire is None:
                    continue
                fresh = not expired and not wire.overdue(now, timeout + stalled)
                if in_time and (fresh or index in self.counted):
                    # Its reply still comes to _deliver, which reads it and moves on.
                    self._owe(index, wire)
                    wire.undo_unwanted()
                    if not wire.usable():
                        pass  # given up by another fan-out: read until it answered
                    elif fresh:
                        self.pool.checkin(index, wire)
                    else:
                        self.nodes[index].mark_late(time.monotonic())
                        self.pool.set_aside(self.nodes[index], index, wire, self.since)
                elif (
                    not expired
                    and wire is self.pool.shared[index]
                    and wire.usable()
                    and not wire.overdue(now, timeout + stalled)
                ):
                    # Cancelled: the other fan-outs' commands on the shared connection stay
                    # there; this one's reply is read and dropped (_deliver), its undo goes
                    # right behind it.
                    if self.late is not None:
                        wire.send_unowned(self.late())
                        wire.flush()  # as in abandon: now, not when the loop turns
                else:
                    if not fresh:
                        # No answer within the node timeout: a miss, unless the loop stalled
                        # or the node answered since on another connection.
                        if index not in self.answered:
                            self.nodes[index].went_silent(excused, self.since)
                        self.nodes[index].mark_late(time.monotonic())
                    self.pool.set_aside(
                        self.nodes[index], index, wire, self.since, self.late, abandon=True
                    )
            if self.every and in_time and self.idempotent:
                # A release or undo a quorum answered: a slower node whose copy waits for a
                # lost packet's retransmission gets one more now, on another connection, that
                # nobody waits for, so the key does not stay there for the next acquire.
                for index in self._late():
                    if not self.copies.get(index):
                        self._copy_to(index)
            for index, copies in self.copies.items():
                for wire, due in copies:
                    self._copy_left(index, wire, due, in_time)
            for index in self.tasks:
                self.replies[index] = NOT_CONNECTED
        return self.replies

    def _owe(self, index: int, wire: AsyncWire) -> None:
        """The fan-out ended in time without node ``index``'s reply on ``wire``: the
        connection owes it (``_owed_reply`` reads it), and the caller may send what ends the
        command behind it (``left``)."""
        command = self.commands[index]
        again = as_bytes(command) if self.idempotent else None
        due = Due(command, self.late, self.sent, again)
        refused = index in self.answered and not granted(self.replies[index])
        leave(due, counted=index in self.counted, refused=refused)
        if wire.reused and index not in self.unmeasured:
            due.waited = time.monotonic() - self.since  # its reply measures the node
        wire.owed.append(due)
        self.owing[index] = due
        list_left(self.owing_out, index, wire, due)

    def _copy_left(self, index: int, wire: AsyncWire, due: Due, in_time: bool) -> None:
        """A copy still out when the fan-out ended: undone behind it at once if nothing came
        of the operation, or the node answered without granting it; else listed in
        ``left``, for what ends the lock to end it too. Its connection is pooled again once
        it answered."""
        refused = not in_time or (index in self.answered and not granted(self.replies[index]))
        leave(due, counted=in_time and index in self.counted, refused=refused)
        if due.unwanted and due.late is not None:
            wire.send_unowned(due.take_undo())
        elif in_time:
            list_left(self.owing_out, index, wire, due)
        self.pool.set_aside(self.nodes[index], index, wire, self.since)

    def _send_copies(self, every: float) -> None:
        """Send the hedge (a copy of the command the node may run twice: see
        :mod:`.hedging`) to every node that has not answered yet, on an idle connection that
        owes nothing (:meth:`LoopPool.spare`); one more each ``every`` seconds, up to
        :func:`.hedging.copies_allowed` connections per node."""
        if self.finished:
            return
        most = copies_allowed(self.idempotent)
        more = False
        for index in self._late():
            copies = self.copies.setdefault(index, [])
            if len(copies) + 1 >= most:
                continue
            sent = self._copy_to(index)
            more = more or not sent or len(copies) + 1 < most
        if more:
            self.pool.loop.call_later(every, self._send_copies, every)

    def _late(self) -> list[int]:
        """The nodes whose reply the command waits for on an open connection."""
        return [i for i, w in enumerate(self.wires) if w is not None and i not in self.answered]

    def _copy_to(self, index: int) -> bool:
        """Send node ``index`` a copy of the command on an idle connection that owes nothing;
        whether there was one (if not, one is being opened)."""
        node = self.nodes[index]
        wire = self.pool.spare(index, node)
        if wire is None or self.hedge is None:
            return False
        command = self.hedge(node, wire)
        due = Due(command, self.late, self.sent, as_bytes(command) if self.idempotent else None)
        self.copies.setdefault(index, []).append((wire, due))
        wire.owed.append(due)
        wire.send(command, functools.partial(self._copy_reply, index, wire, due))
        return True

    def _copy_reply(self, index: int, wire: AsyncWire, due: Due, reply: Any) -> None:
        """The reply to a copy of the command: the node's answer if it is the first (see
        :func:`.hedging.first_word`); after the fan-out ended, read (:meth:`_read_owed`)."""
        copies = self.copies[index]
        with contextlib.suppress(ValueError):
            copies.remove((wire, due))
        word = self._read_owed(wire, due, reply)
        if isinstance(reply, OSError):
            alone = not copies and self.wires[index] is None and index not in self.answered
            if alone and not self.finished:
                self._final(index, os_failure(reply))
            return
        self.nodes[index].detector.answered(time.monotonic(), self.since)
        if word is not None and not self.finished:
            self._word(index, word)
        if wire.usable() and not wire.waiters:
            self.pool.checkin(index, wire)

    def _word(self, index: int, reply: Any) -> None:
        """Node ``index``'s reply on one of the connections carrying the command, while
        copies of it are or were out (see :func:`.hedging.first_word`)."""
        word = first_word(
            reply,
            answered=index in self.answered,
            prior=self.replies[index],
            idempotent=self.idempotent,
            other_out=bool(self.copies.get(index)) or self.wires[index] is not None,
            nothing_left=NOTHING_LEFT,
        )
        if word is None:
            return
        if not self.idempotent and granted(word):
            self.counted.add(index)
        if index not in self.answered:
            self.answered.add(index)
            self._final(index, word)
            return
        self.replies[index] = word
        if (
            self.left
            and 2 * self.left < len(self.nodes)
            and self.enough is not None
            and self.enough(self.replies)
        ):
            self._enough()

    def _send(
        self, index: int, wire: AsyncWire, command: Sequence[Any] | bytes | Pipelined
    ) -> None:
        self.wires[index] = wire
        self.commands[index] = command
        for kept in self.nodes[index].take_later():  # see Node.later
            wire.send_unowned(kept)
        wire.send(command, functools.partial(self._deliver, index))

    def _connect(self, index: int) -> None:
        # Not cancelled when a quorum decides first: the connection goes to the pool.
        task = self.pool.connect_shared(self.nodes[index], index, connect_budget(self.timeout))
        self.tasks[index] = task
        task.add_done_callback(functools.partial(self._connected, index))

    def _connected(self, index: int, task: asyncio.Task[AsyncWire]) -> None:
        if self.tasks.get(index) is task:
            del self.tasks[index]
        if task.cancelled():
            return
        error = task.exception()
        if self.finished:
            return  # the pool keeps the connection (LoopPool.connect_shared)
        if error is None:
            wire = task.result()
            shared = self.pool.shared[index]
            if shared is not None and shared.usable():
                wire = shared  # the pool's (see LoopPool._opened); this one stays idle there
            if self.cut_on.pop(index, None) == wire.run_id:
                self.cut.add(index)  # the same server may have run it (see fanout.Round._resend)
            self._send(index, wire, self.build(self.nodes[index], wire))
            self.unmeasured |= {index}  # sent once connected, after ``since``
            opened = self.pool.loop.time() - self.sent
            if opened > self.slowest_open:
                self.slowest_open = opened
            # The node's reply budget starts now: connecting was not its silence.
            self.reply_until = max(self.reply_until, self.pool.loop.time() + self.timeout)
        elif isinstance(error, WireError):
            self._final(index, error.failure)
        else:
            self._final(index, Failure("error", str(error) or type(error).__name__))
        self._retime()

    def _retime(self) -> None:
        """Set the wait's deadline: :attr:`reply_until`, or :attr:`connect_until` if later
        while too few nodes have their command out (or answered) to decide the operation
        without one still being connected to (a fresh client on a busy host, whose
        handshakes all take longer than the node timeout). Otherwise a node being connected
        to is waited for as a slow node is: a frozen one (its kernel accepts TCP, the server
        never answers the handshake) costs the caller its reply budget, not the connect
        budget, and is :data:`~.nodes.NOT_CONNECTED`, no miss (its connection goes on, and
        its own budget tells). The caller's wait is woken to take the new deadline. While
        :attr:`lingering`, the deadline stays, and the wait ends once no node is being
        connected to."""
        if self.lingering:
            if not self.tasks:
                self.decided = True
            if self.waiter is not None:
                settle(self.waiter, None)
            return
        short = len(self.nodes) - len(self.tasks) < len(self.nodes) // 2 + 1
        until = self.reply_until
        if short and self.connect_until > until:
            until = self.connect_until
        if self.tasks and self.left == len(self.tasks):
            # Only nodes being connected to are left: those that missed an answer lately
            # may be frozen, and are waited for a little (as by the sync fan-out).
            suspect = self._suspect_linger()
            if suspect and self.sent + suspect < until:
                until = self.sent + suspect
        self.wait.deadline = until + self.wait.stalled
        if self.waiter is not None:
            settle(self.waiter, None)

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
            if index in self.answered or self.copies.get(index):
                return  # a copy answered, or may still
            loop = self.pool.loop
            if wire.reused and loop.time() < self.wait.deadline:
                # Closed while pooled (node restart, idle timeout): one fresh try.
                if self.idempotent:
                    self.cut_on[index] = wire.run_id
                self._connect(index)
                self.reply_until = max(self.reply_until, loop.time() + self.timeout)
                self._retime()
            else:
                self._final(index, os_failure(reply))
            return
        if isinstance(reply, ReplyError) and reply.code == "NOSCRIPT":
            # The node restarted or flushed its script cache: send the body once, which also
            # caches it for the next EVALSHA. Its reply then comes two round trips after
            # ``since``: no sample (Karn's rule).
            wire.send(as_eval(self.commands[index]), functools.partial(self._deliver, index))
            self.unmeasured |= {index}
            return
        self.wires[index] = None
        detector = self.nodes[index].detector
        now = time.monotonic()
        detector.answered(now, self.since)
        if wire.reused and index not in self.unmeasured:
            detector.round_trip(now - self.since)
        if on_replica(reply):
            # A demoted master (so are the idle connections to it): the next connection asks
            # the Sentinels where the master is now (a release refused is kept for it by
            # the operation: see base._keep_unreached).
            for other in (wire, *self.pool.wires(index)):
                other.retire()  # what other fan-outs sent on it is answered, refused too
        else:
            self.pool.checkin(index, wire)
        if isinstance(reply, ReplyError):
            reply = reply_failure(reply)
        if self.copies:
            self._word(index, fold(self.commands[index], wire, reply))
        else:
            self._final(index, fold(self.commands[index], wire, reply))

    def _owed_reply(self, index: int, reply: Any) -> None:
        """The reply of a node this fan-out stopped waiting for: the connection owed it."""
        due = self.owing.pop(index, None)
        wire = self.wires[index]
        if due is not None and wire is not None:
            if due.waited and not isinstance(reply, OSError):
                # Read as it comes (the loop reads every connection), so the time to the
                # read is the round trip (see NodeDetector.late_reply).
                read = time.monotonic() - self.since
                self.nodes[index].detector.late_reply(read, due.waited)
            self._read_owed(wire, due, reply)

    def _read_owed(self, wire: AsyncWire, due: Due, reply: Any) -> Any:
        """Read the reply ``wire`` owed for ``due`` (the node's answer, or None when it says
        nothing); once the fan-out ended, the undo goes behind a command given up meanwhile
        (released on another connection, which may have overtaken it)."""
        with contextlib.suppress(ValueError):
            wire.owed.remove(due)
        if isinstance(reply, OSError):
            # Cut before it answered: nothing queued on it runs any more.
            wire.later.extend(unfinished([due]))
            return None
        if noscript(reply):
            if due.again is not None:  # a release runs the same however late
                wire.send_unowned(as_eval(due.again))
            # Any other script did not run; run now, it could outlive what the fan-out decided.
            return None
        if on_replica(reply):
            # Refused by a server that is no longer the group's master: a release goes to the
            # one the next connection finds (token-checked, harmless anywhere).
            if due.again is not None:
                wire.later.append(due.again)
            wire.close()
            return None
        if isinstance(reply, ReplyError):
            reply = reply_failure(reply)
        # Read for what it tells the connection (a changed restart-guard marker).
        reply = fold(due.command, wire, reply)
        if self.finished and due.unwanted and due.late is not None:
            wire.send_unowned(due.take_undo())
        return reply

    def _final(self, index: int, reply: Any) -> None:
        self.replies[index] = settled(reply, index, self.cut, self.undone)
        self.left -= 1
        if not self.left:
            if self.waiter is not None:
                settle(self.waiter, None)
        # Asked only once a majority answered, as the sync fan-out asks it (see FanOut).
        elif (
            2 * self.left < len(self.nodes)
            and self.enough is not None
            and self.enough(self.replies)
        ):
            self._enough()
        elif self.left == len(self.tasks) and not self.lingering:
            self._retime()  # only nodes being connected to are left (see _retime)

    def _suspect_linger(self) -> float:
        """How long from the start the nodes being connected to are waited for when every
        one of them missed an answer lately (:func:`.fanout.suspect_linger`, as the sync
        fan-out's); 0 when some did not."""
        longest = 0.0
        for index in self.tasks:
            node = self.nodes[index]
            if not node.missed_lately():
                return 0.0
            linger = suspect_linger(node, self.timeout)
            if linger > longest:
                longest = linger
        return longest

    def _linger_until(self) -> float:
        """Until when (the loop's clock) a fan-out decided without the nodes still being
        connected to waits for their connections, as the sync fan-out's
        (:func:`.fanout._linger_until`): each from when its connection began, for
        :func:`.fanout.linger_for`, or :func:`.fanout.suspect_linger` if the node missed an
        answer lately. A connection that has been opening longer than that costs nothing
        more: the operation that began it waited for it already (a frozen node's handshake,
        pending for the whole connect budget, cost one operation, not each one meanwhile)."""
        wait_for = linger_for(self.timeout, self.slowest_open)
        until = 0.0
        for index, task in self.tasks.items():
            node = self.nodes[index]
            began = self.pool.connecting_since(index, task)
            if began is None:
                began = self.sent
            at = began + node_linger(node, self.timeout, wait_for)
            if at > until:
                until = at
        return until

    def _enough(self) -> None:
        """``enough`` held: the wait ends, unless nodes are still being connected to; then
        it goes on for those connections only (:meth:`_linger_until`), as the sync
        fan-out's does: a healthy node's copy of a fresh client's first lock is not lost to
        its handshake (each command goes out once its connection is open; its reply is
        owed, as a slow node's is)."""
        if self.tasks and not self.lingering:
            until = self._linger_until()
            if until > self.pool.loop.time():
                self.lingering = True
                self.wait.deadline = until + self.wait.stalled
        if not (self.lingering and self.tasks):
            self.decided = True
        if self.waiter is not None:
            settle(self.waiter, None)
