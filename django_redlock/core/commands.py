"""Key names and the commands of every lock operation, for one key prefix (the key layout is
documented in :mod:`.scripts`). One place builds them, so the sync and async clients and the
listing never spell a key twice."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from . import clock, rwscripts, scripts
from .algorithm import AnyBuilder
from .guard import MARKER_CHANGED
from .info import HOLDER_PLACE
from .kinds import base_name, is_reader, reader_entry_of, reader_name
from .listing import GuardState
from .lock import Lease, LockBase
from .nodes import (
    Failure,
    Node,
    Pipelined,
    ReplyError,
    as_eval,
    eval_command,
    not_redis,
    pack,
    pack_many,
    pack_tuple,
    reply_failure,
    script_command,
)
from .validation import check_name

__all__ = ["AcquireRequest", "Client", "KeyLayout", "lock_fields", "lock_value"]


def lock_value(
    token: str,
    *,
    ttl_ms: int,
    meta_json: str = "{}",
    fence: int = 0,
    renewals: int = 0,
    acquired_ms: int | None = None,
) -> str:
    """A lock key's value, as :mod:`.scripts` reads it (``acquired_ms`` defaults to now)."""
    acquired = int(clock.wall() * 1000) if acquired_ms is None else acquired_ms
    return f"{token} {fence} {renewals} {acquired} {ttl_ms}\n{meta_json}"


def lock_fields(value: bytes | str) -> dict[str, str]:
    """A lock key's value read back (``GET``): ``token``, ``fence``, ``renewals``,
    ``acquired`` (ms), ``ttl`` (ms) and ``meta`` (JSON), as :mod:`.scripts` writes them."""
    text = value.decode() if isinstance(value, bytes) else value
    header, _, meta = text.partition("\n")
    return {**dict(zip(scripts.VALUE_FIELDS, header.split(" "), strict=True)), "meta": meta}


#: The release is ``EVALSHA <RELEASE> 1 key token channel`` (its 40-character digest rather
#: than its body on every release). A node that lost its script cache (restarted, or
#: ``SCRIPT FLUSH``) answers ``NOSCRIPT``, and whoever reads that answer sends the body on the
#: same connection, behind everything sent before: also when the release's operation ended
#: without waiting for that node (a release runs the same however late: it deletes only its
#: own token). The one exception is the undo sent behind an acquire on a connection given up
#: (:meth:`KeyLayout.undo_command`): nobody may ever read its answer (the process may close
#: first), so it carries the body; it is sent only when a node did not answer in time.
_RELEASE_HEAD = ("EVALSHA", scripts.RELEASE.sha, 3)


#: How many names' release keys a :class:`KeyLayout` keeps at most.
_NAMES_KEPT = 4096


