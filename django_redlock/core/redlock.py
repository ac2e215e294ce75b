"""The Redlock algorithm over N independent Redis nodes, synchronous client.

Seed 001 and redis.io's distributed-locks page describe the algorithm; seed 004's pitfalls are
designed out (atomic set-with-expiry, token-checked release and extend, validity measured after
the quorum answered). Decisions live in :mod:`.algorithm` and :mod:`.base`; this module does the
talking, and hands the algorithm the time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Hashable, Iterator, Mapping
from typing import Any, TypeVar

import redis

from .algorithm import Contender, Finally, Listen, Pause, Refusal, Send, SendBatch, Steps, Wait
from .base import RedlockBase
from .fanout import Rounds, fan_out_batch
from .info import LockInfo, NodeHealth
from .listing import glob_escape
from .lock import Lease, Lock
from .nodes import Node, Owing, reply_wait
from .permits import HoldBase, Permits, ReadLock, Semaphore, WriteLock
from .renewal import YIELD_AT_MOST, renewer
from .validation import check_name, check_pattern
from .waiting import HolderWatch, HolderWatches, LocalQueue, ReleaseNotices

__all__ = ["Redlock"]

_T = TypeVar("_T")


class Redlock(RedlockBase):
    """A lock manager over independent Redis nodes.

    Build one per process (the Django layer does, from settings) and take locks with
    :meth:`lock`. Thread-safe and fork-safe: a child process opens its own connections and
    holds none of its parent's locks.
    """

    lock_class = Lock
    semaphore_class = Semaphore
    read_lock_class = ReadLock
    write_lock_class = WriteLock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.permits = Permits(self)
        self._queues: dict[str, LocalQueue] = {}
        self._queues_lock = threading.Lock()
        self._notices = ReleaseNotices(self.nodes, self.node_timeout)
        self._holders = HolderWatches()
        self._rounds = Rounds(self.nodes, self.node_timeout)
        #: Group node name -> the master its health client was last pointed at.
        self._probed: dict[str, str | None] = {}

    # -- public API -----------------------------------------------------------------------------

    def locked(self, name: str) -> bool:
        """Whether anyone holds ``name`` (a quorum of nodes has the key). Raises
        :class:`QuorumError` when too few nodes answered to rule that out."""
        return self._drive(self._locked_steps(name))

    def force_release(self, name: str, token: str | None = None) -> int:
        """Remove ``name`` on every node whoever holds it; returns how many nodes had it.

        With ``token``, only that holder's copies are removed (an operator confirmed a
        release of what they saw, not of whoever took the lock since). The former holder
        learns it lost the lock at its next renewal, check or release.
        """
        return self._drive(self._force_release_steps(name, token))

    def release_token(self, name: str, token: str) -> int:
        """Release ``name`` where ``token`` still holds it (a lock handed over with
        :meth:`Lock.detach`); returns how many nodes it was removed from. Never touches
        another holder's copy."""
        return self._drive(self._release_token_steps(name, token))

    def extend_token(self, name: str, token: str, ttl: float) -> bool:
        """Re-arm ``name`` for ``ttl`` seconds if ``token`` still holds it on a quorum."""
        return self._drive(self._extend_token_steps(name, token, ttl))

    def live_locks(self, pattern: str = "*") -> Iterator[LockInfo]:
        """Every lock some node holds whose name matches the glob ``pattern``, by name
        (read ``LIST_BATCH`` locks per node per step, all nodes at once)."""
        # Checked at the call, not at the iterator's first read.
        return self._live_locks(check_pattern(pattern))

    def _live_locks(self, pattern: str) -> Iterator[LockInfo]:
        yield from self._drive(self._live_locks_steps(pattern))

    def lock_info(self, name: str) -> LockInfo | None:
        """Everything the nodes know about one lock, or None when no node holds it."""
        pattern = glob_escape(check_name(name, listed=True))
        return next((i for i in self.live_locks(pattern) if i.name == name), None)

    def health(self) -> list[NodeHealth]:
        """Reachability, latency, version, uptime, memory, lock keys, clock offset and
        restart-guard state of every node."""
        return self.listing.judge_health([self._probe(node) for node in self.nodes])

    def trust_cluster(self) -> int:
        """Let every reachable node vote now, after checking that none holds a lock.

        For an operator (``manage.py redlock trust``) or a test suite: a brand-new cluster with
        a node down, or nodes flushed while one was unreachable, otherwise wait ``max_ttl``
        before any lock, because no node can vouch that nothing was held. Raises
        :class:`TrustRefused` when a reachable node holds a lock. Returns the number of nodes
        armed (their restart-guard markers written as trusted from now). An unreachable node
        is not armed; when it comes back empty it sits out its guard as usual.
        """
        return self._drive(self._trust_cluster_steps())

    def close(self) -> None:
        """Close every connection this Redlock opened. Held locks stay held: an auto-renewed
        one is still renewed (over new connections) until it is released, any other until
        its lease ends. The instance stays usable: it reconnects when used again."""
        self._notices.close()
        for node in self.nodes:
            node.close()

    # -- acquiring ------------------------------------------------------------------------------

    def _acquire(
        self,
        handle: Lock,
        owner: Hashable,
        *,
        blocking: bool,
        timeout: float | None,
        retries: int | None,
    ) -> Lease | None:
        if handle.reentrant:
            # Asked of the nodes before the hold count goes up: an interrupt meanwhile
            # leaves no hold that nobody will release.
            held = self.leases.joinable(handle.name, owner)
            if held is not None and self._drive(self._rejoined_steps(held)):
                lease = self.leases.reenter(handle, owner)
                if lease is not None:
                    return lease
        if not renewer.caught_up.is_set():
            # Renewal goes first: see renewal's "Renewal goes first".
            renewer.make_way(YIELD_AT_MOST if timeout is None else min(timeout, YIELD_AT_MOST))
        start = time.monotonic()
        try:
            if not blocking:
                # One attempt (a fair lock's in its line): no deadline, no local queue.
                return self._drive(
                    self.algorithm.contend(Contender(handle, owner), False, None, retries, start)
                )
            return self._acquire_waiting(handle, owner, timeout, retries, start)
        except BaseException:
            self._give_back(self.leases.won_unreturned([handle.name], owner, start))
            raise

    def _acquire_waiting(
        self,
        handle: Lock,
        owner: Hashable,
        timeout: float | None,
        retries: int | None,
        start: float,
    ) -> Lease | None:
        """A blocking acquire (begun at ``start``): alone, one attempt as a non-blocking
        one; else in this process's queue for the name, then attempts until acquired or out
        of time."""
        deadline = self.algorithm.deadline(start, timeout, retries)
        courtesy = self.leases.courtesy(handle.name)
        if courtesy:
            time.sleep(min(courtesy, (deadline or start + 1) - start))
        first: Refusal | None = None
        if not handle.fair and not courtesy and handle.name not in self._queues:
            alone = self._drive(self._alone_steps(handle, owner, start))
            if isinstance(alone, Lease):
                return alone
            first = alone
        queue = self._join_queue(handle.name)
        try:
            entered = queue.enter(deadline)
        except BaseException:
            self._drop_queue(handle.name, queue)
            raise
        if not entered:
            self._drop_queue(handle.name, queue)
            refusal = first or Refusal({}, len(self.nodes), queue.holder_left())
            self.algorithm.give_up(handle, refusal, time.monotonic() - start)
            return None
        try:
            lease = self._drive(
                self.algorithm.contend(
                    Contender(handle, owner), True, deadline, retries, start, first, courtesy > 0
                )
            )
        except BaseException:
            self._leave_queue(handle.name, queue, None)
            raise
        if lease is None:
            self._leave_queue(handle.name, queue, None)
        else:
            queue.hold(lease)
            lease.leave_queue = lambda: self._leave_queue(handle.name, queue, lease)
            lease.wake_queue = queue.wake
        return lease

    def _acquire_hold(
        self, handle: HoldBase, owner: Hashable, blocking: bool, timeout: float | None
    ) -> Lease | None:
        """A permit or a read/write hold (:mod:`.permits`)."""
        if not renewer.caught_up.is_set():
            renewer.make_way(YIELD_AT_MOST if timeout is None else min(timeout, YIELD_AT_MOST))
        start = time.monotonic()
        deadline = self.algorithm.deadline(start, timeout, None)
        try:
            return self._drive(self.permits.hold_steps(handle, owner, blocking, deadline, start))
        except BaseException:
            self._give_back(self.leases.won_unreturned(handle.hold_names(), owner, start))
            raise

    def _give_back(self, leases: list[Lease]) -> None:
        """Release leases their acquire's caller never got (interrupted after the win)."""
        for lease in leases:
            with contextlib.suppress(Exception):
                self._release(lease)

    def _drive(self, steps: Steps[_T]) -> _T:
        """Run the algorithm's steps over sockets: each :class:`Send` is one fan-out, a
        :class:`Listen` a subscription kept until the operation ends."""
        reply: Any = None
        cleanup: contextlib.ExitStack | None = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                reply = None
                if isinstance(step, Send):
                    step.started = time.monotonic()
                    try:
                        reply = self._rounds.fan_out(*step.args, hedge=step.hedge)
                    except BaseException:
                        # Interrupted (KeyboardInterrupt) with an acquire on the wire: some
                        # SETs may have landed; take them back before the caller goes on.
                        if step.undo_if_cancelled:
                            with contextlib.suppress(Exception):
                                self._release_everywhere(*step.undo_if_cancelled)
                        raise
                    step.ended = time.monotonic()
                elif isinstance(step, SendBatch):
                    reply = self._send_batch(step)
                elif isinstance(step, Wait):
                    reply = step.notice.wait(step.seconds)
                elif isinstance(step, Pause):
                    time.sleep(step.seconds)
                else:
                    cleanup = cleanup or contextlib.ExitStack()
                    if isinstance(step, Listen):
                        reply = cleanup.enter_context(self._notices.listening(step.channel))
                    else:
                        cleanup.callback(self._finally, step)
        finally:
            if cleanup is not None:
                cleanup.close()

    def _finally(self, step: Finally) -> None:
        if not step.cancelled:
            self._rounds.fan_out(step.send.build)

    def _join_queue(self, name: str) -> LocalQueue:
        with self._queues_lock:
            queue = self._queues.get(name)
            if queue is None:
                queue = self._queues[name] = LocalQueue()
            queue.users += 1
            return queue

    def _leave_queue(self, name: str, queue: LocalQueue, lease: Lease | None) -> None:
        queue.leave(lease)
        self._drop_queue(name, queue)

    def _drop_queue(self, name: str, queue: LocalQueue) -> None:
        """One user fewer (it left, or gave up before reaching the front); the queue goes
        with its last user."""
        with self._queues_lock:
            queue.users -= 1
            if queue.users == 0 and self._queues.get(name) is queue:
                del self._queues[name]

    # -- holding --------------------------------------------------------------------------------

    def _release_everywhere(
        self, name: str, token: str, behind: Mapping[int, Owing] | None = None
    ) -> list[Any]:
        command = self.keys.release_command(name, token)
        replies = self._rounds.fan_out(
            lambda n, w: command,
            enough=self._release_ends(),
            behind=behind,
            idempotent=True,
        )
        self._keep_unreached(command, replies)
        return replies

    def _release(self, lease: Lease) -> None:
        if not self.leases.begin_release(lease):
            return
        try:
            with lease.io_lock:
                behind, lease.behind = lease.behind, None
                if lease.home is not self.leases:
                    behind = None  # see AsyncRedlock._release_after_renewal
                replies = self._release_everywhere(lease.name, lease.token, behind)
        finally:
            if lease.leave_queue is not None:
                lease.leave_queue()
        self.leases.finish_release(lease, replies)

    def _extend(self, lease: Lease, ttl: float) -> bool:
        return self._drive(self._extend_steps(lease, ttl))

    def _start_renewal(self, lease: Lease) -> None:
        renewer.add(self, lease)
        # A long holder hears an operator's force release at once (not at its next renewal),
        # on the holders' channel: subscribed once per node for all of them.
        watch = HolderWatch(lease, self.leases.mark_lost, self.quorum)
        self._holders.add(watch)
        self._notices.keep(self.keys.holders_channel().encode(), self._holders)
        lease.unwatch = functools.partial(self._holders.remove, watch)

    def _renew(self, leases: list[Lease]) -> list[float | None]:
        return self._drive(self._renew_steps(leases))

    def _send_batch(self, step: SendBatch) -> list[Any]:
        # Each lease's io_lock is held while its renewal is on the wire: no release races a
        # PEXPIRE, and nothing is sent for a lease released before this point.
        for lease in step.leases:
            lease.io_lock.acquire()
        try:
            commands = [
                ["PING"] if lease.released else command
                for lease, command in zip(step.leases, step.commands, strict=True)
            ]
            step.answered = [None] * len(self.nodes)
            return fan_out_batch(
                self.nodes,
                commands,
                reply_wait(self.nodes, self.node_timeout),
                quorum=self.quorum,
                until=step.until,
                answered=step.answered,
            )
        finally:
            for lease in step.leases:
                lease.io_lock.release()

    def _check(self, lease: Lease) -> bool:
        return self._drive(self._check_steps(lease))

    def waiter_id(self, name: str) -> str:
        return self._notices.waiter_id(name, functools.partial(self.keys.waiter_channel, name))

    def _after_fork(self) -> None:
        super()._after_fork()
        self._queues = {}
        self._queues_lock = threading.Lock()
        # The parent's listener thread may have held its lock at the fork: a fresh one, and
        # fresh rounds (a parent's thread may have been leading one).
        self._notices = ReleaseNotices(self.nodes, self.node_timeout)
        self._holders = HolderWatches()
        self._rounds = Rounds(self.nodes, self.node_timeout)

    # -- listing and health ---------------------------------------------------------------------

    def _probe(self, node: Node) -> NodeHealth:
        try:
            node.locate()  # a group node: where its master is now
            if node.group is not None and self._probed.get(node.name) != node.address:
                # redis-py's Sentinel pool keeps connections to a deposed master, which still
                # answers reads as a replica (and would report its own, armed marker): after a
                # failover the probe must reach the master the lock connections reach.
                node.client.connection_pool.disconnect()
                self._probed[node.name] = node.address
            # A lock connection first (pooled, or opened with its handshake, then pooled): its
            # INFO tells a service that is not Redis, which redis-py may not (a nil reply to
            # its HELLO leaves it waiting for the rest until its timeout).
            node.checkin(node.checkout(time.monotonic() + self.keys.LIST_TIMEOUT))
        except Exception as exc:
            return self.listing.failed_health(node, exc)
        return self.probe_with(node, node.client)

    def probe_with(self, node: Node, client: redis.Redis) -> NodeHealth:
        """The health probe of ``node`` (its steps: :meth:`_probe_steps`), its commands sent
        through ``client``, a redis-py client of that node: the deploy checks probe with
        their own client, so that ``check --deploy`` judges a node as ``health()`` does (a
        user who may not run the lock scripts or INFO, a service that is not Redis)."""
        try:
            steps = self._probe_steps(node)
            commands = next(steps)
            while True:
                try:
                    replies = [client.execute_command(*c) for c in commands]  # type: ignore[no-untyped-call]
                except redis.ResponseError as exc:
                    commands = steps.throw(exc)
                else:
                    commands = steps.send(replies)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except Exception as exc:
            return self.listing.failed_health(node, exc)
