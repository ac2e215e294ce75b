"""Connections to the Redis nodes: lock connections (:class:`Wire`), the replies each one owes
(:class:`Due`), and one :class:`Node` per server with its pool.

Every connection is opened by redis-py's connection classes, from redis-py's parsing of the
node's URL with its OPTIONS on top (:func:`connection_args`), so TLS, credentials and every
other option mean what they mean in redis-py. Commands are packed by hiredis (:func:`pack`,
redis-py's packer when hiredis is installed) and replies parsed by hiredis's ``Reader``
(:func:`reader`); the fan-out waits on the sockets itself (:mod:`.fanout`), non-blocking,
because redis-py's ``read_response`` blocks until a whole reply is in. Where a connection's
address is chosen: :meth:`Node.connection`.

Idle connections are kept per node in a lock-free deque, so threads share them without
contention, and a forked child opens its own. The fan-out over them is :mod:`.fanout`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union
from urllib.parse import parse_qsl, urlsplit

import hiredis
import redis
from redis.connection import parse_url as _parse_url

from .detector import (
    MIN_SPAN,
    MISSES_TO_DOWN,
    QUICK_GAIN,
    RTT_GAIN,
    SRTT_GAIN,
    connect_budget,
    far_rto,
    overrun,
    reply_budget,
)
from .process import ThisProcess
from .reconnect import reconnector
from .scripts import BODIES, RELEASE, Script
from .sentinel import (
    SentinelGroup,
    SentinelUnavailable,
    Where,
    group_identity,
    group_master_url,
    is_group_url,
    parse_group_url,
    redact_group_url,
    redact_query,
    same_host,
)
from .validation import MAX_NODE_TIMEOUT, check_positive

__all__ = [
    "BEHIND_LATE",
    "DRAIN_FOR",
    "HANDSHAKE",
    "LATENESS",
    "MAX_DB",
    "NOTHING_LEFT",
    "NOT_CONNECTED",
    "NOT_SENT",
    "OWED",
    "SENT_TWICE",
    "SOCKET_FULL",
    "TIMED_OUT",
    "Due",
    "Failure",
    "Incomplete",
    "Link",
    "Node",
    "NodeDetector",
    "NodeSpec",
    "Owing",
    "Pipelined",
    "ProtocolError",
    "ReplyError",
    "Wakeup",
    "Wire",
    "WireError",
    "as_bytes",
    "as_eval",
    "asyncio_refusal",
    "claim_server",
    "connect_failure",
    "connection_args",
    "eval_command",
    "eval_form",
    "fold",
    "leave",
    "list_left",
    "make_nodes",
    "node_client",
    "node_identity",
    "not_redis",
    "on_replica",
    "os_failure",
    "pack",
    "pack_many",
    "pack_tuple",
    "parse_spec",
    "reached",
    "reader",
    "redact",
    "refuse_replica",
    "reply_failure",
    "reply_wait",
    "script_command",
    "section_fields",
    "server_of",
    "settled",
    "shake_hands",
    "undos",
    "unfinished",
    "unpack",
    "unwanted_undos",
]

#: What a node can be configured as: a URL, ``{"URL": ..., "OPTIONS": {...}}``, or a client
#: (whose connection pool's settings are reused).
NodeSpec = Union[str, Mapping[str, Any], "redis.Redis"]

_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")

#: redis-py's URL parser (untyped in redis-py): connection keyword arguments from a URL.
parse_url: Callable[[str], dict[str, Any]] = _parse_url


@dataclass(frozen=True)
class Failure:
    """Why a node did not answer a fan-out: ``timeout``, ``refused``, ``auth`` or ``error``."""

    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


class ProtocolError(ConnectionError):
    """The peer sent something that is not a Redis reply: the address is not a Redis server
    (or the connection is out of step). The connection can never be used again."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"not a Redis server (no RESP reply: {detail})")


def os_failure(exc: OSError) -> Failure:
    """The :class:`Failure` to report for a connection error."""
    if isinstance(exc, ProtocolError):
        return Failure("error", str(exc))
    if isinstance(exc, TimeoutError):  # a write the node did not take in time
        return Failure("timeout", str(exc))
    return Failure("refused", exc.strerror or str(exc))