class KeyLayout:
    """Keys, channels and commands of a Redlock client for one key prefix (a part of a
    client: :class:`.base.RedlockBase` holds one as ``keys``). ``meta`` and ``host`` are the
    client's holder details, written with every lock."""

    def __init__(
        self, key_prefix: str, *, fair_heartbeat: float, meta: dict[str, Any], host: str
    ) -> None:
        self.key_prefix = key_prefix
        #: A lock key is this and its name (:meth:`key`, spelled out on the acquire's path).
        self.lock_prefix = f"{key_prefix}:lock:"
        self.fair_heartbeat = fair_heartbeat
        self.meta = meta
        self.host = host
        self._meta_cache: tuple[int, dict[str, Any], str] | None = None
        self._thread_json: tuple[str | None, str] = (None, "")
        #: Per name, the keys and channel of its release (names are mostly released again
        #: and again; cleared when it grows past :data:`_NAMES_KEPT`).
        self._release_args: dict[str, tuple[str, ...]] = {}

    @functools.cached_property
    def marker_read(self) -> bytes:
        """What an uncontended acquire reads after its SET (see :class:`AcquireRequest`)."""
        return pack(["HMGET", self.node_key(), "run_id", "id"])

    def key(self, name: str) -> str:
        return self.lock_prefix + name

    def acquire_keys(self, name: str) -> list[str]:
        return [self.key(name), f"{self.key_prefix}:fence:{name}", self.node_key()]

    def line_keys(self, name: str) -> list[str]:
        # A semaphore's permits share one line (a fair waiter takes whichever slot frees).
        name = base_name(name)
        p = self.key_prefix
        return [f"{p}:queue:{name}", f"{p}:beats:{name}", f"{p}:qseq:{name}"]

    def ticket_command(self, name: str) -> list[Any]:
        # The sequence expires with an idle line, as the line itself does (FAIR_ACQUIRE).
        idle_ms = int(self.fair_heartbeat * 2000)
        return script_command(scripts.FAIR_TICKET, [self.line_keys(name)[2]], [idle_ms])

    def leave_line_command(self, name: str, waiter: str) -> list[Any]:
        return script_command(scripts.FAIR_LEAVE, self.line_keys(name)[:2], [waiter])

    def line(self, replies: list[Any], waiter: str | None = None) -> tuple[str, int]:
        """A new waiter's place: its name (``waiter.suffix`` for a ``waiter`` id, whose
        channel ``scripts.RELEASE`` tells; else an id of its own) and the largest ticket any
        node drew (quorums overlap, so a waiter arriving after another finished joining
        always draws a larger one)."""
        tickets = [r for r in replies if isinstance(r, int)]
        place = clock.token_hex(8) if waiter is None else f"{waiter}.{clock.token_hex(4)}"
        return place, max(tickets, default=0)

    #: Marker fields a health probe reads (see ``scripts._GUARD``).
    MARKER_FIELDS = ("run_id", "started", "fresh", "trusted", "armed", "id", "replid", "epoch")

    def node_key(self) -> str:
        return f"{self.key_prefix}:node"

    def channel(self, name: str) -> str:
        # One channel per primitive: a release of any permit (or reader) wakes its waiters.
        return f"{self.key_prefix}:released:{base_name(name)}"

    def rw_keys(self, name: str) -> list[str]:
        """A read/write lock's keys, in the order of :mod:`.rwscripts`' acquire scripts."""
        p = self.key_prefix
        return [
            *self.acquire_keys(name),
            f"{p}:readers:{name}",
            f"{p}:rmeta:{name}",
            f"{p}:wwait:{name}",
        ]

    def reader_keys(self, reader: str) -> list[str]:
        """The readers set and their values, of the read/write lock a reader hold is of."""
        name, p = base_name(reader), self.key_prefix
        return [f"{p}:readers:{name}", f"{p}:rmeta:{name}"]

    def check_command(self, name: str, token: str) -> list[Any]:
        """What :meth:`check` reads on each node: a value starting with ``"<token> "`` when
        the hold is ours there."""
        if is_reader(name):
            return script_command(rwscripts.READ_CHECK, self.reader_keys(name)[:1], [token])
        return ["GET", self.key(name)]

    def locked_command(self, name: str) -> list[Any]:
        """What :meth:`locked` asks each node: 1 or a reader's value where ``name`` is held,
        0 or nil where it is not."""
        entry = reader_entry_of(name)
        if entry is not None:
            return self.check_command(reader_name(entry[0]), entry[1])
        return ["EXISTS", self.key(name)]

    def with_guard_state(
        self, command: list[Any] | dict[int, list[Any]], guard_ms: int
    ) -> AnyBuilder:
        """A builder sending ``command`` (to every node, or each node its own, keyed by
        ``id(node)``) with ``scripts.SITS_OUT`` behind it on the same connection (one round
        trip), the node's answer folded into a :class:`GuardState` (or the
        :class:`~.nodes.Failure` of either). A script goes as ``EVAL`` with its body: only a
        lone command's ``NOSCRIPT`` is sent again (:meth:`~.nodes.Wire.settle`), and a node
        that restarted empty, which is what this read is for, has no script cached."""
        node_key = self.node_key()

        def build(node: Node, wire: Any) -> Pipelined:
            its = command[id(node)] if isinstance(command, dict) else command
            data = as_eval(its) if its[0] == "EVALSHA" else pack(its)
            server = f"{wire.run_id} {wire.replid}" if wire.replid else wire.run_id
            guard = pack(eval_command(scripts.SITS_OUT, [node_key], [server, guard_ms]))
            return Pipelined(data + guard, 2, _fold_guard_state)

        return build

    def holders_channel(self) -> str:
        """Where a force release announces the token it removed, for the holder: one channel
        for every lock, so a process's renewing holders need one subscription per node."""
        return f"{self.key_prefix}:forced"

    def release_command(self, name: str, token: str) -> bytes:
        """``RELEASE`` of ``token``, encoded (it runs on every release)."""
        if is_reader(name):
            keys, args = self.reader_keys(name), [token, self.channel(name)]
            return pack(script_command(rwscripts.READ_RELEASE, keys, args))
        known = self._release_args.get(name)
        if known is None:
            if len(self._release_args) >= _NAMES_KEPT:
                self._release_args.clear()
            known = self._release_args[name] = (*self.release_keys(name), self.channel(name))
        key, waiters, line, channel = known
        return pack_tuple((*_RELEASE_HEAD, key, waiters, line, token, channel))

    def undo_command(self, name: str, token: str) -> bytes:
        """``RELEASE`` of ``token`` with the script's body, for a connection given up (see
        ``_RELEASE_HEAD``): it runs whatever the node's script cache, unread."""
        if is_reader(name):
            keys, args = self.reader_keys(name), [token, self.channel(name)]
            return pack(eval_command(rwscripts.READ_RELEASE, keys, args))
        keys, args = self.release_keys(name), [token, self.channel(name)]
        return pack(eval_command(scripts.RELEASE, keys, args))

    def release_keys(self, name: str) -> list[str]:
        """The keys of ``RELEASE``: the lock, its waiters, its fair line."""
        return [self.key(name), self.waiters_key(name), self.line_keys(name)[0]]

    def waiters_key(self, name: str) -> str:
        return f"{self.key_prefix}:waiters:{name}"

    def waiter_channel(self, name: str, waiter: str) -> str:
        """Where a release wakes ``waiter`` alone (see ``scripts.RELEASE``)."""
        return f"{self.channel(name)}:{waiter}"

    def leave_waiters(self, name: str, waiter: str) -> bytes:
        return pack(["ZREM", self.waiters_key(name), waiter])

    def join_waiters(self, name: str, waiter: str, since_ms: int) -> bytes:
        """Joins ``waiter`` to the processes waiting for ``name`` (kept at its place when it is
        there already); the set expires when nobody waits (a waiter joins again on each
        attempt, at least every third of ``fair_heartbeat``)."""
        key = self.waiters_key(name)
        idle_ms = int(self.fair_heartbeat * 2000)
        return pack_many((("ZADD", key, "NX", since_ms, waiter), ("PEXPIRE", key, idle_ms)))

    def fence_command(self, name: str, token: str, fence: int) -> list[Any]:
        return script_command(
            scripts.FENCE_SYNC,
            [self.key(name), f"{self.key_prefix}:fence:{name}"],
            [token, fence],
        )

    def force_release_command(self, name: str, token: str | None = None) -> list[Any]:
        entry = reader_entry_of(check_name(name, listed=True))
        if entry is not None:
            # One reader, as listed: its token is in its name (a token given must match).
            base, reader = entry
            keys = self.reader_keys(base)
            gone = reader if token in (None, reader) else ""
            args = [gone, self.channel(base), self.holders_channel()]
            return eval_command(rwscripts.READ_FORCE_RELEASE, keys, args)
        # With its body, as a release: a slow node runs it late, whatever its script cache.
        return eval_command(
            scripts.FORCE_RELEASE,
            [self.key(check_name(name, listed=True))],
            [self.channel(name), token or "", self.holders_channel()],
        )

    #: Lock hashes read per node per listing step.
    LIST_BATCH = 1000

    #: A listing step may take longer than a lock operation (up to LIST_BATCH locks).
    LIST_TIMEOUT = 2.0

    def list_command(self, cursor: bytes | None, pattern: str) -> list[Any]:
        """The next listing step on a node, or a no-op once its SCAN is done (``cursor`` None),
        so every step is one fan-out over all nodes."""
        if cursor is None:
            return ["PING"]
        match = f"{self.key_prefix}:lock:{pattern}"
        return script_command(scripts.LIST, [], [cursor, match, self.LIST_BATCH])

    def list_readers_command(self, cursor: bytes | None, pattern: str) -> list[Any]:
        """The next step of listing readers (see :meth:`_list_command`); ``pattern`` is on
        the read/write locks' names."""
        if cursor is None:
            return ["PING"]
        p = self.key_prefix
        pattern = pattern.split("#read", 1)[0] + ("*" if "#read" in pattern else "")
        args = [cursor, f"{p}:readers:{pattern}", self.LIST_BATCH]
        return script_command(
            rwscripts.LIST_READERS, [], [*args, f"{p}:readers:", f"{p}:rmeta:", f"{p}:lock:"]
        )

    def trust_command(self, run_id: str, marker: bytes) -> list[Any]:
        return script_command(scripts.TRUST, [self.node_key()], [run_id, marker])

    def trust_now_command(self, wire: Any) -> list[Any]:
        epoch = "" if wire.epoch is None else str(wire.epoch)
        return script_command(
            scripts.TRUST_NOW, [self.node_key()], [wire.run_id, wire.replid, epoch]
        )

    def extend_command(self, lease: Lease, ttl: float, claim: bool = False) -> list[Any]:
        """``EXTEND`` of the lease; with ``claim``, taking the lock where nobody holds it
        (see :mod:`.scripts`), with the value its acquire wrote (as near as it is known)."""
        value = ""
        if claim:
            acquired_ms = int((clock.wall() - (clock.monotonic() - lease.acquired)) * 1000)
            value = lock_value(
                lease.token,
                ttl_ms=int(ttl * 1000),
                meta_json=json.dumps(lease.meta, default=str),
                fence=lease.fence or 0,
                acquired_ms=acquired_ms,
            )
        return self.extend_token_command(lease.name, lease.token, ttl, value)

    def extend_token_command(self, name: str, token: str, ttl: float, value: str = "") -> list[Any]:
        """``EXTEND`` of a hold by its token; with ``value``, also writing it where the hold is
        missing and nobody holds the lock (a reader: where no writer holds it)."""
        args = [token, int(ttl * 1000), value]
        if is_reader(name):
            keys = [*self.reader_keys(name), self.key(base_name(name))]
            return script_command(rwscripts.READ_EXTEND, keys, args)
        return script_command(scripts.EXTEND, [self.key(name)], args)

    def holder_meta(self, meta: Mapping[str, Any]) -> tuple[dict[str, Any], str, float]:
        """The holder's details for the admin page, their JSON (built from a cached part, as
        this runs on every acquire), and the wall-clock time they name as the acquire's."""
        pid = os.getpid()
        if self._meta_cache is None or self._meta_cache[0] != pid:
            fixed = {"host": self.host, "pid": pid, **HOLDER_PLACE, **self.meta}
            self._meta_cache = (pid, fixed, json.dumps(fixed, default=str)[1:-1])
        _, fixed, fixed_json = self._meta_cache
        thread, now = threading.current_thread().name, clock.wall()
        if self._thread_json[0] != thread:  # one entry: a thread mostly locks again and again
            self._thread_json = (thread, f'"thread": {json.dumps(thread)}')
        # To the millisecond, as the lock's value names it: a float's shortest repr costs more
        # than all the rest of this.
        ms = int(now * 1000)
        digits = str(ms)
        holder = {**fixed, "thread": thread, "acquired_at": ms / 1000}
        text = f'{{{fixed_json}, {self._thread_json[1]}, "acquired_at": {digits[:-3]}.{digits[-3:]}'
        if meta:
            holder.update(meta)
            text += ", " + json.dumps(dict(meta), default=str)[1:-1]
        return holder, text + "}", now


