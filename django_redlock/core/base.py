"""The client's side of the Redlock algorithm, written once for the sync and async clients:
the configuration it runs with, the acquire's requests (encoded once for every node), and
every other operation (extend, renew, release by token, listing) as I/O-free steps that two
small drivers run: :mod:`.redlock` over :mod:`.nodes` and :mod:`.waiting` (sockets and poll,
threads), :mod:`.asyncio` over :mod:`.aionodes` and :mod:`.aiowaiting` (asyncio protocols,
tasks). The algorithm itself is :mod:`.algorithm`, with its policies (:mod:`.guard`,
:mod:`.fencing`, :mod:`.fairness`) plugged in: read it against the spec.

The other jobs of a client are parts it holds, not base classes: the algorithm
(``algorithm``), the key layout and commands (``keys``, :mod:`.commands`), the lease table
(``leases``, :mod:`.leases`), listing and health (``listing``, :mod:`.listing`), and, built by
each driver, the steps of semaphores and read/write holds (``permits``, :mod:`.permits`).
"""

from __future__ import annotations

import functools
import os
import socket
import weakref
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import redis

from . import clock
from .algorithm import (
    Algorithm,
    Contender,
    Refusal,
    Send,
    SendBatch,
    Steps,
    keep_unreached,
    to_each_node,
    to_every_node,
)
from .commands import AcquireRequest, KeyLayout
from .errors import QuorumError
from .events import Listener
from .fairness import FairLine, NamedWaiters
from .fencing import Fencing
from .guard import RestartGuard
from .hedging import LOSSY_FOR, heard_out, hedge_at
from .info import LockInfo, NodeHealth
from .kinds import listed_hold
from .leases import LeaseTable, replies_of
from .listing import Listing, glob_escape, parse_info
from .lock import Lease, LockBase
from .nodes import (
    LATENESS,
    NOTHING_LEFT,
    TIMED_OUT,
    Failure,
    Node,
    NodeSpec,
    Pipelined,
    ReplyError,
    make_nodes,
    pack,
)
from .sentinel import GUARD_MARGIN
from .validation import (
    check_fair_heartbeat,
    check_flag,
    check_handle_options,
    check_limit,
    check_meta,
    check_name,
    check_node_timeout,
    check_pattern,
    check_positive,
    check_prefix,
    check_retry_count,
    check_timeout,
    check_token,
    default_max_ttl,
)