class ReplyError(Exception):
    """An error reply (``-ERR ...``), returned as a value rather than raised mid-fan-out."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class Incomplete(Exception):
    """A connection has not received a whole reply yet."""


def reader() -> hiredis.Reader:
    """hiredis's RESP parser (the one redis-py uses) for one connection: replies as bytes,
    error replies as :class:`ReplyError` values, garbage as :class:`ProtocolError`."""
    return hiredis.Reader(protocolError=ProtocolError, replyError=ReplyError)


def pack(command: Sequence[Any]) -> bytes:
    """One command, encoded by hiredis (redis-py's packer with hiredis installed, called
    directly: this runs for every command sent). Arguments are str, bytes or numbers (a bool
    as 0/1, as redis-py's own packer does not take it)."""
    try:
        return hiredis.pack_command(tuple(command))  # type: ignore[no-any-return]
    except TypeError:
        return hiredis.pack_command(tuple(_arg(a) for a in command))  # type: ignore[arg-type,no-any-return]


#: :func:`pack`'s common case, for a tuple of str, bytes and int arguments only (no copy, no
#: Python frame: the hot path's own commands are built this way). The ignore: hiredis's stub
#: types its argument as a tuple of one.
pack_tuple: Callable[[tuple[str | bytes | int, ...]], bytes] = hiredis.pack_command  # type: ignore[assignment]


def _arg(arg: Any) -> str | bytes | int | float:
    if isinstance(arg, (bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, bool):
        return int(arg)
    if isinstance(arg, (str, bytes, int, float)):
        return arg
    raise TypeError(f"a command argument must be str, bytes or a number, got {arg!r}")


def pack_many(commands: Iterable[Sequence[Any]]) -> bytes:
    """Several commands in one buffer (one write)."""
    return b"".join([pack(c) for c in commands])


def unpack(data: bytes) -> list[Any]:
    """The arguments of an encoded command (hiredis reads a command as the array it is)."""
    parser = hiredis.Reader()
    parser.feed(data)
    args = parser.gets()
    assert isinstance(args, list), "not an encoded command"
    return args


class Pipelined:
    """Commands written to one node at once (``data``, ``count`` replies) whose replies
    ``fold(wire, replies)`` turns into the node's one answer. It is given the connection the
    replies came back on, which may remember something about the node (the acquire keeps the
    id of the restart-guard marker it saw vote there). A single command's error reply
    arrives as a :class:`Failure` (after the ``NOSCRIPT`` retry of an ``EVALSHA``); several
    commands' replies arrive as parsed, error replies as :class:`ReplyError`."""

    __slots__ = ("count", "data", "fold")

    def __init__(self, data: bytes, count: int, fold: Callable[[Any, list[Any]], Any]) -> None:
        self.data = data
        self.count = count
        self.fold = fold


class WireError(Exception):
    """A node failed during a lock command; carries the :class:`Failure` to report."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


#: :attr:`Due.reply` until the reply is in.
OWED: Any = object()


class Due:
    """A reply a connection owes for ``command`` (``count`` replies, parsed and folded into
    :attr:`reply` once they are in), with ``late``, the undo to send behind the command if the
    connection is given up before it answers. A fan-out that stopped waiting (a quorum was
    reached) leaves its dues on the pooled connection; the next user of the connection reads
    them first. ``unwanted``: the command's issuer gave up what it did (the lock was released
    on another connection, which may have overtaken it), so whoever reads the reply sends the
    undo behind it. ``left``: nobody waits for the reply any more (the operation ended).
    ``again``: the command itself, encoded, when running it twice does no harm (a release or
    an undo: token-checked deletes); if the connection is cut before it answers, the command
    goes out again with the next operation that reaches the node (:meth:`Node.lose`)."""

    # Class defaults rather than slots: a new one (one per node per operation) sets only what
    # it is given, and most keep the defaults to the end. Those read with every reply
    # (``unwanted``, ``waited``, ``resent``) are set in __init__ as well: CPython 3.11 reads an
    # instance's attribute fast, a class default through the instance slowly.
    #: The parsed (and folded) reply; :data:`OWED` until it is in.
    reply: Any = OWED
    unwanted = False
    left = False
    #: Copies of the same command still owed on other connections to the node (a hedged
    #: request: see :mod:`.fanout`): whatever ends this command ends them too.
    twins: list[Due] | None = None
    #: The connection a twin is owed on (the sync client's), for what ends it to go behind it.
    wire: Any = None
    #: A copy of an acquire whose node granted it on another connection, counted in the
    #: quorum: giving this connection up does not undo it (:meth:`Wire.undos`).
    counted = False
    #: How long its operation waited for the reply on a connection already set up, when it
    #: stopped waiting without it (0: it did not, or the wait says nothing of the round
    #: trip); whoever reads the reply later counts it (:meth:`NodeDetector.late_reply`).
    waited = 0.0
    #: Sent again on the same connection (its script, after ``NOSCRIPT``): its reply is no
    #: round trip sample (Karn's rule: the time since :attr:`sent` spans two of them).
    resent = False

    def __init__(
        self,
        command: Any,
        late: Callable[[], bytes] | None,
        sent: float,
        again: bytes | None = None,
        op: Any = None,
    ) -> None:
        self.command = command
        #: The sync client's fan-out waiting for the reply (see :mod:`.fanout`), if any.
        self.op = op
        self.count = command.count if command.__class__ is Pipelined else 1
        self.late = late
        self.sent = sent
        self.again = again
        self.unwanted = self.resent = False
        self.waited = 0.0

    def take_undo(self) -> bytes:
        """The undo of an unwanted command, once (``late`` is cleared)."""
        late, self.late = self.late, None
        assert late is not None
        return late()


def settled(
    reply: Any, index: int, cut: Container[int] | None, undone: Container[int] | None
) -> Any:
    """Node ``index``'s reply as its operation takes it: a re-sent command's "nothing to do"
    says nothing where the first may have run (``cut``: :data:`SENT_TWICE`), nor does it where
    our own undo of a copy may have been first (``undone``: :data:`NOTHING_LEFT`)."""
    if reply == 0:
        if cut and index in cut:
            return SENT_TWICE
        if undone and index in undone:
            return NOTHING_LEFT
    return reply


def leave(due: Due, *, counted: bool, refused: bool) -> None:
    """``due``'s operation ended without its reply, which nobody waits for now. ``counted``:
    a grant in the quorum of a lease, ended by the lease's release, not undone when its
    connection is given up; ``refused``: the node answered on another connection without
    granting, and this copy may still land, so whoever reads its reply sends its undo."""
    due.left = True
    due.counted = counted
    if refused:
        due.unwanted = True


def list_left(left: dict[int, Any] | None, index: int, wire: Any, due: Due) -> None:
    """List ``wire``, which owes ``due``, in an operation's ``left`` (what ends the command
    goes behind it); a second copy of the command owed to the node becomes the first's twin:
    what ends one ends both."""
    if left is None:
        return
    owing = left.get(index)
    if owing is None:
        left[index] = (wire, due)
    else:
        due.wire = wire
        owing[1].twins = [*(owing[1].twins or ()), due]


def undos(dues: Iterable[Due]) -> list[bytes]:
    """The undo of every command of ``dues`` a connection still owes (sent behind them when
    the connection is given up: the node runs one connection's commands in order, so the
    undo cannot overtake a command still queued there; on a new connection it could, and
    leave the command's effect behind). Not of a copy of an acquire whose node granted it on
    another connection (:attr:`Due.counted`): that grant is part of a lease, which its
    release ends (see :attr:`Due.twins`)."""
    return [due.late() for due in dues if due.late is not None and not due.counted]


def unwanted_undos(dues: Iterable[Due]) -> list[bytes]:
    """The undo of each command of ``dues`` whose issuer gave it up (a lock released on
    another connection, which may have overtaken the acquire on the node); once each."""
    return [due.take_undo() for due in dues if due.unwanted and due.late is not None]


def unfinished(dues: Iterable[Due]) -> list[bytes]:
    """What must still reach the node when a connection is cut (the node closed it,
    ``CLIENT KILL``, a failed link) before it answered ``dues`` of operations that ended:
    their releases and undos (:attr:`Due.again`), and the undo of a command its issuer gave up
    (:attr:`Due.unwanted`). Once the node closed the connection, nothing queued on it runs any
    more, so these may go out on another one."""
    kept = []
    for due in dues:
        if not due.left:
            continue  # its operation still waits: it resends, or reports the failure
        if due.again is not None:
            kept.append(due.again)
        elif due.unwanted and due.late is not None:
            kept.append(due.late())
    return kept


#: How many of a node's round trips a reply may be owed for and still be on its way (see
#: :meth:`Node._held_up`).
HELD_UP_ROUND_TRIPS = 2

#: A new connection's first round trip: INFO (the run id and start of the server, and
#: whether it is a replica), and the release script loaded, so a release (an ``EVALSHA``)
#: whose answer nobody reads in time does not meet a ``NOSCRIPT`` on a server that restarted
#: (see ``commands._RELEASE_HEAD``). Two INFO commands: Redis 6.2 takes one section each.
HANDSHAKE = (
    pack(["INFO", "server"])
    + pack(["INFO", "replication"])
    + pack(["SCRIPT", "LOAD", RELEASE.body])
)

#: What a non-blocking socket raises when it takes nothing now (a TLS one may need to read).
SOCKET_FULL = (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError)


class Link:
    """What a lock connection (the sync :class:`Wire`, ``aionodes.AsyncWire``) knows of the
    server it reached: its handshake's answers, and what the lock commands learnt there."""

    #: The server's run id (the restart guard compares it inside the acquire script).
    run_id = ""
    #: The server's ``master_replid`` at the handshake ("" where INFO replication was
    #: withheld): a new one after a promotion, so the guard tells a master that resynced from
    #: another (and lost leases) under its own run id.
    replid = ""
    #: When the server started (``time.time()``; see :func:`server_of`).
    started = 0.0
    #: ``(host, port)`` it reached (a group node's master moves: see :meth:`Node.current`).
    address: tuple[Any, Any] = (None, None)
    #: A group node's: the Sentinels' failover epoch when they named the master it reached
    #: (the acquire script arms a marker of an older epoch anew); None for a server's URL.
    epoch: int | None = None
    #: ``[run id, marker id]`` of the node's restart-guard marker when it last voted on
    #: this connection (see ``commands.AcquireRequest``); None until then, and once it changed.
    vote_marker: list[bytes] | None = None
    #: When the node was trusted as part of a new cluster (``time.monotonic``), or None.
    trusted_at: float | None = None
    #: True once it served a command: a reused socket may have been closed by the node
    #: (restart, idle timeout) while it sat in the pool.
    reused = False

    def learn(self, other: Link) -> None:
        """Know what ``other``, a connection to the same server, knew of it."""
        self.run_id, self.started, self.address = other.run_id, other.started, other.address
        self.replid, self.epoch = other.replid, other.epoch
        self.vote_marker, self.trusted_at = other.vote_marker, other.trusted_at


class Wire(Link):
    """One plain socket to a node, used for lock commands only: opened with a blocking
    handshake (:data:`HANDSHAKE`), then left non-blocking so a fan-out can wait on many of them
    at once."""

    def __init__(self, node: Node, timeout: float) -> None:
        #: The node whose count of open connections this one is in, until closed (see
        #: :meth:`Node.take_slot`).
        self.node: Node | None = None
        #: When (``time.monotonic``) it last went back to the pool (see :meth:`Node.trim`).
        self.idle_since = time.monotonic()
        #: The replies that have arrived, parsed by hiredis as they come.
        self.reader = reader()
        #: Replies taken of a :class:`Pipelined` command still waiting for the rest.
        self.partial: list[Any] = []
        self.fd = -1
        #: The replies this connection owes, oldest first (Redis answers in order).
        self.due: deque[Due] = deque()
        #: How long a write may wait for the node to take it (see :meth:`write`).
        self.timeout = node.node_timeout
        #: True once the server answered ``READONLY``: it is a replica now (demoted by a
        #: failover), and the connection is not pooled again (:meth:`Node.checkin`).
        self.on_replica = False
        #: Where a command that must still reach the node goes (:attr:`Node.later`).
        self.later = node.later
        #: redis-py's connection: it connects (TCP or unix socket, TLS with every ``ssl_*``
        #: option, AUTH, SELECT, client name) exactly as the node's URL and OPTIONS mean in
        #: redis-py; the lock commands then pipeline on its socket without blocking.
        where = node.where
        self.conn = conn = node.connection(timeout, where=where)
        self.address = address_of(conn)
        self.epoch = None if where is None else where[1]
        node.take_slot()
        self.node = node
        try:
            conn.connect()
            asked = time.monotonic()
            conn.send_packed_command([HANDSHAKE])
            info = conn.read_response()
            # A round trip like any other: a node is measured from its first connection,
            # not from its first command on a pooled one (one may never come in time).
            node.detector.round_trip(time.monotonic() - asked)
            try:
                replication = conn.read_response()
            except redis.ResponseError:  # INFO's replication section withheld: not judged
                replication = None
            with contextlib.suppress(redis.ResponseError):  # a user not allowed SCRIPT LOAD
                conn.read_response()
            self.run_id, self.started, self.replid = shake_hands(node, info, replication)
            sock = conn._sock
            assert sock is not None
        except BaseException as exc:
            self.close()
            if isinstance(exc, (redis.RedisError, OSError)):
                raise WireError(connect_failure(exc)) from None
            raise
        self.sock: socket.socket = sock
        sock.settimeout(0)
        #: Kept: the fan-out looks it up per reply, and a closed socket's would be -1.
        self.fd = sock.fileno()

    def write(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """Send ``data`` whole on the non-blocking socket: one ``send`` as a rule. What the
        socket does not take at once (its buffer is full: a large command, or a round of many,
        on a young connection over a real network) goes out as it drains, within ``timeout``
        seconds (the node timeout by default). Raises ``OSError`` (``TimeoutError`` when the
        node takes too long); the connection is then broken: part of a command may be out."""
        sock = self.sock
        try:
            sent = sock.send(data)
        except SOCKET_FULL:
            sent = 0
        if sent == len(data):
            return
        rest = memoryview(data)[sent:]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while rest:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError(f"the node took {len(data) - len(rest)} of {len(data)} bytes")
            with contextlib.suppress(*SOCKET_FULL):
                rest = rest[sock.send(rest) :]

    def feed(self) -> None:
        """Hand what has arrived on the socket to the parser (never blocks)."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        if not data:
            raise ConnectionResetError("connection closed by the node")
        self.reader.feed(data)

    def take(self) -> Any:
        """The next whole reply; raises :class:`Incomplete` if there is none
        (:class:`ProtocolError` for garbage)."""
        value = self.reader.gets()
        if value is False:
            raise Incomplete
        return value

    def read(self) -> None:
        """Read what has arrived on the socket (never blocks) and fold every whole reply into
        the :class:`Due` it answers, oldest first; raises :class:`Incomplete` at the first one
        still on its way (``OSError`` for a broken connection, :class:`ProtocolError` for
        garbage). Every reply of every fan-out passes here: the common case (a reply that is
        no error) is written out in this frame, the rest is :meth:`_unusual`."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        else:
            if not data:
                raise ConnectionResetError("connection closed by the node")
            self.reader.feed(data)
        gets = self.reader.gets
        due = self.due
        while due:
            entry = due[0]
            count = entry.count
            if count == 1:
                reply = gets()
                if reply is False:
                    raise Incomplete
            else:
                # A pipeline's replies: those in already are kept for the next read.
                partial = self.partial
                while len(partial) < count:
                    value = gets()
                    if value is False:
                        raise Incomplete
                    partial.append(value)
                self.partial = []
                reply = partial
            due.popleft()
            kind = reply.__class__
            if kind is ReplyError:
                reply = self._unusual(entry, reply)
                if reply is OWED:
                    continue
            elif kind is list:
                # A pipeline's error reply (a script's own arrays hold none: an error ends it).
                for item in reply:
                    if item.__class__ is ReplyError:
                        self._unusual(entry, reply)
                        break
            command = entry.command
            if command.__class__ is Pipelined:
                reply = command.fold(self, [reply] if count == 1 else reply)
            entry.reply = reply
            if entry.unwanted and entry.late is not None:
                if self._peer_closed():
                    # Sent here it would be lost with the connection, which nothing may read
                    # again before the next operation reaches the node on another one.
                    self.later.append(entry.take_undo())
                else:
                    self.send_unowned([entry.take_undo()])
            if entry.waited:
                self._late(entry)

    def _peer_closed(self) -> bool:
        """Whether the node (or a link between) closed the connection after the replies read
        so far: nothing sent on it now would run. Not known on a TLS socket (False)."""
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, ssl.SSLWantReadError, ValueError):
            return False  # open; or TLS, which cannot peek
        except OSError:
            return True

    def _late(self, entry: Due) -> None:
        """:meth:`read` of the reply of a command its operation stopped waiting for: the
        node's round trips are measured by it (see :meth:`NodeDetector.late_reply`)."""
        node = self.node
        if node is not None and not entry.resent:
            node.detector.late_reply(time.monotonic() - entry.sent, entry.waited)

    def _unusual(self, entry: Due, reply: Any) -> Any:
        """:meth:`read` of a reply that is an error or holds one (or an array): it may say the
        server is a replica now, or that it no longer knows a script. The reply to fold: a
        :class:`Failure` for an error reply, or :data:`OWED` for a script sent again with its
        body (``NOSCRIPT``: the node restarted or flushed its script cache; the ``EVAL``
        also caches it for the next ``EVALSHA``), owed anew."""
        if on_replica(reply):
            self.on_replica = True
            if entry.left and entry.again is not None:
                # A release whose operation ended without this reply (it kept nothing for
                # the node): it goes to the master the next connection finds.
                self.later.append(entry.again)
        if reply.__class__ is not ReplyError:
            return reply
        if reply.code == "NOSCRIPT" and (not entry.left or entry.again is not None):
            # A release or an undo runs the same however late (it deletes only its own
            # token): it goes again, with its body, behind what this connection carries,
            # also when its operation ended.
            again = as_eval(entry.command if entry.again is None else entry.again)
            if entry.again is not None:
                entry.again = again
            entry.resent = True
            self.write(again)
            self.due.append(entry)
            return OWED
        # Any other script of an operation that ended did not run: running it now, after the
        # operation decided without it (an acquire's lock may be released by now), would
        # leave its effect behind.
        return reply_failure(reply)

    def send_unowned(self, commands: list[bytes]) -> None:
        """Send encoded commands no operation waits for (undos, late releases): their replies
        are owed like any other, read and dropped by whoever reads the connection next.
        Owed before they are sent: if sending fails, the connection is lost with them
        (:meth:`Node.lose`)."""
        self.write(self.owe_unowned(commands))

    def owe_unowned(self, commands: list[bytes]) -> bytes:
        """:meth:`send_unowned` but for the write: the replies are owed now, and the caller
        sends the returned bytes (ahead of its own command, in the same write)."""
        now = time.monotonic()
        for command in commands:
            due = Due(b"", None, now, again=command)
            due.left = True
            self.due.append(due)
        return b"".join(commands)

    def settle_within(self, timeout: float) -> None:
        """Read until every reply it owes is in; raises :class:`Incomplete` after ``timeout``
        seconds (``OSError`` for a broken connection)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while self.due:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise Incomplete
            with contextlib.suppress(Incomplete):
                self.read()

    def undo_unwanted(self) -> None:
        """Send, behind everything it carries, :func:`unwanted_undos` of what it owes.
        Whoever holds the connection does this: when it reads the replies, when it puts the
        connection back in the pool owing, when it closes it."""
        undos = unwanted_undos(self.due)
        if undos:
            self.send_unowned(undos)

    def overdue(self, now: float, timeout: float) -> bool:
        """Whether its oldest unanswered command has waited longer than ``timeout``."""
        return bool(self.due) and self.due[0].sent + timeout <= now

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        node, self.node = self.node, None
        if node is None:
            return
        with contextlib.suppress(OSError, redis.RedisError):
            self.conn.disconnect()
        node.free_slot()


class Wakeup:
    """Wakes a fan-out waiting in ``poll`` from the threads that open connections for it
    (:meth:`Node.open_for`): a pipe whose read end the fan-out polls beside its nodes'
    sockets, and the news of each node, its failure (None: a connection is in the pool)."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._news: dict[Node, Failure | None] = {}
        self._closed = False

    def tell(self, node: Node, failure: Failure | None) -> None:
        with self._lock:
            if self._closed:
                return
            woken = bool(self._news)
            self._news[node] = failure
            if not woken:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write_fd, b"\0")

    def take(self) -> dict[Node, Failure | None]:
        """The news since the last :meth:`take` (the pipe read empty)."""
        with self._lock:
            news, self._news = self._news, {}
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 64)
        return news

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)