class Client(Protocol):
    """What an :class:`AcquireRequest` reads of its client (:class:`.base.RedlockBase`)."""

    keys: KeyLayout
    restart_guard: bool
    guard_period: float
    fair_heartbeat: float


def server_of_wire(wire: Any) -> str:
    """What the acquire script is told of the server a connection reached (``scripts._GUARD``,
    ARGV[5]): its run id, its ``master_replid`` (where it read one) and, for a group's master,
    the Sentinels' failover epoch it was named at."""
    if wire.epoch is not None:
        return f"{wire.run_id} {wire.replid} {wire.epoch}"
    return f"{wire.run_id} {wire.replid}" if wire.replid else wire.run_id


class AcquireRequest:
    """One attempt's token, holder metadata and commands, encoded once for every node.

    On a connection that has seen its node vote, an uncontended acquire is a plain
    ``SET key value NX PX ttl``, pipelined with ``PTTL`` (for the refusal) and, with the restart
    guard on, a read of the node's marker: Redis runs one connection's commands in order, so
    the marker is read after the ``SET``. When the marker is the one this connection saw vote
    (same server, same marker id), nothing was lost since, and the ``SET``'s answer is the
    node's vote. Otherwise (:data:`MARKER_CHANGED`) the caller sends the full acquire script
    to that node, which judges the guard and the trust of a new cluster, and which sees our
    own ``SET`` as our grant if it landed. Fencing and fair locks always use their script.
    The script's answer tells the marker's id, kept on the connection for the next attempt.
    """

    def __init__(
        self,
        redlock: Client,
        handle: LockBase,
        line: tuple[str, int] | None = None,
        join: bytes | None = None,
    ) -> None:
        self.token = clock.token_hex(16)
        # The name and flags, not the handle: a connection that still owes this attempt's
        # reply keeps the request, and must not keep the handle (see Lease.abandoned).
        self._redlock, self._name, self._fencing, self._line = (
            redlock,
            handle.name,
            handle.fencing,
            line,
        )
        #: A waiter's place among the name's waiters, taken (or kept) before the attempt on
        #: the same connection: a release that comes after the attempt was refused wakes it.
        self._join = join
        self.meta, self._meta_json, now = redlock.keys.holder_meta(handle.meta)
        self._ttl_ms = int(handle.ttl * 1000)
        self._guarded = redlock.restart_guard
        self._fast: Pipelined | None = None
        self._script: tuple[list[Any], list[Any]] | None = None
        #: A node late to answer gets a copy of the full acquire script on a second
        #: connection (the sync driver's hedged request): it takes our own token as our
        #: grant, so the copy may land second. Not for fair or fencing locks, nor another
        #: hold's request.
        self.hedge: AnyBuilder | None = None
        if line is None and not handle.fencing:
            self.hedge = self.script
            key = redlock.keys.lock_prefix + handle.name
            # lock_value(), written out (no fence, no renewal yet): this runs on every acquire.
            value = f"{self.token} 0 0 {int(now * 1000)} {self._ttl_ms}\n{self._meta_json}"
            # SET NX PX and PTTL encoded in one step: this runs on every uncontended acquire.
            data = pack_tuple(("SET", key, value, "NX", "PX", self._ttl_ms)) + pack_tuple(
                ("PTTL", key)
            )
            count = 2
            if self._guarded:
                data += redlock.keys.marker_read
                count = 3
            self._fast = Pipelined(data, count, self._fold_fast)

    def build(self, node: Node, wire: Any) -> Pipelined:
        """The :data:`~.fanout.CommandBuilder` of this attempt."""
        if self._fast is not None and (wire.vote_marker is not None or not self._guarded):
            attempt = self._fast
        else:
            attempt = self.script(node, wire)
        return attempt if self._join is None else _joined(self._join, attempt)

    def script(self, node: Node, wire: Any) -> Pipelined:
        """The full acquire script (the run id is per wire; encoded at the first use, as most
        attempts never send it)."""
        if self._script is None:
            redlock = self._redlock
            script, keys, extra = self._parts()
            guard = str(int(redlock.guard_period * 1000)) if self._guarded else "0"
            head = [
                "EVALSHA",
                script.sha,
                len(keys),
                *keys,
                self.token,
                self._ttl_ms,
                self._meta_json,
                "1" if self._fencing else "0",
            ]
            self._script = (head, [guard, *extra])
        head, tail = self._script
        return Pipelined(pack([*head, server_of_wire(wire), *tail]), 1, _fold_script)

    def _parts(self) -> tuple[scripts.Script, list[str], list[Any]]:
        """The acquire script, its keys, and its arguments after the guard period."""
        redlock, name, line = self._redlock, self._name, self._line
        keys = redlock.keys.acquire_keys(name)
        if line is None:
            return scripts.ACQUIRE, keys, []
        keys = keys + redlock.keys.line_keys(name)
        return scripts.FAIR_ACQUIRE, keys, [line[0], line[1], int(redlock.fair_heartbeat * 1000)]

    def recheck(self, answered: list[Node]) -> AnyBuilder:
        """The builder of a second round, after some node's marker changed: the full script
        to every node that answered the first round, so the guard and trust judgements see
        every node at one moment (the script counts our own ``SET`` as our grant), and a
        harmless ``PING`` to the nodes that did not answer: their first command may still be
        queued (with its undo behind it), and a script on a new connection could overtake
        both."""
        ids = {id(node) for node in answered}
        return lambda node, wire: self.script(node, wire) if id(node) in ids else _PING

    def _fold_fast(self, wire: Any, replies: list[Any]) -> Any:
        taken = replies[0]
        # SET NX answers OK or nil, PTTL an integer: a vote read from anything else would be
        # made up (a service that speaks RESP but is not Redis). An error reply is neither,
        # so the common case needs no look for one.
        if replies[1].__class__ is not int or (taken is not None and taken != b"OK"):
            return _error_in(replies) or not_redis("SET, PTTL", replies[:2])
        # [run id, marker id] as this connection saw them when the node voted.
        if self._guarded and replies[2] != wire.vote_marker:
            if replies[2].__class__ is ReplyError:
                return reply_failure(replies[2])
            wire.vote_marker = None
            return MARKER_CHANGED
        # The marker is unchanged, so is its trust: its age has grown by the time since.
        trusted = wire.trusted_at
        age = -1 if trusted is None else int((clock.monotonic() - trusted) * 1000)
        if replies[0] is not None:  # +OK: taken
            return [0, 0, age, None]
        return [1, replies[1], age, None]

    def undo(self) -> bytes:
        """The release of this attempt's token, for a node whose answer did not come in time
        (sent behind the acquire on the same connection: see :class:`.fanout.FanOut`), with
        the script's body: nobody may ever read its answer."""
        return self._redlock.keys.undo_command(self._name, self.token)


