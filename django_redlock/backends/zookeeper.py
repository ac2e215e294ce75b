"""Locks on a ZooKeeper ensemble (kazoo): the recipe of seed 002.

Each lock name is a persistent directory node under ``root``; a contender creates an ephemeral
sequential child ``lock-<seq>`` holding its token and metadata (JSON). The lowest sequence holds
the lock; every other contender watches only the node just before its own, so a release wakes
exactly one waiter (FIFO, no herd). The fence is the sequence number: the parent's counter
never goes back, also after the children were deleted.

The lock lives as long as the holder's session: there is no lease to renew (``auto_renew`` and
``extend`` only confirm the node is still there) and ``validity`` is infinite while connected.
When the connection drops, ``held`` turns False until it is back and the node is found still
there (the node watch is set anew: it went with the connection); when the session expires,
or an operator force-releases the node, the lock is lost: a ``lost`` event (the ``lock_lost``
signal) fires and ``release()`` raises :class:`~django_redlock.LockLost`. A crashed holder's
node disappears when the server expires its session (``session_timeout``).

No call waits on ZooKeeper for longer than ``connect_timeout`` at a time (kazoo's blocking
calls wait for ever while disconnected, so every request goes through its async twin with that
timeout): to connect, then for each answer; a call gives up at the first request left
unanswered. Then ``check()`` is False (the node is not known to be ours, as a Redlock's check()
with its nodes down), ``health()`` reports the service unreachable with the reason, and the
other calls raise :class:`ZooKeeperUnreachable` naming the hosts (etcd's convention). A lost
connection or an expired session reads the same way: with the session, the lock node is gone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import quote, unquote

from ..core import LockInfo, NodeHealth, check_positive
from . import base
from .base import BackendLock, BackendLocks, Grant, check_name, check_root, holder_meta

__all__ = ["ZooKeeperLocks", "ZooKeeperUnreachable"]

PREFIX = "lock-"


class ZooKeeperUnreachable(RuntimeError):
    """ZooKeeper did not answer within ``connect_timeout``, or the connection or the session
    was lost while it was asked."""


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
    ``ttl`` (accepted for a uniform interface; a ZooKeeper lock has no lease).
    ``connect_timeout`` also bounds each wait for an answer (see the module docstring)."""

    service = "zookeeper"
    fair = True  # each waiter watches its predecessor: first come, first served
    leased = False  # no validity while the connection is down is no lease run out

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
        super().__init__(ttl=ttl, retry_count=retry_count, retry_delay=retry_delay)
        if not isinstance(hosts, str) or not hosts:
            raise ValueError(
                f"ZooKeeperLocks: hosts must be 'host:port[,host:port...]', got {hosts!r}"
            )
        self.node_name = self.hosts = hosts
        self.root = check_root("ZooKeeperLocks", root, "be an absolute path like /locks")
        self.session_timeout = check_positive("session_timeout", session_timeout)
        self.connect_timeout = check_positive("connect_timeout", connect_timeout)
        self._new_client()

    @property
    def client(self) -> Any:
        """This process's KazooClient (a forked child gets its own session)."""
        self._this_process()
        return self._client

    def _new_client(self) -> None:
        self._client = self._kazoo()
        self._grants: weakref.WeakSet[Grant] = weakref.WeakSet()
        self._started = self._rooted = False
        self._start_lock = threading.Lock()
        self._state_lock = threading.Lock()

    def _kazoo(self) -> Any:
        from kazoo.client import KazooClient

        client = KazooClient(hosts=self.hosts, timeout=self.session_timeout)
        client.add_listener(self._on_state)
        return client

    def _after_fork(self) -> None:
        # The parent's client is left alone: its connection thread does not run here, and
        # stopping it would close the parent's session, and its ephemeral lock nodes with it.
        self._new_client()

    def _zk(self) -> Any:
        self._this_process()
        if not self._start_lock.acquire(timeout=self.connect_timeout):
            raise ZooKeeperUnreachable(f"zookeeper unreachable ({self.hosts}: still connecting)")
        try:
            if not self._started:
                client = self.client
                if not client.start_async().wait(self.connect_timeout):
                    # Not client.start(), which then stops the connection attempt and waits
                    # for that too (twice connect_timeout against a frozen server): it stops
                    # aside, with no session to end, and the next call starts a new client
                    # (its states are not this manager's any more).
                    client.remove_listener(self._on_state)
                    self._client = self._kazoo()
                    base.spawn(None, self._shut_aside, client)
                    raise self._unreachable(client.handler.timeout_exception())
                self._started = True
            if not self._rooted:
                self._answer(self.client.ensure_path_async(self.root))
                self._rooted = True
        finally:
            self._start_lock.release()
        return self.client

    def _ask(self, request: str, *args: Any, **options: Any) -> Any:
        """kazoo's ``client.<request>(*args, **options)``, answered within connect_timeout."""
        return self._answer(getattr(self._zk(), f"{request}_async")(*args, **options), request)

    def _answer(self, pending: Any, request: str = "") -> Any:
        """What ZooKeeper answered to ``pending`` (kazoo's IAsyncResult), or
        ZooKeeperUnreachable when no answer came within connect_timeout. An unanswered
        request stays queued in kazoo and is sent when the connection is back."""
        try:
            return pending.get(timeout=self.connect_timeout)
        except self.unavailable() as exc:
            if request == "create":
                # Sent later, it would make a lock node nobody waits on: delete it then.
                pending.rawlink(self._drop_created)
            raise self._unreachable(exc) from exc

    def _drop_created(self, created: Any) -> None:
        # Runs in kazoo's callback thread: nothing that waits.
        if created.successful():
            self.client.delete_async(created.value)

    def _unreachable(self, exc: BaseException) -> ZooKeeperUnreachable:
        if isinstance(exc, self.client.handler.timeout_exception):
            reason = f"no answer within {self.connect_timeout:g} s"
        else:
            reason = str(exc) or type(exc).__name__
        return ZooKeeperUnreachable(f"zookeeper unreachable ({self.hosts}: {reason})")

    def unavailable(self) -> tuple[type[BaseException], ...]:
        from kazoo.exceptions import ConnectionLoss, SessionExpiredError  # closed: expired too

        timeout = self.client.handler.timeout_exception
        return (ZooKeeperUnreachable, timeout, ConnectionLoss, SessionExpiredError)

    def _dir(self, name: str) -> str:
        return f"{self.root}/{znode_name(name)}"

    # -- acquiring ------------------------------------------------------------------------------

    def _take(
        self, handle: BackendLock, token: str, blocking: bool, deadline: float | None
    ) -> Grant | None:
        from kazoo.exceptions import NoNodeError

        meta = holder_meta(handle.meta)
        data = self._record(token, meta)
        node = f"{self._dir(handle.name)}/{PREFIX}"
        path = self._ask(
            "create", node, data.encode(), ephemeral=True, sequence=True, makepath=True
        )
        ours = path.rsplit("/", 1)[1]
        try:
            while True:
                children = self._ask("get_children", self._dir(handle.name))
                queue = sorted(c for c in children if c.startswith(PREFIX))
                if ours not in queue:
                    raise NoNodeError(f"our queue node {path} vanished (session expired?)")
                position = queue.index(ours)
                if position == 0:
                    break
                if not blocking:
                    self._ask("delete", path)
                    return None
                gone = threading.Event()
                predecessor = f"{self._dir(handle.name)}/{queue[position - 1]}"
                # (kazoo also fires the watch, with no event, when the connection drops)
                if self._ask("exists", predecessor, watch=lambda e, g=gone: g.set()) is None:
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not gone.wait(left):
                    self._ask("delete", path)
                    return None
            fence = int(ours[len(PREFIX) :])
            grant = Grant(handle.name, token, handle.ttl, None, math.inf, meta=meta, fence=fence)
            grant.state = path
            self._grants.add(grant)
            # Deleted by anyone but our release (force release, session expiry): lost.
            self._ask("exists", path, watch=functools.partial(self._on_node_event, grant))
        except BaseException:
            # Sent now, or when the connection is back (a lost session took the node already);
            # waiting for the answer would only hold up the error.
            self.client.delete_async(path)
            raise
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
                with self._state_lock:
                    grant.valid_until = time.monotonic()
            else:
                self._rewatch(grant)

    def _rewatch(self, grant: Grant) -> None:
        """Back with the same session: the node watch went with the connection (the server
        forgets a connection's watches, kazoo fires them with no event), and the node may
        have been deleted meanwhile. Ask again with a new watch; held once the node is seen."""
        watch = functools.partial(self._on_node_event, grant)
        seen = self.client.exists_async(grant.state, watch=watch)
        seen.rawlink(lambda seen: self._on_seen(grant, seen))

    def _on_seen(self, grant: Grant, seen: Any) -> None:
        # Runs in kazoo's callback thread. No answer: the connection dropped again, and the
        # next reconnection asks again.
        if not seen.successful():
            return
        if seen.value is None:
            self._mark_lost(grant, "the lock node was deleted (force release or session expiry)")
            return
        with self._state_lock:  # not after a newer disconnection made it not held
            if self.client.connected and not (grant.released or grant.lost):
                grant.valid_until = math.inf

    # -- holding --------------------------------------------------------------------------------

    def _still_held(self, grant: Grant) -> bool:
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self._ask("get", grant.state)
        except NoNodeError:
            return False
        return bool(json.loads(data)["token"] == grant.token)

    def _give_back(self, grant: Grant) -> bool:
        from kazoo.exceptions import NoNodeError

        grant.released = True  # our own delete is not a loss
        try:
            self._ask("delete", grant.state)
        except NoNodeError:
            grant.released = False
            return False
        except ZooKeeperUnreachable as exc:
            raise ZooKeeperUnreachable(
                f"{exc}; lock {grant.name!r} is released when the connection is back, or "
                "when its session expires"
            ) from exc
        return True

    def _renew(self, grant: Grant, ttl: float) -> bool:
        return self._still_held(grant)  # a session lock has no lease to re-arm

    def _queue(self, name: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
        """The nodes of ``name`` still there, in the order they are served (the holder
        first): (path, data, stat)."""
        from kazoo.exceptions import NoNodeError

        try:
            children = self._ask("get_children", self._dir(name))
        except NoNodeError:
            return
        for child in sorted(c for c in children if c.startswith(PREFIX)):
            path = f"{self._dir(name)}/{child}"
            try:
                data, stat = self._ask("get", path)
            except NoNodeError:  # released or given up meanwhile
                continue
            yield path, json.loads(data), stat

    def _holder(self, name: str) -> tuple[str, dict[str, Any], Any] | None:
        """The holding node of ``name``: (path, data, stat), or None."""
        return next(self._queue(name), None)

    def contenders(self, name: str) -> list[dict[str, Any]]:
        """The metadata of everyone holding or waiting for lock ``name``, the holder first,
        then the waiters in the order they will be served (kazoo's ``Lock.contenders()``,
        which lists their identifiers: pass ``meta={"id": ...}`` to have one)."""
        return [dict(data["meta"]) for _, data, _ in self._queue(check_name(name, listed=True))]

    def _adopt(self, name: str, token: str) -> Grant | None:
        holder = self._holder(name)
        if holder is None or holder[1]["token"] != token:
            return None
        return Grant(name, token, self.ttl, None, math.inf, meta=holder[1]["meta"], state=holder[0])

    def _remove(self, name: str, token: str | None) -> int:
        from kazoo.exceptions import NoNodeError

        holder = self._holder(name)
        if holder is None or token not in (None, holder[1]["token"]):
            return 0
        with contextlib.suppress(NoNodeError):  # released meanwhile
            self._ask("delete", holder[0], version=holder[2].version)
            return 1
        return 0

    def locked(self, name: str) -> bool:
        return self._holder(check_name(name, listed=True)) is not None

    def _infos(self, wanted: Callable[[str], bool]) -> Iterable[LockInfo]:
        for directory in self._ask("get_children", self.root):
            name = unquote(directory)  # the inverse of znode_name()
            holder = self._holder(name) if wanted(name) else None
            if holder is not None:
                path, data, _ = holder
                session = self.session_timeout  # how long it outlives a crashed holder
                yield self._info(name, data, session, session, int(path.rsplit("-", 1)[1]))

    def _held_count(self) -> int:
        """How many locks are held: the directories with a contender in them (the first one
        holds the lock), as ``live_locks()`` lists them. A lock's directory outlives its last
        holder (removing it would race a contender creating its node there), so counting
        the directories would count every lock name ever used."""
        from kazoo.exceptions import NoNodeError

        held = 0
        for directory in self._ask("get_children", self.root):
            try:
                children = self._ask("get_children", f"{self.root}/{directory}")
            except NoNodeError:
                continue
            held += any(child.startswith(PREFIX) for child in children)
        return held

    def health(self) -> list[NodeHealth]:
        try:
            self._zk()
            started = time.perf_counter()
            self._ask("exists", self.root)
            latency = time.perf_counter() - started
            count = self._held_count()
        except Exception as exc:
            return [base.unreachable(self.node_name, exc)]
        node = self.node_name
        return [NodeHealth(node, True, latency, server="zookeeper", lock_keys=count)]

    def close(self) -> None:
        self._this_process()  # in a forked child: close the child's own, never the parent's
        with self._start_lock:
            if self._started:
                self.client.stop()
                self.client.close()
                self._started = self._rooted = False

    @staticmethod
    def _shut_aside(client: Any) -> None:
        with contextlib.suppress(Exception):  # a client nobody uses: nobody to tell
            client.stop()
            client.close()