#: Spare connections a node may want opened in the background at a time (see
#: :meth:`Node.want_spare`).
SPARES = 8

#: How long an idle connection stays open unused (see :meth:`Node.trim`): a process that
#: stops taking locks keeps :data:`MIN_IDLE` connections per node.
IDLE_FOR = 10.0

#: Idle connections a node keeps.
MIN_IDLE = 1

#: Connections a node keeps open, beyond the most its operations used at once lately
#: (:meth:`Node.wanted`), for the replies that come back late: with fewer, on a busy host
#: every connection of a node owed a late reply now and then, and an operation found none
#: to use ("every connection owes a late reply").
IDLE_SLACK = SPARES

#: How often the trimmer looks at every node's idle connections (:meth:`Node.trim`).
TRIM_EVERY = 1.0

#: How long a connection given up stays open to be read (:meth:`Node.abandon`): a lease
#: lasts at most ``max_ttl`` (60 s by default), so what its undo removes is gone by then.
DRAIN_FOR = 60.0


#: A connection that still owes the reply of a command, and that reply (see
#: :class:`.fanout.FanOut`).
Owing = tuple[Wire, Due]


_AUTH_ERRORS = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.NoPermissionError,
)


def connect_failure(exc: BaseException) -> Failure:
    """The :class:`Failure` of a connection redis-py could not open: ``auth`` for refused
    credentials, ``timeout``, else the socket's or TLS's own reason (``refused``). redis-py
    may wrap the cause (a connection error around an authentication error), so the chain
    is read."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    for link in chain:
        if isinstance(link, redis.exceptions.InvalidResponse):
            return Failure("error", str(ProtocolError(str(link))))
        if isinstance(link, _AUTH_ERRORS):
            return Failure("auth", str(link))
        if isinstance(link, redis.ResponseError):
            text = str(link)
            auth = "AUTH" in text.upper() or "password" in text
            return Failure("auth" if auth else "error", text)
    for link in chain:
        if isinstance(link, (redis.TimeoutError, TimeoutError)):
            return Failure("timeout", "no answer while connecting")
        if isinstance(link, OSError):
            return os_failure(link)
    return Failure("error", str(exc))


def shake_hands(node: Node, info: Any, replication: Any) -> tuple[str, float, str]:
    """The server's run id, start (:func:`server_of`) and ``master_replid`` ("" when not
    told) from a new connection's :data:`HANDSHAKE` replies (``replication`` None where the
    section was withheld), once the server is one ``node`` may vote with
    (:func:`claim_server`, :func:`refuse_replica`)."""
    run_id, started = server_of(info)
    claim_server(node, run_id)
    fields = section_fields(replication)
    refuse_replica(node, fields)
    return run_id, started, fields.get("master_replid", "")


def server_of(info: Any) -> tuple[str, float]:
    """The server's run id, and when it started (``time.time()``, to the second: INFO's
    uptime, by the server's clock where INFO has it), from its INFO reply. Raises
    :class:`WireError` for an INFO that names no run id and version: a service that speaks
    RESP but is not Redis would answer the lock commands with replies the algorithm never gets
    from Redis (and the restart guard needs the run id), so it fails here, as a node that
    cannot be reached."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else ""
    run_id = ""
    versioned = False
    uptime = 0
    # The server's own clock when it wrote INFO (Redis 6.2+, Valkey): a start time computed
    # from it does not move with how long this process took to read the reply (a busy host
    # made servers started together look seconds apart).
    server_now: float | None = None
    for line in text.splitlines():
        if line.startswith("run_id:"):
            run_id = line[7:].strip()
        elif line.startswith(("redis_version:", "valkey_version:")):
            versioned = True
        elif line.startswith("uptime_in_seconds:") and line[18:].strip().isdigit():
            uptime = int(line[18:])
        elif line.startswith("server_time_usec:") and line[17:].strip().isdigit():
            server_now = int(line[17:]) / 1e6
    if not run_id or not versioned:
        raise WireError(not_redis("INFO", info))
    if server_now is None:
        return run_id, time.time() - uptime
    # INFO's uptime is the whole seconds between the server's start second and the second of
    # server_now (both from one clock reading), so this is the start second itself: a start
    # at x.9 is x, never x.9 plus the fraction of the moment INFO was written.
    return run_id, float(math.floor(server_now) - uptime)


def not_redis(command: str, reply: Any) -> Failure:
    """The failure of a node that answered ``command`` with ``reply``, which no Redis server
    gives (shown short: the reply of a service that is not Redis may be anything)."""
    shown = "nil" if reply is None else repr(reply)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return Failure("error", f"not a Redis server: {command} answered {shown}")


#: Error codes of a server that is not (or no longer) its group's writable master: a
#: replica, or a master cut off from its replicas (``min-replicas-to-write``; a master
#: deposed by a failover it did not hear of).
_NOT_MASTER = ("READONLY", "NOREPLICAS")


def on_replica(reply: Any) -> bool:
    """Whether a reply (or one of a pipeline's) says the server is not the group's master
    any more: the connection is then dropped, and the next one asks where the master is."""
    if reply.__class__ is list:
        # A loop, not recursion per item: every reply of every fan-out passes here.
        for item in reply:
            if item.__class__ is ReplyError:
                if item.code in _NOT_MASTER:
                    return True
            elif item.__class__ is list and on_replica(item):
                return True
        return False
    return reply.__class__ is ReplyError and reply.code in _NOT_MASTER


def reply_failure(reply: ReplyError) -> Failure:
    if reply.code in ("NOAUTH", "WRONGPASS", "NOPERM", "ERR") and (
        reply.code != "ERR" or "AUTH" in str(reply).upper() or "password" in str(reply)
    ):
        return Failure("auth", str(reply))
    return Failure("error", str(reply))


class NodeDetector:
    """What one process knows about one node's health: its misses, whether it is down and
    why, and its round trips. Not locked: every update is a few attribute writes, and a lost
    update between threads only delays a verdict by one observation."""

    __slots__ = (
        "down_since",
        "first_miss",
        "heard_at",
        "min_span",
        "missed_since",
        "misses",
        "misses_to_down",
        "node_timeout",
        "quick",
        "reason",
        "rto",
        "rttvar4",
        "srtt",
    )

    def __init__(
        self,
        node_timeout: float,
        *,
        misses_to_down: int = MISSES_TO_DOWN,
        min_span: float = MIN_SPAN,
    ) -> None:
        if misses_to_down < 1:
            raise ValueError(f"misses_to_down must be at least 1, got {misses_to_down!r}")
        if min_span < 0:
            raise ValueError(f"min_span must not be negative, got {min_span!r}")
        self.node_timeout = node_timeout
        self.misses_to_down = misses_to_down
        self.min_span = min_span
        self.reset()

    def reset(self) -> None:
        """Forget everything (a forked child starts over with the node)."""
        #: Consecutive misses not excused, and when the first of them was.
        self.misses = 0
        self.first_miss = 0.0
        #: When the node was found down, or None while it is up.
        self.down_since: float | None = None
        #: Why it is down ("" while up).
        self.reason = ""
        #: Smoothed round trip (seconds); None before the first one. Kept by the sync
        #: fan-out, which measures them (:func:`.fanout.fan_out`).
        self.srtt: float | None = None
        #: The node's round trip when nothing holds it up (seconds; None before the first),
        #: kept by the fan-out too: it follows a shorter one at once and a longer one by
        #: :data:`.detector.QUICK_GAIN` of the difference, so a reply late by a retransmission
        #: barely moves it (the smoothed round trip takes an eighth of it).
        self.quick: float | None = None
        #: Four times the round trips' mean deviation (:attr:`rttvar`), and the time by which
        #: a reply is late: ``srtt + rttvar4`` (0 before the first round trip). RFC 6298's, as
        #: TCP's retransmission timeout: the operations' reply budget follows it
        #: (:func:`.detector.reply_budget`). Kept four times over, as that sum needs it.
        self.rttvar4 = 0.0
        self.rto = 0.0
        #: When the newest command the node answered (on any connection) was sent; -inf
        #: before the first answer that says.
        self.heard_at = float("-inf")
        #: When the first of the misses went out (its command or connection attempt).
        self.missed_since = 0.0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def rttvar(self) -> float:
        """The round trips' mean deviation (RFC 6298's ``RTTVAR``; 0 before the first)."""
        return self.rttvar4 / 4

    def answered(self, now: float, sent: float | None = None) -> bool:
        """The node answered (a reply, a probe's connection): its misses are forgotten and,
        if it was down, it votes again. ``sent``: when the command it answered was sent (see
        :meth:`heard_since`): a reply to a command sent before the misses began (read late)
        clears nothing. Returns whether it was down."""
        if sent is not None:
            if sent > self.heard_at:
                self.heard_at = sent
            if self.down_since is not None and sent < self.down_since:
                return False
            if self.misses and sent < self.missed_since:
                return False
        self.misses = 0
        if self.down_since is None:
            return False
        self.down_since = None
        self.reason = ""
        return True

    def round_trip(self, rtt: float) -> None:
        """A reply came ``rtt`` seconds after its command went out on a connection already
        set up (a new one's first round trip includes its handshake). The sync fan-out's hot
        path writes this out (:func:`.fanout.fan_out`)."""
        quick = self.quick
        self.quick = rtt if quick is None or rtt < quick else quick + QUICK_GAIN * (rtt - quick)
        srtt = self.srtt
        if srtt is None:
            self.srtt, self.rttvar4 = rtt, 2 * rtt  # RFC 6298: RTTVAR is half the first
        else:
            self.rttvar4 += RTT_GAIN * (4 * abs(rtt - srtt) - self.rttvar4)
            self.srtt = srtt + SRTT_GAIN * (rtt - srtt)
        self.rto = self.srtt + self.rttvar4

    def late_reply(self, read: float, waited: float) -> None:
        """A reply read ``read`` seconds after its command went out, by whoever read its
        connection after the operation stopped waiting for it ``waited`` seconds after (a
        quorum had answered, or the wait ran out). Without it a node slower than the quorum
        is never measured, and its estimate, too low, makes the quorum-th smallest one
        undershoot. Its round trip lies between the two; the time to the read counts, but
        at most twice ``waited``: a reply read long after it came (by the next operation of
        a process that was idle) does not count the idle time."""
        self.round_trip(read if read < 2 * waited else 2 * waited)

    def budget(self) -> float:
        """How long a reply of this node may take before its connection counts as owing a
        late one (a pool's judgement): the node timeout, or longer while its measured round
        trips run longer (:func:`.detector.reply_budget`). Not the back-off of :attr:`rto`:
        a frozen node's connections are not waited on longer for its silence."""
        srtt = self.srtt
        if srtt is None:
            return self.node_timeout
        rto = far_rto(srtt + self.rttvar4, srtt, self.node_timeout)
        return reply_budget(self.node_timeout, (rto,), 1)

    def heard_since(self, when: float) -> bool:
        """Whether the node answered a command (on any connection) sent at or after ``when``:
        it ran what reached it after that moment, so it is not frozen or gone."""
        return self.heard_at >= when

    def missed(self, now: float, *, excused: bool = False, since: float | None = None) -> bool:
        """The node did not answer within its budget (a reply, or a connection attempt).
        ``excused``: this process was stalled meanwhile, so the silence says nothing about the
        node. ``since``: when the unanswered command went out; a node that answered a command
        sent on another connection after that is not silent (one reply held up on a lossy link
        is late, not lost), so the miss says nothing about it either. Returns True when this
        miss made the node down."""
        if excused or self.down_since is not None:
            return False
        # The reply is late, whatever the node's state: the next one gets twice the time (as
        # TCP backs its retransmission timer off), or a node whose round trips run longer
        # than the budget would never answer one in time to teach the budget otherwise.
        self.rto = reply_budget(self.node_timeout, (2 * max(self.rto, self.node_timeout),), 1)
        if since is not None and self.heard_since(since):
            return False
        if not self.misses:
            self.first_miss = now
            self.missed_since = now if since is None else since
        self.misses += 1
        if self.misses >= self.misses_to_down and now - self.first_miss >= self.min_span:
            self.down_since = now
            self.reason = (
                f"no answer {self.misses} times in a row over {now - self.first_miss:.1f} s"
            )
            return True
        return False

    def refused(self, now: float, detail: str) -> bool:
        """A connection to the node failed outright (refused, reset): the node is down at
        once. Returns True when it was up."""
        self.misses = 0
        if self.down_since is not None:
            return False
        self.down_since = now
        self.reason = f"connection failed: {detail}" if detail else "connection failed"
        return True