def _fold_guard_state(wire: Any, replies: list[Any]) -> GuardState | Failure:
    """A read's answer and ``scripts.SITS_OUT``'s, as one :class:`GuardState`."""
    failure = _error_in(replies)
    if failure is not None:
        return failure
    reply, guard = replies
    if not (
        guard.__class__ is list
        and len(guard) == 2
        and guard[0].__class__ is int
        and guard[1].__class__ is int
    ):
        return not_redis("the restart-guard read", guard)
    return GuardState(reply, guard[0], guard[1] == 1, wire.started)


def _error_in(replies: list[Any]) -> Failure | None:
    """The first error reply among a pipeline's replies, as a failure."""
    for reply in replies:
        if reply.__class__ is ReplyError:
            return reply_failure(reply)
    return None


def _joined(join: bytes, attempt: Pipelined) -> Pipelined:
    """``attempt`` behind ``join`` (two commands whose answers nobody reads) on the same
    connection. A script goes as ``EVAL`` with its body: only one command's ``NOSCRIPT`` is
    sent again by the connection (:meth:`~.nodes.Wire.settle`)."""
    if attempt.count > 1:
        return Pipelined(join + attempt.data, attempt.count + 2, _skip_join(attempt.fold))
    data = join + as_eval(attempt.data)

    def fold(wire: Any, replies: list[Any]) -> Any:
        reply = replies[2]
        if reply.__class__ is ReplyError:
            reply = reply_failure(reply)
        return attempt.fold(wire, [reply])

    return Pipelined(data, 3, fold)


