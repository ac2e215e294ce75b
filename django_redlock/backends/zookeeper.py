"""Locks on a ZooKeeper ensemble (kazoo): the recipe of seed 002.

Each lock name is a persistent directory node under ``root``; a contender creates an ephemeral
sequential child ``lock-<seq>`` holding its token and metadata (JSON). The lowest sequence holds
the lock; every other contender watches only the node just before its own, so a release wakes
exactly one waiter (FIFO, no herd). The fence is the sequence number: the parent's counter
never goes back, also after the children were deleted.

The lock lives as long as the holder's session: there is no lease to renew (``auto_renew`` and
``extend`` only confirm the node is still there) and ``validity`` is infinite while connected.
When the connection drops, ``held`` turns False until it is back; when the session expires,
or an operator force-releases the node, the lock is lost: a ``lost`` event (the ``lock_lost``
signal) fires and ``release()`` raises :class:`~django_redlock.LockLost`. A crashed holder's
node disappears when the server expires its session (``session_timeout``).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from ..core import LockInfo, NodeHealth, check_positive
from .base import (
    BackendLock,
    BackendLocks,
    Grant,
    check_name,
    holder_meta,
    utc_from_micros,
)

__all__ = ["ZooKeeperLocks"]

PREFIX = "lock-"


def znode_name(name: str) -> str:
    """The znode name of lock ``name``: percent-encoded, so a "/" does not nest and every
    character ZooKeeper refuses is escaped. "." and ".." are path steps to ZooKeeper, not
    names, and quote() leaves dots alone: those two get "%2E" (every other name keeps the
    encoding it always had). ``unquote`` turns each back into the name."""
    encoded = quote(name, safe="")
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


class ZooKeeperLocks(BackendLocks):
    """Locks on ZooKeeper. ``OPTIONS``: ``hosts`` ("host:port,..."), ``root`` (the directory
    of the lock nodes, default ``/django_redlock``), ``session_timeout`` (seconds, default 10:
    how long a crashed holder keeps its locks), ``connect_timeout`` (seconds, default 5),
    ``ttl`` (accepted for a uniform interface; a ZooKeeper lock has no lease)."""

    service = "zookeeper"

    @property
    def node_name(self) -> str:
        return self.hosts

    fair = True  # each waiter watches its predecessor: first come, first served

    def __init__(
        self,
        hosts: str,
        *,
        root: str = "/django_redlock",
        session_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        ttl: float = 30.0,
        retry_count: int = 3,
        retry_delay: float = 0.2,
    ) -> None:
        from kazoo.client import KazooClient

        super().__init__(ttl=ttl, retry_count=retry_count, retry_delay=retry_delay)
        if not isinstance(hosts, str) or not hosts:
            raise ValueError(
                f"ZooKeeperLocks: hosts must be 'host:port[,host:port...]', got {hosts!r}"
            )
        if not isinstance(root, str) or not root.startswith("/") or root.endswith("/"):
            raise ValueError(
                f"ZooKeeperLocks: root must be an absolute path like /locks, got {root!r}"
            )
        self.hosts = hosts
        self.root = root
        self.session_timeout = check_positive("session_timeout", session_timeout)
        self.connect_timeout = check_positive("connect_timeout", connect_timeout)
        self.client = KazooClient(hosts=hosts, timeout=self.session_timeout)
        self.client.add_listener(self._on_state)
        self._grants: weakref.WeakSet[Grant] = weakref.WeakSet()
        self._started = False
        self._start_lock = threading.Lock()

    def _zk(self) -> Any:
        with self._start_lock:
            if not self._started:
                self.client.start(timeout=self.connect_timeout)
                self.client.ensure_path(self.root)
                self._started = True
        return self.client

    def _dir(self, name: str) -> str:
        return f"{self.root}/{znode_name(name)}"

    # -- acquiring ------------------------------------------------------------------------------

    def _take(
        self, handle: BackendLock, token: str, blocking: bool, deadline: float | None
    ) -> Grant | None:
        from kazoo.exceptions import NoNodeError

        zk = self._zk()
        meta = holder_meta(handle.meta)
        started = time.monotonic()
        data = json.dumps({"token": token, "meta": meta, "acquired_us": int(time.time() * 1e6)})
        path = zk.create(
            f"{self._dir(handle.name)}/{PREFIX}",
            data.encode(),
            ephemeral=True,
            sequence=True,
            makepath=True,
        )
        ours = path.rsplit("/", 1)[1]
        try:
            while True:
                queue = sorted(
                    c for c in zk.get_children(self._dir(handle.name)) if c.startswith(PREFIX)
                )
                if ours not in queue:
                    raise NoNodeError(f"our queue node {path} vanished (session expired?)")
                position = queue.index(ours)
                if position == 0:
                    break
                if not blocking:
                    zk.delete(path)
                    return None
                gone = threading.Event()
                predecessor = f"{self._dir(handle.name)}/{queue[position - 1]}"
                if zk.exists(predecessor, watch=lambda event, gone=gone: gone.set()) is None:
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not gone.wait(left):
                    zk.delete(path)
                    return None
        except BaseException:
            if zk.connected:
                with contextlib.suppress(NoNodeError):
                    zk.delete(path)
            raise
        grant = self._grant(
            handle, token, meta, started=started, fence=int(ours[len(PREFIX) :]), state=path
        )
        grant.valid_until = math.inf
        self._grants.add(grant)
        # Deleted by anyone but our release (force release, session expiry): lost.
        zk.exists(path, watch=lambda event: self._on_node_event(grant, event))
        return grant

    def _on_node_event(self, grant: Grant, event: Any) -> None:
        if event.type == "DELETED" and not grant.released:
            self._mark_lost(grant, "the lock node was deleted (force release or session expiry)")

    def _on_state(self, state: str) -> None:
        # Runs in kazoo's connection thread: no blocking calls here.
        for grant in list(self._grants):
            if grant.released or grant.lost:
                continue
            if state == "LOST":
                self._mark_lost(grant, "the ZooKeeper session expired")
            elif state == "SUSPENDED":  # the session may still live: not held until we know
                grant.valid_until = time.monotonic()
            else:
                grant.valid_until = math.inf

    # -- holding --------------------------------------------------------------------------------

    def _owned(self, grant: Grant) -> bool:
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self._zk().get(grant.state)
        except NoNodeError:
            return False
        return bool(json.loads(data)["token"] == grant.token)

    def _give_back(self, grant: Grant) -> bool:
        from kazoo.exceptions import NoNodeError

        grant.released = True  # our own delete is not a loss
        try:
            self._zk().delete(grant.state)
        except NoNodeError:
            grant.released = False
            return False
        return True

    def _renew(self, grant: Grant, ttl: float) -> bool:
        return self._owned(grant)

    def _still_held(self, grant: Grant) -> bool:
        return self._owned(grant)

    def _holder(self, name: str) -> tuple[str, dict[str, Any], Any] | None:
        """The holding node of ``name``: (path, data, stat), or None."""
        from kazoo.exceptions import NoNodeError

        zk = self._zk()
        try:
            queue = sorted(c for c in zk.get_children(self._dir(name)) if c.startswith(PREFIX))
        except NoNodeError:
            return None
        for child in queue:  # the first that still exists
            path = f"{self._dir(name)}/{child}"
            try:
                data, stat = zk.get(path)
            except NoNodeError:
                continue
            return path, json.loads(data), stat
        return None

    def _adopt(self, name: str, token: str) -> Grant | None:
        holder = self._holder(name)
        if holder is None or holder[1]["token"] != token:
            return None
        return Grant(name, token, self.ttl, math.inf, holder[1]["meta"], state=holder[0])

    def _remove(self, name: str, token: str | None) -> int:
        from kazoo.exceptions import NoNodeError

        holder = self._holder(name)
        if holder is None or (token is not None and holder[1]["token"] != token):
            return 0
        try:
            self._zk().delete(holder[0], version=holder[2].version)
        except NoNodeError:
            return 0
        return 1

    def locked(self, name: str) -> bool:
        return self._holder(check_name(name)) is not None

    def _infos(self, pattern: str) -> Iterable[LockInfo]:
        import fnmatch

        for directory in self._zk().get_children(self.root):
            name = unquote(directory)  # the inverse of znode_name()
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            holder = self._holder(name)
            if holder is None:
                continue
            path, data, _ = holder
            yield self._info(
                name,
                data["token"],
                data["meta"],
                acquired_at=utc_from_micros(data.get("acquired_us")),
                ttl=self.session_timeout,  # how long it outlives a crashed holder
                lease=self.session_timeout,
                fence=int(path.rsplit("-", 1)[1]),
            )

    def health(self) -> list[NodeHealth]:
        try:
            zk = self._zk()
            started = time.perf_counter()
            zk.exists(self.root)
            latency = time.perf_counter() - started
            count = sum(1 for _ in zk.get_children(self.root))
        except Exception as exc:
            return [
                NodeHealth(
                    node=self.node_name, reachable=False, error=str(exc) or type(exc).__name__
                )
            ]
        return [NodeHealth(node=self.node_name, reachable=True, latency=latency, lock_keys=count)]

    def close(self) -> None:
        with self._start_lock:
            if self._started:
                self.client.stop()
                self.client.close()
                self._started = False