class Lateness:
    """When any node of this process was last late (the largest :attr:`Node.late_at`): the
    fan-outs ask whether a node is behind a lossy link on every operation, and mostly the
    answer is no, told by this one time without a look at each node."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = float("-inf")


#: This process's :class:`Lateness` (a forked child's starts with its parent's: at worst it
#: looks at its nodes once more).
LATENESS = Lateness()


class Trimmer:
    """One thread per process that calls every live node's :meth:`Node.trim` each
    :data:`TRIM_EVERY` seconds: a process that stops taking locks has no operation left to
    close its idle connections. It ends when no node is left (closed or collected)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: weakref.WeakSet[Node] = weakref.WeakSet()
        self._pid: int | None = None

    def watch(self, node: Node) -> None:
        with self._lock:
            self._nodes.add(node)
            if self._pid != ThisProcess.pid:
                self._pid = ThisProcess.pid
                threading.Thread(target=self._run, name="redlock-trimmer", daemon=True).start()

    def forget(self, node: Node) -> None:
        with self._lock:
            self._nodes.discard(node)

    def _run(self) -> None:
        pid = ThisProcess.pid
        while True:
            time.sleep(TRIM_EVERY)  # a timer: no event to wait for
            with self._lock:
                nodes = list(self._nodes)
                if not nodes or self._pid != pid:
                    if self._pid == pid:
                        self._pid = None
                    return
            for node in nodes:
                with contextlib.suppress(Exception):  # a node closed meanwhile
                    node.trim()
            del nodes


trimmer = Trimmer()


