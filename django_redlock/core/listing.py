"""What the nodes hold, read back for the admin page, the CLI and monitoring: live locks and
node health (a part of a client: :class:`.base.RedlockBase` holds one)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, NamedTuple

import redis

from .errors import TrustRefused
from .info import LockInfo, NodeHealth, NodeLockState
from .nodes import Failure, Node
from .scripts import PERMITTED

__all__ = ["GuardState", "Listing", "glob_escape", "parse_info"]


#: Seconds within which the servers of a brand-new cluster started: servers restarted further
#: apart lost their data apart, and a lease may have been taken on the later ones in between
#: (see :meth:`.guard.RestartGuard.all_fresh`). INFO gives each server's start second (its
#: uptime is in whole seconds), and start seconds at most this far apart are together: every
#: spread up to it passes, and none of 3 s or more (a refusal's "more than 2s apart" is true).
FRESH_START_SPREAD = 2.0


def started_together(started: Sequence[float], now: float, max_ttl: float) -> bool:
    """Whether servers that started at ``started`` (``time.time()`` values) may be trusted as
    one brand-new cluster: they started within :data:`FRESH_START_SPREAD` of each other, or all
    longer than a lease ago (a restart that long ago lost nothing a lease could outlive)."""
    recent = now - max(started) < max_ttl
    return not recent or max(started) - min(started) <= FRESH_START_SPREAD


class GuardState(NamedTuple):
    """A node's restart guard as a read saw it (``scripts.SITS_OUT``), beside that read's own
    answer (``reply``): how long the node still sits out (0: it votes), whether it has no
    marker at all, and when its server started (``time.time()``, from the connection's
    handshake), which tells whether a cluster of such nodes may be brand-new."""

    reply: Any
    sits_out_ms: int
    unmarked: bool
    started: float


class Listing:
    """Live locks and node health, judged from the nodes' answers (a part of a client, which
    sends the commands and hands the answers in)."""

    def __init__(
        self,
        nodes: list[Node],
        *,
        key_prefix: str,
        quorum: int,
        max_ttl: float,
        guard_period: float,
        restart_guard: bool,
        trust_fresh_cluster: bool,
    ) -> None:
        self.nodes = nodes
        self.key_prefix = key_prefix
        self.quorum = quorum
        self.max_ttl = max_ttl
        self.guard_period = guard_period
        self.restart_guard = restart_guard
        self.trust_fresh_cluster = trust_fresh_cluster

    def list_step(
        self,
        cursors: list[bytes | None],
        replies: list[Any],
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

    def sitting_out(self, states: Sequence[GuardState | Failure]) -> dict[int, str]:
        """The nodes (by index, with why) whose "not held" is no evidence: each sits out its
        restart guard, so it may have lost the key of a lease still running on the others,
        and tells no more than a node that did not answer. Not the nodes of a brand-new
        cluster (every node answered with no marker at all, their servers started together),
        which the acquire trusts at once (:meth:`.guard.RestartGuard.all_fresh`): no lease it
        would protect was ever granted there."""
        if not self.restart_guard:
            return {}
        guarded = {
            i: s for i, s in enumerate(states) if not isinstance(s, Failure) and s.sits_out_ms > 0
        }
        if (
            self.trust_fresh_cluster
            and len(guarded) == len(states)
            and all(s.unmarked for s in guarded.values())
            and started_together([s.started for s in guarded.values()], time.time(), self.max_ttl)
        ):
            return {}
        return {
            i: f"guarded: sits out its restart guard ({s.sits_out_ms / 1000:.1f}s more) and "
            "may have lost the key"
            for i, s in guarded.items()
        }

    def lock_info(
        self, name: str, states: list[tuple[Node, list[Any]]], sitting_out: Sequence[str] = ()
    ) -> LockInfo:
        """One lock from the nodes' listing entries ``[key, token, meta, fence, renewals,
        acquired ms, lease ms, pttl ms]``; ``sitting_out`` names the nodes in their restart
        guard (:meth:`sitting_out`): one without a copy may have lost it, so the lock is not
        judged free (or split) while they could make up its quorum."""
        per_node = tuple(
            NodeLockState(
                node=node.name,
                token=entry[1],
                ttl=entry[7] / 1000,
                renewals=int(entry[4]),
                fence=int(entry[3]) or None,
                acquired_at=_from_ms(entry[5]),
                lease=int(entry[6]) / 1000 or None,
                master=node.address,
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
        fences = [s.fence for s in mine if s.fence]
        # The holder's fence is on a quorum of its nodes once its acquire returned; a slower
        # node may still show the one it proposed until the write-back reaches it.
        agreed = [f for f in set(fences) if fences.count(f) >= self.quorum]
        holding = {s.node for s in per_node}
        guarded = tuple(n for n in sitting_out if n not in holding)
        # A guarded node's lost copy was armed with the others: taken as the longest of them.
        longest = max(s.ttl for s in mine)
        ttls = sorted([*(s.ttl for s in mine), *(longest for _ in guarded)], reverse=True)
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
            fence=agreed[0] if agreed else max(fences, default=None),
            renewals=max(s.renewals for s in mine),
            per_node=per_node,
            lease=max((s.lease for s in mine if s.lease), default=None),
            guarded=guarded,
        )

    def judge_health(self, health: list[NodeHealth]) -> list[NodeHealth]:
        """Each node's :attr:`NodeHealth.status`, with the whole cluster in view: the nodes of
        a brand-new cluster (every node reachable and fresh) vote at the first lock, which
        trusts them all, so they are not shown as guarded."""
        now = time.time()
        # The judgement an acquire makes (RestartGuard.all_fresh), so that health, `redlock
        # check` and the readiness view do not call a cluster voting that refuses every lock.
        new_cluster = (
            self.restart_guard
            and self.trust_fresh_cluster
            and all(h.reachable and h.guarded_for and h.fresh for h in health)
            and started_together([now - (h.uptime or 0.0) for h in health], now, self.max_ttl)
        )
        judged = []
        first: dict[str, str] = {}  # run id -> the node that reached that server first
        for h in health:
            other = first.setdefault(h.run_id, h.node) if h.reachable and h.run_id else h.node
            if other != h.node:
                # One server listed twice (a unix socket and a TCP port): it votes once, as
                # the acquire's connections let it (nodes.claim_server).
                why = (
                    f"the same Redis server as node {other} (run_id {h.run_id}): one server "
                    "must not vote twice (remove one of the two entries)"
                )
                judged.append(replace(h, reachable=False, status="down", error=why))
            elif not h.reachable:
                judged.append(h)
            elif new_cluster:
                judged.append(replace(h, guarded_for=0.0, status="voting"))
            else:
                judged.append(replace(h, status="guarded" if h.guarded_for else "voting"))
        return judged

    def node_health(self, node: Node, probe: Mapping[str, Any]) -> NodeHealth:
        """Health from what one node answered: ``latency``, ``time`` (sec, usec), ``sent``,
        ``received`` (local wall clock), ``info``, ``marker`` (:attr:`MARKER_FIELDS`), ``keys``."""
        info = probe["info"]
        server_time = probe["time"]
        unlike = _unlike_redis(info, server_time, probe["marker"] if self.restart_guard else None)
        if unlike:
            return NodeHealth(
                node=node.name,
                reachable=False,
                error=f"not a Redis server: {unlike}",
                master=node.address,
            )
        node_now = int(server_time[0]) + int(server_time[1]) / 1e6
        guarded_for = fresh = armed = None
        if self.restart_guard:
            run_id, started, is_fresh, trusted, _, marker_id, replid, epoch = probe["marker"]
            armed = (
                run_id is not None
                and run_id.decode() == info.get("run_id")
                and not _resynced(marker_id, replid, info.get("master_replid"))
                and not _named_since(epoch, node.where)
            )
            if not armed:
                # The next acquire arms the marker: the guard runs from then.
                guarded_for, fresh = self.guard_period, run_id is None
            elif int(trusted or 0) > 0:
                guarded_for, fresh = 0.0, False
            else:
                guarded_for = max(int(started) / 1000 + self.guard_period - node_now, 0.0)
                fresh = is_fresh == b"1" and guarded_for > 0
        return NodeHealth(
            node=node.name,
            reachable=True,
            latency=probe["latency"],
            server=_server_name(info),
            version=_server_version(info),
            uptime=float(info.get("uptime_in_seconds", 0)),
            run_id=info.get("run_id"),
            used_memory=info.get("used_memory"),
            lock_keys=probe["keys"],
            clock_offset=node_now - (probe["sent"] + probe["received"]) / 2,
            guarded_for=guarded_for,
            fresh=fresh,
            armed=armed,
            master=node.address,
        )

    def permission_probe(self) -> list[list[Any]]:
        """Commands a health probe sends to learn whether the node's user may run the lock
        scripts (see ``scripts.PERMITTED``): EVAL first (which caches it), then EVALSHA."""
        key = f"{self.key_prefix}:lock:\x00health-probe"
        return [["EVAL", PERMITTED.body, 1, key], ["EVALSHA", PERMITTED.sha, 1, key]]

    def script_refused(self, exc: Exception) -> Exception:
        """What a health probe reports when the permission probe was answered ``exc``."""
        detail = str(exc)
        # redis-py drops the error code from the message (its NoPermissionError); ours keeps it.
        if isinstance(exc, redis.exceptions.NoPermissionError):
            detail = f"NOPERM {detail}"
        if not detail.startswith("NOPERM"):
            return exc
        return PermissionError(
            "the node's user may not run the lock scripts (EVAL/EVALSHA on "
            f"{self.key_prefix}:lock:*), so it can never vote: {detail}"
        )

    def failed_health(self, node: Node, exc: Exception) -> NodeHealth:
        """Health of a node whose probe raised ``exc``."""
        if isinstance(exc, _UNREADABLE):
            # The reply parsers (redis-py's, and the probes') take apart what Redis answers:
            # what they cannot comes from a service that is not Redis, and their own words
            # ("'int' object has no attribute 'get'") would tell an operator nothing.
            error = "not a Redis server: it answered with replies Redis never gives"
        else:
            error = str(exc) or type(exc).__name__
        return NodeHealth(node=node.name, reachable=False, error=error, master=node.address)

    def refuse_trust(self, held: Sequence[LockInfo]) -> None:
        """``trust_cluster()`` asserts that no lock is held: refuse when a node says one is."""
        if held:
            names = ", ".join(repr(i.name) for i in held[:5])
            raise TrustRefused(
                f"{len(held)} lock(s) held on the reachable nodes ({names}"
                f"{', ...' if len(held) > 5 else ''}): trusting the nodes now could grant a "
                "lock twice. Wait until they are released (or force-release them) first.",
                held[0].name,
            )


#: What a probe raises when a reply is not of the shape Redis gives (:meth:`failed_health`).
_UNREADABLE = (AttributeError, IndexError, KeyError, TypeError, ValueError)


def _unlike_redis(info: Any, server_time: Any, marker: Any) -> str:
    """What in a node's answers to the health probe no Redis server gives ("": nothing), so
    that judging them cannot fail: INFO names the server's run id and version, TIME is two
    numbers, the marker read (:attr:`MARKER_FIELDS`; None with the restart guard off) is the run
    id and numbers."""
    if not (
        isinstance(info, Mapping)
        and info.get("run_id")
        and (info.get("redis_version") or info.get("valkey_version"))
    ):
        return "its INFO names no run_id and version"
    if not (
        isinstance(server_time, (list, tuple))
        and len(server_time) == 2
        and all(_number(value) for value in server_time)
    ):
        return f"TIME answered {server_time!r:.60}"
    if marker is not None and not (
        isinstance(marker, list)
        and len(marker) == 8
        and all(value is None or isinstance(value, bytes) for value in marker[::6])
        and all(value is None or _number(value) for value in (*marker[1:6], marker[7]))
    ):
        return f"HMGET answered {marker!r:.60}"
    return ""


def _named_since(epoch: bytes | None, where: Any) -> bool:
    """Whether the Sentinels named a group's master at a newer failover epoch than the one
    its marker was armed at (``scripts._GUARD``): the next acquire arms it anew."""
    return (
        epoch is not None and where is not None and where[1] is not None and int(epoch) < where[1]
    )


def _resynced(marker_id: bytes | None, replid: bytes | None, current: Any) -> bool:
    """The marker's replication id (``"<marker id> <master_replid>"``, see ``scripts._GUARD``)
    is not the server's: it was promoted since, so the next acquire arms the marker again. A
    missing one, or one another marker version left, is filled in instead."""
    if marker_id is None or replid is None or not current:
        return False
    of, _, was = replid.partition(b" ")
    return of == marker_id and was.decode(errors="replace") != str(current)


def _server_name(info: Mapping[str, Any]) -> str:
    """``valkey`` for Valkey (its INFO has ``server_name``), else ``redis``."""
    name = info.get("server_name")
    if name:
        return str(name)
    return "valkey" if info.get("valkey_version") else "redis"


def _server_version(info: Mapping[str, Any]) -> str:
    """The server's own version: Valkey also reports the Redis release it is compatible with
    as ``redis_version`` (7.2.4 for every Valkey 8), which is not its version."""
    return str(info.get("valkey_version") or info.get("redis_version"))


def _number(value: Any) -> bool:
    """An integer reply, or a string reply holding one."""
    if isinstance(value, int):
        return True
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return isinstance(value, str) and value.removeprefix("-").isdigit()


def _from_ms(raw: Any) -> datetime | None:
    if not raw:
        return None
    return datetime.fromtimestamp(int(raw) / 1000, tz=timezone.utc)


def glob_escape(name: str) -> str:
    """A glob matching exactly ``name`` (for SCAN MATCH). Redis' glob takes a backslash
    escape; a bracket class would not do for ']' and '\\'."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in name)


def parse_info(raw: Any) -> dict[str, Any]:
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