def _skip_join(fold: Callable[[Any, list[Any]], Any]) -> Callable[[Any, list[Any]], Any]:
    return lambda wire, replies: fold(wire, replies[2:])


def _fold_script(wire: Any, replies: list[Any]) -> Any:
    """An acquire script's answer; a node that votes (taken or held) names its marker, which
    the connection keeps for the plain ``SET`` of the next attempt, with when (on this
    process's clock) the node was trusted as part of a new cluster, which the restart guard's
    :meth:`~.guard.RestartGuard.settling` compares."""
    reply = replies[0]
    # Every answer of the script is [status, integer, integer, marker], a guarded node's with
    # its marker's age before the marker: the algorithm reads them without checking again.
    if (
        reply.__class__ is list
        and len(reply) > 3
        and reply[1].__class__ is int
        and reply[2].__class__ is int
    ):
        status = reply[0]
        if status == 0 or status == 1:
            marker = reply[3]
            wire.vote_marker = [wire.run_id.encode(), marker] if isinstance(marker, bytes) else None
            trusted_age = reply[2]
            wire.trusted_at = None if trusted_age < 0 else clock.monotonic() - trusted_age / 1000
            return reply
        if status == 3:
            return reply
        if status == 2 and len(reply) > 4 and reply[3].__class__ is int:
            reply.append(wire.started)  # for the guard: did the nodes start together?
            return reply
    if reply.__class__ is Failure:  # an error reply
        return reply
    return not_redis("the acquire script", reply)


#: What a node that did not answer the first round gets in a recheck
#: (:meth:`AcquireRequest.recheck`).
_PING = pack(["PING"])
