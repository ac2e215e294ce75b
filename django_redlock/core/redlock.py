"""The Redlock algorithm over N independent Redis nodes, synchronous client.

Seed 001 and redis.io's distributed-locks page describe the algorithm; seed 004's pitfalls are
designed out (atomic set-with-expiry, token-checked release and extend, validity measured after
the quorum answered). Decisions live in :mod:`.base`; this module does the talking.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any

from .base import AcquireRequest, RedlockBase, Refusal, glob_escape
from .info import LockInfo, NodeHealth
from .lock import Lease, Lock, current_owner
from .nodes import Failure, Node, fan_out
from .renewal import renewer
from .validation import check_name
from .waiting import LocalQueue, ReleaseNotice, ReleaseNotices

__all__ = ["Redlock"]


class Redlock(RedlockBase):
    """A lock manager over independent Redis nodes.

    Build one per process (the Django layer does, from settings) and take locks with
    :meth:`lock`. Thread-safe and fork-safe: a child process opens its own connections and
    holds none of its parent's locks.
    """

    lock_class = Lock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queues: dict[str, LocalQueue] = {}
        self._queues_lock = threading.Lock()
        self._notices = ReleaseNotices(self.nodes, self.node_timeout)

    # -- public API -----------------------------------------------------------------------------

    def locked(self, name: str) -> bool:
        """Whether anyone holds ``name`` (a quorum of nodes has the key)."""
        key = self._key(check_name(name))
        replies = fan_out(self.nodes, lambda n, w: ("EXISTS", key), self.node_timeout)
        return sum(1 for r in replies if r == 1) >= self.quorum

    def force_release(self, name: str, token: str | None = None) -> int:
        """Remove ``name`` on every node whoever holds it; returns how many nodes had it.

        With ``token``, only that holder's copies are removed (an operator confirmed a
        release of what they saw, not of whoever took the lock since). The former holder
        learns it lost the lock at its next renewal, check or release.
        """
        command = self._force_release_command(name, token)
        replies = fan_out(self.nodes, lambda n, w: command, self.node_timeout)
        return self._judge_force_release(name, replies)

    def release_token(self, name: str, token: str) -> int:
        """Release ``name`` where ``token`` still holds it (a lock handed over with
        :meth:`Lock.detach`); returns how many nodes it was removed from. Never touches
        another holder's copy."""
        check_name(name)
        return sum(1 for r in self._release_everywhere(name, token) if isinstance(r, int) and r)

    def extend_token(self, name: str, token: str, ttl: float) -> bool:
        """Re-arm ``name`` for ``ttl`` seconds if ``token`` still holds it on a quorum."""
        check_name(name)
        command = self._extend_token_command(name, token, self._check_extend_ttl(ttl))
        replies = fan_out(self.nodes, lambda n, w: command, self.node_timeout)
        return sum(1 for r in replies if r == 1) >= self.quorum

    def live_locks(self, pattern: str = "*") -> Iterator[LockInfo]:
        """Every lock some node holds whose name matches the glob ``pattern``, by name.

        Each step reads up to ``LIST_BATCH`` locks per node in one script call (a SCAN step,
        never KEYS, so a busy node is not blocked), on all nodes at once.
        """
        cursors: list[bytes | None] = [b"0"] * len(self.nodes)
        found: dict[str, list[tuple[Node, list[Any]]]] = {}
        while any(c is not None for c in cursors):
            replies = fan_out(
                self.nodes, lambda n, w: self._list_command(cursors[self.nodes.index(n)],
                                                            pattern),
                self.LIST_TIMEOUT,
            )
            self._list_step(cursors, replies, found)
        for name in sorted(found):
            yield self._lock_info(name, found[name])

    def lock_info(self, name: str) -> LockInfo | None:
        """Everything the nodes know about one lock, or None when no node holds it."""
        pattern = glob_escape(check_name(name))
        return next((i for i in self.live_locks(pattern) if i.name == name), None)

    def health(self) -> list[NodeHealth]:
        """Reachability, latency, version, uptime, memory, lock keys, clock offset and
        restart-guard state of every node."""
        return [self._probe(node) for node in self.nodes]

    def close(self) -> None:
        """Close every connection this Redlock opened (held locks stay held until their
        lease ends)."""
        self._notices.close()
        for node in self.nodes:
            node.close()

    # -- acquiring ------------------------------------------------------------------------------

    def _acquire(self, handle: Lock, *, blocking: bool, timeout: float | None) -> Lease | None:
        owner = handle.owner if handle.owner is not None else current_owner()
        lease = self._reenter(handle, owner)
        if lease is not None:
            return lease
        start = time.monotonic()
        deadline = self._deadline(start, timeout)
        if blocking:
            time.sleep(min(self._courtesy(handle.name), (deadline or start + 1) - start))
        queue = self._join_queue(handle.name) if blocking else None
        try:
            if queue is not None and not queue.enter(deadline):
                self._give_up(handle, Refusal({}, len(self.nodes), None), time.monotonic() - start)
                return None
            lease = self._contend(handle, owner, blocking, deadline, timeout, start)
        except BaseException:
            if queue is not None:
                self._leave_queue(handle.name, queue, None)
            raise
        if queue is not None:
            if lease is None:
                self._leave_queue(handle.name, queue, None)
            else:
                queue.hold(lease)
                lease.leave_queue = lambda: self._leave_queue(handle.name, queue, lease)
        return lease

    def _contend(
        self, handle: Lock, owner: Hashable, blocking: bool, deadline: float | None,
        timeout: float | None, start: float,
    ) -> Lease | None:
        attempts = 0
        released: ReleaseNotice | None = None
        line = None
        if handle.fair:
            command = self._ticket_command(handle.name)
            line = self._line(fan_out(self.nodes, lambda n, w: command, self.node_timeout))
        with contextlib.ExitStack() as stack:
            if line is not None:
                stack.callback(self._leave_line, handle.name, line[0])
            while True:
                outcome = self._attempt(handle, owner, line)
                if isinstance(outcome, Lease):
                    self._register(handle, outcome, time.monotonic() - start)
                    if outcome.auto_renew:
                        self._start_renewal(outcome)
                    return outcome
                attempts += 1
                now = time.monotonic()
                if self._out_of_time(blocking, attempts, timeout, deadline, now):
                    self._give_up(handle, outcome, now - start)
                    return None
                if released is None:
                    # Subscribe, then try again at once: a release between our first attempt
                    # and the subscription would otherwise go unnoticed.
                    channel = self._channel(handle.name)
                    released = stack.enter_context(self._notices.listening(channel))
                    continue
                released.wait(self._pause_for(handle, outcome, timeout, deadline, now))

    def _attempt(
        self, handle: Lock, owner: Hashable, line: tuple[str, int] | None = None,
        settle: int = 3,
    ) -> Lease | Refusal:
        request = AcquireRequest(self, handle, line)
        start = time.monotonic()
        replies = fan_out(
            self.nodes, lambda node, wire: request.command(wire.run_id), self.node_timeout
        )
        spread = time.monotonic() - start
        lease = self._lease_if_valid(handle, owner, request, replies, start)
        if lease is not None and lease.fence is not None:
            command = self._fence_command(handle.name, request.token, lease.fence)
            synced = fan_out(self.nodes, lambda n, w: command, self.node_timeout)
            valid = time.monotonic() < lease.valid_until
            if sum(1 for r in synced if r == 1) < self.quorum or not valid:
                lease = None
        if lease is not None:
            return lease
        if self._granted(replies) or any(isinstance(r, Failure) for r in replies):
            # Also nodes that timed out: the SET may have landed after we stopped waiting.
            self._release_everywhere(handle.name, request.token)
        if self._all_fresh(replies) and self._trust_all():
            return self._attempt(handle, owner, line, settle=0)
        if settle and self._settling(replies, spread):
            time.sleep(self.node_timeout)
            return self._attempt(handle, owner, line, settle - 1)
        return self._refusal(replies)

    def _leave_line(self, name: str, waiter: str) -> None:
        command = self._leave_line_command(name, waiter)
        fan_out(self.nodes, lambda n, w: command, self.node_timeout)

    def _trust_all(self) -> bool:
        replies = fan_out(
            self.nodes, lambda n, wire: self._trust_command(wire.run_id), self.node_timeout
        )
        return all(r == 1 for r in replies)

    def _join_queue(self, name: str) -> LocalQueue:
        with self._queues_lock:
            queue = self._queues.get(name)
            if queue is None:
                queue = self._queues[name] = LocalQueue()
            queue.users += 1
            return queue

    def _leave_queue(self, name: str, queue: LocalQueue, lease: Lease | None) -> None:
        queue.leave(lease)
        with self._queues_lock:
            queue.users -= 1
            if queue.users == 0 and self._queues.get(name) is queue:
                del self._queues[name]

    # -- holding --------------------------------------------------------------------------------

    def _release_everywhere(self, name: str, token: str) -> list[Any]:
        command = self._release_command(name, token)
        return fan_out(self.nodes, lambda n, w: command, self.node_timeout)

    def _release(self, lease: Lease) -> None:
        if not self._begin_release(lease):
            return
        try:
            with lease.io_lock:
                replies = self._release_everywhere(lease.name, lease.token)
        finally:
            if lease.leave_queue is not None:
                lease.leave_queue()
        self._finish_release(lease, replies)

    def _extend(self, lease: Lease, ttl: float) -> bool:
        ttl = self._check_extend_ttl(ttl)
        if lease.released or lease.lost:
            return False
        command = self._extend_command(lease, ttl)
        start = time.monotonic()
        replies = fan_out(self.nodes, lambda n, w: command, self.node_timeout)
        return self._judge_extend(lease, ttl, replies, start)

    def _start_renewal(self, lease: Lease) -> None:
        renewer.add(self, lease)

    def _renew(self, lease: Lease) -> float | None:
        """One watchdog turn: when to renew next, or None to stop."""
        now = time.monotonic()
        if lease.validity <= 0:
            self._mark_lost(lease, "the lease ran out before it could be renewed "
                                   "(was the process paused?)")
            return None
        if lease.renew_until is not None and now >= lease.renew_until:
            return None
        with lease.io_lock:
            if lease.released:
                return None
            renewed = self._extend(lease, lease.ttl)
        if renewed:
            return time.monotonic() + lease.ttl / 3
        if lease.lost:
            return None
        # No quorum this time: try again soon, while the lease still has validity.
        return time.monotonic() + min(lease.ttl / 10, max(lease.validity / 2, 0.01))

    def _check(self, lease: Lease) -> bool:
        if lease.released or lease.lost:
            return False
        key = self._key(lease.name)
        replies = fan_out(self.nodes, lambda n, w: ("HGET", key, "token"), self.node_timeout)
        return self._judge_check(lease, replies)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._queues = {}
        self._queues_lock = threading.Lock()

    # -- listing and health ---------------------------------------------------------------------

    def _probe(self, node: Node) -> NodeHealth:
        try:
            sent = time.time()
            t0 = time.perf_counter()
            node.client.ping()
            latency = time.perf_counter() - t0
            probe = {
                "latency": latency,
                "sent": sent,
                "time": node.client.time(),
                "received": time.time(),
                "info": node.client.info(),
                "marker": node.client.hmget(self._node_key(), *self.MARKER_FIELDS),
                "keys": sum(1 for _ in node.client.scan_iter(
                    match=f"{self.key_prefix}:lock:*", count=1000)),
            }
        except Exception as exc:
            return NodeHealth(node=node.name, reachable=False,
                              error=str(exc) or type(exc).__name__)
        return self._node_health(node, probe)