__all__ = ["RedlockBase", "glob_escape"]

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
        self.fair_heartbeat = check_fair_heartbeat(fair_heartbeat)
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
        self._compose()
        _INSTANCES.add(self)

    def _compose(self) -> None:
        """The algorithm over this client's nodes, with its policies plugged in (and the
        process's clocks and random source: the simulator swaps :mod:`.clock`'s)."""
        policies = [RestartGuard(self), Fencing(self), FairLine(self), NamedWaiters(self)]
        self.algorithm = Algorithm(self, policies, functools.partial(AcquireRequest, self), clock)

    def _start_renewal(self, lease: Lease) -> None:
        """Hand an auto-renewed lease to this client's watchdog (the driver's)."""
        raise NotImplementedError

    def _after_fork(self) -> None:
        """In a forked child: hold nothing of the parent's (the drivers drop their
        connections' state too)."""
        self.leases.after_fork()

    def share_holds(self, other: RedlockBase) -> None:
        """Count one owner's holds through this client and ``other`` together: an owner
        that holds a lock through one re-enters it through the other (a reentrant lock),
        instead of waiting for itself. For a :class:`~.redlock.Redlock` and an
        :class:`~.asyncio.AsyncRedlock` of the same nodes: an async view's hold, joined by
        the sync function it calls through ``sync_to_async`` (and the reverse).

        The lease stays the taking client's (its end is told to that client's listeners);
        the last hold ends it on the nodes, through whichever client drops it."""
        mine = (self.key_prefix, [node.name for node in self.nodes])
        theirs = (other.key_prefix, [node.name for node in other.nodes])
        if mine != theirs:
            raise ValueError(
                f"{self!r} and {other!r} do not lock the same names on the same nodes: "
                "they cannot share holds"
            )
        self.leases.share_holds(other.leases)

    def waiter_id(self, name: str) -> str:
        """The id a blocked acquire of ``name`` waits to be woken under (a new one each time
        here; the drivers keep one per name, so its channel stays subscribed)."""
        return clock.token_hex(8)

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
            retries=None if retries is None else check_retry_count(retries, "retries"),
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
        details = {} if meta is None else check_meta(meta, besides=self.meta)
        cap = check_handle_options(name, auto_renew, fencing, fair, blocking, owner, renew_for)
        return cls(
            self,
            name,
            ttl=lease_ttl,
            auto_renew=auto_renew,
            fencing=fencing,
            reentrant=reentrant,
            fair=fair,
            blocking=blocking,
            timeout=None if timeout is None else check_timeout(timeout),
            meta=details,
            owner=owner,
            renew_for=cap,
            retries=retries,
        )

    # -- judging replies ------------------------------------------------------------------------

    def _keep_unreached(self, release: bytes, replies: list[Any]) -> None:
        keep_unreached(self.nodes, release, replies)

    def _release_ends(self) -> Callable[[list[Any]], bool]:
        """When a release's wait ends: at a quorum, or on a lossy link, while copies go out,
        once every node that did not miss lately answered too (:func:`.hedging.heard_out`)."""
        now = clock.monotonic()
        # Mostly no node of the process answered late lately: told without a call (this runs
        # on every release).
        if LATENESS.last > now - LOSSY_FOR and (
            hedge_at(self.nodes, now, now, self.node_timeout) is not None
        ):
            return self._released_everywhere
        return self._released_by_quorum

    def _released_everywhere(self, replies: list[Any]) -> bool:
        return self._released_by_quorum(replies) and heard_out(self.nodes, replies, TIMED_OUT)

    def _released_by_quorum(self, replies: list[Any]) -> bool:
        """A release's wait ends once a quorum removed the key: the lock is free for others
        and cannot be reported as lost any more (a slower node removes its copy as it gets
        to it). A copy of the release that found nothing left while the first one's reply is
        still on its way (:data:`~.nodes.NOTHING_LEFT`) counts: the key is not ours there."""
        # A list, not a generator: this runs on every release (one call, not one per reply).
        removed = [r for r in replies if (r.__class__ is int and r > 0) or r is NOTHING_LEFT]
        return len(removed) >= self.quorum

    def _alone_steps(
        self, handle: LockBase, owner: Hashable, start: float
    ) -> Steps[Lease | Refusal]:
        """A blocking acquire's first attempt while no other thread (or task) of this process
        wants the name: one attempt, as a non-blocking acquire makes, without lining up in
        the local queue, which exists to line up this process's own contenders. A refusal is
        then :meth:`.Algorithm.contend`'s first attempt, made in line."""
        outcome = yield from self.algorithm.attempt(Contender(handle, owner))
        return self.leases.won(handle, outcome, start) if isinstance(outcome, Lease) else outcome

    def _locked_steps(self, name: str) -> Steps[bool]:
        check = self.keys.locked_command(check_name(name, listed=True))
        if self.restart_guard:
            guard_ms = int(self.guard_period * 1000)
            answers = yield Send(self.keys.with_guard_state(check, guard_ms))
            sitting = self.listing.sitting_out(answers)
            replies = [a if isinstance(a, Failure) else a.reply for a in answers]
        else:
            replies = yield Send(to_every_node(check))
            sitting = {}
        held_there = [r == 1 or isinstance(r, bytes) for r in replies]
        held = sum(held_there)
        if held >= self.quorum:
            return True
        # A node in its restart guard may have lost the key of a lease still running on the
        # others: its "not held" is no answer, as a silent node's.
        unknown = {
            n.name: sitting[i] if i in sitting else str(r)
            for i, (n, r) in enumerate(zip(self.nodes, replies, strict=True))
            if isinstance(r, Failure) or (i in sitting and not held_there[i])
        }
        if held + len(unknown) < self.quorum:
            return False
        # The silent nodes may hold it: "free" would be a guess (redis-py's locked() raises
        # when it cannot ask, and so does an acquire here).
        raise QuorumError(
            f"lock {name!r}: could not tell whether it is held: {held} of {len(self.nodes)} "
            f"nodes hold it, {len(unknown)} could not answer (silent, or in their restart "
            f"guard), {self.quorum} needed",
            name,
            failures=unknown,
        )

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
        hold = listed_hold(check_name(name, listed=True), check_token(token))
        if hold is None:
            return 0
        command = self.keys.release_command(hold, token)
        replies = yield Send(to_every_node(command), idempotent=True)
        self._keep_unreached(command, replies)
        return sum(1 for r in replies if isinstance(r, int) and r)

    def _extend_token_steps(self, name: str, token: str, ttl: float) -> Steps[bool]:
        ttl = self._check_extend_ttl(ttl)
        hold = listed_hold(check_name(name, listed=True), check_token(token))
        if hold is None:
            return False
        command = self.keys.extend_token_command(hold, token, ttl)
        replies = yield Send(to_every_node(command))
        return sum(1 for r in replies if r == 1) >= self.quorum

    def _extend_steps(self, lease: Lease, ttl: float) -> Steps[bool]:
        ttl = self._check_extend_ttl(ttl)
        if lease.released or lease.lost or lease.foreign:
            return False
        send = Send(to_every_node(self.keys.extend_command(lease, ttl)))
        replies = yield send
        start = send.started
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

    def _rejoined_steps(self, lease: Lease) -> Steps[bool]:
        """Whether the hold a reentrant acquire just joined is still there: someone else may
        have removed it (an operator's force release, which a holder without auto_renew hears
        of only at its next check), and joining it then would tell this owner it holds a lock
        another may hold. Gone from a quorum (the lease is marked lost): False, and the
        acquire takes the lock anew. Nodes that could not answer: the hold stands, as far as
        this process knows."""
        held = yield from self._check_steps(lease)
        return held or lease.lost is None

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

    def _list_steps(
        self, pattern: str, read_guard: bool = False
    ) -> Steps[tuple[dict[str, list[tuple[Node, list[Any]]]], tuple[str, ...]]]:
        """Every lock some node holds whose name matches the glob ``pattern``: each step reads
        up to ``LIST_BATCH`` locks per node in one script call (a SCAN step, never KEYS, so a
        busy node is not blocked), on all nodes at once. Returns each name's per-node
        entries (see :meth:`.Listing.lock_info`) and, with ``read_guard``, the nodes that
        sit out their restart guard (read in the first step, :meth:`.Listing.sitting_out`)."""
        pattern = check_pattern(pattern)
        found: dict[str, list[tuple[Node, list[Any]]]] = {}
        sitting: tuple[str, ...] = ()
        read_guard = read_guard and self.restart_guard
        # The locks, then the read/write locks' readers (one entry per reader).
        for command in (self.keys.list_command, self.keys.list_readers_command):
            cursors: list[bytes | None] = [b"0"] * len(self.nodes)
            while any(c is not None for c in cursors):
                commands = {
                    id(node): command(cursor, pattern)
                    for node, cursor in zip(self.nodes, cursors, strict=True)
                }
                if read_guard:
                    read_guard = False
                    guard_ms = int(self.guard_period * 1000)
                    step = self.keys.with_guard_state(commands, guard_ms)
                    states = yield Send(step, timeout=self.keys.LIST_TIMEOUT)
                    guarded = self.listing.sitting_out(states)
                    sitting = tuple(self.nodes[i].name for i in sorted(guarded))
                    replies = [s if isinstance(s, Failure) else s.reply for s in states]
                else:
                    replies = yield Send(to_each_node(commands), timeout=self.keys.LIST_TIMEOUT)
                self.listing.list_step(cursors, replies, found)
        return found, sitting

    def _live_locks_steps(self, pattern: str) -> Steps[list[LockInfo]]:
        """``live_locks()``: each lock judged with the nodes in their restart guard in view."""
        found, sitting = yield from self._list_steps(pattern, read_guard=True)
        return [self.listing.lock_info(name, found[name], sitting) for name in sorted(found)]

    def _probe_steps(self, node: Node) -> Generator[list[list[Any]], list[Any], NodeHealth]:
        """One node's health probe as I/O-free steps: each yield is commands the driver
        pipelines to ``node``, resumed with their replies (as redis-py's client parses them,
        or as they came), or thrown the error a reply was."""
        sent = clock.wall()
        t0 = clock.monotonic()
        yield [["PING"]]
        latency = clock.monotonic() - t0
        try:
            yield self.listing.permission_probe()
        except (ReplyError, redis.ResponseError) as exc:
            raise self.listing.script_refused(exc) from None
        [server_time] = yield [["TIME"]]
        received = clock.wall()
        info, marker = yield [["INFO"], ["HMGET", self.keys.node_key(), *self.keys.MARKER_FIELDS]]
        keys, cursor, match = 0, b"0", f"{self.key_prefix}:lock:*"
        while True:
            [(cursor, found)] = yield [["SCAN", cursor, "MATCH", match, "COUNT", 1000]]
            keys += len(found)
            if cursor in (b"0", 0):
                break
        info = info if isinstance(info, Mapping) else parse_info(info)
        probe = {"latency": latency, "sent": sent, "time": server_time, "received": received}
        return self.listing.node_health(
            node, {**probe, "info": info, "marker": marker, "keys": keys}
        )

    def _trust_cluster_steps(self) -> Steps[int]:
        """``trust_cluster()``: refuse when a reachable node holds a lock (the operator's
        assertion is false), else arm every reachable node's marker as trusted now."""
        found, _ = yield from self._list_steps("*")
        self.listing.refuse_trust(
            [self.listing.lock_info(name, found[name]) for name in sorted(found)]
        )
        replies = yield Send(lambda n, wire: self.keys.trust_now_command(wire))
        return sum(1 for r in replies if r == 1)

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


def _answered_at(replies: list[Any], answered: list[float | None], quorum: int) -> float | None:
    """When a quorum of nodes had extended a lease (the ``quorum``-th earliest answer among
    the nodes that replied 1), None when too few did or the driver did not say when."""
    times = sorted(t for r, t in zip(replies, answered, strict=False) if r == 1 and t is not None)
    return times[quorum - 1] if len(times) >= quorum else None


def _either_extended(first: list[Any], claimed: list[Any]) -> list[Any]:
    """A renewal's replies after its claiming round: a node extended in either counts (one
    that answered the first and failed the second still holds our re-armed copy)."""
    return [1 if a == 1 else b for a, b in zip(first, claimed, strict=True)]
