"""Locks on etcd (v3 API through etcd's JSON gateway over HTTP; stdlib only).

etcd's own lock recipe (``concurrency.Mutex``): each contender grants a lease of ``ttl``
seconds and puts ``<root>/<name>/<lease id>`` under it in a transaction that only creates the
key (compare ``create_revision == 0``). The key with the lowest create revision holds the lock;
every other contender watches only the key created just before its own and re-checks when it
is deleted (FIFO, no herd). The create revision is the fence: etcd's revision counter only
grows, for every key, for ever.

The lease is the lock's life: a holder that crashes stops sending keepalives and etcd deletes
its key when the lease runs out; ``auto_renew`` sends a keepalive every ttl/3. An etcd lease
keeps the TTL it was granted with, so ``extend(ttl)`` with another TTL grants a new lease and
moves the key onto it in a transaction that compares the key's create revision (the key
stays, so does the fence), then revokes the old lease; with the same TTL it sends a
keepalive.

A holder hears at once when its key is deleted by anyone else (a force release, its lease
running out): one watch over the root prefix per manager, open while it holds locks, marks
the lock lost (``held`` turns False, the ``lost`` event fires).

No maintained Python client for the v3 API installs cleanly today (``etcd3`` needs an old
protobuf and is unmaintained); the JSON gateway is part of every etcd server and keeps the
dependency list empty.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

from ..core import LockInfo, NodeHealth, check_positive
from . import base
from .base import BackendLock, BackendLocks, Grant, check_name, check_root, holder_meta

__all__ = ["EtcdError", "EtcdLocks", "EtcdServerError", "EtcdUnreachable"]


class EtcdError(RuntimeError):
    """etcd answered with an error, or could not be reached on any endpoint. ``code``: the
    gRPC status code etcd answered with (5: not found), None when it did not answer;
    ``status``: the HTTP status it answered with, None when it did not answer."""

    def __init__(self, message: str, code: int | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


#: The gRPC status code of an answer "not found" (a lease etcd does not have).
NOT_FOUND = 5
STATUS = "/v3/maintenance/status"


class EtcdUnreachable(EtcdError):
    """No endpoint answered (refused, timed out, dropped the connection): the service is
    down, not wrong. ``check()`` reads it as "not known to be ours" (``unavailable()``), as
    it reads :class:`EtcdServerError`; any other error etcd answered with (a 4xx: a request
    it refuses) stays a plain :class:`EtcdError`."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__(f"etcd unreachable ({'; '.join(errors)})")


class EtcdServerError(EtcdError):
    """etcd, or a proxy in front of it, answered HTTP 5xx: it could not serve the request
    (no leader, a request that timed out inside the cluster, a balancer with no etcd behind
    it). Down rather than wrong, as :class:`EtcdUnreachable`. It is not sent again to
    another endpoint: etcd may have applied it."""


def _answered_error(path: str, status: int, raw: bytes) -> EtcdError:
    """The error for an answer other than 200: etcd's gateway answers JSON (``error``,
    ``code``); a balancer or proxy in front of it may answer a page of its own."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        detail, code = payload.get("error", payload), payload.get("code")
    else:
        detail, code = raw.decode(errors="replace").strip()[:200], None
    kind = EtcdServerError if status >= 500 else EtcdError
    return kind(f"etcd {path}: HTTP {status}: {detail}", code, status)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(value: str) -> str:
    return base64.b64decode(value).decode()


def _prefix_end(prefix: str) -> str:
    """The range_end that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def _new_connection(endpoint: str, timeout: float) -> http.client.HTTPConnection:
    url = urlsplit(endpoint)
    factory = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    return factory(url.hostname or "127.0.0.1", url.port, timeout=timeout)


def _check_endpoint(endpoint: str) -> None:
    """Refuse an endpoint no connection can be made to (no host, a bad port): it would
    otherwise be tried, and fail, at every request."""
    url = urlsplit(endpoint)
    try:
        port = url.port  # raises ValueError on a port that is not a number below 65536
    except ValueError:
        port = -1
    if not url.hostname:
        raise ValueError(f"EtcdLocks: endpoint {endpoint!r} names no host")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(
            f"EtcdLocks: endpoint {endpoint!r} has an invalid port (ports are 1-65535)"
        )


