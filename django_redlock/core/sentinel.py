"""Sentinel-managed groups as Redlock nodes: ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE/DB``.

A group (a master, its replicas and the Sentinels watching them) counts as one node. Its
address is not fixed: the node asks the Sentinels (redis-py's :class:`redis.sentinel.Sentinel`,
``discover_master``) where the master is each time it opens a connection, and it opens one
after a connection error or a ``READONLY`` reply (the server it reached was demoted), so a
failover moves the node to the new master with its next connection.

A promoted replica may lack writes its master acknowledged (replication is asynchronous), so
it could vote a lock free that another client still holds. The restart guard keeps it out of
the quorum: the acquire script finds the node's marker written under another server's run id
(the old master's, replicated), arms it anew, and the node does not vote until the longest
lease (``max_ttl``) has passed, by when every lease the old master granted has ended.

A failover need not leave such a trace: a master frozen (a GC pause, a stalled VM) while the
Sentinels promote its replica comes back still a master under its own run id, and a later
failover may name it master again before the Sentinels ever made it a replica, with its own
old marker, although it missed every lease the interim master granted. So the node also
tells the script the Sentinels' ``config-epoch`` for the group, which every failover
increments: a marker armed at an older epoch is armed anew at this one (the node sits out its
guard), whichever server it is on. A connection opened at one epoch is not used at another.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.connection import parse_url as _parse_url

# redis-py's URL parser and Sentinel clients, untyped in redis-py.
parse_url: Callable[[str], dict[str, Any]] = _parse_url
_Sentinel: Callable[..., Any] = redis.sentinel.Sentinel
_AsyncSentinel: Callable[..., Any] = redis.asyncio.sentinel.Sentinel
_SentinelPool: Callable[..., Any] = redis.sentinel.SentinelConnectionPool

__all__ = [
    "CONFIRM_EVERY",
    "DEFAULT_SENTINEL_PORT",
    "GUARD_MARGIN",
    "SCHEME",
    "GroupURL",
    "SentinelGroup",
    "SentinelUnavailable",
    "Where",
    "group_identity",
    "group_master_url",
    "is_group_url",
    "parse_group_url",
    "redact_group_url",
    "same_host",
]

#: The URL scheme of a Sentinel-managed group.
SCHEME = "redis+sentinel"

#: The port a Sentinel listens on when the URL names none.
DEFAULT_SENTINEL_PORT = 26379

#: Seconds a group node keeps using its master without the Sentinels confirming it. A master
#: deposed by a failover keeps taking writes until the Sentinels reconfigure it (about ten
#: seconds after the switch, or never while it is cut off from them); a client that went on
#: using it would count it as the group's vote beside the promoted replica's. Asking again
#: this often keeps that overlap far inside the restart guard of the new master.
CONFIRM_EVERY = 1.0

#: Seconds added to the restart guard (``max_ttl``) of every node of a Redlock that has a
#: Sentinel group among its nodes. A promoted master's guard may start as soon as it is
#: promoted; the Sentinels announce the switch up to a second or two later, and a client may use
#: the deposed master for up to :data:`CONFIRM_EVERY` after that (a descheduled thread a little
#: longer): a lease the deposed master granted then ends within this margin after ``max_ttl``.
GUARD_MARGIN = 5.0


#: Where a group's master is: ``((host, port), config-epoch)``, as one Sentinel answered (the
#: epoch None where the Sentinel did not tell it).
Where = tuple[tuple[str, int], int | None]


class SentinelUnavailable(ConnectionError):
    """No Sentinel named the group's master, and none was known before."""


@dataclass(frozen=True)
class GroupURL:
    """A ``redis+sentinel://`` URL taken apart."""

    #: ``(host, port)`` of each Sentinel, in the URL's order.
    sentinels: tuple[tuple[str, int], ...]
    #: The service (master) name the Sentinels monitor.
    service: str
    #: redis-py connection settings for the master (db, username, password and the query's
    #: options, parsed as redis-py parses a ``redis://`` URL's).
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: The master's ``redis://`` URL with ``{address}`` for its ``host:port``.
    master_url: str = ""


