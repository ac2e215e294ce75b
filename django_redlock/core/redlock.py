"""The Redlock algorithm over N independent Redis nodes (seed 001, redis.io/docs/manual/patterns/
distributed-locks), with the pitfalls of seed 004 designed out."""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from . import scripts
from .errors import LockLost, LockNotOwned, QuorumError
from .events import Listener, LockEvent, emit
from .info import LockInfo, NodeHealth, NodeLockState
from .lock import Lease, Lock, current_owner
from .nodes import Failure, Node, NodeSpec, Wire, fan_out, make_nodes, script_command
from .validation import check_name, check_positive, check_prefix, check_timeout

__all__ = ["Redlock"]

#: Fixed part of the clock-drift allowance (the Redlock spec adds 2 ms for Redis' own expiry
#: granularity).
DRIFT_FLOOR = 0.002

_INSTANCES: weakref.WeakSet[Redlock] = weakref.WeakSet()


def _forget_inherited_state() -> None:
    # A forked child shares its parent's sockets and lease table; it holds none of those locks.
    for redlock in list(_INSTANCES):
        redlock._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_state)


class _Refusal:
    """Why one attempt did not produce a lock."""

    def __init__(self, failures: dict[str, str], answered: int, retry_after: float | None) -> None:
        self.failures = failures
        self.answered = answered  #: nodes that gave a verdict (granted, held or guarded-by-us)
        self.retry_after = retry_after


