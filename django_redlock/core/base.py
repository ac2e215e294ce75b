"""The Redlock algorithm, written once for the sync and async clients: the configuration it
runs with, and every operation as I/O-free steps (:class:`Send` / :class:`Pause`) that two
small drivers run: :mod:`.redlock` over :mod:`.nodes` and :mod:`.waiting` (sockets and poll,
threads), :mod:`.asyncio` over :mod:`.aionodes` and :mod:`.aiowaiting` (asyncio protocols,
tasks). Read :meth:`RedlockBase._attempt_steps` against the spec top to bottom.

The other jobs of a client are parts it holds, not base classes: the key layout and commands
(``keys``, :mod:`.commands`), the lease table (``leases``, :mod:`.leases`), listing and health
(``listing``, :mod:`.listing`), and, built by each driver, the steps of semaphores and
read/write holds (``permits``, :mod:`.permits`).
"""

from __future__ import annotations

import math
import os
import socket
import weakref
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from . import clock, scripts
from .commands import KeyLayout, lock_value
from .errors import QuorumError
from .events import Listener, LockEvent, emit
from .leases import DRIFT_FLOOR, LeaseTable, replies_of
from .listing import FRESH_START_SPREAD, Listing, glob_escape, started_together
from .lock import Lease, LockBase
from .nodes import (
    BEHIND_LATE,
    NOTHING_LEFT,
    TIMED_OUT,
    Failure,
    Node,
    NodeSpec,
    Pipelined,
    ReplyError,
    as_eval,
    make_nodes,
    not_redis,
    pack,
    reached,
    reply_failure,
)
from .sentinel import GUARD_MARGIN
from .validation import (
    check_flag,
    check_limit,
    check_meta,
    check_name,
    check_node_timeout,
    check_positive,
    check_prefix,
    check_retry_count,
    check_timeout,
    check_token,
    default_max_ttl,
)

__all__ = [
    "DRIFT_FLOOR",
    "AcquireRequest",
    "Finally",
    "Listen",
    "Pause",
    "RedlockBase",
    "Refusal",
    "Send",
    "SendBatch",
    "Steps",
    "Wait",
    "glob_escape",
]

_T = TypeVar("_T")

#: Builds one node's command from the connection it goes out on (sync or async): the
#: arguments, or the command already encoded.
AnyBuilder = Callable[[Node, Any], Sequence[Any] | bytes | Pipelined]

_INSTANCES: weakref.WeakSet[RedlockBase] = weakref.WeakSet()


def _forget_inherited_state() -> None:
    # A forked child shares its parent's lease table; it holds none of those locks.
    for redlock in list(_INSTANCES):
        redlock._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_state)