def is_group_url(url: object) -> bool:
    return isinstance(url, str) and url.lower().startswith(SCHEME + "://")


def _host_port(url: str, item: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"node URL {redact_group_url(url)!r} has an invalid Sentinel {item!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"node URL {redact_group_url(url)!r} names a Sentinel without a host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    # isascii(): str.isdigit() and int() take other scripts' digits, which no URL does.
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"node URL {redact_group_url(url)!r} has an invalid Sentinel port {port_text!r} "
            "(ports are 1-65535)"
        )
    return host, int(port_text)


def parse_group_url(url: str) -> GroupURL:
    """Raises ValueError naming the URL (without its password) for a malformed one."""
    shown = redact_group_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() != SCHEME:
        raise ValueError(f"node URL {shown!r} is not a {SCHEME}:// URL")
    if parts.fragment:
        raise ValueError(f"node URL {shown!r} has a fragment")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"node URL {shown!r} names no Sentinel (HOST:PORT[,HOST:PORT...])")
    sentinels = tuple(_host_port(url, item.strip()) for item in hosts.split(","))
    if len(set(sentinels)) != len(sentinels):
        raise ValueError(f"node URL {shown!r} names a Sentinel twice")
    segments = parts.path.split("/")[1:]
    if not segments or not segments[0]:
        raise ValueError(f"node URL {shown!r} names no service: {SCHEME}://HOST:PORT/SERVICE/DB")
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise ValueError(
            f"node URL {shown!r} must end in /SERVICE/DB (DB a database number), got {parts.path!r}"
        )
    service = unquote(segments[0])
    db = segments[1] if len(segments) == 2 else "0"
    # The master's settings mean what they mean in a redis:// URL: redis-py parses them.
    netloc = f"{userinfo}@placeholder" if userinfo else "placeholder"
    query = f"?{parts.query}" if parts.query else ""
    try:
        kwargs = parse_url(f"redis://{netloc}/{db}{query}")
    except ValueError as exc:
        raise ValueError(f"node URL {shown!r}: {exc}") from None
    for key in ("host", "port", "path", "connection_class"):
        kwargs.pop(key, None)
    credentials = f"{userinfo}@" if userinfo else ""
    master_url = f"redis://{credentials}{{address}}/{db}{query}"
    return GroupURL(sentinels, service, kwargs, master_url)


def group_master_url(url: str, address: str = "localhost:6379") -> str:
    """The ``redis://`` URL of a group's master at ``address`` (``host:port``): the URL's
    credentials, database and options, as a server's URL would give them."""
    return parse_group_url(url).master_url.replace("{address}", address)


def redact_query(query: str) -> str:
    """A URL query with every value hidden but those of redis-py's typed options (``db``,
    timeouts, flags): a password, under its own name or a mistyped one, is never shown."""
    if not query:
        return query
    return urlencode(
        [
            (name, value if name in URL_QUERY_ARGUMENT_PARSERS else "***")
            for name, value in parse_qsl(query, keep_blank_values=True)
        ],
        safe="*/",
    )