class Node:
    """One independent Redis server: pooled connections for lock commands, and a redis-py client
    for listing, health and pub/sub."""

    def __init__(self, spec: NodeSpec, *, node_timeout: float, asyncio: bool = False) -> None:
        url, options = parse_spec(spec)
        self.url = url
        #: The URL without credentials: safe for logs, errors and the admin page.
        self.name = redact(url)
        options.pop("decode_responses", None)
        #: At most this many lock connections open to the node in this process (redis-py's
        #: name for a pool's cap): an operation that finds them all busy waits for one
        #: (:meth:`checkout`). None: as many as the operations use at once.
        self.max_connections = max_connections(url, options)
        options.pop("max_connections", None)
        if asyncio and self.max_connections is not None:
            raise ValueError(MAX_CONNECTIONS_ASYNC)
        #: Lock connections open (or being opened) to the node in this process.
        self._open = 0
        #: Held to count them; notified when one comes back to the pool or closes.
        self._room = threading.Condition()
        #: The most connections in use at once in this :data:`IDLE_FOR` window and the one
        #: before, when this window ends, and what they make :meth:`wanted`.
        self._peak = 0
        self._peak_before = 0
        self._window_ends = time.monotonic() + IDLE_FOR
        self._wanted = IDLE_SLACK
        #: A Sentinel-managed group's Sentinels: the node's address is its master's, asked
        #: for with every new connection (:meth:`locate`). None for a server's URL.
        self.group: SentinelGroup | None = None
        #: Where a group's master was last located (None before, and for a server's URL):
        #: its connections go there (:meth:`connection`), and are used at that epoch only.
        self.where: Where | None = None
        if is_group_url(url):
            self.group = SentinelGroup(url, options, node_timeout=node_timeout)
        #: redis-py's connection class and arguments for the node, from redis-py's own URL
        #: parsing with OPTIONS on top: every option means what it means in redis-py (a
        #: group's are its master's, at the address :meth:`locate` finds).
        self.connection_class, self.connection_kwargs = connection_args(url, options)
        #: The same for ``redis.asyncio`` (an asyncio client's lock connections; the
        #: reconnector's probes stay sync), None for a sync client.
        self.aio_connection_args = connection_args(url, options, asyncio=True) if asyncio else None
        self.node_timeout = node_timeout
        #: The client's nodes by the run id of the server each reached first (shared by
        #: them, see :func:`make_nodes`): what a URL cannot tell (a unix socket and a TCP
        #: port of one server), the server's identity can.
        self.reached: dict[str, Node] = {}
        self._idle: deque[Wire] = deque()
        #: Connections given up, kept open (and read) until the node has run what they
        #: carry: see :meth:`abandon`.
        self._draining: deque[tuple[Wire, float]] = deque()
        #: Releases that could not reach the node (no connection, or it broke): the next
        #: operation that reaches it sends them first (:meth:`send_later`). A release checks
        #: its token, so sending it late never touches another holder's lock.
        self.later: deque[bytes] = deque(maxlen=10_000)
        #: ``(process id, time.monotonic())`` of the connection attempt that timed out, until
        #: the node is reached again: operations then count it as failed at once
        #: (:meth:`unreachable`). A forked child has no reconnector: it starts over.
        self._silent: tuple[int, float] | None = None
        #: ``(process id, time.monotonic())`` of a miss, while the reconnector connects to
        #: the node in the background (:meth:`not_now`).
        self._probing: tuple[int, float] | None = None
        #: Spare connections being opened (:meth:`want_spare`).
        self._spares = 0
        #: The reconnector's connections being opened (:meth:`reconnect`).
        self._probes = 0
        self._spares_lock = threading.Lock()
        #: Connections being opened for fan-outs on threads of their own (:meth:`open_for`),
        #: when the oldest of them began (``time.monotonic``), and the fan-outs waiting for
        #: one (held with ``_spares_lock``).
        self._opening = 0
        self._opening_since = 0.0
        self._waiting: set[Wakeup] = set()
        self.closed = False
        #: When (``time.monotonic``) a reply of this node last came later than the node
        #: timeout, or a connection had to be set aside for one (see :data:`.hedging.LOSSY_FOR`).
        self.late_at = float("-inf")  # set through mark_late()
        #: What this process has seen of the node: misses, connection errors, round trips.
        self.detector = NodeDetector(node_timeout)
        #: Idle asyncio connections of event loops that ended, for the next loop to adopt
        #: (``aionodes.park``): a fresh loop per request (an async view under WSGI) then
        #: connects nothing. Each entry has a ``sock`` (closed with the node).
        self.parked: deque[Any] = deque()
        self._pid = ThisProcess.pid
        slow = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0, **options}
        #: For work that may take longer than a lock operation (SCAN, INFO, pub/sub).
        self.client = (
            redis.Redis.from_url(url, **slow)
            if self.group is None
            else self.group.client(**{k: v for k, v in slow.items() if k != "sentinel_kwargs"})
        )
        trimmer.watch(self)

    def __repr__(self) -> str:
        return f"<Node {self.name}>"

    @property
    def master(self) -> tuple[str, int] | None:
        """``(host, port)`` of a group's master as last located (None before, and for a
        server's URL)."""
        where = self.where
        return None if where is None else where[0]

    @property
    def address(self) -> str | None:
        """A group node's master as last resolved (``host:port``); None for a server's URL."""
        return None if self.group is None else self.group.address

    def locate(self, where: Where | None = None) -> None:
        """Before a new connection: point a group node at its master (``where``, else asked
        of the Sentinels now). When the master moved, or a failover named it again (a new
        epoch), the idle connections are closed (what they owe for ended operations goes out
        on a new one): a new connection's first vote is the acquire script's, which judges
        the epoch. Raises :class:`WireError` when no master is known."""
        group = self.group
        if group is None:
            return
        if where is None:
            try:
                where = group.find()
            except SentinelUnavailable as exc:
                raise WireError(Failure("error", str(exc))) from None
        if self.where == where:
            return
        self.where = where  # one tuple, swapped whole: other threads may be connecting
        while self._idle:
            try:
                wire = self._idle.pop()
            except IndexError:
                break
            self.lose(wire)

    def connection(
        self, timeout: float, *, asyncio: bool = False, where: Where | None = None
    ) -> Any:
        """A new (unconnected) redis-py connection to the node (``redis.asyncio``'s with
        ``asyncio``) that connects, and answers its handshake, within ``timeout`` seconds:
        a group node's to its master at ``where`` (as last located when not given)."""
        cls, kwargs = self.connection_class, self.connection_kwargs
        if asyncio:
            assert self.aio_connection_args is not None
            cls, kwargs = self.aio_connection_args
        if where is None:
            where = self.where
        if where is not None:
            master = where[0]
            kwargs = {**kwargs, "host": master[0], "port": master[1]}
        return cls(**kwargs, socket_timeout=timeout, socket_connect_timeout=timeout)

    def checkout(self, deadline: float) -> Wire:
        """A pooled connection, or a new one (which may take until ``deadline``, on the
        monotonic clock, and at least 5 ms). Raises :class:`WireError` at once while the
        node is unreachable (:meth:`unreachable`). See :meth:`checkout_pooled`."""
        wire = self._checkout(deadline, True)
        assert wire is not None
        return wire

    def checkout_pooled(self, deadline: float) -> Wire | None:
        """:meth:`checkout`, but None where it would open a new connection: the caller has
        one opened in the background (:meth:`open_for`) rather than wait for its handshake
        (also where every connection owes a reply held up far beyond the node's round trip:
        :meth:`_held_up`). Raises :class:`WireError` at once while the node is down
        (:meth:`unreachable`)."""
        return self._checkout(deadline, False)

    def _checkout(self, deadline: float, connect: bool) -> Wire | None:
        """:meth:`checkout`'s work; with ``connect`` False, None instead of a new
        connection.

        A pooled connection that still owes a reply it should have had by now (a lost packet
        holds it up for TCP's retransmission, 200 ms at least) is not used: a command sent
        behind it would wait for it too. It is set aside, read as its replies come, and
        pooled again once it owes nothing (:meth:`_sweep`). One whose reply may still come in
        time is used when no other is idle (owed for less than a quarter of the node timeout
        first, else for less than the node timeout): connecting costs a round trip of its
        own, and on a loaded host replies are merely slow."""
        if self._pid != ThisProcess.pid:
            # Inherited sockets belong to the parent's conversations with the node, and the
            # parent's reconnector is not running here.
            self._idle = deque()
            self._draining = deque()
            self._spares = 0
            self._probes = 0
            # The parent's threads opening connections did not come along.
            self._opening = 0
            self._waiting = set()
            self._open = self._peak = self._peak_before = 0
            self._wanted = IDLE_SLACK
            self.detector.reset()
            self._pid = ThisProcess.pid
            trimmer.watch(self)
        if self._draining:
            self._sweep()
        if self.group is not None and self.group.due(self.where):
            self.locate()
        #: An owing connection whose reply may still come in time: owed for less than a
        #: quarter of the node timeout (``young``: a reply later than that is probably held
        #: up on the link), or for less than the node timeout (``due``).
        young: Wire | None = None
        due: Wire | None = None
        group = self.group
        while True:
            try:
                wire = self._idle.pop()
            except IndexError:
                break
            if group is not None and not self.current(wire):
                self.lose(wire)  # to a group's former master, or of a former epoch
                continue
            if not wire.due:
                owes: bool | None = False
            else:
                owes = self._owes(wire)
                if owes is None:
                    continue
            if owes:
                now = time.monotonic()
                owed_for = now - wire.due[0].sent
                budget = self.detector.budget()
                if owed_for >= budget:
                    self.abandon(wire)  # as a fan-out gives up a connection past it
                    # A reply that operations decided without (a quorum answered first) is
                    # past its budget: a miss, unless the node answered since.
                    self.went_silent(since=wire.due[0].sent)
                elif young is None and owed_for < budget / 4:
                    young = wire
                elif due is None:
                    due = wire
                else:
                    self._draining.append((wire, now + DRAIN_FOR))
                    self.mark_late(now)
                    self.want_spare()  # its stand-in, while it waits for its reply
                continue
            for owing in (young, due):
                if owing is not None:
                    self._idle.appendleft(owing)  # last in line: its reply may be late
            if self._draining and len(self._idle) < SPARES:
                # Replies are late on this link: stand-ins for the connections waiting for
                # theirs are opened before the pool runs dry, not once it has.
                self.want_spare()
            return wire
        if young is not None:
            if due is not None:
                self._idle.appendleft(due)
            return young
        if due is not None:
            # On a loaded host a reply is merely slow: waiting behind it within the node
            # timeout beats counting the node out. A spare is opened in the background.
            self.want_spare()
            return due
        if self._draining and not connect and self._held_up():
            # Every connection owes a reply held up far beyond the node's round trip (a lost
            # packet, or a frozen node): the operation waits, as for any connection being
            # opened, for one in use to come back or for one opened in the background
            # (:meth:`open_for`), a little (a frozen node costs it a fraction of the node
            # timeout: see fanout.suspect_linger).
            return None
        if self._draining and not self._worth_waiting():
            # Every connection owes a reply past its deadline: the node is frozen, or behind
            # a lossy link, where a handshake may be late too. Others are opened in the
            # background; this operation tries one handshake within the node timeout if the
            # node answered anything since its oldest late command went out (a lossy link,
            # not a frozen node), and a handshake that is late itself is no miss: the
            # connections waiting for their replies tell that story already.
            self.want_spare()
            oldest = self._oldest_owed() or 0.0
            if self.unreachable() is None and self.detector.heard_since(oldest):
                try:
                    return Wire(self, min(self.node_timeout, deadline - time.monotonic()))
                except WireError:
                    pass
            raise WireError(BEHIND_LATE)
        if self.max_connections is not None and self._await_room(deadline):
            return self._checkout(deadline, connect)
        if not connect:
            failure = self.unreachable()
            if failure is not None:
                raise WireError(failure)
            return None
        try:
            return self.connect(max(deadline - time.monotonic(), 0.005))
        except WireError as exc:
            if exc.failure is not AT_CAP:
                raise
        return self._checkout(deadline, connect)  # another thread took the last slot first

    def _held_up(self) -> bool:
        """Whether the oldest reply owed on a set-aside connection has been owed for more
        than :data:`HELD_UP_ROUND_TRIPS` of the node's round trips while the node is not
        down: it is not on its way (a far node's reply owed for less is, and a new
        connection's handshake would take longer than waiting for it)."""
        quick = self.detector.quick
        if quick is None or self.unreachable() is not None:
            return False
        oldest = self._oldest_owed()
        return oldest is not None and time.monotonic() - oldest > HELD_UP_ROUND_TRIPS * quick

    def _oldest_owed(self) -> float | None:
        """When the oldest command still owed on a set-aside connection was sent."""
        return min((w.due[0].sent for w, _ in list(self._draining) if w.due), default=None)

    def _comes_back(self) -> bool:
        """Whether a connection to the node is being opened for an operation, or is in use
        by one (neither idle nor set aside, nor opened in the background for the pool): it
        comes back to the pool within an operation."""
        if self._opening:
            return True
        in_use = self._open - self._spares - self._probes - len(self._idle)
        return in_use > len(self._draining)

    def _worth_waiting(self) -> bool:
        """Whether :attr:`max_connections` are open and some are in use (not all set aside
        for late replies): one comes back within an operation."""
        cap = self.max_connections
        return cap is not None and self._open >= cap and self._open > len(self._draining)

    def _await_room(self, deadline: float) -> bool:
        """With :attr:`max_connections` open: wait, until ``deadline``, for one to come back
        to the pool (True) or to close (False: one may be opened). Raises :class:`WireError`
        at the deadline: the operation counts the node as failed, without a miss (the node
        did nothing wrong)."""
        cap = self.max_connections
        with self._room:
            while cap is not None and self._open >= cap:
                if self._idle:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WireError(AT_CAP)
                self._room.wait(remaining)
        return False

    def take_slot(self) -> None:
        """Count a connection about to be opened; raises :class:`WireError` (:data:`AT_CAP`)
        when :attr:`max_connections` are open already."""
        with self._room:
            if self.max_connections is not None and self._open >= self.max_connections:
                raise WireError(AT_CAP)
            self._open += 1

    def free_slot(self) -> None:
        with self._room:
            self._open = max(self._open - 1, 0)
            self._room.notify()

    def wanted(self) -> int:
        """How many connections the node keeps open outside those set aside for late
        replies: the most its operations had in use at once in the last :data:`IDLE_FOR`
        seconds or so, and :data:`IDLE_SLACK` more. Beyond that, a connection coming back
        to the pool is closed and no spare is opened."""
        return self._wanted

    def _note_busy(self, now: float) -> None:
        """Count the connections in use now (open, neither idle nor set aside) towards
        :meth:`wanted`; a new window begins every :data:`IDLE_FOR` seconds."""
        busy = self._open - len(self._idle) - len(self._draining)
        if now >= self._window_ends:
            self._peak_before, self._peak = self._peak, busy
            self._window_ends = now + IDLE_FOR
        elif busy > self._peak:
            self._peak = busy
        else:
            return
        self._wanted = max(self._peak, self._peak_before) + IDLE_SLACK

    def _pool(self, wire: Wire, now: float | None = None, *, last: bool = False) -> None:
        """Put ``wire`` in the pool (the next to be used, or with ``last`` the last), or
        close it when the pool holds what the operations want already (:meth:`wanted`) and it
        owes nothing: spares opened while replies were late would otherwise stay open once
        those replies came (closing one that owes a reply would reset it, and the node drop
        what it has not read). ``now``: the monotonic time, if the caller has it."""
        if now is None:
            now = time.monotonic()
        idle = self._idle
        # Only a new peak or window calls _note_busy(): every reply of every fan-out comes here.
        if self._open - len(idle) - len(self._draining) > self._peak or now >= self._window_ends:
            self._note_busy(now)
        if len(idle) >= self._wanted and not wire.due:
            wire.close()
            return
        wire.reused = True
        wire.idle_since = now
        if last:
            idle.appendleft(wire)
        else:
            idle.append(wire)
        if self._waiting:
            for wakeup in list(self._waiting):  # fan-outs waiting for a connection
                wakeup.tell(self, None)
        if self.max_connections is not None:
            with self._room:
                self._room.notify()

    def trim(self) -> None:
        """Run by the trimmer every :data:`TRIM_EVERY` seconds: read the replies that came in
        on idle connections that owed them (a connection is never counted busy with its reply
        waiting in the socket), give up those whose reply is later than the node timeout
        (:meth:`abandon`), and close those unused for :data:`IDLE_FOR` seconds, keeping
        :data:`MIN_IDLE`."""
        if self._pid != ThisProcess.pid or self.closed:
            return
        now = time.monotonic()
        self._note_busy(now)
        if self._draining:
            self._sweep()
        for wire in list(self._idle):
            unused = wire.idle_since <= now - IDLE_FOR
            if not wire.due and not (unused and len(self._idle) > MIN_IDLE):
                continue
            owes = self._take(wire)
            if owes is None:
                continue
            if owes and wire.overdue(time.monotonic(), self.detector.budget()):
                self.abandon(wire)
            elif owes or not unused or len(self._idle) + 1 <= MIN_IDLE:
                self._idle.appendleft(wire)
            else:
                wire.close()

    def _take(self, wire: Wire) -> bool | None:
        """Take ``wire`` out of the pool and read what came in on it: whether it still owes
        replies; None when another thread took it first, or it broke (see :meth:`_owes`)."""
        try:
            self._idle.remove(wire)
        except ValueError:
            return None
        return self._owes(wire) if wire.due else False

    def spare(self) -> Wire | None:
        """An idle pooled connection that owes nothing, taken out of the pool, for a copy of
        a command whose reply is late on another connection (a hedged request: see
        :mod:`.fanout`); None when there is none (where replies are late, more are then
        opened in the background). It never connects: a copy that must wait for a handshake
        comes too late to help."""
        if self._draining:
            self._sweep()
        for wire in list(self._idle):
            if not self.current(wire):
                continue
            # Most that owe owe only replies that came in since (a copy's, read by nobody).
            owes = self._take(wire)
            if owes is None:
                continue
            if owes:
                self._idle.appendleft(wire)
                continue
            return wire
        if self._draining:
            self.want_spare()  # replies are late on this link: copies will want more
        return None

    def want_spare(self) -> None:
        """Open one more connection to the node for the pool, on a thread of its own (at most
        :data:`SPARES` being opened at a time), as the asyncio client does: replies are late
        on its link, and the connections that wait for theirs take no command meanwhile. Not
        through the reconnector, which serves every node in turn, waiting for each one's
        handshakes (one of which a lossy link makes late now and then) before the next. None
        while the node is down or just missed an answer (:meth:`not_now`): the reconnector
        reaches it first, and the next operation that finds its replies late asks again."""
        with self._spares_lock:
            if self._spares >= SPARES or self.closed or self.not_now() is not None:
                return
            if self._open + self._spares - len(self._draining) >= self.wanted():
                return  # the pool holds what the operations use at once already
            if self.max_connections is not None and self._open >= self.max_connections:
                return
            self._spares += 1
        threading.Thread(target=self._open_spare, name="redlock-spare", daemon=True).start()

    def _owes(self, wire: Wire) -> bool | None:
        """Read what has arrived on a pooled or set-aside connection that owes replies (never
        blocks): whether it still owes some; None when it broke (it is lost: see
        :meth:`lose`). Once it owes nothing, the node answered the last command sent on it
        (perhaps after it missed its deadline: a late reply is a lossy or slow link, not a
        down node): operations connect to the node again, and its misses are forgotten."""
        sent = wire.due[-1].sent
        try:
            wire.read()
        except Incomplete:
            return True
        except OSError:
            self.lose(wire)
            return None
        self.detector.answered(time.monotonic(), sent)
        # Only news from after a miss says the node is back: a reply read late may have
        # been sent before it froze.
        probing = self._probing
        if probing is not None and sent >= probing[1]:
            self._probing = None
        silent = self._silent
        if silent is not None and sent >= silent[1]:
            self._silent = None
        return False

    def current(self, wire: Any) -> bool:
        """Whether ``wire`` goes to the node's server: a group's master as last named, at the
        epoch last named (a connection to a former master, or opened before a failover named
        its server master again, is not used again)."""
        where = self.where
        return self.group is None or (
            where is not None and wire.address == where[0] and wire.epoch == where[1]
        )

    def connect(self, timeout: float) -> Wire:
        """A new connection, within ``timeout`` seconds; raises :class:`WireError` (at once
        while the node is down: :meth:`unreachable`)."""
        failure = self.unreachable()
        if failure is not None:
            raise WireError(failure)
        started = time.monotonic()
        try:
            self.locate()
            wire = Wire(self, timeout)
        except WireError as exc:
            self.connect_failed(exc.failure, timeout, time.monotonic() - started)
            raise
        self.connected()
        return wire

    def connect_failed(
        self, failure: Failure, budget: float, took: float, *, miss: bool = True
    ) -> None:
        """An operation's attempt to connect within ``budget`` seconds failed after ``took``:
        a timeout is a miss (unless not ``miss``: a spare opened in the background, whose
        lateness the connections waiting for their replies already tell; excused when this
        process overran the budget), a refusal makes the node down at once."""
        if failure.reason == "timeout":
            if miss:
                self.went_silent(overrun(budget, took) > 0)
        elif failure.reason == "refused":
            self.detector.refused(time.monotonic(), failure.detail)

    def connected(self) -> None:
        """An operation connected to the node: if it was down, it votes again."""
        if self.detector.down:
            self.detector.answered(time.monotonic())

    def unreachable(self) -> Failure | None:
        """Why an operation must not wait to connect to the node now: a connection attempt
        timed out and the node has not been reached since. Trying again in every operation
        would make each wait ``node_timeout`` while the node stays silent (frozen, or its
        packets dropped); the reconnector tries instead."""
        silent = self._silent
        if silent is None or silent[0] != ThisProcess.pid:
            return None
        return Failure(
            "timeout",
            f"{self.detector.reason or 'no answer'}; down for "
            f"{time.monotonic() - silent[1]:.1f} s (reconnecting in the background)",
        )

    def not_now(self) -> Failure | None:
        """Why no spare connection is opened to the node now: it is down
        (:meth:`unreachable`), or it just missed an answer and the reconnector is connecting
        to it in the background (:meth:`missed_lately`). An operation may still have one
        opened for itself, and waits for it only a little (:func:`.fanout.suspect_linger`)."""
        failure = self.unreachable()
        if failure is not None:
            return failure
        probing = self._probing
        if probing is None or probing[0] != ThisProcess.pid:
            return None
        return Failure("timeout", "missed an answer; connecting in the background")

    def near(self) -> bool:
        """Whether :data:`HELD_UP_ROUND_TRIPS` of the node's round trips fit in the node
        timeout, so a reply later than that is held up (a lost packet, a frozen node) rather
        than on its way: a far node's late reply is on its way (its first round trips, not
        yet settled, stretch its budget), and a new connection's handshake would take longer
        than it."""
        quick = self.detector.quick
        return quick is not None and HELD_UP_ROUND_TRIPS * quick < self.node_timeout

    def missed_lately(self) -> bool:
        """Whether the node missed an answer (excused or not) and has not answered since: it
        may be frozen, so an operation waits for a new connection to it only a little
        (:func:`.fanout.suspect_linger`)."""
        probing = self._probing
        return probing is not None and probing[0] == ThisProcess.pid

    def mark_late(self, now: float) -> None:
        """A reply of this node came later than the node timeout, or a connection had to be
        set aside for one, at ``now``."""
        self.late_at = now
        if now > LATENESS.last:
            LATENESS.last = now

    def went_silent(self, excused: bool = False, since: float | None = None) -> None:
        """A connection attempt, or a command, got no answer within its budget: one miss
        (``excused``, ``since``: as :meth:`NodeDetector.missed`; a late reply's connection is
        read as it comes: see :meth:`abandon`). The reconnector connects to the node in the
        background, and operations wait for their own new connections to it only a little
        (:meth:`missed_lately`); once the misses are evidence that it is down
        (:mod:`.detector`), it counts as failed at once until it answers again."""
        if self.unreachable() is not None:
            return
        if since is not None and self.detector.heard_since(since):
            return
        now = time.monotonic()
        if self.detector.missed(now, excused=excused, since=since):
            self._silent = (ThisProcess.pid, now)
        self._probing = (ThisProcess.pid, now)
        reconnector.watch(self)

    def reconnect(self) -> bool:
        """One attempt of the reconnector; True once the node is reached (or no longer
        waited for: :meth:`close`). The new connection sends what could not reach the node
        meanwhile and reads the answers before the node counts as back (an asyncio client
        never reads this connection, and a connection cut with them unanswered keeps them
        for the next try); then it goes to the pool. Spare connections are not its work
        (:meth:`want_spare`)."""
        if self.unreachable() is None and self._probing is None:
            return True
        budget = connect_budget(self.node_timeout)
        started = time.monotonic()
        self._probes += 1
        try:
            self.locate()
            wire = Wire(self, budget)
        except WireError as exc:
            now = time.monotonic()
            if exc.failure is AT_CAP:
                return False  # every connection allowed is in use: the node is not silent
            if exc.failure.reason == "refused":
                # Refused at once: operations may try it themselves, it costs them nothing.
                self.detector.refused(now, exc.failure.detail)
                self._silent = self._probing = None
                return True
            if self.detector.missed(now, excused=overrun(budget, now - started) > 0):
                self._silent = (ThisProcess.pid, now)
            return False
        finally:
            self._probes -= 1
        if self.unreachable() is None and self._probing is None:  # closed meanwhile
            wire.close()
            return True
        try:
            self.send_later(wire)
            wire.settle_within(self.detector.budget())
        except (OSError, Incomplete):
            self.lose(wire)  # what it carries goes out again with the next try
            return False
        if self._idle and not wire.due:
            # The pool has one already (an asyncio client's misses are probed here too, and
            # never use this pool): one per probe would pile up.
            wire.close()
        else:
            self.checkin(wire)
        self.detector.answered(time.monotonic())
        self._silent = None
        self._probing = None
        return True

    def open_for(self, wakeup: Wakeup, budget: float) -> None:
        """A fan-out that found no pooled connection to the node waits for one opened on a
        thread of its own within ``budget`` seconds: ``wakeup`` hears of each connection so
        opened (pooled, for whichever operation takes it first) or of why it failed, until
        :meth:`stop_waiting`. The fan-out never waits for a handshake itself, so a node that
        accepts TCP and never answers it (a frozen server) costs the caller its reply budget
        at most, not the connect budget; and no command goes out on a connection before it
        is open and taken by an operation still waiting, so none is left carrying an
        acquire that nobody will undo. While one such connection has been opening for
        longer than the node timeout, no other is started: the node may be silent, and the
        fan-outs wait for that one (its failure after its budget is the miss it is: see
        :meth:`connect`)."""
        with self._spares_lock:
            self._waiting.add(wakeup)
            if self._draining and self._comes_back():
                # Replies are late on this link: rather than open ever more connections (a
                # busy host, where they are late everywhere), the one in use comes back
                # (:meth:`_pool` tells the fan-outs waiting).
                return
            now = time.monotonic()
            if self._opening and (
                self._opening >= SPARES or now - self._opening_since > self.node_timeout
            ):
                return
            if not self._opening:
                self._opening_since = now
            self._opening += 1
        threading.Thread(
            target=self._open_for_fan_outs, args=(budget,), name="redlock-connect", daemon=True
        ).start()

    def connecting_since(self) -> float | None:
        """When (``time.monotonic``) the connections being opened for fan-outs began, at
        the earliest (see :meth:`open_for`); None when none is."""
        return self._opening_since if self._opening else None

    def stop_waiting(self, wakeup: Wakeup) -> None:
        """A fan-out no longer waits for a connection opened for it (see :meth:`open_for`)."""
        with self._spares_lock:
            self._waiting.discard(wakeup)

    def _open_for_fan_outs(self, budget: float) -> None:
        failure: Failure | None = None
        try:
            wire = self.connect(budget)
        except WireError as exc:
            failure = exc.failure
        except BaseException as exc:  # a thread of its own: nobody else would hear of it
            failure = Failure("error", str(exc) or type(exc).__name__)
        else:
            if self._pid != ThisProcess.pid or self.closed:
                wire.close()
                failure = Failure("error", "the client was closed")
            else:
                try:
                    # What could not reach the node meanwhile goes out now (a release kept by
                    # an operation that gave up waiting for this very connection): the next
                    # operation may be long in coming. Its replies are read by the next user.
                    self.send_later(wire)
                except OSError as exc:
                    self.lose(wire)  # what it carried is kept again
                    failure = os_failure(exc)
                else:
                    self._pool(wire)
        with self._spares_lock:
            self._opening = max(self._opening - 1, 0)
            if self._opening:
                self._opening_since = time.monotonic()  # a later one's start, at the latest
            waiting = list(self._waiting)
        for wakeup in waiting:
            wakeup.tell(self, failure)

    def _open_spare(self) -> None:
        try:
            try:
                self.locate()
                wire = Wire(self, connect_budget(self.node_timeout))
            except WireError:
                return  # the operations find out why
            if self._pid != ThisProcess.pid or self.closed:
                wire.close()
                return
            self.detector.answered(time.monotonic())
            self._pool(wire, last=True)
        finally:
            with self._spares_lock:
                self._spares = max(self._spares - 1, 0)

    def checkin(self, wire: Wire) -> None:
        if wire.on_replica or (self.group is not None and not self.current(wire)):
            self.lose(wire)  # the next connection goes to the master (see locate)
            return
        self._pool(wire)

    def abandon(self, wire: Wire) -> None:
        """Stop waiting on a connection (it owes a reply older than the node timeout): the
        undo of every command it carries goes out behind them, on the same connection, so the
        node runs it after the command however late that arrives. It is not closed: closing a
        socket whose replies are still coming resets the connection, and the node then drops
        what it has not read (a frozen node: the commands and the undos queued behind them);
        and a late reply is not a dead connection (a lost packet delays it by TCP's
        retransmission). The next :meth:`checkout` reads it; once it owes nothing it is pooled
        again, and after :data:`DRAIN_FOR` seconds without that it is closed."""
        owed = undos(wire.due)
        try:
            if owed:
                wire.send_unowned(owed)
        except OSError:
            self.lose(wire)  # the undos were owed: lose keeps them
            return
        now = time.monotonic()
        self.mark_late(now)
        self._draining.append((wire, now + DRAIN_FOR))

    def lose(self, wire: Wire) -> None:
        """Close a connection that broke: what it carried for operations that ended and must
        still reach the node (:func:`unfinished`) goes out with the next operation."""
        self.later.extend(unfinished(wire.due))
        wire.close()

    def _sweep(self) -> None:
        for _ in range(len(self._draining)):
            try:
                wire, until = self._draining.popleft()
            except IndexError:  # another thread swept it
                return
            owes = self._owes(wire) if wire.due else False
            if owes is None:
                continue
            if owes:
                if time.monotonic() < until:
                    self._draining.append((wire, until))
                else:
                    wire.close()
                continue
            if wire.on_replica or (self.group is not None and not self.current(wire)):
                self.lose(wire)
            else:
                self._pool(wire, last=True)

    def send_later(self, wire: Wire) -> None:
        """Send on ``wire`` what could not reach the node before (see :attr:`later`). If
        sending fails, they are owed by ``wire``: :meth:`lose` keeps them again."""
        data = self.owe_later(wire)
        if data:
            wire.write(data)

    def owe_later(self, wire: Wire) -> bytes:
        """:meth:`send_later` for a caller that sends the returned bytes on ``wire`` in the
        same write as its own command, right behind them. On a hot key a waiter's leave of
        the name's waiters goes out with its release this way: a write of its own would wake
        the node (and, on a busy host, often switch to it) once more per node, on the path
        from one holder to the next."""
        pending = self.take_later()
        return wire.owe_unowned(pending) if pending else b""

    def take_later(self) -> list[bytes]:
        """Everything in :attr:`later`, taken out before it is sent: a send that fails puts
        its command back, for the next connection."""
        pending = []
        while self.later:
            try:
                pending.append(self.later.popleft())
            except IndexError:  # another thread took them
                break
        return pending

    def reclaim(self, wire: Wire) -> bool:
        """Take ``wire`` out of the pool if it is idle there, or set aside owing a late reply
        (another thread may be using it, or it was closed)."""
        try:
            self._idle.remove(wire)
        except ValueError:
            pass
        else:
            return True
        for entry in list(self._draining):
            if entry[0] is wire:
                try:
                    self._draining.remove(entry)
                except ValueError:
                    return False
                return True
        return False

    def close(self) -> None:
        self.closed = True
        self._spares = 0
        reconnector.forget(self)
        trimmer.forget(self)
        self._silent = None
        self._probing = None
        self.detector.reset()
        while self.parked:
            with contextlib.suppress(OSError):
                self.parked.pop().sock.close()
        while self._idle:
            wire = self._idle.pop()
            with contextlib.suppress(OSError):
                wire.undo_unwanted()
            wire.close()
        while self._draining:
            wire = self._draining.pop()[0]
            with contextlib.suppress(OSError):
                wire.undo_unwanted()  # a copy of a released lock's acquire may still land
            wire.close()
        self.client.close()
        if self.group is not None:
            self.group.close()