class Refusal:
    """Why one attempt did not produce a lock."""

    def __init__(
        self,
        failures: dict[str, str],
        answered: int,
        retry_after: float | None,
        late: bool = False,
    ) -> None:
        self.failures = failures
        self.answered = answered  #: nodes that gave a verdict (granted or held)
        self.retry_after = retry_after
        #: Refused for lateness: some node's answer did not come in time (a lossy link holds a
        #: reply up for TCP's retransmission) or every connection to it still owed one, no
        #: node is guarded or queued for, and the nodes that said "held" are too few to keep
        #: a quorum away.
        self.late = late


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
        redlock: RedlockBase,
        handle: LockBase,
        line: tuple[str, int] | None = None,
        join: bytes | None = None,
    ) -> None:
        self.token = clock.token_hex(16)
        self._redlock, self._handle, self._line = redlock, handle, line
        #: A waiter's place among the name's waiters, taken (or kept) before the attempt on
        #: the same connection: a release that comes after the attempt was refused wakes it.
        self._join = join
        self.meta, self._meta_json = redlock.keys.holder_meta(handle.meta)
        self._ttl_ms = int(handle.ttl * 1000)
        self._guarded = redlock.restart_guard
        self._fast: Pipelined | None = None
        self._script: tuple[list[Any], list[Any]] | None = None
        if line is None and not handle.fencing:
            key = redlock.keys.key(handle.name)
            value = lock_value(self.token, ttl_ms=self._ttl_ms, meta_json=self._meta_json)
            # SET NX PX and PTTL encoded in one step: this runs on every uncontended acquire.
            data = pack(("SET", key, value, "NX", "PX", self._ttl_ms)) + pack(("PTTL", key))
            count = 2
            if self._guarded:
                data += redlock._marker_read
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
            redlock, handle = self._redlock, self._handle
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
                "1" if handle.fencing else "0",
            ]
            self._script = (head, [guard, *extra])
        head, tail = self._script
        return Pipelined(pack([*head, wire.run_id, *tail]), 1, _fold_script)

    def _parts(self) -> tuple[scripts.Script, list[str], list[Any]]:
        """The acquire script, its keys, and its arguments after the guard period."""
        redlock, handle, line = self._redlock, self._handle, self._line
        keys = redlock.keys.acquire_keys(handle.name)
        if line is None:
            return scripts.ACQUIRE, keys, []
        keys = keys + redlock.keys.line_keys(handle.name)
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
        for reply in replies:
            if reply.__class__ is ReplyError:
                return reply_failure(reply)
        taken = replies[0]
        # SET NX answers OK or nil, PTTL an integer: a vote read from anything else would be
        # made up (a service that speaks RESP but is not Redis).
        if replies[1].__class__ is not int or (taken is not None and taken != b"OK"):
            return not_redis("SET, PTTL", replies[:2])
        # [run id, marker id] as this connection saw them when the node voted.
        if self._guarded and replies[2] != wire.vote_marker:
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
        return self._redlock.keys.undo_command(self._handle.name, self.token)


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
    process's clock) the node was trusted as part of a new cluster, which :meth:`_settling`
    compares."""
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
            reply.append(wire.started)  # for _all_fresh: did the nodes start together?
            return reply
    if reply.__class__ is Failure:  # an error reply
        return reply
    return not_redis("the acquire script", reply)


#: The answer of a node whose restart-guard marker is not the one this connection saw vote:
#: it gets the full acquire script (:meth:`AcquireRequest.recheck`).
MARKER_CHANGED = Failure("marker", "the node's restart-guard marker changed")

_PING = pack(["PING"])


class Send:
    """A step of the algorithm: send a command to every node at once (the driver's fan-out)
    and resume with the replies in node order. ``enough(replies)`` may end the wait before
    every node answered (see :class:`.fanout.FanOut`); the driver then lists in ``left`` the
    connections that still owe a reply. ``late`` builds the undo for a node that does not
    answer in time; ``undo_if_cancelled`` is the ``(name, token)`` whose keys a driver releases
    when the caller is cancelled (asyncio, in the background) or interrupted (sync) while this
    step is on the wire.
    ``idempotent``: the command may run twice (a release, an undo); ``behind``: connections
    that still owe the reply of a command this one ends, for it to go out behind (both: see
    :class:`.fanout.FanOut`)."""

    __slots__ = (
        "behind",
        "build",
        "enough",
        "hedge",
        "idempotent",
        "late",
        "left",
        "timeout",
        "undo_if_cancelled",
    )

    def __init__(
        self,
        build: AnyBuilder,
        late: Callable[[], bytes] | None = None,
        undo_if_cancelled: tuple[str, str] | None = None,
        timeout: float | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        idempotent: bool = False,
        behind: Mapping[int, Any] | None = None,
    ) -> None:
        self.build = build
        self.behind = behind
        self.late = late
        self.undo_if_cancelled = undo_if_cancelled
        self.timeout = timeout  #: None: the node timeout
        self.enough = enough
        self.idempotent = idempotent
        self.left: dict[int, Any] = {}
        #: Builds the copy of the command a node late to answer gets on a second connection
        #: (the sync driver's hedged request: see :func:`.fanout.fan_out`); None: the command
        #: itself if ``idempotent``, else no copy.
        self.hedge: AnyBuilder | None = None

    def fan_out_args(self) -> tuple[Any, ...]:
        """The arguments of either driver's fan-out, in its order (the two take the same)."""
        return (
            self.build,
            self.timeout,
            self.late,
            self.enough,
            self.left,
            self.behind,
            self.idempotent,
        )


def to_every_node(command: list[Any] | bytes) -> AnyBuilder:
    """A builder sending the same command to every node."""
    return lambda node, wire: command


def to_each_node(commands: dict[int, list[Any]]) -> AnyBuilder:
    """A builder sending each node its own command (keyed by ``id(node)``)."""
    return lambda node, wire: commands[id(node)]


class Pause:
    """A step of the algorithm: wait ``seconds``, then resume (with None)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class SendBatch:
    """A step: pipeline ``commands`` to every node at once (one write per node); resume with
    each node's replies in command order, or its :class:`~.nodes.Failure`. ``leases`` are the
    leases the commands renew: the driver keeps their release from running meanwhile, and a
    lease released before the batch went out gets a harmless ``PING`` instead. The replies
    are worth waiting for until ``until`` (monotonic: the last of the leases' validity), not
    beyond a quorum's answer and its straggler's grace; the driver records in ``answered``
    when each node's replies were all in (None where they were not)."""

    __slots__ = ("answered", "commands", "leases", "until")

    def __init__(self, commands: list[list[Any]], leases: list[Lease]) -> None:
        self.commands = commands
        self.leases = leases
        self.until = max((lease.valid_until for lease in leases), default=0.0)
        self.answered: list[float | None] = []


class Listen:
    """A step: subscribe to release channel ``channel`` until the operation ends; resume with
    the notice to wait on (the driver's :class:`~.waiting.ReleaseNotice`)."""

    __slots__ = ("channel",)

    def __init__(self, channel: str) -> None:
        self.channel = channel


class Wait:
    """A step: wait on ``notice`` (from :class:`Listen`) for a release, at most ``seconds``."""

    __slots__ = ("notice", "seconds")

    def __init__(self, notice: Any, seconds: float) -> None:
        self.notice = notice
        self.seconds = seconds


class Finally:
    """A step: when the operation ends, however it ends, send ``send`` (cleanup that must go
    out even when the caller is interrupted, e.g. leaving a fair lock's line)."""

    __slots__ = ("cancelled", "send")

    def __init__(self, send: Send) -> None:
        self.send = send
        #: Set by the operation once the cleanup is no longer needed (or was handed to
        #: :attr:`.nodes.Node.later`): the driver then sends nothing.
        self.cancelled = False


#: The I/O-free steps of an operation: they yield what to do and receive its outcome; the
#: return value is the operation's result. ``Redlock`` and ``AsyncRedlock`` each drive them.
Steps = Generator[Send | SendBatch | Pause | Listen | Wait | Finally, Any, _T]


class RedlockBase:
    """Configuration and decisions of the Redlock algorithm, without I/O."""

    #: The handle class :meth:`lock` returns.
    lock_class: type[LockBase] = LockBase
    #: The class of the client's lease table (:attr:`leases`).
    lease_table_class: type[LeaseTable] = LeaseTable
    #: The handle classes (sync or async) of semaphores and read/write locks (:mod:`.permits`).
    semaphore_class: type[LockBase] = LockBase
    read_lock_class: type[LockBase] = LockBase
    write_lock_class: type[LockBase] = LockBase
    #: Whether the nodes' connections are ``redis.asyncio``'s (an option they cannot honour
    #: is refused when the client is built).
    asyncio_transport = False

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        *,
        key_prefix: str = "redlock",
        ttl: float = 30.0,
        node_timeout: float = 0.05,
        retry_count: int = 3,
        retry_delay: float = 0.2,
        drift_factor: float = 0.01,
        max_ttl: float | None = None,
        restart_guard: bool = True,
        trust_fresh_cluster: bool = True,
        reentrant: bool = False,
        fair_heartbeat: float = 3.0,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.key_prefix = check_prefix(key_prefix)
        self.ttl = check_positive("ttl", ttl)
        self.node_timeout = check_node_timeout(node_timeout)
        self.retry_count = check_retry_count(retry_count)
        self.retry_delay = check_positive("retry_delay", retry_delay, allow_zero=True)
        self.drift_factor = check_positive("drift_factor", drift_factor, allow_zero=True)
        if self.drift_factor >= 0.5:
            raise ValueError(f"drift_factor must be < 0.5, got {drift_factor!r}")
        self.max_ttl = (
            default_max_ttl(self.ttl) if max_ttl is None else check_positive("max_ttl", max_ttl)
        )
        if self.ttl > self.max_ttl:
            raise ValueError(f"ttl {ttl!r} is longer than max_ttl {self.max_ttl!r}")
        if self.node_timeout >= self.ttl:
            raise ValueError(f"node_timeout {node_timeout!r} must be much smaller than ttl {ttl!r}")
        details = check_meta(meta, str_keys=False)
        self.restart_guard = check_flag("restart_guard", restart_guard)
        self.trust_fresh_cluster = check_flag("trust_fresh_cluster", trust_fresh_cluster)
        self.reentrant = check_flag("reentrant", reentrant)
        #: A fair lock's waiter that stops refreshing its place for this long is dropped.
        self.fair_heartbeat = check_positive("fair_heartbeat", fair_heartbeat)
        self.meta = details
        self.nodes: list[Node] = make_nodes(
            nodes, node_timeout=self.node_timeout, asyncio=self.asyncio_transport
        )
        self.quorum = len(self.nodes) // 2 + 1
        #: How long a node sits out after its marker was armed anew: ``max_ttl``, and with a
        #: Sentinel group among the nodes the time a deposed master may still grant.
        self.guard_period = self.max_ttl + (
            GUARD_MARGIN if any(node.group is not None for node in self.nodes) else 0.0
        )
        self.keys = KeyLayout(
            self.key_prefix,
            fair_heartbeat=self.fair_heartbeat,
            meta=self.meta,
            host=socket.gethostname(),
        )
        self.listing = Listing(
            self.nodes,
            key_prefix=self.key_prefix,
            quorum=self.quorum,
            max_ttl=self.max_ttl,
            guard_period=self.guard_period,
            restart_guard=self.restart_guard,
            trust_fresh_cluster=self.trust_fresh_cluster,
        )
        #: Called with a :class:`LockEvent` on acquire, release, contention, loss and force
        #: release.
        self.listeners: list[Listener] = []
        self.leases = self.lease_table_class(
            self.nodes,
            quorum=self.quorum,
            drift_factor=self.drift_factor,
            listeners=self.listeners,
            start_renewal=self._start_renewal,
        )
        #: What an uncontended acquire reads after its SET (see :class:`AcquireRequest`).
        self._marker_read = pack(["HMGET", self.keys.node_key(), "run_id", "id"])
        _INSTANCES.add(self)

    def _start_renewal(self, lease: Lease) -> None:
        """Hand an auto-renewed lease to this client's watchdog (the driver's)."""
        raise NotImplementedError

    def _after_fork(self) -> None:
        """In a forked child: hold nothing of the parent's (the drivers drop their
        connections' state too)."""
        self.leases.after_fork()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {len(self.nodes)} nodes, quorum {self.quorum}, "
            f"prefix {self.key_prefix!r}>"
        )

    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        fencing: bool = False,
        reentrant: bool | None = None,
        fair: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
        owner: Hashable | None = None,
        renew_for: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """A handle on lock ``name``; nothing is sent until it is acquired.

        ``ttl`` is the lease in seconds (default: the Redlock's), at most ``max_ttl``.
        ``auto_renew`` keeps re-arming it every ttl/3 while held (``renew_for`` caps the total).
        ``meta`` is shown on the admin page as the holder's details. ``owner`` replaces the
        current thread/task as the reentrancy owner (a Celery task id, say).
        """
        return self._hold(
            self.lock_class, name, ttl, auto_renew, fencing, fair, blocking, timeout, meta,
            owner, renew_for,
            reentrant=self.reentrant if reentrant is None else check_flag("reentrant", reentrant),
            retries=None if retries is None else check_retry_count(retries),
        )  # fmt: skip

    def semaphore(
        self,
        name: str,
        limit: int,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        fair: bool = False,
        fencing: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
        owner: Hashable | None = None,
        renew_for: float | None = None,
    ) -> Any:
        """A handle on semaphore ``name``: at most ``limit`` holders at once, each holding one
        permit (a slot, see :mod:`.permits`) with the mutex's rules: ``ttl``, ``auto_renew``,
        ``fencing`` (a fence per slot), ``fair`` (one line for every slot), ``meta``.
        Every user of one name must give the same ``limit`` (a larger one lets more in)."""
        check_limit(limit, f"limit of semaphore {name!r}")
        handle: Any = self._hold(
            self.semaphore_class, name, ttl, auto_renew, fencing, fair, blocking, timeout,
            meta, owner, renew_for,
        )  # fmt: skip
        handle.limit = limit
        return handle

    def read_lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
        owner: Hashable | None = None,
        renew_for: float | None = None,
    ) -> Any:
        """A handle on the read side of read/write lock ``name``: many readers at once, never
        while a writer holds it or waits for it."""
        return self._hold(
            self.read_lock_class, name, ttl, auto_renew, False, False, blocking, timeout,
            meta, owner, renew_for,
        )  # fmt: skip

    def write_lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
        fencing: bool = False,
        blocking: bool = True,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
        owner: Hashable | None = None,
        renew_for: float | None = None,
    ) -> Any:
        """A handle on the write side of read/write lock ``name``: one writer, no reader. The
        writer is the lock ``name`` itself (listed, renewed, fenced and force-released as
        any lock); don't take ``rl.lock(name)`` on the same name, which ignores readers."""
        return self._hold(
            self.write_lock_class, name, ttl, auto_renew, fencing, False, blocking, timeout,
            meta, owner, renew_for,
        )  # fmt: skip

    def _hold(
        self,
        cls: type[LockBase],
        name: str,
        ttl: float | None,
        auto_renew: bool,
        fencing: bool,
        fair: bool,
        blocking: bool,
        timeout: float | None,
        meta: Mapping[str, Any] | None,
        owner: Hashable | None,
        renew_for: float | None,
        reentrant: bool = False,
        retries: int | None = None,
    ) -> Any:
        """A handle of class ``cls`` (a lock's, a semaphore's, a read or write lock's), its
        options checked."""
        check_name(name)
        lease_ttl = self.ttl if ttl is None else check_positive("ttl", ttl)
        if lease_ttl > self.max_ttl:
            raise ValueError(
                f"ttl {ttl!r} for {name!r} exceeds max_ttl {self.max_ttl!r} (the restart "
                "guard only protects leases up to max_ttl)"
            )
        if lease_ttl <= self.node_timeout:
            raise ValueError(f"ttl {ttl!r} for {name!r} must exceed node_timeout")
        details = check_meta(meta, besides=self.meta)
        if renew_for is not None:
            check_positive("renew_for", renew_for)
            if not auto_renew:
                raise ValueError(
                    f"renew_for={renew_for!r} caps auto-renewal: {name!r} needs auto_renew=True"
                )
        return cls(
            self,
            name,
            ttl=lease_ttl,
            auto_renew=check_flag("auto_renew", auto_renew),
            fencing=check_flag("fencing", fencing),
            reentrant=reentrant,
            fair=check_flag("fair", fair),
            blocking=check_flag("blocking", blocking),
            timeout=check_timeout(timeout),
            meta=details,
            owner=owner,
            renew_for=renew_for,
            retries=retries,
        )

    # -- judging replies ------------------------------------------------------------------------

    def _granted(self, replies: list[Any]) -> list[Any]:
        return [r for r in replies if isinstance(r, list) and r[0] == 0]

    def _granted_by_quorum(self, replies: list[Any]) -> bool:
        """An acquire's wait ends once a quorum granted it: the lock is ours whatever the
        slower nodes answer (validity is measured from before the first send)."""
        return sum(1 for r in replies if r.__class__ is list and r[0] == 0) >= self.quorum

    def _keep_unreached(self, release: bytes, replies: list[Any]) -> None:
        """A release that could not reach a node goes out with the next operation that
        reaches it (:attr:`.nodes.Node.later`)."""
        for node, reply in zip(self.nodes, replies, strict=True):
            if not reached(reply):
                node.later.append(release)

    def _synced(self, replies: list[Any]) -> bool:
        """A fence written back to a quorum holding our token."""
        return sum(1 for r in replies if r == 1) >= self.quorum

    def _released_by_quorum(self, replies: list[Any]) -> bool:
        """A release's wait ends once a quorum removed the key: the lock is free for others
        and cannot be reported as lost any more (a slower node removes its copy as it gets
        to it). A copy of the release that found nothing left while the first one's reply is
        still on its way (:data:`~.nodes.NOTHING_LEFT`) counts: the key is not ours there."""
        return (
            sum(1 for r in replies if (r.__class__ is int and r > 0) or r is NOTHING_LEFT)
            >= self.quorum
        )

    def _lease_if_valid(
        self,
        handle: LockBase,
        owner: Hashable,
        request: AcquireRequest,
        replies: list[Any],
        start: float,
    ) -> Lease | None:
        """The lease when a quorum granted it with validity left (validity measured after the
        replies came in: node-redlock returned locks with none left)."""
        granted = [r for r in replies if r.__class__ is list and r[0] == 0]
        valid_until = start + handle.ttl - self.leases.margin(handle.ttl)
        if len(granted) < self.quorum or clock.monotonic() >= valid_until:
            return None
        return Lease(
            name=handle.name,
            token=request.token,
            ttl=handle.ttl,
            owner=owner,
            valid_until=valid_until,
            fence=max(int(r[1]) for r in granted) if handle.fencing else None,
            acquired=start,
            meta=request.meta,
            auto_renew=handle.auto_renew,
            renew_until=None if handle.renew_for is None else start + handle.renew_for,
        )

    def _trust_builder(self, replies: list[Any]) -> AnyBuilder:
        """TRUST for each node, naming the marker this attempt saw fresh there (a node
        flushed and armed again since has another marker and is not trusted)."""
        seen = {id(node): r[4] for node, r in zip(self.nodes, replies, strict=True)}
        return lambda node, wire: self.keys.trust_command(wire.run_id, seen[id(node)])

    def _all_fresh(self, replies: list[Any], spread: float) -> bool:
        """A brand-new cluster: every node is in its guard for a missing marker, all the
        markers were armed by one attempt (within a node timeout of each other), and the
        servers started together (:data:`FRESH_START_SPREAD`): none of the nodes has ever held
        a lock under this prefix, or all lost their data at once.

        There is no lease to protect, so the caller trusts them all at once instead of idling
        for max_ttl (docs/guarantees). A node that is fresh while another votes is never
        trusted this way: it may have forgotten a lease the others still count on. Nor are
        nodes that lost their data apart: one came back into a running cluster while a lease
        may have been taken on the others since, which they then lost in turn. ``spread``
        is how long this fan-out took: the nodes measured their markers' ages at moments at
        most that far apart."""
        if not (self.restart_guard and self.trust_fresh_cluster):
            return False
        if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
            return False
        armed_ages: list[int] = [r[3] for r in replies]
        if max(armed_ages) - min(armed_ages) > (self.node_timeout + spread) * 1000 + 1:
            return False
        # A node that lost its data and was not reached again before the others lost theirs
        # is armed with them, but its server restarted earlier. (Servers that all started
        # more than a lease ago lost nothing to a restart that a lease could outlive.)
        return started_together([r[5] for r in replies], clock.wall(), self.max_ttl)

    def _settling(self, replies: list[Any], spread: float) -> bool:
        """A brand-new cluster that another client is trusting right now: the nodes still
        guarded have no marker of their own (fresh) written *before* the others were trusted,
        so they belong to the same brand-new cluster and the trust round just has not reached
        them yet. Worth another try after a node timeout. A node that restarted empty in a
        running cluster wrote its marker after its peers were trusted (or they never were),
        and is refused at once. ``spread`` is how long the fan-out took: the nodes measured
        their ages at moments at most that far apart."""
        if not (self.restart_guard and self.trust_fresh_cluster):
            return False
        guarded = [r for r in replies if isinstance(r, list) and r[0] == 2]
        others = [r for r in replies if isinstance(r, list) and r[0] != 2]
        if not guarded or not others or len(guarded) + len(others) != len(replies):
            return False
        trusted_ages = [r[2] if len(r) > 2 else -1 for r in others]
        if min(trusted_ages) < 0:
            return False
        slack = spread * 1000 + 1
        return all(r[2] == 1 and r[3] + slack >= max(trusted_ages) for r in guarded)

    def _contend_steps(
        self,
        handle: LockBase,
        owner: Hashable,
        blocking: bool,
        deadline: float | None,
        retries: int | None,
        start: float,
        first: Refusal | None = None,
        listen_first: bool = False,
    ) -> Steps[Lease | None]:
        """Attempts until the lock is ours or the time is up: after the first refusal,
        subscribe to this waiter's own release channel and try again at once (a release
        between the attempt and the subscription would otherwise go unnoticed); then wait for
        a release notice, the holder's lease end or a random retry delay (:meth:`_pause_for`).
        A fair lock draws its place in line first and leaves the line when done; any other
        lock joins the name's waiters with each attempt. ``first`` is the refusal of an attempt
        already made (:meth:`_alone_steps`). ``listen_first``: this process just released the
        name and woke a waiter, who is taking it now: the first attempt is made waiting
        already (subscribed and joined), as it would be refused. No recursion: one loop, each
        attempt one :meth:`_attempt_steps`.

        A release wakes one waiter by name (``scripts.RELEASE``): the fair line's first, else
        the one that has waited longest. It is alone to contend (but for the releaser, who
        holds back: :meth:`_courtesy`, and newcomers), so it asks every node at once. The
        others sleep on: they ask the nodes again when their pause ends (at most a third of
        ``fair_heartbeat``), so a woken waiter that died before taking the lock costs the
        rest at most that."""
        attempts = 0
        notice = line = join = leave = None
        left = b""  #: the leave, encoded for any connection (a script with its body)
        if handle.fair:
            line = self.keys.line(
                (yield Send(to_every_node(self.keys.ticket_command(handle.name))))
            )
            waiter = line[0]
            command = self.keys.leave_line_command(handle.name, waiter)
            leave, left = Finally(Send(to_every_node(command))), as_eval(command)
            yield leave
        else:
            waiter = clock.token_hex(8)
        while True:
            if notice is None and (listen_first or attempts):
                notice = yield Listen(self.keys.waiter_channel(handle.name, waiter))
                if line is None:
                    join = self.keys.join_waiters(handle.name, waiter, int(clock.wall() * 1000))
                    left = self.keys.leave_waiters(handle.name, waiter)
                    leave = Finally(Send(to_every_node(left)))
                    yield leave
            if first is None:
                outcome = yield from self._attempt_steps(handle, owner, line, join=join)
            else:
                outcome, first = first, None
            if isinstance(outcome, Lease):
                if leave is not None:
                    # The nodes that granted a fair lock took its waiter out of the line;
                    # the others (and every node, for the waiters of another lock) get the
                    # leave with the next command that reaches them, the release at the
                    # latest, which it goes out before: no round trip between a waiter's
                    # grant and its caller, and no release wakes it after.
                    leave.cancelled = True
                    for node in self.nodes:
                        node.later.append(left)
                return self.leases.won(handle, outcome, start)
            attempts += 1
            now = clock.monotonic()
            if self._out_of_time(blocking, attempts, retries, deadline, now):
                self._give_up(handle, outcome, now - start)
                return None
            if notice is not None:
                pause = self._pause_for(handle, outcome, retries, deadline, now, True)
                yield Wait(notice, pause)

    def _alone_steps(
        self, handle: LockBase, owner: Hashable, start: float
    ) -> Steps[Lease | Refusal]:
        """A blocking acquire's first attempt while no other thread (or task) of this process
        wants the name: one attempt, as a non-blocking acquire makes, without lining up in
        the local queue, which exists to line up this process's own contenders. A refusal is
        then :meth:`_contend_steps`' first attempt, made in line."""
        outcome = yield from self._attempt_steps(handle, owner)
        return self.leases.won(handle, outcome, start) if isinstance(outcome, Lease) else outcome

    def _attempt_steps(
        self,
        handle: LockBase,
        owner: Hashable,
        line: tuple[str, int] | None = None,
        make: Callable[[], AcquireRequest] | None = None,
        join: bytes | None = None,
    ) -> Steps[Lease | Refusal]:
        """One acquire attempt, as the Redlock spec reads (redis.io, seed 001):

        1. the same random token to every node at once, each bounded by ``node_timeout``;
        2. a quorum (N/2+1) granted it and validity = ttl - elapsed - drift is left: ours
           (with fencing, the agreed fence is written back to a quorum first); the wait ends
           as soon as a quorum granted, so a slower minority never sets the pace;
        3. otherwise undo it everywhere (also where the answer did not come in time: the SET
           may have landed late; a late node gets the undo behind the acquire);
        4. a brand-new cluster (every node fresh) is trusted and tried again once; a cluster
           another client is trusting right now is tried again after a node timeout (up to
           three times);
        5. else the refusal says why, and when the lock frees up (retry with jitter is the
           caller's loop: :meth:`_pause_for`).

        ``make`` builds each attempt's request in place of :class:`AcquireRequest` (a read or
        write hold's script: :mod:`.permits`); the rest of the attempt is the same.

        ``join``: the waiter's place among the name's waiters, taken with each attempt (see
        :meth:`_contend_steps`).
        """
        settle, trusted = 3, False
        # A node late to answer gets a copy of the full acquire script on a second connection
        # (the sync driver's hedged request): it takes our own token as our grant, so the
        # copy may land second. Not for fair or fencing locks, nor another hold's request.
        hedged = make is None and line is None and not handle.fencing
        while True:
            request = AcquireRequest(self, handle, line, join) if make is None else make()
            cancel = (handle.name, request.token)
            start = clock.monotonic()
            send = Send(request.build, request.undo, cancel, None, self._granted_by_quorum)
            if hedged:
                send.hedge = request.script
            replies = yield send
            if any(r is MARKER_CHANGED for r in replies) and not self._granted_by_quorum(replies):
                answered = {
                    i
                    for i, r in enumerate(replies)
                    if r is MARKER_CHANGED or not isinstance(r, Failure)
                }
                recheck = request.recheck([self.nodes[i] for i in answered])
                again = yield Send(recheck, request.undo, cancel)
                replies = [again[i] if i in answered else r for i, r in enumerate(replies)]
            spread = clock.monotonic() - start
            lease = self._lease_if_valid(handle, owner, request, replies, start)
            if lease is not None and lease.fence is not None:
                command = self.keys.fence_command(handle.name, request.token, lease.fence)
                synced = yield Send(to_every_node(command), None, cancel, None, self._synced)
                valid = clock.monotonic() < lease.valid_until
                if not self._synced(synced) or not valid:
                    lease = None
            if lease is not None:
                # The release goes out behind the acquire where it is still on its way.
                lease.behind = send.left
                return lease
            if self._granted(replies) or any(isinstance(r, Failure) for r in replies):
                undo = self.keys.release_command(handle.name, request.token)
                # Behind the acquire where it is still on its way, as a release goes; kept
                # for a node it could not reach, as a release is.
                # Its answers change nothing once a majority has them: a slower node gets it
                # behind whatever it still owes, and nobody waits for it there.
                undone = yield Send(
                    to_every_node(undo),
                    None,
                    cancel,
                    enough=_any_answers,
                    idempotent=True,
                    behind=send.left,
                )
                self._keep_unreached(undo, undone)
            if not trusted and self._all_fresh(replies, spread):
                trusted = True
                # Each node's marker as this attempt saw it fresh: only that one is trusted.
                trust = yield Send(self._trust_builder(replies))
                if any(r == 1 for r in trust):  # a node it could not trust stays guarded
                    settle = 0
                    continue
            if settle and self._settling(replies, spread):
                # Another client is trusting this brand-new cluster right now.
                settle -= 1
                yield Pause(self.node_timeout)
                continue
            return self._refusal(replies)

    # -- the other operations, as steps (one fan-out each) ---------------------------------------

    def _locked_steps(self, name: str) -> Steps[bool]:
        replies = yield Send(to_every_node(["EXISTS", self.keys.key(check_name(name))]))
        return sum(1 for r in replies if r == 1) >= self.quorum

    def _force_release_steps(self, name: str, token: str | None) -> Steps[int]:
        token = None if token is None else check_token(token)
        command = pack(self.keys.force_release_command(name, token))
        replies = yield Send(to_every_node(command), idempotent=token is not None)
        if token is not None:
            # Only that holder's copies: sending it late never touches another holder's lock
            # (without a token it could remove the next holder's).
            self._keep_unreached(command, replies)
        return self.leases.judge_force_release(name, replies)

    def _release_token_steps(self, name: str, token: str) -> Steps[int]:
        command = self.keys.release_command(check_name(name), check_token(token))
        replies = yield Send(to_every_node(command), idempotent=True)
        self._keep_unreached(command, replies)
        return sum(1 for r in replies if isinstance(r, int) and r)

    def _extend_token_steps(self, name: str, token: str, ttl: float) -> Steps[bool]:
        ttl = self._check_extend_ttl(ttl)
        command = self.keys.extend_token_command(check_name(name), check_token(token), ttl)
        replies = yield Send(to_every_node(command))
        return sum(1 for r in replies if r == 1) >= self.quorum

    def _extend_steps(self, lease: Lease, ttl: float) -> Steps[bool]:
        ttl = self._check_extend_ttl(ttl)
        if lease.released or lease.lost or lease.foreign:
            return False
        start = clock.monotonic()
        replies = yield Send(to_every_node(self.keys.extend_command(lease, ttl)))
        if self._should_claim(lease, replies):
            claimed = yield Send(to_every_node(self.keys.extend_command(lease, ttl, claim=True)))
            replies = _either_extended(replies, claimed)
        return self.leases.judge_extend(lease, ttl, replies, start)

    def _should_claim(self, lease: Lease, replies: list[Any]) -> bool:
        """Whether a renewal takes the lock on the nodes where it is missing too: some node
        still holds our copy and some has none of ours (a racing loser held it when we took
        the lock, or it restarted empty), and the lease is valid, so nobody else can hold a
        quorum. Held on a bare quorum, one node pausing would otherwise cost the lock. Never
        once the nodes that answered say the token is gone from a quorum (a force release:
        the loss is reported, as someone else may have held the lock meanwhile). A node that
        did not answer is not counted either way, so a key deleted behind our back on a node
        that is slow right now is not noticed here (one key deleted by hand is outside what
        Redlock can see: docs/guarantees, "What the guard cannot see")."""
        missing = replies.count(0)
        return 0 < missing <= len(self.nodes) - self.quorum and 1 in replies and lease.validity > 0

    def _check_steps(self, lease: Lease) -> Steps[bool]:
        if lease.released or lease.lost or lease.foreign:
            return False
        replies = yield Send(to_every_node(self.keys.check_command(lease.name, lease.token)))
        return self.leases.judge_check(lease, replies)

    def _renew_steps(self, leases: list[Lease]) -> Steps[list[float | None]]:
        """One watchdog round over the due leases, in one pipelined fan-out (a silent node
        costs one node timeout per round, not one per lease): per lease, when to renew it
        next, or None to stop."""
        now = clock.monotonic()
        batch = [lease for lease in leases if self.leases.wants_renewal(lease, now)]
        whens: dict[int, float | None] = {}
        if batch:
            start = clock.monotonic()
            commands = [self.keys.extend_command(lease, lease.ttl) for lease in batch]
            step = SendBatch(commands, batch)
            results = yield step
            replies = [replies_of(results, position) for position in range(len(batch))]
            # When each lease's quorum had extended it: a renewal counts only if that was
            # before its validity ran out.
            answered = step.answered or [None] * len(self.nodes)
            at = [_answered_at(its, answered, self.quorum) for its in replies]
            claiming = [i for i, lease in enumerate(batch) if self._should_claim(lease, replies[i])]
            if claiming:
                leases_claiming = [batch[i] for i in claiming]
                claim = SendBatch(
                    [
                        self.keys.extend_command(lease, lease.ttl, claim=True)
                        for lease in leases_claiming
                    ],
                    leases_claiming,
                )
                claimed = yield claim
                claim_answered = claim.answered or [None] * len(self.nodes)
                for position, i in enumerate(claiming):
                    first = replies[i]
                    replies[i] = _either_extended(first, replies_of(claimed, position))
                    times = [
                        a if r == 1 else c
                        for r, a, c in zip(first, answered, claim_answered, strict=True)
                    ]
                    at[i] = _answered_at(replies[i], times, self.quorum)
            judged = self.leases.judge_renewals(batch, replies, start, at)
            whens = dict(zip(map(id, batch), judged, strict=True))
        return [whens.get(id(lease)) for lease in leases]

    def _list_steps(self, pattern: str) -> Steps[dict[str, list[tuple[Node, list[Any]]]]]:
        """Every lock some node holds whose name matches the glob ``pattern``: each step reads
        up to ``LIST_BATCH`` locks per node in one script call (a SCAN step, never KEYS, so a
        busy node is not blocked), on all nodes at once. Returns each name's per-node
        entries (see :meth:`.Listing.lock_info`)."""
        found: dict[str, list[tuple[Node, list[Any]]]] = {}
        # The locks, then the read/write locks' readers (one entry per reader).
        for command in (self.keys.list_command, self.keys.list_readers_command):
            cursors: list[bytes | None] = [b"0"] * len(self.nodes)
            while any(c is not None for c in cursors):
                commands = {
                    id(node): command(cursor, pattern)
                    for node, cursor in zip(self.nodes, cursors, strict=True)
                }
                replies = yield Send(to_each_node(commands), timeout=self.keys.LIST_TIMEOUT)
                self.listing.list_step(cursors, replies, found)
        return found

    def _trust_cluster_steps(self) -> Steps[int]:
        """``trust_cluster()``: refuse when a reachable node holds a lock (the operator's
        assertion is false), else arm every reachable node's marker as trusted now."""
        found = yield from self._list_steps("*")
        self.listing.refuse_trust(
            [self.listing.lock_info(name, found[name]) for name in sorted(found)]
        )
        replies = yield Send(lambda n, wire: self.keys.trust_now_command(wire.run_id))
        return sum(1 for r in replies if r == 1)

    def _refusal(self, replies: list[Any]) -> Refusal:
        failures: dict[str, str] = {}
        held_pttls: list[int] = []
        answered = 0
        timed_out = contended = False
        new = self._why_new_is_guarded(replies)
        for node, reply in zip(self.nodes, replies, strict=True):
            if isinstance(reply, Failure):
                failures[node.name] = str(reply)
                timed_out = timed_out or reply is TIMED_OUT or reply == BEHIND_LATE
            elif reply[0] == 1:
                answered += 1
                held_pttls.append(max(int(reply[1]), 0))
                failures[node.name] = "held"
            elif reply[0] == 2:
                failures[node.name] = _guard_reason(reply, new)
                contended = True
            elif reply[0] == 3:
                answered += 1
                failures[node.name] = "queued behind an earlier waiter"
                contended = True
            else:
                answered += 1
        retry_after = None
        free = len(self.nodes) - len(held_pttls)
        still_needed = self.quorum - free
        if held_pttls and 0 < still_needed <= len(held_pttls):
            # The lock frees up once enough leases have run out to leave a quorum free.
            retry_after = sorted(held_pttls)[still_needed - 1] / 1000
        # Held on too few nodes to keep a quorum from us: a copy that outlived its holder's
        # release because it landed late, or a late node's; no split vote to break up.
        contended = contended or still_needed > 0
        return Refusal(failures, answered, retry_after, timed_out and not contended)

    def _why_new_is_guarded(self, replies: list[Any]) -> str | None:
        """When every node answered guarded for a missing marker (a cluster that looks
        brand-new) and was not trusted as one: why not (None when some node is not new)."""
        if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
            return None
        if not (self.restart_guard and self.trust_fresh_cluster):
            return "every node has no lock data, but trust_fresh_cluster is off"
        if len(replies[0]) > 5 and not started_together(
            [r[5] for r in replies], clock.wall(), self.max_ttl
        ):
            return (
                "every node has no lock data, but their servers started more than "
                f"{FRESH_START_SPREAD:g}s apart (FRESH_START_SPREAD, from INFO's uptime), so "
                "they may have lost their data apart and none can vouch for another"
            )
        return (
            "every node has no lock data, but their markers were armed apart, so they may have "
            "lost their data apart and none can vouch for another"
        )

    def _give_up(self, handle: LockBase, refusal: Refusal, waited: float) -> None:
        """Report a failed acquire; raise when the cluster could not even give a verdict."""
        handle.retry_after = refusal.retry_after
        emit(
            self.listeners,
            LockEvent(
                "contended",
                handle.name,
                meta=handle.meta,
                waited=waited,
                retry_after=refusal.retry_after,
                reason=", ".join(f"{n}: {why}" for n, why in refusal.failures.items()),
            ),
        )
        if refusal.answered < self.quorum:
            raise QuorumError(
                f"lock {handle.name!r}: only {refusal.answered} of {len(self.nodes)} nodes "
                f"could answer, {self.quorum} needed",
                handle.name,
                failures=refusal.failures,
                retry_after=refusal.retry_after,
            )

    def _deadline(self, start: float, timeout: float | None, retries: int | None) -> float | None:
        """When a blocking acquire gives up: ``timeout`` seconds from now, never for ``None``
        or ``inf`` (unless ``retries`` bounds it: once that many retries could have run)."""
        if timeout is None and retries is not None:
            return start + (retries + 1) * max(self.retry_delay, self.node_timeout)
        return None if timeout is None or math.isinf(timeout) else start + timeout

    def _out_of_time(
        self,
        blocking: bool,
        attempts: int,
        retries: int | None,
        deadline: float | None,
        now: float,
    ) -> bool:
        if not blocking:
            return True
        if retries is not None and attempts > retries:
            return True
        return deadline is not None and now >= deadline

    def _pause_for(
        self,
        handle: LockBase,
        refusal: Refusal,
        retries: int | None,
        deadline: float | None,
        now: float,
        by_name: bool = False,
    ) -> float:
        """How long to wait before the next attempt if no release notice comes first: until
        the holder's lease runs out when the nodes told us, else a random retry delay. With
        ``retries`` (the spec's retry loop) never longer than ``retry_delay``. The jitter keeps
        contenders from retrying in lock step. ``by_name``: a release wakes this waiter
        alone, on its own channel (see :meth:`_contend_steps`)."""
        jitter = clock.uniform(0, self.retry_delay / 2)
        if refusal.late:
            # The next attempt goes out on other connections (a late one is set aside until
            # it answered), so it is not held up behind the late reply; a little jitter keeps
            # this process's own threads apart.
            delay = clock.uniform(0, min(self.node_timeout, self.retry_delay / 2))
        elif refusal.retry_after is not None:
            delay = refusal.retry_after + min(jitter, 0.002)
        else:
            delay = self.retry_delay / 2 + jitter
        if retries is not None:
            delay = min(delay, self.retry_delay / 2 + jitter)
        if handle.fair or by_name:
            # A waiter refreshes its place on every attempt (a fair line drops a waiter whose
            # heartbeat ran out), and one woken by name only asks again if the waiter a
            # release woke took nothing.
            delay = min(delay, self.fair_heartbeat / 3)
        if deadline is not None:
            delay = min(delay, deadline - now)
        return max(delay, 0.0)

    def _detach(self, lease: Lease) -> str:
        """:meth:`.LockBase.detach`'s work (the handles call it on every lock service)."""
        return self.leases.detach(lease)

    def _check_extend_ttl(self, ttl: float) -> float:
        ttl = check_positive("ttl", ttl)
        if ttl > self.max_ttl:
            raise ValueError(f"ttl {ttl!r} exceeds max_ttl {self.max_ttl!r}")
        if ttl <= self.node_timeout:
            raise ValueError(f"ttl {ttl!r} must exceed node_timeout {self.node_timeout!r}")
        return ttl