def redact_group_url(url: str) -> str:
    """The URL without credentials (safe for logs, errors and the admin page)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    path, question, query = path.partition("?")
    query = redact_query(query)
    if "@" in netloc:
        netloc = f"***@{netloc.rpartition('@')[2]}"
    return f"{scheme}://{netloc}{slash}{path}{question}{query}"


def same_host(host: str) -> str:
    """One spelling per host: ``localhost``, ``127.0.0.1`` and ``::1`` are this machine."""
    host = host.lower()
    return "127.0.0.1" if host in ("localhost", "::1") else host


def group_identity(url: str) -> tuple[str, str, int]:
    """What makes two configured groups the same: the service name on the same Sentinels."""
    parsed = parse_group_url(url)
    hosts = ",".join(sorted(f"{same_host(h)}:{p}" for h, p in parsed.sentinels))
    return ("sentinel", f"{parsed.service}@{hosts}", 0)


def _address(server: tuple[str, int]) -> str:
    host, port = server
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Located:
    """What redis-py's Sentinel pool asks where the master is: the group
    (:meth:`SentinelGroup.resolve`)."""

    def __init__(self, group: SentinelGroup) -> None:
        self._group = group

    def discover_master(self, service_name: str) -> tuple[str, int]:
        return self._group.resolve()


class SentinelGroup:
    """The Sentinels of one group, and where they last said its master is.

    ``options`` are the node's OPTIONS: redis-py connection settings for the master (TLS,
    credentials, timeouts), and ``sentinel_kwargs`` for the connections to the Sentinels
    (as redis-py's ``Sentinel`` takes them). The Sentinels are asked with the node timeout
    unless ``sentinel_kwargs`` says otherwise: resolution happens while a lock operation
    connects.
    """

    def __init__(self, url: str, options: Mapping[str, Any], *, node_timeout: float) -> None:
        self.url = url
        self.name = redact_group_url(url)
        parsed = parse_group_url(url)
        self.service = parsed.service
        self.sentinels = parsed.sentinels
        self._master_url = parsed.master_url
        options = dict(options)
        self.sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": node_timeout,
            "socket_connect_timeout": node_timeout,
            **(options.pop("sentinel_kwargs", None) or {}),
        }
        #: redis-py connection settings for the master, without its address.
        self.master_kwargs: dict[str, Any] = {**parsed.kwargs, **options}
        self._sentinel = _Sentinel(list(self.sentinels), sentinel_kwargs=self._kwargs(redis.retry))
        #: Where the Sentinels last said the master is, or None before they were first asked.
        self.where: Where | None = None
        #: When (``time.monotonic``) the Sentinels were last asked, answering or not.
        self.asked = -CONFIRM_EVERY
        #: ``(host, port)`` of the servers configured as nodes of their own beside this group
        #: (set by the client): a master found among them would vote twice.
        self.elsewhere: frozenset[tuple[str, int]] = frozenset()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<SentinelGroup {self.name} master={self.address}>"

    def _kwargs(self, retry: Any) -> dict[str, Any]:
        # No retries of redis-py's own (its default backs off for seconds): the next Sentinel
        # is the retry, and the master last named the fallback.
        return {"retry": retry.Retry(NoBackoff(), 0), **self.sentinel_kwargs}

    @property
    def master(self) -> tuple[str, int] | None:
        """``(host, port)`` the Sentinels last named, or None before they were first asked."""
        where = self.where
        return None if where is None else where[0]

    @property
    def address(self) -> str | None:
        """``host:port`` of the master as last resolved."""
        master = self.master
        return None if master is None else _address(master)

    def master_url(self, master: tuple[str, int]) -> str:
        """A ``redis://`` URL of ``master`` with the group URL's credentials, database and
        options: what a node at that address would be configured as."""
        return self._master_url.replace("{address}", _address(master))

    def due(self, where: Where | None) -> bool:
        """Whether the master is to be confirmed before the next use (see
        :data:`CONFIRM_EVERY`) by a node that last located it at ``where``: also when the
        Sentinels were asked for something else since (the health and listing client's
        connections) and named another master or epoch, which the node must not miss until
        the next confirmation."""
        return time.monotonic() - self.asked >= CONFIRM_EVERY or where != self.where

    def resolve(self) -> tuple[str, int]:
        """Ask the Sentinels where the master is now. When none answers, the master last
        named (it may well be up: the Sentinels are a separate service); raises
        :class:`SentinelUnavailable` when there is none."""
        return self.find()[0]

    def find(self) -> Where:
        """:meth:`resolve`, with the failover epoch the Sentinel named the master at.

        A majority of the group's Sentinels is asked (in turn, those that answered last time
        first, until that many answered), and the master named at the newest epoch among
        their answers is taken: a Sentinel that missed a failover (down during it, or
        restarted from its config of before) names the deposed master at the older epoch,
        and a failover is authorised by a majority of the Sentinels, so one of any majority
        took part in the newest one. With no majority answering, the node goes on with the
        master last named (never with what a minority says), or is unavailable if it has
        none: one Sentinel alone may be the lagging one."""
        errors: list[Exception] = []
        answers: list[Where | None] = []
        sentinels = self._sentinel.sentinels
        answered = []
        for sentinel in list(sentinels):
            if len(answers) >= self.majority:
                break
            try:
                masters = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(exc)
                continue
            answered.append(sentinel)
            answers.append(self._master_in(masters))
        sentinels[:] = [*answered, *(s for s in sentinels if s not in answered)]
        return self._decide(answers, errors)

    async def afind(self) -> Where:
        """:meth:`find` for the asyncio client, on connections of the running loop."""
        sentinel = _AsyncSentinel(
            list(self.sentinels), sentinel_kwargs=self._kwargs(redis.asyncio.retry)
        )
        errors: list[Exception] = []
        answers: list[Where | None] = []
        try:
            for client in sentinel.sentinels:
                if len(answers) >= self.majority:
                    break
                try:
                    masters = await client.sentinel_masters()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    errors.append(exc)
                    continue
                answers.append(self._master_in(masters))
        finally:
            for client in sentinel.sentinels:
                with contextlib.suppress(Exception):
                    await client.aclose()
        return self._decide(answers, errors)

    @property
    def majority(self) -> int:
        """How many of the group's Sentinels must answer before the node follows them."""
        return len(self.sentinels) // 2 + 1

    def _decide(self, answers: list[Where | None], errors: list[Exception]) -> Where:
        """Where the master is, from a majority of the Sentinels' ``answers`` (None: that
        Sentinel names no master up for the service): the one named at the newest epoch.
        Fewer answers, or none naming a master: :meth:`_fall_back`."""
        named = [where for where in answers if where is not None]
        if len(answers) < self.majority or not named:
            return self._fall_back(errors, named)
        return self._found(max(named, key=lambda where: -1 if where[1] is None else where[1]))

    def _master_in(self, masters: Mapping[str, Any]) -> Where | None:
        """The master one Sentinel's ``SENTINEL MASTERS`` names for the service, as redis-py's
        ``discover_master`` judges it (a master it sees up), or None."""
        state = masters.get(self.service)
        if not state or not self._sentinel.check_master_state(state, self.service):
            return None
        epoch = state.get("config-epoch")
        return (str(state["ip"]), int(state["port"])), None if epoch is None else int(epoch)

    def _found(self, where: Where) -> Where:
        master = where[0]
        if (same_host(master[0]), master[1]) in self.elsewhere:
            # Static checks cannot see it (the address is known only now); voting would let
            # one server's failure count twice.
            raise SentinelUnavailable(
                f"the Sentinels name {master[0]}:{master[1]} as {self.service!r}'s master, "
                "which is also configured as a node of its own: one server must not vote "
                "twice (remove one of the two entries)"
            )
        with self._lock:
            self.where = where
            self.asked = time.monotonic()
        return where

    def _fall_back(self, errors: list[Exception], named: list[Where]) -> Where:
        # Not asked again before CONFIRM_EVERY: every operation would wait for them.
        self.asked = time.monotonic()
        where = self.where
        if where is None:
            asked = ", ".join(f"{host}:{port}" for host, port in self.sentinels)
            if named:
                why = (
                    f"{len(named)} of {len(self.sentinels)} answered, {self.majority} needed: "
                    "one Sentinel alone may not have learnt of a failover"
                )
            else:
                why = "unreachable" if errors else "no such master"
            raise SentinelUnavailable(
                f"no majority of Sentinels named a master for {self.service!r} "
                f"(asked {asked}: {why})"
            ) from None
        return where

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client of the master (redis-py's Sentinel pool: it finds the master
        again after a failover), for work other than lock commands (listing, health). It
        finds the master as the lock connections do (:meth:`resolve`): with no Sentinel
        answering, the master last named, so health() shows the server this client votes
        through rather than the group down."""
        options = {**self.master_kwargs, **kwargs, "is_master": True}
        pool = _SentinelPool(self.service, _Located(self), **options)
        client: redis.Redis = redis.Redis.from_pool(pool)
        return client

    def close(self) -> None:
        for client in self._sentinel.sentinels:
            with contextlib.suppress(Exception):
                client.close()