def parse_spec(spec: NodeSpec) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, redis.Redis):
        pool = spec.connection_pool
        kwargs = dict(pool.connection_kwargs)
        if "path" in kwargs:
            url = f"unix://{kwargs.pop('path')}?db={kwargs.pop('db', 0)}"
        else:
            tls = issubclass(pool.connection_class, redis.connection.SSLConnection)
            url = (
                f"{'rediss' if tls else 'redis'}://{kwargs.pop('host', 'localhost')}:"
                f"{kwargs.pop('port', 6379)}/{kwargs.pop('db', 0)}"
            )
        # Every connection setting of the client (TLS, credentials, keepalive...) is kept;
        # timeouts are the Redlock's own, and the default retry of a redis.Redis would make a
        # down node cost several connection attempts with back-off inside one lock operation.
        # The lock connections parse RESP2 whatever the client speaks: the same replies.
        for drop in ("socket_timeout", "socket_connect_timeout", "decode_responses", "retry"):
            kwargs.pop(drop, None)
        kwargs.pop("protocol", None)
        kwargs["connection_class"] = pool.connection_class
        return url, {k: v for k, v in kwargs.items() if k in _OPTIONS}
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"URL", "OPTIONS"}
        if "URL" not in spec or unknown:
            raise ValueError(
                "a node given as a dict needs 'URL' and may have 'OPTIONS', "
                f"got keys {sorted(spec)}"
            )
        # Only a missing OPTIONS means none: a falsy non-dict ([], None, 0) is a mistake.
        options = spec.get("OPTIONS", {})
        if not isinstance(options, Mapping):
            raise TypeError(f"node OPTIONS must be a dict, got {options!r}")
        url = _check_url(spec["URL"])
        return url, _check_options(options, group=is_group_url(url), node=redact(url))
    return _check_url(spec), {}


