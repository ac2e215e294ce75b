"""redis-py connection options on the lock connections, seen from the server (real nodes).

The lock connections are redis-py's own, so an option given in a node's OPTIONS or URL does
on them what it does in redis-py: a client name is set, credentials come from a credential
provider, the database comes from the URL's query, keepalive is on the socket. Each test
shows the option's effect on the server (``CLIENT LIST``), sync and async.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import redis
from redis.backoff import NoBackoff
from redis.credentials import UsernamePasswordCredentialProvider
from redis.retry import Retry

from django_redlock import Redlock
from django_redlock.core.asyncio import AsyncRedlock
from tests.helpers import node_client


def _clients(node) -> list[dict]:
    with node_client(node) as client:
        return list(client.client_list())


def _cycle(specs: list, name: str) -> None:
    rl = Redlock(specs, node_timeout=2.0)
    try:
        lock = rl.lock(name)
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        rl.close()


def test_client_name_names_the_lock_connections(redis_nodes) -> None:
    specs = [{"URL": url, "OPTIONS": {"client_name": "locks-sync"}} for url in redis_nodes.urls]
    rl = Redlock(specs, node_timeout=2.0)
    try:
        lock = rl.lock("named")
        assert lock.acquire(blocking=False)
        # The pooled lock connection of every node carries the name.
        for node in redis_nodes:
            assert "locks-sync" in [c.get("name") for c in _clients(node)]
        lock.release()
    finally:
        rl.close()

    async def main() -> None:
        aspecs = [{"URL": u, "OPTIONS": {"client_name": "locks-async"}} for u in redis_nodes.urls]
        arl = AsyncRedlock(aspecs, node_timeout=2.0)
        try:
            lock = arl.lock("named-async")
            assert await lock.acquire(blocking=False)
            for node in redis_nodes:
                assert "locks-async" in [c.get("name") for c in _clients(node)]
            await lock.release()
        finally:
            await arl.close()

    asyncio.run(main())


def test_credential_provider_supplies_the_password(redis_cluster_factory) -> None:
    cluster = redis_cluster_factory(3, password="pr0vided")
    plain = [url.replace(":pr0vided@", "") for url in cluster.urls]
    assert all("pr0vided" not in url for url in plain)
    provider = UsernamePasswordCredentialProvider(password="pr0vided")
    _cycle([{"URL": url, "OPTIONS": {"credential_provider": provider}} for url in plain], "cred")


def test_the_database_of_the_url_query_is_selected(redis_nodes) -> None:
    urls = [f"{url.rsplit('/', 1)[0]}/?db=3" for url in redis_nodes.urls]
    rl = Redlock(urls, node_timeout=2.0, key_prefix="dbq")
    try:
        lock = rl.lock("in-db-3")
        assert lock.acquire(blocking=False)
        for node in redis_nodes:
            with node.client(db=3, socket_timeout=5) as c:
                assert c.exists("dbq:lock:in-db-3") == 1
            with node_client(node) as c:
                assert c.exists("dbq:lock:in-db-3") == 0
        lock.release()
    finally:
        rl.close()


def test_a_client_node_lends_its_client_name(redis_nodes) -> None:
    clients = [redis.Redis.from_url(url, client_name="lent") for url in redis_nodes.urls]
    rl = Redlock(clients, node_timeout=2.0)
    try:
        lock = rl.lock("lent")
        assert lock.acquire(blocking=False)
        for node in redis_nodes:
            assert "lent" in [c.get("name") for c in _clients(node)]
        lock.release()
    finally:
        rl.close()
        for client in clients:
            client.close()


def test_a_sync_retry_is_refused_for_the_asyncio_client() -> None:
    """redis.asyncio awaits its ``Retry``: a sync one would fail at the first connection."""
    spec = {"URL": "redis://127.0.0.1:6399/0", "OPTIONS": {"retry": Retry(NoBackoff(), 1)}}
    Redlock([spec]).close()
    with pytest.raises(ValueError, match="retry"):
        AsyncRedlock([spec])


@pytest.mark.parametrize(
    "query, named",
    [
        ("?ssl=true", "rediss://"),
        ("?ssl_ca_certs=/etc/ssl/ca.pem", "rediss://"),
        ("?socket_timout=1", "'socket_timout'"),
        ("?protocol=3", "'protocol'"),
        ("?socket_timeout=-1", "socket_timeout"),
        ("?socket_timeout=0", "socket_timeout"),
        ("?max_connections=0", "max_connections must be a whole number of at least 1"),
    ],
)
def test_a_url_query_option_that_cannot_be_honoured_is_refused(redis_nodes, query, named):
    # Refused when the client is built, as the same option in OPTIONS is: dropped, ?ssl=true
    # would send the lock commands in plain text to a server the user meant to reach by TLS.
    url = redis_nodes.urls[0] + query
    with pytest.raises(ValueError, match=re.escape(named)):
        Redlock([url, *redis_nodes.urls[1:]])
    with pytest.raises(ValueError, match=re.escape(named)):
        AsyncRedlock([url, *redis_nodes.urls[1:]])


@pytest.mark.parametrize("name", ["single_connection_client", "cache_config"])
def test_a_pool_option_is_refused_not_dropped(redis_nodes, name) -> None:
    """A ``redis.Redis`` setting of its pool or client, not of a connection: the lock
    connections could only drop it (a capped pool would still see many connections)."""
    spec = {"URL": redis_nodes.urls[0], "OPTIONS": {name: 1}}
    for client in (Redlock, AsyncRedlock):
        with pytest.raises(ValueError, match=f"'{name}' cannot be honoured"):
            client([spec, *redis_nodes.urls[1:]])


def test_url_query_options_that_redis_py_reads_are_used(redis_nodes) -> None:
    urls = [f"{url}?client_name=from-query&socket_keepalive=true" for url in redis_nodes.urls]
    rl = Redlock(urls, node_timeout=2.0)
    try:
        lock = rl.lock("query-options")
        assert lock.acquire(blocking=False)
        names = {c["name"] for c in _clients(redis_nodes[0])}
        assert "from-query" in names
        lock.release()
    finally:
        rl.close()