def _any_answers(replies: list[Any]) -> bool:
    """An ``enough`` for a command whose answers nobody reads: a majority's (asked only
    once a majority answered)."""
    return True


def _answered_at(replies: list[Any], answered: list[float | None], quorum: int) -> float | None:
    """When a quorum of nodes had extended a lease (the ``quorum``-th earliest answer among
    the nodes that replied 1), None when too few did or the driver did not say when."""
    times = sorted(t for r, t in zip(replies, answered, strict=False) if r == 1 and t is not None)
    return times[quorum - 1] if len(times) >= quorum else None


def _either_extended(first: list[Any], claimed: list[Any]) -> list[Any]:
    """A renewal's replies after its claiming round: a node extended in either counts (one
    that answered the first and failed the second still holds our re-armed copy)."""
    return [1 if a == 1 else b for a, b in zip(first, claimed, strict=True)]


def _guard_reason(reply: list[Any], new: str | None = None) -> str:
    """Why a node in its restart guard does not vote, and what an operator can do (``new``:
    why a cluster of new nodes only was not trusted, see ``_why_new_is_guarded``)."""
    seconds = f"{int(reply[1]) / 1000:.1f}s"
    if reply[2] == 1:
        why = new or "not every node is new, so no node can vouch that nothing was held"
        return (
            f"guarded for {seconds}: it has no lock data (new, flushed or restarted empty) and "
            f"{why}; if no lock is held, `manage.py redlock trust` (Redlock.trust_cluster()) "
            "lets it vote now"
        )
    return f"guarded for {seconds}: a new server process (restart or failover) may have lost leases"