#: What a node's OPTIONS may set: redis-py's connection settings (the URL gives the address),
#: and its connection class (a TLS one, from a cache's client).
_OPTIONS = frozenset(inspect.signature(redis.Redis.__init__).parameters) - {
    "self",
    "connection_pool",
    "host",
    "port",
    "db",
    "unix_socket_path",
} | {"connection_class"}

#: What a group's ``sentinel_kwargs`` may set: redis-py's ``Sentinel`` builds a
#: ``redis.Redis(host, port, **sentinel_kwargs)`` for each Sentinel.
_SENTINEL_OPTIONS = frozenset(inspect.signature(redis.Redis.__init__).parameters) - {
    "self",
    "connection_pool",
    "host",
    "port",
}

#: ``redis.Redis`` settings of its client or pool, not of a connection: the lock connections
#: are not drawn from a redis-py pool, so these could only be dropped.
_POOL_OPTIONS = {
    "single_connection_client": "the lock connections are the package's own, not one "
    "client connection's",
    "cache": "a lock's state is never read from a client-side cache",
    "cache_config": "a lock's state is never read from a client-side cache",
}

#: OPTIONS that are durations in seconds (checked here: redis-py takes them as they come).
_DURATION_OPTIONS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")


def _check_options(
    options: Mapping[str, Any], *, group: bool = False, node: str = ""
) -> dict[str, Any]:
    """A node's OPTIONS, refused before anything connects (an unknown name or a bad value
    would otherwise surface as a node that looks down). A Sentinel group's may also give
    ``sentinel_kwargs``: redis-py's settings for the connections to its Sentinels. ``node``:
    the node's URL as shown, for the errors that redis-py would raise without naming it."""
    allowed = _OPTIONS | {"sentinel_kwargs"} if group else _OPTIONS
    unknown = sorted(str(name) for name in options if name not in allowed)
    if unknown:
        raise ValueError(
            f"node OPTIONS {unknown[0]!r} is not a redis-py connection setting that a node may "
            "set (the URL gives the address; e.g. password, username, ssl_ca_certs, "
            "socket_timeout)"
        )
    sentinel_kwargs = options.get("sentinel_kwargs")
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
        raise TypeError(
            f"node OPTIONS sentinel_kwargs must be a dict, got {type(sentinel_kwargs).__name__}"
        )
    unknown = sorted(str(name) for name in sentinel_kwargs or {} if name not in _SENTINEL_OPTIONS)
    if unknown:
        # redis-py would raise a bare TypeError at the first connection to a Sentinel
        raise ValueError(
            f"node {node!r} OPTIONS sentinel_kwargs {unknown[0]!r} is not a redis-py "
            "connection setting of a Sentinel connection (the Sentinels' addresses are in the "
            "URL; e.g. password, username, ssl, socket_timeout)"
        )
    _check_durations("node OPTIONS sentinel_kwargs", sentinel_kwargs or {})
    for name, why in _POOL_OPTIONS.items():
        if options.get(name) is not None:
            raise ValueError(f"node OPTIONS {name!r} cannot be honoured: {why}")
    cap = options.get("max_connections")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(
            f"node OPTIONS max_connections must be a whole number of at least 1 (or None), "
            f"got {cap!r}"
        )
    if options.get("protocol") not in (None, 2, "2"):
        raise ValueError(
            f"node OPTIONS 'protocol' {options['protocol']!r} cannot be honoured: the lock "
            "connections speak RESP2 (protocol=2)"
        )
    cert_reqs = options.get("ssl_cert_reqs")
    if isinstance(cert_reqs, str) and cert_reqs not in ("none", "optional", "required"):
        # redis-py would raise only when a connection is made, and the node look down
        raise ValueError(
            f"node OPTIONS ssl_cert_reqs {cert_reqs!r} must be 'none', 'optional' or 'required' "
            "(or an ssl.VerifyMode)"
        )
    for name in ("username", "password"):
        value = options.get(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"node OPTIONS {name} must be a str, got {type(value).__name__}")
    _check_durations("node OPTIONS", options)
    return dict(options)


def _check_durations(what: str, options: Mapping[str, Any]) -> None:
    # redis-py takes them as they come, and would fail every lock operation
    for name in _DURATION_OPTIONS:
        if options.get(name) is not None:
            check_positive(
                f"{what} {name}",
                options[name],
                allow_zero=name == "health_check_interval",  # redis-py's default: no checks
                maximum=MAX_NODE_TIMEOUT * 60,
            )


def _init_params(cls: type) -> frozenset[str]:
    """The keyword arguments a redis-py connection class takes (its ``__init__`` and those of
    the bases it passes ``**kwargs`` on to)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(
                name
                for name, param in inspect.signature(init).parameters.items()
                if param.kind is param.KEYWORD_ONLY or param.kind is param.POSITIONAL_OR_KEYWORD
            )
    names.discard("self")
    return frozenset(names)


def connection_args(
    url: str, options: Mapping[str, Any], *, asyncio: bool = False
) -> tuple[type, dict[str, Any]]:
    """redis-py's connection class (``redis.asyncio``'s with ``asyncio``) and its arguments
    for a node, parsed by redis-py from the URL with the node's OPTIONS on top (a pool's or
    client's settings were refused by ``_check_options``). Raises ValueError naming an option
    that the connection cannot honour (a TLS option on a plain connection, OCSP on an asyncio
    one): a security setting is never dropped."""
    options = dict(options)
    given = url
    scheme = "redis+sentinel" if is_group_url(url) else urlsplit(url).scheme
    if scheme == "redis+sentinel":
        # A group's master, as its redis:// URL gives it; the address is located later
        # (Node.connection).
        options.pop("sentinel_kwargs", None)
        url = group_master_url(url)
    ssl = options.pop("ssl", None)
    _check_tls_agrees(scheme, ssl, options.get("connection_class"))
    if ssl and "connection_class" not in options:
        options["connection_class"] = redis.connection.SSLConnection
    pool = redis.ConnectionPool.from_url(url, **options)
    cls = pool.connection_class
    kwargs = dict(pool.connection_kwargs)
    # As redis-py read it, from the path or the query (which wins): one check for both.
    _check_db(given, kwargs.get("db", 0))
    if asyncio:
        cls = _asyncio_class(cls)
    accepted = _init_params(cls)
    for name in sorted(kwargs):
        if name in accepted:
            continue
        value = kwargs.pop(name)
        if name.startswith("ssl_") and value not in (None, False):
            if asyncio and cls.__name__ == "SSLConnection":
                raise ValueError(
                    f"node OPTIONS {name!r} cannot be honoured on an asyncio connection "
                    f"({cls.__module__}.{cls.__name__} has no OCSP checks)"
                )
            raise ValueError(
                f"node OPTIONS {name!r} cannot be honoured on this connection "
                f"({cls.__module__}.{cls.__name__}; {_TLS_NEEDS[scheme]})"
            )
    for name in ("socket_timeout", "socket_connect_timeout", "decode_responses"):
        kwargs.pop(name, None)
    if asyncio and kwargs.get("retry") is not None:
        from redis.asyncio.retry import Retry as AsyncRetry

        if not isinstance(kwargs["retry"], AsyncRetry):
            raise ValueError(
                "node OPTIONS 'retry' must be a redis.asyncio.retry.Retry for an asyncio client"
            )
    # The lock commands' replies are read as RESP2 (redis-py itself may default to RESP3).
    kwargs["protocol"] = 2
    # A new connection's CLIENT SETINFO costs it a round trip before its first lock command:
    # sent only when asked for.
    if not {"lib_name", "lib_version", "driver_info"} & set(options):
        kwargs.pop("lib_name", None)
        kwargs.pop("lib_version", None)
        if "driver_info" in accepted:  # redis-py 7.1+: the others are deprecated
            kwargs["driver_info"] = None
        else:
            kwargs["lib_name"] = kwargs["lib_version"] = None
    return cls, kwargs


#: What a TLS option needs, by the node URL's scheme.
_TLS_NEEDS = {
    "redis": 'a TLS option needs a rediss:// URL (or "ssl": True in OPTIONS)',
    "rediss": "a TLS option needs a TLS connection class",
    "unix": "TLS is not available over a unix:// socket",
    "redis+sentinel": 'a Sentinel group\'s master is reached over TLS with "ssl": True in '
    "its OPTIONS",
}


def _check_tls_agrees(scheme: str, ssl: Any, connection_class: Any) -> None:
    """Refuse a node whose connection would not be what its URL (and ``ssl``) say: a plain
    connection class on a ``rediss://`` node speaks plain text while ``health()`` and the
    admin page show ``rediss://``, so a TLS setting that cannot be honoured is an error."""
    if ssl is not None and ssl.__class__ is not bool:
        raise TypeError(f"node OPTIONS 'ssl' must be True or False, got {ssl!r}")
    if ssl is False and scheme == "rediss":
        raise ValueError(
            'node OPTIONS "ssl": False cannot be honoured on a rediss:// URL, which is always '
            "TLS: give a redis:// URL for a plain connection"
        )
    if ssl and scheme == "unix":
        raise ValueError(f'node OPTIONS "ssl": True cannot be honoured: {_TLS_NEEDS["unix"]}')
    if connection_class is None:
        return
    import redis.asyncio.connection as aio

    if not isinstance(connection_class, type):
        raise TypeError(
            f"node OPTIONS 'connection_class' must be a redis-py connection class, got "
            f"{connection_class!r}"
        )
    shown = f"{connection_class.__module__}.{connection_class.__qualname__}"
    tls = issubclass(connection_class, (redis.connection.SSLConnection, aio.SSLConnection))
    unix = issubclass(
        connection_class,
        (redis.connection.UnixDomainSocketConnection, aio.UnixDomainSocketConnection),
    )
    if not tls and (scheme == "rediss" or ssl):
        said = "a rediss:// URL" if scheme == "rediss" else '"ssl": True'
        raise ValueError(
            f"node OPTIONS 'connection_class' {shown} cannot be honoured with {said}: it is "
            "not a TLS connection class (redis.SSLConnection or a subclass), so the node "
            "would be reached in plain text"
        )
    if (scheme == "unix") != unix:
        want = "a unix:// URL" if unix else "a host and port"
        raise ValueError(
            f"node OPTIONS 'connection_class' {shown} cannot be honoured on this "
            f"{scheme}:// URL: it connects to {want}"
        )


def max_connections(url: str, options: Mapping[str, Any]) -> int | None:
    """A node's cap on its lock connections: its ``max_connections`` option, else its URL's
    query's (checked by ``_check_query``); None for none."""
    cap = options.get("max_connections")
    if cap is None:
        cap = parse_url(group_master_url(url) if is_group_url(url) else url).get("max_connections")
    return cap


MAX_CONNECTIONS_ASYNC = (
    "node OPTIONS 'max_connections' cannot be honoured by AsyncRedlock: its connections are "
    "per event loop (a Redlock's are per process)"
)