class Redlock:
    """A lock manager over independent Redis nodes.

    Build one per process (the Django layer does, from settings) and take locks with
    :meth:`lock`. All methods are thread-safe.
    """

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
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.key_prefix = check_prefix(key_prefix)
        self.ttl = check_positive("ttl", ttl)
        self.node_timeout = check_positive("node_timeout", node_timeout)
        if isinstance(retry_count, bool) or not isinstance(retry_count, int) or retry_count < 0:
            raise ValueError(f"retry_count must be an int >= 0, got {retry_count!r}")
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
        self.restart_guard = bool(restart_guard)
        self.trust_fresh_cluster = bool(trust_fresh_cluster)
        self.reentrant = bool(reentrant)
        self.meta = dict(meta or {})
        self.nodes: list[Node] = make_nodes(nodes, node_timeout=self.node_timeout)
        self.quorum = len(self.nodes) // 2 + 1
        self._leases: dict[str, Lease] = {}
        self._leases_lock = threading.Lock()
        self._host = socket.gethostname()
        #: Called with a :class:`LockEvent` on acquire, release, contention, loss and force
        #: release.
        self.listeners: list[Listener] = []
        _INSTANCES.add(self)

    def __repr__(self) -> str:
        return (
            f"<Redlock {len(self.nodes)} nodes, quorum {self.quorum}, prefix {self.key_prefix!r}>"
        )

    # -- public API -----------------------------------------------------------------------------

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
    ) -> Lock:
        """A handle on lock ``name``; nothing is sent until it is acquired.

        ``ttl`` is the lease in seconds (default: the Redlock's), at most ``max_ttl``.
        ``meta`` is shown on the admin page as the holder's details. ``owner`` replaces the
        current thread/task as the reentrancy owner (a Celery task id, say). ``renew_for``
        caps how long auto-renewal keeps the lock alive in total.
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
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict, got {meta!r}")
        if renew_for is not None:
            check_positive("renew_for", renew_for)
        return Lock(
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

    def locked(self, name: str) -> bool:
        """Whether anyone holds ``name`` (a quorum of nodes has the key)."""
        key = self._key(check_name(name))
        replies = fan_out(self.nodes, lambda n, c: ("EXISTS", key), self.node_timeout)
        return sum(1 for r in replies if r == 1) >= self.quorum

    def force_release(self, name: str) -> int:
        """Remove ``name`` on every node whoever holds it; returns how many nodes had it.

        The former holder learns it lost the lock at its next renewal, check or release.
        """
        key = self._key(check_name(name))
        channel = self._channel(name)
        command = script_command(scripts.FORCE_RELEASE, [key], [channel])
        replies = fan_out(self.nodes, lambda n, c: command, self.node_timeout)
        tokens = {r.decode() for r in replies if isinstance(r, bytes)}
        removed = sum(1 for r in replies if isinstance(r, bytes))
        with self._leases_lock:
            lease = self._leases.get(name)
        if lease is not None and lease.token in tokens:
            self._mark_lost(lease, "force-released by an operator")
        emit(self.listeners, LockEvent("force_released", name, token=next(iter(tokens), None),
                                       nodes=removed))
        return removed

    def live_locks(self, pattern: str = "*") -> Iterator[LockInfo]:
        """Every lock some node holds whose name matches the glob ``pattern``.

        Reads with SCAN and pipelined HGETALL/PTTL, never KEYS, so a busy node is not blocked.
        """
        states: dict[str, list[tuple[Node, dict[bytes, bytes], int]]] = {}
        prefix = f"{self.key_prefix}:lock:"
        for node in self.nodes:
            try:
                for name, fields, pttl in self._scan_node(node, prefix + pattern):
                    states.setdefault(name[len(prefix):], []).append((node, fields, pttl))
            except Exception:
                continue
        for name in sorted(states):
            info = self._lock_info(name, states[name])
            if info is not None:
                yield info

    def lock_info(self, name: str) -> LockInfo | None:
        """Everything the nodes know about one lock, or None when no node holds it."""
        return next(
            (i for i in self.live_locks(_glob_escape(check_name(name))) if i.name == name), None
        )

    def health(self) -> list[NodeHealth]:
        """Reachability, latency, version, uptime, memory, lock keys, clock offset and
        restart-guard state of every node."""
        return [self._node_health(node) for node in self.nodes]

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    # -- the algorithm --------------------------------------------------------------------------

    def _acquire(self, handle: Lock, *, blocking: bool, timeout: float | None) -> Lease | None:
        owner = handle.owner if handle.owner is not None else current_owner()
        if handle.reentrant:
            with self._leases_lock:
                lease = self._leases.get(handle.name)
                if lease is not None and lease.owner == owner and lease.validity > 0:
                    lease.count += 1
                    return lease
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        attempts = 0
        while True:
            outcome = self._attempt(handle, owner)
            if isinstance(outcome, Lease):
                handle.retry_after = None
                with self._leases_lock:
                    self._leases[handle.name] = outcome
                emit(self.listeners, LockEvent(
                    "acquired", handle.name, token=outcome.token, meta=outcome.meta,
                    waited=time.monotonic() - start, fence=outcome.fence,
                ))
                return outcome
            handle.retry_after = outcome.retry_after
            attempts += 1
            now = time.monotonic()
            out_of_time = (
                not blocking
                or (deadline is None and attempts > self.retry_count)
                or (deadline is not None and now >= deadline)
            )
            if out_of_time:
                emit(self.listeners, LockEvent(
                    "contended", handle.name, meta=handle.meta, waited=now - start,
                    retry_after=outcome.retry_after,
                    reason=", ".join(f"{n}: {why}" for n, why in outcome.failures.items()),
                ))
                if outcome.answered < self.quorum:
                    raise QuorumError(
                        f"lock {handle.name!r}: only {outcome.answered} of {len(self.nodes)} "
                        f"nodes could answer, {self.quorum} needed",
                        handle.name,
                        failures=outcome.failures,
                        retry_after=outcome.retry_after,
                    )
                return None
            self._pause(handle.name, outcome, None if deadline is None else deadline - now)

    def _pause(self, name: str, refusal: _Refusal, remaining: float | None) -> None:
        # Random jitter keeps contenders from retrying in lock step (Redlock spec).
        delay = random.uniform(self.retry_delay / 2, self.retry_delay)
        if refusal.retry_after is not None:
            delay = min(delay, refusal.retry_after)
        if remaining is not None:
            delay = min(delay, remaining)
        time.sleep(max(delay, 0.0))

    def _attempt(self, handle: Lock, owner: Hashable) -> Lease | _Refusal:
        name, ttl = handle.name, handle.ttl
        token = secrets.token_hex(16)
        key, keys = self._key(name), self._acquire_keys(name)
        meta = self._holder_meta(handle.meta)
        args = [
            token,
            int(ttl * 1000),
            json.dumps(meta, default=str, separators=(",", ":")),
            "1" if handle.fencing else "0",
        ]
        guard = str(int(self.max_ttl * 1000)) if self.restart_guard else "0"

        def build(node: Node, conn: Wire) -> list[Any]:
            return script_command(scripts.ACQUIRE, keys, [*args, conn.run_id, guard])

        start = time.monotonic()
        replies = fan_out(self.nodes, build, self.node_timeout)
        granted = [r for r in replies if isinstance(r, list) and r[0] == 0]
        validity = ttl - (time.monotonic() - start) - (ttl * self.drift_factor + DRIFT_FLOOR)
        if len(granted) >= self.quorum and validity > 0:
            fence = None
            if handle.fencing:
                fence = max(int(r[1]) for r in granted)
                if not self._sync_fence(key, keys[1], token, fence):
                    self._release_everywhere(key, name, token)
                    return _Refusal({"fence": "could not record the fence on a quorum"}, 0, None)
                validity = ttl - (time.monotonic() - start) - (ttl * self.drift_factor
                                                               + DRIFT_FLOOR)
                if validity <= 0:
                    self._release_everywhere(key, name, token)
                    return _Refusal({}, len(self.nodes), None)
            return Lease(
                name=name,
                token=token,
                ttl=ttl,
                owner=owner,
                valid_until=start + ttl - (ttl * self.drift_factor + DRIFT_FLOOR),
                fence=fence,
                acquired=start,
                meta=meta,
                auto_renew=handle.auto_renew,
                renew_until=None if handle.renew_for is None else start + handle.renew_for,
            )
        if granted:
            # Also nodes that timed out: their SET may have landed after we stopped waiting.
            self._release_everywhere(key, name, token)
        elif any(isinstance(r, Failure) for r in replies):
            self._release_everywhere(key, name, token)
        if self._cluster_is_fresh(replies):
            return self._attempt(handle, owner)
        return self._refusal(replies)

    def _refusal(self, replies: list[Any]) -> _Refusal:
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
            else:
                answered += 1
        retry_after = None
        free = len(self.nodes) - len(held_pttls)
        still_needed = self.quorum - free
        if held_pttls and 0 < still_needed <= len(held_pttls):
            retry_after = sorted(held_pttls)[still_needed - 1] / 1000
        return _Refusal(failures, answered, retry_after)

    def _cluster_is_fresh(self, replies: list[Any]) -> bool:
        """A brand-new cluster: every node reports a restart guard from a missing marker.

        No node has ever held a lock under this prefix, so there is no lease to protect; trust
        them all now instead of idling for max_ttl (docs/guarantees, "restart guard").
        """
        if not (self.restart_guard and self.trust_fresh_cluster):
            return False
        if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
            return False
        marker = self._node_key()
        trusted = fan_out(
            self.nodes,
            lambda n, c: script_command(scripts.TRUST, [marker], [c.redlock_run_id]),
            self.node_timeout,
        )
        return all(r == 1 for r in trusted)

    def _sync_fence(self, key: str, counter: str, token: str, fence: int) -> bool:
        """Write the agreed fence back to a quorum before the lock is handed out, so any later
        quorum (which overlaps this one) draws a larger number."""
        command = script_command(scripts.FENCE_SYNC, [key, counter], [token, fence])
        replies = fan_out(self.nodes, lambda n, c: command, self.node_timeout)
        return sum(1 for r in replies if r == 1) >= self.quorum

    def _release_everywhere(self, key: str, name: str, token: str) -> list[Any]:
        command = script_command(scripts.RELEASE, [key], [token, self._channel(name)])
        return fan_out(self.nodes, lambda n, c: command, self.node_timeout)

    def _release(self, lease: Lease) -> None:
        with self._leases_lock:
            if lease.count > 1:
                lease.count -= 1
                return
            lease.released = True
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        replies = self._release_everywhere(self._key(lease.name), lease.name, lease.token)
        emit(self.listeners, LockEvent(
            "released", lease.name, token=lease.token, meta=lease.meta,
            held=time.monotonic() - lease.acquired, fence=lease.fence, reason=lease.lost,
        ))
        if lease.lost:
            raise LockLost(f"lock {lease.name!r} was lost before release: {lease.lost}",
                           lease.name)
        refused = sum(1 for r in replies if r == 0)
        if refused > len(self.nodes) - self.quorum:
            raise LockNotOwned(
                f"lock {lease.name!r} was no longer ours on {refused} of {len(self.nodes)} nodes "
                "(the lease ran out before release)",
                lease.name,
            )

    def _extend(self, lease: Lease, ttl: float) -> bool:
        ttl = check_positive("ttl", ttl)
        if ttl > self.max_ttl:
            raise ValueError(f"ttl {ttl!r} exceeds max_ttl {self.max_ttl!r}")
        if lease.released or lease.lost:
            return False
        command = script_command(scripts.EXTEND, [self._key(lease.name)], [lease.token,
                                                                           int(ttl * 1000)])
        start = time.monotonic()
        replies = fan_out(self.nodes, lambda n, c: command, self.node_timeout)
        ours = sum(1 for r in replies if r == 1)
        margin = ttl * self.drift_factor + DRIFT_FLOOR
        if ours >= self.quorum and ttl - (time.monotonic() - start) - margin > 0:
            lease.valid_until = start + ttl - margin
            lease.ttl = ttl
            lease.last_renewal = start
            return True
        if sum(1 for r in replies if r == 0) > len(self.nodes) - self.quorum:
            self._mark_lost(lease, "the token is gone from a quorum of nodes")
        return False

    def _check(self, lease: Lease) -> bool:
        if lease.released or lease.lost:
            return False
        key = self._key(lease.name)
        replies = fan_out(self.nodes, lambda n, c: ("HGET", key, "token"), self.node_timeout)
        token = lease.token.encode()
        if sum(1 for r in replies if r == token) >= self.quorum:
            return True
        if sum(1 for r in replies if not isinstance(r, Failure) and r != token) > (
            len(self.nodes) - self.quorum
        ):
            self._mark_lost(lease, "the token is gone from a quorum of nodes")
        return False

    def _mark_lost(self, lease: Lease, why: str) -> None:
        if lease.lost is None and not lease.released:
            lease.lost = why
            with self._leases_lock:
                if self._leases.get(lease.name) is lease:
                    del self._leases[lease.name]
            emit(self.listeners, LockEvent(
                "lost", lease.name, token=lease.token, meta=lease.meta,
                held=time.monotonic() - lease.acquired, fence=lease.fence, reason=why,
            ))

    def _after_fork(self) -> None:
        self._leases_lock = threading.Lock()
        self._leases = {}

    # -- keys and metadata ----------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.key_prefix}:lock:{name}"

    def _acquire_keys(self, name: str) -> list[str]:
        return [self._key(name), f"{self.key_prefix}:fence:{name}", self._node_key()]

    def _node_key(self) -> str:
        return f"{self.key_prefix}:node"

    def _channel(self, name: str) -> str:
        return f"{self.key_prefix}:released:{name}"

    def _holder_meta(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "host": self._host,
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "acquired_at": time.time(),
            **self.meta,
            **meta,
        }

    # -- listing and health ---------------------------------------------------------------------

    def _scan_node(
        self, node: Node, match: str
    ) -> Iterator[tuple[str, dict[bytes, bytes], int]]:
        batch: list[bytes] = []
        for raw in node.client.scan_iter(match=match, count=1000, _type="hash"):
            batch.append(raw)
            if len(batch) >= 500:
                yield from self._read_batch(node, batch)
                batch = []
        if batch:
            yield from self._read_batch(node, batch)

    @staticmethod
    def _read_batch(
        node: Node, keys: list[bytes]
    ) -> Iterator[tuple[str, dict[bytes, bytes], int]]:
        pipe = node.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
            pipe.pttl(key)
        results = pipe.execute()
        for i, key in enumerate(keys):
            fields, pttl = results[2 * i], results[2 * i + 1]
            if fields and b"token" in fields and pttl > 0:
                yield key.decode(errors="replace"), fields, pttl

    def _lock_info(
        self, name: str, states: list[tuple[Node, dict[bytes, bytes], int]]
    ) -> LockInfo | None:
        per_node = tuple(
            NodeLockState(
                node=node.name,
                token=fields[b"token"].decode(),
                ttl=pttl / 1000,
                renewals=int(fields.get(b"renewals", 0)),
                fence=int(fields[b"fence"]) or None if b"fence" in fields else None,
                acquired_at=_from_ms(fields.get(b"acquired")),
            )
            for node, fields, pttl in states
        )
        tokens = [s.token for s in per_node]
        token = max(set(tokens), key=tokens.count)
        mine = [s for s in per_node if s.token == token]
        fields = next(f for _, f, _ in states if f[b"token"].decode() == token)
        try:
            meta = json.loads(fields.get(b"meta", b"{}"))
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
        )

    def _node_health(self, node: Node) -> NodeHealth:
        try:
            sent = time.time()
            t0 = time.perf_counter()
            node.client.ping()
            latency = time.perf_counter() - t0
            server_time = node.client.time()
            received = time.time()
            info = node.client.info()
            marker = node.client.hmget(self._node_key(), "run_id", "usable_at")
            lock_keys = sum(
                1 for _ in node.client.scan_iter(match=f"{self.key_prefix}:lock:*", count=1000)
            )
        except Exception as exc:
            error = str(exc) or type(exc).__name__
            return NodeHealth(node=node.name, reachable=False, error=error)
        node_now = server_time[0] + server_time[1] / 1e6
        guarded_for = None
        if self.restart_guard:
            run_id = info.get("run_id")
            if marker[0] is None or marker[0].decode() != run_id:
                guarded_for = max(self.max_ttl - float(info.get("uptime_in_seconds", 0)), 0.0)
            else:
                guarded_for = max(int(marker[1]) / 1000 - node_now, 0.0)
        return NodeHealth(
            node=node.name,
            reachable=True,
            latency=latency,
            version=str(info.get("redis_version") or info.get("valkey_version")),
            uptime=float(info.get("uptime_in_seconds", 0)),
            run_id=info.get("run_id"),
            used_memory=info.get("used_memory"),
            lock_keys=lock_keys,
            clock_offset=node_now - (sent + received) / 2,
            guarded_for=guarded_for,
        )


def _from_ms(raw: bytes | None) -> datetime | None:
    if not raw:
        return None
    return datetime.fromtimestamp(int(raw) / 1000, tz=timezone.utc)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in name)
