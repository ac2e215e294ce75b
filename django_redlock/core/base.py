"""Everything the sync and async clients share: configuration, keys, holder metadata, how
the nodes' replies are judged, the lease table for reentrancy, and listing.

The two clients differ only in how they talk to the nodes (``redlock.py`` with sockets and poll,
``asyncio.py`` with streams) and how they wait.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Hashable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from . import scripts
from .errors import LockLost, LockNotOwned, QuorumError
from .events import Listener, LockEvent, emit
from .info import LockInfo, NodeHealth, NodeLockState
from .lock import Lease, LockBase
from .nodes import Failure, Node, NodeSpec, make_nodes, script_command
from .resp import bulk
from .validation import check_name, check_positive, check_prefix, check_timeout

__all__ = ["DRIFT_FLOOR", "AcquireRequest", "RedlockBase", "Refusal"]

#: Fixed part of the clock-drift allowance (the Redlock spec adds 2 ms for Redis' own expiry
#: granularity).
DRIFT_FLOOR = 0.002

#: Largest ``retry_count``: beyond it, ask for a ``timeout`` instead.
MAX_RETRY_COUNT = 1000

#: Head start, in seconds, that a releaser gives processes its release woke (see
#: ``_courtesy``): enough for a woken waiter's attempt to reach the nodes first.
COURTESY = 0.003

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
        self, failures: dict[str, str], answered: int, retry_after: float | None
    ) -> None:
        self.failures = failures
        self.answered = answered  #: nodes that gave a verdict (granted or held)
        self.retry_after = retry_after


class AcquireRequest:
    """One attempt's token, holder metadata and script, encoded once for every node.

    Only the server's run id differs between nodes, so the command is kept as the encoded
    parts around it. For a fair lock, ``line`` is the caller's ``(waiter id, ticket)``.
    """

    def __init__(
        self, redlock: RedlockBase, handle: LockBase, line: tuple[str, int] | None = None
    ) -> None:
        self.token = secrets.token_hex(16)
        self.meta, meta_json = redlock._holder_meta(handle.meta)
        keys = redlock._acquire_keys(handle.name)
        script = scripts.ACQUIRE
        extra: list[Any] = []
        if line is not None:
            script = scripts.FAIR_ACQUIRE
            keys = keys + redlock._line_keys(handle.name)
            extra = [line[0], line[1], int(redlock.fair_heartbeat * 1000)]
        guard = str(int(redlock.max_ttl * 1000)) if redlock.restart_guard else "0"
        head = ["EVALSHA", script.sha, len(keys), *keys, self.token, int(handle.ttl * 1000),
                meta_json, "1" if handle.fencing else "0"]
        self._head = b"*%d\r\n" % (len(head) + 2 + len(extra)) + b"".join(map(bulk, head))
        self._tail = b"".join(map(bulk, [guard, *extra]))

    def command(self, run_id: str) -> bytes:
        return self._head + bulk(run_id) + self._tail


class RedlockBase:
    """Configuration and decisions of the Redlock algorithm, without I/O."""

    #: The handle class :meth:`lock` returns.
    lock_class: type[LockBase] = LockBase

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
        reentrant: bool = True,
        fair_heartbeat: float = 3.0,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.key_prefix = check_prefix(key_prefix)
        self.ttl = check_positive("ttl", ttl)
        self.node_timeout = check_positive("node_timeout", node_timeout)
        if isinstance(retry_count, bool) or not isinstance(retry_count, int):
            raise TypeError(f"retry_count must be an int, got {retry_count!r}")
        if not 0 <= retry_count <= MAX_RETRY_COUNT:
            raise ValueError(
                f"retry_count must be between 0 and {MAX_RETRY_COUNT}, got {retry_count!r} "
                "(for a longer wait pass a timeout)"
            )
        self.retry_count = retry_count
        self.retry_delay = check_positive("retry_delay", retry_delay, allow_zero=True)
        self.drift_factor = check_positive("drift_factor", drift_factor, allow_zero=True)
        if self.drift_factor >= 0.5:
            raise ValueError(f"drift_factor must be < 0.5, got {drift_factor!r}")
        self.max_ttl = (
            max(self.ttl, 60.0) if max_ttl is None else check_positive("max_ttl", max_ttl)
        )
        if self.ttl > self.max_ttl:
            raise ValueError(f"ttl {ttl!r} is longer than max_ttl {self.max_ttl!r}")
        if self.node_timeout >= self.ttl:
            raise ValueError(
                f"node_timeout {node_timeout!r} must be much smaller than ttl {ttl!r}"
            )
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict, got {meta!r}")
        self.restart_guard = bool(restart_guard)
        self.trust_fresh_cluster = bool(trust_fresh_cluster)
        self.reentrant = bool(reentrant)
        #: A fair lock's waiter that stops refreshing its place for this long is dropped.
        self.fair_heartbeat = check_positive("fair_heartbeat", fair_heartbeat)
        self.meta = dict(meta or {})
        self.nodes: list[Node] = make_nodes(nodes, node_timeout=self.node_timeout)
        self.quorum = len(self.nodes) // 2 + 1
        self._leases: dict[str, Lease] = {}
        self._leases_lock = threading.Lock()
        self._yield_until: dict[str, float] = {}
        self._host = socket.gethostname()
        self._meta_cache: tuple[int, dict[str, Any], str] | None = None
        #: Called with a :class:`LockEvent` on acquire, release, contention, loss and force
        #: release.
        self.listeners: list[Listener] = []
        _INSTANCES.add(self)

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
    ) -> Any:
        """A handle on lock ``name``; nothing is sent until it is acquired.

        ``ttl`` is the lease in seconds (default: the Redlock's), at most ``max_ttl``.
        ``auto_renew`` keeps re-arming it every ttl/3 while held (``renew_for`` caps the total).
        ``meta`` is shown on the admin page as the holder's details. ``owner`` replaces the
        current thread/task as the reentrancy owner (a Celery task id, say).
        """
        check_name(name)
        lease_ttl = self.ttl if ttl is None else check_positive("ttl", ttl)
        if lease_ttl > self.max_ttl:
            raise ValueError(
                f"ttl {ttl!r} for lock {name!r} exceeds max_ttl {self.max_ttl!r} (the restart "
                "guard only protects leases up to max_ttl)"
            )
        if lease_ttl <= self.node_timeout:
            raise ValueError(f"ttl {ttl!r} for lock {name!r} must exceed node_timeout")
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(f"meta must be a dict, got {meta!r}")
            bad = [k for k in meta if not isinstance(k, str)]
            if bad:
                raise TypeError(f"meta keys must be str, got {bad[0]!r} in {meta!r}")
        if renew_for is not None:
            check_positive("renew_for", renew_for)
        return self.lock_class(
            self,
            name,
            ttl=lease_ttl,
            auto_renew=bool(auto_renew),
            fencing=bool(fencing),
            reentrant=self.reentrant if reentrant is None else bool(reentrant),
            fair=bool(fair),
            blocking=bool(blocking),
            timeout=check_timeout(timeout),
            meta=dict(meta or {}),
            owner=owner,
            renew_for=renew_for,
        )

    # -- judging replies ------------------------------------------------------------------------

    def _margin(self, ttl: float) -> float:
        return ttl * self.drift_factor + DRIFT_FLOOR

    def _granted(self, replies: list[Any]) -> list[Any]:
        return [r for r in replies if isinstance(r, list) and r[0] == 0]

    def _lease_if_valid(
        self, handle: LockBase, owner: Hashable, request: AcquireRequest, replies: list[Any],
        start: float,
    ) -> Lease | None:
        """The lease when a quorum granted it with validity left (validity measured after the
        replies came in: node-redlock returned locks with none left)."""
        granted = self._granted(replies)
        validity = handle.ttl - (time.monotonic() - start) - self._margin(handle.ttl)
        if len(granted) < self.quorum or validity <= 0:
            return None
        return Lease(
            name=handle.name,
            token=request.token,
            ttl=handle.ttl,
            owner=owner,
            valid_until=start + handle.ttl - self._margin(handle.ttl),
            fence=max(int(r[1]) for r in granted) if handle.fencing else None,
            acquired=start,
            meta=request.meta,
            auto_renew=handle.auto_renew,
            renew_until=None if handle.renew_for is None else start + handle.renew_for,
        )

    def _all_fresh(self, replies: list[Any]) -> bool:
        """A brand-new cluster: no node has a marker from before (each is guarded for a
        missing marker, or up long enough to need no guard but never used), and some are
        guarded.

        No node has ever held a lock under this prefix, so there is no lease to protect; the
        caller trusts them all at once instead of idling for max_ttl (docs/guarantees).
        """
        if not (self.restart_guard and self.trust_fresh_cluster):
            return False
        guarded = False
        for r in replies:
            if not isinstance(r, list):
                return False
            if r[0] == 2:
                if r[2] != 1:
                    return False
                guarded = True
            elif len(r) < 3 or r[2] != -2:
                return False
        return guarded

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

    def _refusal(self, replies: list[Any]) -> Refusal:
        failures: dict[str, str] = {}
        held_pttls: list[int] = []
        answered = 0
        for node, reply in zip(self.nodes, replies, strict=True):
            if isinstance(reply, Failure):
                failures[node.name] = str(reply)
            elif reply[0] == 1:
                answered += 1
                held_pttls.append(max(int(reply[1]), 0))
                failures[node.name] = "held"
            elif reply[0] == 2:
                failures[node.name] = f"guarded for {int(reply[1]) / 1000:.1f}s after a restart"
            elif reply[0] == 3:
                answered += 1
                failures[node.name] = "queued behind an earlier waiter"
            else:
                answered += 1
        retry_after = None
        free = len(self.nodes) - len(held_pttls)
        still_needed = self.quorum - free
        if held_pttls and 0 < still_needed <= len(held_pttls):
            # The lock frees up once enough leases have run out to leave a quorum free.
            retry_after = sorted(held_pttls)[still_needed - 1] / 1000
        return Refusal(failures, answered, retry_after)

    def _give_up(self, handle: LockBase, refusal: Refusal, waited: float) -> None:
        """Report a failed acquire; raise when the cluster could not even give a verdict."""
        handle.retry_after = refusal.retry_after
        emit(self.listeners, LockEvent(
            "contended", handle.name, meta=handle.meta, waited=waited,
            retry_after=refusal.retry_after,
            reason=", ".join(f"{n}: {why}" for n, why in refusal.failures.items()),
        ))
        if refusal.answered < self.quorum:
            raise QuorumError(
                f"lock {handle.name!r}: only {refusal.answered} of {len(self.nodes)} nodes "
                f"could answer, {self.quorum} needed",
                handle.name,
                failures=refusal.failures,
                retry_after=refusal.retry_after,
            )

    def _deadline(self, start: float, timeout: float | None) -> float | None:
        """When a blocking acquire gives up: ``timeout`` seconds from now, never for ``inf``,
        and for ``None`` (the retry policy) once ``retry_count`` retries could have run."""
        if timeout is None:
            return start + (self.retry_count + 1) * max(self.retry_delay, self.node_timeout)
        return None if math.isinf(timeout) else start + timeout

    def _out_of_time(
        self, blocking: bool, attempts: int, timeout: float | None, deadline: float | None,
        now: float,
    ) -> bool:
        if not blocking:
            return True
        if timeout is None and attempts > self.retry_count:
            return True
        return deadline is not None and now >= deadline

    def _pause_for(
        self, handle: LockBase, refusal: Refusal, timeout: float | None, deadline: float | None,
        now: float,
    ) -> float:
        """How long to wait before the next attempt if no release notice comes first: until
        the holder's lease runs out when the nodes told us, else a random retry delay. Under
        the retry policy (``timeout=None``) never longer than ``retry_delay``. The jitter keeps
        contenders from retrying in lock step."""
        jitter = random.uniform(0, self.retry_delay / 2)
        if refusal.retry_after is not None:
            delay = refusal.retry_after + min(jitter, 0.002)
        else:
            delay = self.retry_delay / 2 + jitter
        if timeout is None:
            delay = min(delay, self.retry_delay / 2 + jitter)
        if handle.fair:
            # A fair waiter refreshes its place in line on every attempt.
            delay = min(delay, self.fair_heartbeat / 3)
        if deadline is not None:
            delay = min(delay, deadline - now)
        return max(delay, 0.0)

    # -- the lease table ------------------------------------------------------------------------

    def _reenter(self, handle: LockBase, owner: Hashable) -> Lease | None:
        """The owner's current lease of this name, one hold deeper, if reentry applies.

        A nested hold may ask for renewal the outer one did not (a long job under a view's
        lock): the lease is then renewed from now on. It cannot get a fence the outer
        acquisition did not draw, so asking for one is an error rather than a silent None.
        """
        if not handle.reentrant:
            return None
        with self._leases_lock:
            lease = self._leases.get(handle.name)
            if lease is None or lease.owner != owner or lease.validity <= 0:
                return None
            if handle.fencing and lease.fence is None:
                raise ValueError(
                    f"lock {handle.name!r} is already held by this owner without fencing; a "
                    "reentrant hold cannot add a fence (take the outer lock with fencing=True)"
                )
            lease.count += 1
            upgrade = handle.auto_renew and not lease.auto_renew
            if upgrade:
                lease.auto_renew = True
        if upgrade:
            self._start_renewal(lease)
        return lease

    def _start_renewal(self, lease: Lease) -> None:
        """Hand an auto-renewed lease to this client's watchdog."""
        raise NotImplementedError

    def _register(self, handle: LockBase, lease: Lease, waited: float) -> None:
        handle.retry_after = None
        with self._leases_lock:
            self._leases[lease.name] = lease
        emit(self.listeners, LockEvent(
            "acquired", lease.name, token=lease.token, meta=lease.meta, waited=waited,
            fence=lease.fence,
        ))

    def _begin_release(self, lease: Lease) -> bool:
        """Drop one hold; True when the last hold is gone and the nodes must be told."""
        if lease.count <= 1 and lease.validity <= 0:
            # Also when the watchdog has not run yet (the whole process was frozen): a lease
            # that ran out is lost, whether or not another owner took the name since.
            self._mark_lost(lease, "the lease ran out before release")
        with self._leases_lock:
            if lease.count > 1:
                lease.count -= 1
                return False
            lease.released = True
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        return True

    def _courtesy(self, name: str) -> float:
        """Seconds this process should hold back before contending for ``name`` again: after
        its release told waiting processes, they get a head start, else the releaser would win
        every round (it needs no wake-up) and starve them."""
        with self._leases_lock:
            until = self._yield_until.pop(name, 0.0)
        return max(until - time.monotonic(), 0.0)

    def _finish_release(self, lease: Lease, replies: list[Any]) -> None:
        if any(isinstance(r, int) and r > 1 for r in replies):
            with self._leases_lock:
                self._yield_until[lease.name] = time.monotonic() + COURTESY
        emit(self.listeners, LockEvent(
            "released", lease.name, token=lease.token, meta=lease.meta,
            held=time.monotonic() - lease.acquired, fence=lease.fence, reason=lease.lost,
        ))
        if lease.lost:
            raise LockLost(
                f"lock {lease.name!r} was lost before release: {lease.lost}", lease.name
            )
        refused = sum(1 for r in replies if r == 0)
        if refused > len(self.nodes) - self.quorum:
            emit(self.listeners, LockEvent(
                "lost", lease.name, token=lease.token, meta=lease.meta,
                held=time.monotonic() - lease.acquired, fence=lease.fence,
                reason="the lease ran out before release",
            ))
            raise LockNotOwned(
                f"lock {lease.name!r} was no longer ours on {refused} of {len(self.nodes)} nodes "
                "(the lease ran out before release)",
                lease.name,
            )

    def _extend_command(self, lease: Lease, ttl: float) -> list[Any]:
        return self._extend_token_command(lease.name, lease.token, ttl)

    def _extend_token_command(self, name: str, token: str, ttl: float) -> list[Any]:
        return script_command(scripts.EXTEND, [self._key(name)], [token, int(ttl * 1000)])

    def _detach(self, lease: Lease) -> str:
        """Stop tracking a lease here without releasing it: the process it was taken for
        releases it by token. It is no longer renewed or reentered in this process."""
        with self._leases_lock:
            lease.released = True
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        if lease.leave_queue is not None:
            lease.leave_queue()
        return lease.token

    def _check_extend_ttl(self, ttl: float) -> float:
        ttl = check_positive("ttl", ttl)
        if ttl > self.max_ttl:
            raise ValueError(f"ttl {ttl!r} exceeds max_ttl {self.max_ttl!r}")
        if ttl <= self.node_timeout:
            raise ValueError(f"ttl {ttl!r} must exceed node_timeout {self.node_timeout!r}")
        return ttl

    def _judge_extend(self, lease: Lease, ttl: float, replies: list[Any], start: float) -> bool:
        ours = sum(1 for r in replies if r == 1)
        margin = self._margin(ttl)
        if ours >= self.quorum and ttl - (time.monotonic() - start) - margin > 0 and not (
            lease.released or lease.lost
        ):
            lease.valid_until = start + ttl - margin
            lease.ttl = ttl
            lease.last_renewal = start
            return True
        if sum(1 for r in replies if r == 0) > len(self.nodes) - self.quorum:
            self._mark_lost(lease, "the token is gone from a quorum of nodes")
        return False

    def _judge_check(self, lease: Lease, replies: list[Any]) -> bool:
        token = lease.token.encode()
        if sum(1 for r in replies if r == token) >= self.quorum:
            return True
        if sum(1 for r in replies if not isinstance(r, Failure) and r != token) > (
            len(self.nodes) - self.quorum
        ):
            self._mark_lost(lease, "the token is gone from a quorum of nodes")
        return False

    def _mark_lost(self, lease: Lease, why: str) -> None:
        with self._leases_lock:
            if lease.lost is not None or lease.released:
                return
            lease.lost = why
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        emit(self.listeners, LockEvent(
            "lost", lease.name, token=lease.token, meta=lease.meta,
            held=time.monotonic() - lease.acquired, fence=lease.fence, reason=why,
        ))

    def _judge_force_release(self, name: str, replies: list[Any]) -> int:
        tokens = {r.decode() for r in replies if isinstance(r, bytes)}
        removed = sum(1 for r in replies if isinstance(r, bytes))
        with self._leases_lock:
            lease = self._leases.get(name)
        if lease is not None and lease.token in tokens:
            self._mark_lost(lease, "force-released by an operator")
        emit(self.listeners, LockEvent(
            "force_released", name, token=next(iter(tokens), None), nodes=removed
        ))
        return removed

    def _after_fork(self) -> None:
        self._leases_lock = threading.Lock()
        self._leases = {}
        self._yield_until = {}

    # -- keys and metadata ----------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.key_prefix}:lock:{name}"

    def _acquire_keys(self, name: str) -> list[str]:
        return [self._key(name), f"{self.key_prefix}:fence:{name}", self._node_key()]

    def _line_keys(self, name: str) -> list[str]:
        p = self.key_prefix
        return [f"{p}:queue:{name}", f"{p}:beats:{name}", f"{p}:qseq:{name}"]

    def _ticket_command(self, name: str) -> list[Any]:
        return script_command(scripts.FAIR_TICKET, [self._line_keys(name)[2]], [])

    def _leave_line_command(self, name: str, waiter: str) -> list[Any]:
        return script_command(scripts.FAIR_LEAVE, self._line_keys(name)[:2], [waiter])

    def _line(self, replies: list[Any]) -> tuple[str, int]:
        """A new waiter's place: the largest ticket any node drew (quorums overlap, so a waiter
        arriving after another finished joining always draws a larger one)."""
        tickets = [r for r in replies if isinstance(r, int)]
        return secrets.token_hex(8), max(tickets, default=0)

    #: Marker fields a health probe reads (see ``scripts._GUARD``).
    MARKER_FIELDS = ("run_id", "started", "fresh", "trusted", "armed")

    def _node_key(self) -> str:
        return f"{self.key_prefix}:node"

    def _channel(self, name: str) -> str:
        return f"{self.key_prefix}:released:{name}"

    def _release_command(self, name: str, token: str) -> list[Any]:
        return script_command(scripts.RELEASE, [self._key(name)], [token, self._channel(name)])

    def _fence_command(self, name: str, token: str, fence: int) -> list[Any]:
        return script_command(
            scripts.FENCE_SYNC, [self._key(name), f"{self.key_prefix}:fence:{name}"],
            [token, fence],
        )

    def _force_release_command(self, name: str, token: str | None = None) -> list[Any]:
        return script_command(scripts.FORCE_RELEASE, [self._key(check_name(name))],
                              [self._channel(name), token or ""])

    #: Lock hashes read per node per listing step.
    LIST_BATCH = 1000
    #: A listing step may take longer than a lock operation (up to LIST_BATCH locks).
    LIST_TIMEOUT = 2.0

    def _list_command(self, cursor: bytes | None, pattern: str) -> list[Any]:
        """The next listing step on a node, or a no-op once its SCAN is done (``cursor`` None),
        so every step is one fan-out over all nodes."""
        if cursor is None:
            return ["PING"]
        match = f"{self.key_prefix}:lock:{pattern}"
        return script_command(scripts.LIST, [], [cursor, match, self.LIST_BATCH])

    def _list_step(
        self, cursors: list[bytes | None], replies: list[Any],
        found: dict[str, list[tuple[Node, list[Any]]]],
    ) -> None:
        """Record one listing step's locks; advance each node's cursor (None when done or the
        node failed: an unreachable node just contributes nothing)."""
        skip = len(self.key_prefix) + 6  # "<prefix>:lock:"
        for index, (cursor, reply) in enumerate(zip(cursors, replies, strict=True)):
            if cursor is None:
                continue
            if not isinstance(reply, list) or len(reply) != 2:
                cursors[index] = None
                continue
            node = self.nodes[index]
            for entry in json.loads(reply[1]):
                found.setdefault(entry[0][skip:], []).append((node, entry))
            cursors[index] = None if reply[0] in (b"0", 0) else reply[0]

    def _trust_command(self, run_id: str) -> list[Any]:
        return script_command(scripts.TRUST, [self._node_key()], [run_id])

    def _holder_meta(self, meta: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
        """The holder's details for the admin page, and their JSON (built from a cached part,
        as this runs on every acquire)."""
        pid = os.getpid()
        if self._meta_cache is None or self._meta_cache[0] != pid:
            fixed = {"host": self._host, "pid": pid, **self.meta}
            self._meta_cache = (pid, fixed, json.dumps(fixed, default=str)[1:-1])
        _, fixed, fixed_json = self._meta_cache
        thread, now = threading.current_thread().name, time.time()
        holder = {**fixed, "thread": thread, "acquired_at": now}
        parts = [fixed_json, f'"thread": {json.dumps(thread)}', f'"acquired_at": {now!r}']
        if meta:
            holder.update(meta)
            parts.append(json.dumps(dict(meta), default=str)[1:-1])
        return holder, "{" + ", ".join(p for p in parts if p) + "}"

    # -- listing --------------------------------------------------------------------------------

    def _lock_info(self, name: str, states: list[tuple[Node, list[Any]]]) -> LockInfo:
        """One lock from the nodes' listing entries ``[key, token, meta, fence, renewals,
        acquired ms, lease ms, pttl ms]``."""
        per_node = tuple(
            NodeLockState(
                node=node.name,
                token=entry[1],
                ttl=entry[7] / 1000,
                renewals=int(entry[4]),
                fence=int(entry[3]) or None,
                acquired_at=_from_ms(entry[5]),
                lease=int(entry[6]) / 1000 or None,
            )
            for node, entry in states
        )
        tokens = [s.token for s in per_node]
        token = max(set(tokens), key=tokens.count)
        mine = [s for s in per_node if s.token == token]
        raw_meta = next(entry[2] for _, entry in states if entry[1] == token)
        try:
            meta = json.loads(raw_meta)
        except ValueError:
            meta = {}
        ttls = sorted((s.ttl for s in mine), reverse=True)
        # The lock is free once fewer than a quorum still hold it.
        ttl = ttls[self.quorum - 1] if len(ttls) >= self.quorum else 0.0
        return LockInfo(
            name=name,
            token=token,
            meta=meta if isinstance(meta, dict) else {"value": meta},
            acquired_at=min((s.acquired_at for s in mine if s.acquired_at), default=None),
            ttl=ttl,
            nodes=len(mine),
            total_nodes=len(self.nodes),
            quorum=self.quorum,
            fence=max((s.fence for s in mine if s.fence), default=None),
            renewals=max(s.renewals for s in mine),
            per_node=per_node,
            lease=max((s.lease for s in mine if s.lease), default=None),
        )

    def _node_health(self, node: Node, probe: Mapping[str, Any]) -> NodeHealth:
        """Health from what one node answered: ``latency``, ``time`` (sec, usec), ``sent``,
        ``received`` (local wall clock), ``info``, ``marker`` (:attr:`MARKER_FIELDS`), ``keys``."""
        info = probe["info"]
        server_time = probe["time"]
        node_now = int(server_time[0]) + int(server_time[1]) / 1e6
        guarded_for = fresh = None
        if self.restart_guard:
            run_id, started, is_fresh, trusted, _ = probe["marker"]
            if run_id is None or run_id.decode() != info.get("run_id"):
                # The next acquire arms the marker from the node's start time.
                guarded_for = max(self.max_ttl - float(info.get("uptime_in_seconds", 0)), 0.0)
                fresh = run_id is None and guarded_for > 0
            elif int(trusted or 0) > 0:
                guarded_for, fresh = 0.0, False
            else:
                guarded_for = max(int(started) / 1000 + self.max_ttl - node_now, 0.0)
                fresh = is_fresh == b"1" and guarded_for > 0
        return NodeHealth(
            node=node.name,
            reachable=True,
            latency=probe["latency"],
            version=str(info.get("redis_version") or info.get("valkey_version")),
            uptime=float(info.get("uptime_in_seconds", 0)),
            run_id=info.get("run_id"),
            used_memory=info.get("used_memory"),
            lock_keys=probe["keys"],
            clock_offset=node_now - (probe["sent"] + probe["received"]) / 2,
            guarded_for=guarded_for,
            fresh=fresh,
        )


def _from_ms(raw: Any) -> datetime | None:
    if not raw:
        return None
    return datetime.fromtimestamp(int(raw) / 1000, tz=timezone.utc)


def glob_escape(name: str) -> str:
    """A glob matching exactly ``name`` (for SCAN MATCH). Redis' glob takes a backslash
    escape; a bracket class would not do for ']' and '\\'."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in name)