def asyncio_refusal(url: str, options: Mapping[str, Any]) -> str | None:
    """Why ``AsyncRedlock`` cannot take a node that ``Redlock`` takes (None when it can):
    ``max_connections`` (its connections are per loop), an option redis-py's asyncio
    connections do not have (OCSP). ``url`` and ``options`` passed the sync rules."""
    if max_connections(url, options) is not None:
        return MAX_CONNECTIONS_ASYNC
    try:
        connection_args(url, options, asyncio=True)
    except ValueError as exc:
        return str(exc)
    return None


#: The largest database number a server can have: SELECT takes 0 .. ``databases`` - 1, and
#: ``databases`` is a 32-bit int setting.
MAX_DB = 2**31 - 1


def _check_db(url: str, db: object) -> None:
    """Refuse a database number no Redis server has: redis-py takes any int, and every lock
    operation would then fail at the connection's SELECT ("value is out of range"), the node
    looking down."""
    if isinstance(db, bool) or not isinstance(db, int) or not 0 <= db <= MAX_DB:
        raise ValueError(
            f"node URL {redact(url)!r} has an invalid database number {db}: Redis's SELECT "
            f"takes 0 to databases-1, and databases is a 32-bit setting (at most {MAX_DB})"
        )


def _asyncio_class(cls: type) -> type:
    """The ``redis.asyncio`` twin of a redis-py connection class."""
    import redis.asyncio.connection as aio

    if issubclass(cls, redis.connection.SSLConnection):
        return aio.SSLConnection
    if issubclass(cls, redis.connection.UnixDomainSocketConnection):
        return aio.UnixDomainSocketConnection
    return aio.Connection


def _check_url(url: object) -> str:
    if not isinstance(url, str):
        raise TypeError(f"a node must be a URL string, a dict or a redis.Redis, got {url!r}")
    if is_group_url(url):
        parse_group_url(url)
        if urlsplit(url).query:
            _check_query(url, tls=False)
        return url
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"node URL {redact(url)!r} must start with redis://, rediss://, unix:// or "
            "redis+sentinel://"
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"node URL {redact(url)!r} names no socket path")
    else:
        if not parts.hostname:
            raise ValueError(f"node URL {redact(url)!r} names no host")
        try:
            port = parts.port  # raises ValueError on a port that is not a number below 65536
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"node URL {redact(url)!r} has an invalid port (ports are 1-65535)")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"node URL {redact(url)!r} has an invalid database number {db!r}")
    if parts.query:
        _check_query(url, tls=parts.scheme == "rediss")
    return url


def _check_query(url: str, tls: bool) -> None:
    """A node URL's query options, checked as OPTIONS are: redis-py reads them on every
    connection it opens, so one it cannot take (or that this package would drop) is refused
    here rather than ignored when a connection is made."""
    names = [name for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)]
    for name in names:
        if (name == "ssl" or name.startswith("ssl_")) and not tls:
            raise ValueError(
                f"node URL {redact(url)!r} asks for TLS with {name!r} in its query: TLS "
                "nodes are written rediss:// (a Sentinel group's master: OPTIONS ssl=True)"
            )
    try:
        parsed = parse_url(group_master_url(url) if is_group_url(url) else url)
    except ValueError as exc:
        raise ValueError(f"node URL {redact(url)!r}: {exc}") from None
    options = {name: parsed[name] for name in names if name in parsed and name != "db"}
    try:
        _check_options(options)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("node OPTIONS", "query option", 1)
        raise type(exc)(f"node URL {redact(url)!r}: {message}") from None


def redact(url: str) -> str:
    if is_group_url(url):
        return redact_group_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return redact_group_url(url)
    parts = urlsplit(url)
    query = redact_query(parts.query)
    if parts.password is None and parts.username is None:
        # urlsplit's geturl() would rewrite a malformed URL the user should see as written
        return url if query == parts.query else url.replace(parts.query, query)
    parts = parts._replace(query=query)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return parts._replace(netloc=f"***@{netloc}").geturl()


def node_identity(url: str) -> tuple[str, str, int]:
    """What makes two configured nodes the same server. The database number is left out on
    purpose: two databases of one server fail together, so they are not independent nodes.
    A Sentinel group is its service name on its Sentinels."""
    if is_group_url(url):
        return group_identity(url)
    parts = urlsplit(url)
    if parts.scheme == "unix":
        # One socket file however the path is spelt: a doubled slash, ``.`` and ``..``
        # segments and symlinked directories name the same file.
        return ("unix", os.path.realpath(parts.path), 0)
    return ("tcp", same_host(parts.hostname or ""), parts.port or 6379)


def address_of(conn: Any) -> tuple[Any, Any]:
    """``(host, port)`` a redis-py connection goes to (``(None, None)`` for a unix socket)."""
    return getattr(conn, "host", None), getattr(conn, "port", None)


def node_client(url: str, options: Mapping[str, Any], **kwargs: Any) -> redis.Redis:
    """A redis-py client of a node (a group's: of its master, found through its Sentinels)
    for one-off work such as the deploy checks' probe; ``kwargs`` override ``options``."""
    if is_group_url(url):
        timeout = kwargs.get("socket_timeout") or options.get("socket_timeout") or 2.0
        group = SentinelGroup(url, options, node_timeout=timeout)
        return group.client(**kwargs)
    client: redis.Redis = redis.Redis.from_url(url, **{**options, **kwargs})
    return client


def claim_server(node: Node, run_id: str) -> None:
    """Refuse a connection of ``node`` to a server that another node of the client reached
    first (the same ``run_id``): one server must not vote twice."""
    other = node.reached.setdefault(run_id, node) if run_id else node
    if other is not node:
        why = (
            f"the same Redis server as node {other.name} (run_id {run_id}): one server must "
            "not vote twice (remove one of the two entries)"
        )
        raise WireError(Failure("refused", why))


def section_fields(section: Any) -> dict[str, str]:
    """An INFO section's ``key:value`` lines as text (empty where the section was withheld:
    ``section`` None)."""
    if not isinstance(section, bytes):
        return {}
    return {
        key: value.strip()
        for key, _, value in (
            line.partition(":")
            for line in section.decode(errors="replace").splitlines()
            if ":" in line
        )
    }


def refuse_replica(node: Node, replication: Mapping[str, str]) -> None:
    """Refuse a connection of a plain node to a replica (``INFO replication``'s fields say
    ``role:slave``): it is not independent of its primary (it holds that primary's keys, and
    loses its own writes at the next resync), and a read-only one never votes anyway. A
    Sentinel group's connection that reached a replica is the failover's business: it is
    dropped at its first ``READONLY`` and the next one asks the Sentinels."""
    if node.group is not None:
        return
    if replication.get("role") == "slave":
        primary = f"{replication.get('master_host', '?')}:{replication.get('master_port', '?')}"
        why = (
            f"a replica (of {primary}), not an independent primary: only primaries vote "
            "(list the primary once, or make each node a primary of its own)"
        )
        raise WireError(Failure("refused", why))


def make_nodes(
    specs: Sequence[NodeSpec], *, node_timeout: float, asyncio: bool = False
) -> list[Node]:
    """Validate every spec before opening anything, then build the nodes (for an asyncio
    client with ``asyncio``: its connections are ``redis.asyncio``'s)."""
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise TypeError(f"nodes must be a list of node URLs, got {specs!r}")
    if not specs:
        raise ValueError("nodes is empty: give at least one Redis node")
    parsed = [parse_spec(spec) for spec in specs]
    seen: dict[tuple[str, str, int], str] = {}
    for url, _ in parsed:
        ident = node_identity(url)
        if ident in seen:
            raise ValueError(
                f"nodes {redact(seen[ident])!r} and {redact(url)!r} are the same Redis server: "
                "Redlock needs independent nodes"
            )
        seen[ident] = url
    nodes = [Node(spec, node_timeout=node_timeout, asyncio=asyncio) for spec in specs]
    servers = frozenset((host, port) for kind, host, port in seen if kind == "tcp")
    reached: dict[str, Node] = {}
    for node in nodes:
        node.reached = reached
        if node.group is not None:
            node.group.elsewhere = servers
    return nodes


def script_command(script: Script, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
    return ["EVALSHA", script.sha, len(keys), *keys, *args]


def eval_command(script: Script, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
    """The script with its body: for a command nobody may read the answer of in time (a slow
    node), so it never depends on the node's script cache (a late ``NOSCRIPT`` is not retried
    once its operation ended)."""
    return ["EVAL", script.body, len(keys), *keys, *args]


def as_bytes(command: Sequence[Any] | bytes | Pipelined) -> bytes:
    """A command ready for the socket (some come already encoded)."""
    if isinstance(command, bytes):
        return command
    if isinstance(command, Pipelined):
        return command.data
    return pack(command)


def eval_form(command: Sequence[Any] | bytes | Pipelined) -> list[Any]:
    """The EVAL form of an EVALSHA command, for a node that answered NOSCRIPT (it restarted
    or flushed its script cache; this also caches the script again)."""
    if isinstance(command, Pipelined):
        command = command.data
    args = unpack(command) if isinstance(command, bytes) else list(command)
    sha = args[1].decode() if isinstance(args[1], bytes) else args[1]
    return ["EVAL", BODIES[sha], *args[2:]]


def as_eval(command: Sequence[Any] | bytes | Pipelined) -> bytes:
    """:func:`eval_form`, encoded."""
    return pack(eval_form(command))


#: The reply of a node that did not answer in time (immutable: shared by every fan-out): the
#: command went out to it, and runs there when the node gets to it.
TIMED_OUT = Failure("timeout")

#: The reply of a node every connection to which owes a reply past its deadline (the command
#: did not go out: it would have waited behind them; another connection is being opened).
BEHIND_LATE = Failure("timeout", "every connection owes a late reply; opening another")

#: The reply of a node whose connection was still being opened when a fan-out ended: the
#: command never reached it (see :func:`reached`), and the node is not found silent for it
#: (the connection goes on being opened; its own budget tells whether the node answers).
NOT_CONNECTED = Failure("timeout", "no answer while connecting")

#: Why an operation got no connection to a node with ``max_connections`` in use until its
#: deadline (not a miss: the node did nothing wrong).
AT_CAP = Failure("error", "every connection allowed by max_connections is in use")

#: The reply of a node the command never went out to (the sending thread was interrupted
#: first): a release so answered is kept for the node (:func:`reached` is False).
NOT_SENT = Failure("error", "not sent: the operation was interrupted first")

#: The answer "nothing to do" (0) of an idempotent command (a release: a token-checked delete)
#: sent again after its connection was cut with the first one out: the node may have run the
#: first one, so the answer says nothing of whether the key was ours (no false LockNotOwned).
SENT_TWICE = Failure(
    "error", "the connection was cut with the command out; sent again, it found nothing left to do"
)


#: The answer "nothing to do" (0) of a copy of an idempotent command (a hedged release: see
#: :mod:`.fanout`) while the first is still unanswered on another connection: the first may
#: have run, its reply held up on the link. Either way the key does not hold our token on the
#: node any more, so the release counts it as done there; it reports nothing of whether the
#: key was ours (no false LockNotOwned).
NOTHING_LEFT = Failure(
    "error", "a copy of the command found nothing left to do; the first one is still unanswered"
)


def reply_wait(nodes: Sequence[Node], node_timeout: float) -> float:
    """How long an operation waits for the nodes' replies: ``node_timeout``, or longer while
    the round trips of a quorum of those not found down run longer
    (:func:`.detector.reply_budget`): with one node down, the others' slowest may be needed."""
    rtos = [
        far_rto(n.detector.rto, n.detector.srtt, node_timeout)
        for n in nodes
        if n.detector.down_since is None
    ]
    return reply_budget(node_timeout, rtos, len(nodes) // 2 + 1)


def reached(reply: Any) -> bool:
    """Whether a fan-out's command reached the node (answered, or queued there): a
    :class:`Failure` other than :data:`TIMED_OUT` means no connection, or a broken one."""
    return (
        reply.__class__ is not Failure
        or reply is TIMED_OUT
        or reply is SENT_TWICE
        or reply is NOTHING_LEFT
    )


def fold(command: Any, wire: Any, reply: Any) -> Any:
    """A node's answer to ``command``: the reply itself, or a :class:`Pipelined` command's
    folded replies (``reply`` is then the list of them, or the one reply)."""
    if command.__class__ is not Pipelined:
        return reply
    return command.fold(wire, [reply] if command.count == 1 else reply)