class _Gateway:
    """POSTs JSON to the v3 gateway over one keep-alive connection per thread, trying the
    endpoints in turn when one fails."""

    def __init__(self, endpoints: list[str], timeout: float) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._local = threading.local()

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        errors = []
        for endpoint in self.endpoints:
            try:
                return self._post(endpoint, path, body, timeout or self.timeout)
            except (OSError, http.client.HTTPException) as exc:
                self._drop(endpoint)
                errors.append(f"{endpoint}: {exc}")
        raise EtcdUnreachable(errors)

    def _connection(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        pool = self._local.__dict__.setdefault("pool", {})
        connection = pool.get(endpoint)
        if connection is None:
            connection = pool[endpoint] = _new_connection(endpoint, timeout)
        connection.timeout = timeout
        if connection.sock is not None:
            connection.sock.settimeout(timeout)
        return connection

    def _drop(self, endpoint: str) -> None:
        connection = self._local.__dict__.get("pool", {}).pop(endpoint, None)
        if connection is not None:
            connection.close()

    def _post(
        self, endpoint: str, path: str, body: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        connection = self._connection(endpoint, timeout)
        try:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            raw = response.read()
            if response.status != 200:
                raise _answered_error(path, response.status, raw)
            payload: dict[str, Any] = json.loads(raw or b"{}")
        except EtcdError:
            raise  # answered in full: the connection is ready for the next request
        except BaseException:
            # A request cut short (timed out, interrupted, a reply cut off) leaves the
            # connection mid-exchange: http.client refuses its next request ("Request-sent"),
            # and a late reply would answer the wrong one. Every caller, health() too, gets a
            # fresh connection next time.
            self._drop(endpoint)
            raise
        return payload

    def watch_delete(self, key: str, revision: int, timeout: float) -> bool:
        """Wait until ``key`` is deleted after ``revision`` (True) or ``timeout`` passes, on
        the first endpoint that takes the watch."""
        errors = []
        for endpoint in self.endpoints:
            try:
                return self._watch_delete(endpoint, key, revision, timeout)
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"{endpoint}: {exc}")
        raise EtcdUnreachable(errors)

    def _watch_delete(self, endpoint: str, key: str, revision: int, timeout: float) -> bool:
        connection = _new_connection(endpoint, timeout)
        try:
            body = {"create_request": {"key": _b64(key), "start_revision": revision + 1}}
            connection.request("POST", "/v3/watch", json.dumps(body))
            response = connection.getresponse()
            if response.status != 200:
                raise _answered_error("/v3/watch", response.status, response.read())
            while True:
                line = response.readline()
                if not line:
                    return False
                events = json.loads(line).get("result", {}).get("events", [])
                if any(event.get("type") == "DELETE" for event in events):
                    return True
        except TimeoutError:
            return False
        finally:
            connection.close()

    def open_watch(
        self, body: dict[str, Any], timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A watch stream (the connection and its response, one JSON reply per line) on the
        first endpoint that takes it."""
        errors = []
        for endpoint in self.endpoints:
            connection = _new_connection(endpoint, timeout)
            try:
                connection.request("POST", "/v3/watch", json.dumps({"create_request": body}))
                response = connection.getresponse()
                if response.status == 200:
                    return connection, response
                errors.append(f"{endpoint}: HTTP {response.status}")
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"{endpoint}: {exc}")
            connection.close()
        raise EtcdUnreachable(errors)

    def close(self) -> None:
        for connection in self._local.__dict__.get("pool", {}).values():
            connection.close()
        self._local = threading.local()


@dataclass
class _Held:
    """What a holder keeps of its lock: its key, the lease the key lives on (it changes when
    ``extend`` moves the key to a lease of another TTL), the TTL that lease was asked for
    (0: unknown, for a lock adopted by token), and a guard that keeps a renewal, an extend
    and the release of one lock from interleaving their requests."""

    key: str
    lease: str
    ttl: int
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)


#: How long the loss watch waits on a silent stream before it opens it anew (from the last
#: revision it saw, so nothing is missed), and how long it pauses after a failed attempt.
WATCH_IDLE = 5.0
WATCH_RETRY = 0.2


class _KeyWatch:
    """One watch stream over the root prefix, open while the manager holds locks: a DELETE of
    a held key (a force release, its lease running out) marks that lock lost at once.

    Deletes are seen from ``_since`` on: a stream starts at the create revision of the first
    key it watches, and a stream that ends (idle, a dropped connection) opens again just after
    the last event it saw. A key created before the revision the watching began (a waiter
    that queued long ago) is looked up once when added, for a delete the stream cannot see.
    Our own release stops watching its key before it deletes it.
    """

    def __init__(self, locks: EtcdLocks) -> None:
        self._locks = locks
        self._held: dict[str, Grant] = {}  #: key -> grant
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self._covered_from = 0  #: deletes from this revision on are seen by the stream
        self._since = 0  #: the revision the next stream starts at
        self._stream: http.client.HTTPConnection | None = None

    def add(self, grant: Grant) -> None:
        held: _Held = grant.state
        fence = int(grant.fence or 0)
        with self._mutex:
            self._held[held.key] = grant
            if self._thread is None:
                self._covered_from = self._since = fence + 1
                self._thread = base.spawn("etcd-lock-watch", self._run)
                return
            unseen = fence + 1 < self._covered_from
        # etcd not answering now is no loss: the holder learns at its next check or extend.
        with contextlib.suppress(EtcdError):
            if unseen and not self._locks._still_held(grant):
                self._lost(held.key, grant)

    def remove(self, grant: Grant) -> None:
        held: _Held = grant.state
        with self._mutex:
            if self._held.get(held.key) is grant:
                del self._held[held.key]
            stream = self._stream if not self._held else None
        if stream is not None:  # nothing left to watch: end the stream, and its thread
            _shut(stream)

    def close(self) -> None:
        with self._mutex:
            self._held.clear()
            stream = self._stream
        if stream is not None:
            _shut(stream)

    def _lost(self, key: str, grant: Grant) -> None:
        with self._mutex:
            if self._held.get(key) is not grant:
                return  # released (or handed over) meanwhile: not a loss
            del self._held[key]
        self._locks._mark_lost(grant, "its key was deleted (a force release, or its lease ran out)")

    def _run(self) -> None:
        root = f"{self._locks.root}/"
        watch: dict[str, Any] = {"key": _b64(root), "range_end": _prefix_end(root)}
        watch["filters"] = ["NOPUT"]
        while True:
            with self._mutex:
                if not self._held:
                    self._thread = None
                    return
                body = {**watch, "start_revision": self._since}
            try:
                connection, response = self._locks.gateway.open_watch(body, WATCH_IDLE)
            except EtcdError:
                time.sleep(WATCH_RETRY)  # etcd is down: keep trying while locks are held
                continue
            with self._mutex:
                self._stream = connection
                stop = not self._held
            try:
                if not stop:
                    self._follow(response)
            except (OSError, http.client.HTTPException, ValueError):
                pass  # idle for WATCH_IDLE, or the connection dropped: open it again
            finally:
                with self._mutex:
                    self._stream = None
                connection.close()

    def _follow(self, response: http.client.HTTPResponse) -> None:
        while True:
            line = response.readline()
            if not line:
                return
            result = json.loads(line).get("result", {})
            if result.get("compact_revision") and result.get("canceled"):
                self._after_compaction(int(result["header"]["revision"]))
                return
            for event in result.get("events", []):
                kv = event.get("kv", {})
                with self._mutex:
                    self._since = max(self._since, int(kv.get("mod_revision", 0)) + 1)
                    grant = self._held.get(_text(kv.get("key", "")))
                if event.get("type") == "DELETE" and grant is not None:
                    self._lost(_text(kv["key"]), grant)

    def _after_compaction(self, revision: int) -> None:
        """The revisions to watch from are compacted away: look each held key up instead,
        and watch from now on."""
        with self._mutex:
            self._since = revision + 1
            held = list(self._held.items())
        for key, grant in held:
            with contextlib.suppress(EtcdError):
                if not self._locks._still_held(grant):
                    self._lost(key, grant)


def _shut(connection: http.client.HTTPConnection) -> None:
    """End a stream another thread is reading: its read returns at once."""
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class EtcdLocks(BackendLocks):
    """Locks on etcd. ``OPTIONS``: ``endpoints`` (list of client URLs), ``root`` (key prefix,
    default ``/django_redlock``), ``ttl`` (default lease, seconds; etcd counts whole seconds),
    ``request_timeout`` (seconds per request, default 5)."""

    service = "etcd"

    fair = True  # each waiter watches the key created just before its own

    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        root: str = "/django_redlock",
        ttl: float = 30.0,
        request_timeout: float = 5.0,
        retry_count: int = 3,
        retry_delay: float = 0.2,
    ) -> None:
        super().__init__(ttl=ttl, retry_count=retry_count, retry_delay=retry_delay)
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints or not all(
            isinstance(e, str) and urlsplit(e).scheme in ("http", "https") for e in endpoints
        ):
            raise ValueError(f"EtcdLocks: endpoints must be http(s) URLs, got {endpoints!r}")
        for endpoint in endpoints:
            _check_endpoint(endpoint)
        self.endpoints = list(endpoints)
        self.node_name = ",".join(self.endpoints)
        self.root = check_root("EtcdLocks", root, "look like /locks")
        self._gateway = _Gateway(self.endpoints, check_positive("request_timeout", request_timeout))
        self._key_watch = _KeyWatch(self)

    @property
    def gateway(self) -> _Gateway:
        """The HTTP connections of this process (a forked child gets its own)."""
        self._this_process()
        return self._gateway

    def _after_fork(self) -> None:
        # The parent's keep-alive connections and its watch stream are left as they are (no
        # close, no shutdown: shutdown would end the parent's stream): a fresh pool and a
        # fresh watch, whose thread starts with this process's first held lock.
        self._gateway = _Gateway(self.endpoints, self._gateway.timeout)
        self._key_watch = _KeyWatch(self)

    def unavailable(self) -> tuple[type[BaseException], ...]:
        return (EtcdUnreachable, EtcdServerError)

    # etcd could not be reached, or answered with an error: no verdict (see _verdict).

    def _acquire(self, handle: BackendLock, owner: Hashable, **options: Any) -> Grant | None:
        with self._verdict(handle.name, "grant", (EtcdError,)):
            return super()._acquire(handle, owner, **options)

    def _release(self, grant: Grant) -> None:
        # The delete may have been applied before the error: the lock is gone, or held by
        # its token until its lease ends.
        after = "; it may stay held until its lease ends"
        with self._verdict(grant.name, "release", (EtcdError,), after):
            super()._release(grant)

    def _extend(self, grant: Grant, ttl: float) -> bool:
        with self._verdict(grant.name, "extend", (EtcdError,)):
            return super()._extend(grant, ttl)

    def _prefix(self, name: str) -> str:
        return f"{self.root}/{quote(name, safe='')}/"

    def _range(self, prefix: str, **options: Any) -> dict[str, Any]:
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), **options}
        return self.gateway.post("/v3/kv/range", body)

    def _if_created(self, key: str, revision: int | str | None, then: dict[str, Any]) -> Any:
        """One transaction: ``then`` if the key has this create revision (0: the key does not
        exist). The reply tells ``succeeded`` and the header's revision."""
        compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL"}
        compare["create_revision"] = str(revision)
        return self.gateway.post("/v3/kv/txn", {"compare": [compare], "success": [then]})

    def _first(self, name: str) -> dict[str, Any] | None:
        """The holder's key-value of ``name`` (lowest create revision), or None."""
        reply = self._range(self._prefix(name), sort_order="ASCEND", sort_target="CREATE", limit=1)
        kvs = reply.get("kvs", [])
        return kvs[0] if kvs else None

    # -- acquiring ------------------------------------------------------------------------------

    def _take(
        self, handle: BackendLock, token: str, blocking: bool, deadline: float | None
    ) -> Grant | None:
        meta = holder_meta(handle.meta)
        ttl = max(math.ceil(handle.ttl), 1)
        value = _b64(self._record(token, meta))
        while True:
            started = time.monotonic()
            lease = self.gateway.post("/v3/lease/grant", {"TTL": ttl})["ID"]
            held = _Held(f"{self._prefix(handle.name)}{int(lease):x}", lease, ttl)
            try:
                put = {"request_put": {"key": _b64(held.key), "value": value, "lease": lease}}
                fence = int(self._if_created(held.key, 0, put)["header"]["revision"])
                turn = self._wait_turn(handle.name, held, fence, blocking, deadline, started)
            except BaseException:
                self._revoke(lease, quiet=True)
                raise
            if turn is None:
                self._revoke(lease)  # a failure: acquire() raises it as QuorumError
                return None
            if turn is not False:
                valid_until = turn + handle.ttl
                grant = Grant(handle.name, token, handle.ttl, None, valid_until, meta=meta)
                grant.fence, grant.state = fence, held
                return grant
            # Our lease ran out while we waited (a paused process): our place in the line is
            # gone, so take a new one behind whoever queued meanwhile.
            self._revoke(lease, quiet=True)

    def _wait_turn(
        self,
        name: str,
        held: _Held,
        fence: int,
        blocking: bool,
        deadline: float | None,
        granted: float,
    ) -> float | Literal[False] | None:
        """Wait until no key of ``name`` was created before ours (``held.key``). Returns when
        our lease counts from (``granted``, or its last refresh after a wait), False when our
        key vanished while we waited, None when we gave up."""
        lease, ttl, waited = held.lease, held.ttl, False
        while True:
            last = {"sort_order": "DESCEND", "sort_target": "CREATE", "limit": 1}
            before = self._range(self._prefix(name), **last, max_create_revision=fence - 1)
            kvs = before.get("kvs", [])
            if not kvs:
                if not waited:
                    return granted
                # Ours only if our own key outlived the wait: refresh its lease, then look.
                refreshed = time.monotonic()
                ours = self._keep_alive(lease) and self._exists(held.key, fence)
                return refreshed if ours else False
            left = None if deadline is None else deadline - time.monotonic()
            if not blocking or (left is not None and left <= 0):
                return None
            # A waiter's key lives on its own lease: keep it alive, or the key vanishes from
            # the line and, with nobody left before it, the waiter would "win" a lock it no
            # longer has a key for.
            if not self._keep_alive(lease):
                return False
            waited = True
            # Watch only the key just before ours, from the revision we read it at, waking
            # in time for the next keepalive.
            wait = ttl / 3 if left is None else min(left, ttl / 3)
            self.gateway.watch_delete(_text(kvs[0]["key"]), int(before["header"]["revision"]), wait)

    def _keep_alive(self, lease: str) -> float:
        """Refresh ``lease``; the seconds etcd granted, 0 when it is gone."""
        reply = self.gateway.post("/v3/lease/keepalive", {"ID": lease})
        return float(reply.get("result", {}).get("TTL", 0))

    def _exists(self, key: str, fence: int | None) -> bool:
        reply = self.gateway.post("/v3/kv/range", {"key": _b64(key)})
        kvs = reply.get("kvs", [])
        return bool(kvs) and int(kvs[0]["create_revision"]) == fence

    def _revoke(self, lease: str, quiet: bool = False) -> None:
        """Revoke ``lease``, and with it its key. A lease etcd no longer has (it ran out while
        etcd or this process was paused) has nothing left to revoke: done. ``quiet``: any
        other failure is let go too (the lease ends by itself)."""
        try:
            self.gateway.post("/v3/lease/revoke", {"ID": lease})
        except EtcdError as exc:
            if not quiet and exc.code != NOT_FOUND:
                raise

    # -- holding --------------------------------------------------------------------------------

    def _watch(self, grant: Grant) -> None:
        self._key_watch.add(grant)

    def _unwatch(self, grant: Grant) -> None:
        self._key_watch.remove(grant)

    def _give_back(self, grant: Grant) -> bool:
        held: _Held = grant.state
        with held.guard:
            delete = {"request_delete_range": {"key": _b64(held.key)}}
            reply = self._if_created(held.key, grant.fence, delete)
            self._revoke(held.lease, quiet=True)
        return bool(reply.get("succeeded"))

    def _renew(self, grant: Grant, ttl: float) -> bool | float:
        held: _Held = grant.state
        wanted = max(math.ceil(ttl), 1)
        with held.guard:
            if wanted != held.ttl:
                return self._move(grant, held, wanted, ttl)
            if not self._still_held(grant):
                return False
            granted = self._keep_alive(held.lease)
        return min(granted, ttl) if granted > 0 else False

    def _move(self, grant: Grant, held: _Held, wanted: int, ttl: float) -> bool | float:
        """Re-arm the lock for another TTL: a new lease, the key moved onto it if it is still
        ours (same create revision: the key, and so the fence, stay), the old lease revoked.
        Under ``held.guard``."""
        lease = self.gateway.post("/v3/lease/grant", {"TTL": wanted})
        new_lease, granted = lease["ID"], float(lease.get("TTL", wanted))
        try:
            put = {"request_put": {"key": _b64(held.key), "lease": new_lease, "ignore_value": True}}
            moved = bool(self._if_created(held.key, grant.fence, put).get("succeeded"))
        except BaseException:
            self._revoke(new_lease, quiet=True)
            raise
        if not moved:  # deleted or taken over meanwhile: the lock is not ours any more
            self._revoke(new_lease, quiet=True)
            return False
        old_lease, held.lease, held.ttl = held.lease, new_lease, wanted
        self._revoke(old_lease, quiet=True)  # holds no key now; it would expire anyway
        return min(granted, ttl)

    def _still_held(self, grant: Grant) -> bool:
        held: _Held = grant.state
        return self._exists(held.key, grant.fence)

    def _adopt(self, name: str, token: str) -> Grant | None:
        first = self._first(name)
        if first is None or json.loads(_text(first["value"]))["token"] != token:
            return None
        # The TTL its lease was asked for is not known here: an extend moves it to a new one.
        state = _Held(_text(first["key"]), first.get("lease", "0"), 0)
        fence = int(first["create_revision"])
        return Grant(name, token, self.ttl, None, time.monotonic(), fence=fence, state=state)

    def _remove(self, name: str, token: str | None) -> int:
        first = self._first(name)
        if first is None:
            return 0
        if token is not None and json.loads(_text(first["value"]))["token"] != token:
            return 0
        delete = {"request_delete_range": {"key": first["key"]}}
        reply = self._if_created(_text(first["key"]), first["create_revision"], delete)
        return 1 if reply.get("succeeded") else 0

    def locked(self, name: str) -> bool:
        return self._first(check_name(name, listed=True)) is not None

    def _infos(self, wanted: Callable[[str], bool]) -> Iterable[LockInfo]:
        reply = self._range(f"{self.root}/", sort_order="ASCEND", sort_target="CREATE")
        holders: dict[str, dict[str, Any]] = {}
        for kv in reply.get("kvs", []):
            name = unquote(_text(kv["key"])[len(self.root) + 1 :].rsplit("/", 1)[0])
            holders.setdefault(name, kv)  # ascending create revision: the first is the holder
        for name, kv in holders.items():
            if wanted(name):
                data = json.loads(_text(kv["value"]))
                lease = self.gateway.post("/v3/lease/timetolive", {"ID": kv.get("lease", "0")})
                left, granted = (
                    max(float(lease.get("TTL", 0)), 0.0),
                    float(lease.get("grantedTTL", 0)),
                )
                yield self._info(name, data, left, granted or None, int(kv["create_revision"]))

    def health(self) -> list[NodeHealth]:
        result = []
        for endpoint in self.endpoints:
            try:
                started = time.perf_counter()
                status = self.gateway._post(endpoint, STATUS, {}, self.gateway.timeout)
                latency = time.perf_counter() - started
            except Exception as exc:
                result.append(base.unreachable(endpoint, exc))
                continue
            result.append(NodeHealth(endpoint, True, latency, status.get("version"), server="etcd"))
        return result

    def close(self) -> None:
        self._this_process()  # in a forked child: close the child's own, never the parent's
        self._key_watch.close()
        self.gateway.close()
