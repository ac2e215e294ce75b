"""Bad input is refused before any network call, with an error naming the bad value.

Every case runs against a live 3-node cluster and then proves that nothing reached the nodes:
the nodes' command counters moved only by our own INFO calls, and no lock key exists anywhere
(nothing half-locked).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import AsyncRedlock, Redlock
from django_redlock.core.listing import glob_escape
from django_redlock.testing import RedisCluster
from tests.helpers import all_keys, node_client


class Untouched:
    """Asserts the nodes served no command between ``before()`` and ``after()`` except the
    INFO calls made by this helper (one per node per call, on one persistent connection)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.clients = [node_client(n) for n in cluster]
        self.cluster = cluster
        self.counts = self._read()

    def _read(self) -> list[int]:
        return [int(c.info("stats")["total_commands_processed"]) for c in self.clients]

    def check(self) -> None:
        now = self._read()
        # INFO replies count commands served before it: the previous INFO is the only one.
        assert [b - a for a, b in zip(self.counts, now, strict=True)] == [1] * len(now), (
            "a node served commands during a call that should have failed before any I/O"
        )
        assert all_keys(self.cluster) == [{}] * len(self.clients)
        self.counts = self._read()

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.fixture
def untouched(redis_nodes: RedisCluster):
    watcher = Untouched(redis_nodes)
    yield watcher
    watcher.close()


def _raises(
    untouched: Untouched, exc: type[Exception], match: str, call: Callable[[], Any]
) -> None:
    with pytest.raises(exc) as info:
        call()
    assert re.search(match, str(info.value)), f"{str(info.value)!r} does not match {match!r}"
    untouched.check()


# --------------------------------------------------------------------------- lock names

NAME_CASES = [
    (123, TypeError, r"123"),
    (None, TypeError, r"None"),
    (b"bytes-name", TypeError, r"b'bytes-name'"),
    (["a"], TypeError, r"\['a'\]"),
    ("", ValueError, r"empty"),
    ("x" * 513, ValueError, r"513.*xxxxxxxx"),
]


@pytest.mark.parametrize(
    ("name", "exc", "match"), NAME_CASES, ids=[repr(c[0])[:20] for c in NAME_CASES]
)
def test_bad_lock_name(redis_nodes, untouched, name, exc, match) -> None:
    rl = Redlock(redis_nodes.urls)
    try:
        _raises(untouched, exc, match, lambda: rl.lock(name))
        _raises(untouched, exc, match, lambda: rl.locked(name))
        _raises(untouched, exc, match, lambda: rl.force_release(name))
        _raises(untouched, exc, match, lambda: rl.lock_info(name))
    finally:
        rl.close()


RESERVED_NAMES = ["y#read", "y#read:abc", "a:b#read:0123456789abcdef", "x#permit:0", "x#permit:12"]


@pytest.mark.parametrize("name", RESERVED_NAMES)
def test_a_name_of_the_reserved_internal_forms_is_refused(redis_nodes, untouched, name) -> None:
    """A plain lock named like a reader's entry would be listed as the reader and force-released
    as it; a primitive named like a permit would share a semaphore's slot: every factory, sync
    and async, refuses such a name, naming the value and the form."""
    rl, arl = Redlock(redis_nodes.urls), AsyncRedlock(redis_nodes.urls)
    makers = [rl.lock, rl.read_lock, rl.write_lock, lambda n: rl.semaphore(n, 2)]
    makers += [arl.lock, arl.read_lock, arl.write_lock, lambda n: arl.semaphore(n, 2)]
    try:
        for make in makers:
            match = rf"{re.escape(repr(name))}.*form '<name>#.*reserved"
            _raises(untouched, ValueError, match, lambda make=make: make(name))
    finally:
        rl.close()
        asyncio.run(arl.close())


def test_names_near_the_reserved_forms_are_accepted(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    for name in [
        "y#reader",
        "y#read:xyz",
        "y#read:",
        "#read",
        "x#permit:",
        "x#permit:a",
        "#permit:0",
    ]:
        lock = rl.lock(name)
        assert lock.acquire(blocking=False), name
        assert [i.name for i in rl.live_locks(glob_escape(name))] == [name]
        lock.release()


def test_longest_name_is_accepted(redis_nodes, untouched) -> None:
    rl = Redlock(redis_nodes.urls)
    try:
        lock = rl.lock("y" * 512)
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        rl.close()


def test_the_listed_holds_of_the_longest_names_are_taken(redis_nodes, make_redlock) -> None:
    """A semaphore or read/write lock may have the longest name; its holds are listed under
    longer names (name#permit:k, name#read:<token>), which every by-name call takes."""
    rl = make_redlock(redis_nodes, ttl=10.0, node_timeout=0.5)
    sem, reader = rl.semaphore("s" * 512, limit=3), rl.read_lock("r" * 512)
    assert sem.acquire(blocking=False) and reader.acquire(blocking=False)
    permit, entry = f"{'s' * 512}#permit:{sem.permit}", f"{'r' * 512}#read:{reader.token}"
    assert [i.name for i in rl.live_locks("s*")] == [permit]
    assert [i.name for i in rl.live_locks("r*")] == [entry]
    for name, token in ((permit, sem.token), (entry, reader.token)):
        info = rl.lock_info(name)
        assert info is not None and info.token == token
        assert rl.locked(name) is True
        assert rl.extend_token(name, token, 20.0) is True
    assert rl.release_token(permit, sem.token) >= 2
    assert rl.force_release(entry) >= 2
    assert rl.lock_info(permit) is None and rl.lock_info(entry) is None


@pytest.mark.parametrize(
    "name",
    [
        "x" * 513 + "#permit:0",
        "x" * 513 + "#read",
        "x" * 513 + "#read:" + "a" * 32,
        "x#read:" + "a" * 600,
        "x#permit:" + "1" * 600,
    ],
    ids=["permit", "reader", "entry", "long-token", "long-slot"],
)
def test_a_listed_name_over_the_limit_is_refused(redis_nodes, untouched, name) -> None:
    """Past the limit, only the forms the package lists its holds under: the primitive's
    name within the limit, a permit's slot and a reader's token as long as they come."""
    rl = Redlock(redis_nodes.urls)
    try:
        _raises(untouched, ValueError, r"limit is 512", lambda: rl.lock_info(name))
        _raises(untouched, ValueError, r"limit is 512", lambda: rl.force_release(name))
    finally:
        rl.close()


TOKEN_CASES = [
    (5, TypeError, r"\b5\b"),
    (b"tok", TypeError, r"b'tok'"),
    ("", ValueError, r"empty"),
]


@pytest.mark.parametrize(
    ("token", "exc", "match"), TOKEN_CASES, ids=[repr(c[0]) for c in TOKEN_CASES]
)
def test_bad_token(redis_nodes, untouched, token, exc, match) -> None:
    rl = Redlock(redis_nodes.urls)
    try:
        _raises(untouched, exc, match, lambda: rl.release_token("t", token))
        _raises(untouched, exc, match, lambda: rl.extend_token("t", token, 5))
        _raises(untouched, exc, match, lambda: rl.force_release("t", token))
    finally:
        rl.close()


PATTERN_CASES = [
    (5, TypeError, r"pattern.*\b5\b"),
    (None, TypeError, r"pattern.*None"),
    (b"x*", TypeError, r"pattern.*b'x\*'"),
    (["x"], TypeError, r"pattern.*\['x'\]"),
    ("x\ud800*", ValueError, r"pattern.*not valid Unicode"),
]


@pytest.mark.parametrize(
    ("pattern", "exc", "match"), PATTERN_CASES, ids=[repr(c[0]) for c in PATTERN_CASES]
)
def test_bad_listing_pattern(redis_nodes, untouched, pattern, exc, match) -> None:
    """live_locks() refuses a pattern that is not a str when it is called, sync (before the
    iterator is even read) and async, with nothing sent."""
    rl, arl = Redlock(redis_nodes.urls), AsyncRedlock(redis_nodes.urls)
    try:
        _raises(untouched, exc, match, lambda: rl.live_locks(pattern))
        _raises(untouched, exc, match, lambda: asyncio.run(arl.live_locks(pattern)))
    finally:
        rl.close()
        asyncio.run(arl.close())


# --------------------------------------------------------------------------- numbers

TTL_CASES = [
    (0, ValueError, r"\b0\b"),
    (-1, ValueError, r"-1"),
    (-0.5, ValueError, r"-0\.5"),
    (float("nan"), ValueError, r"nan"),
    (float("inf"), ValueError, r"inf"),
    (True, TypeError, r"True"),
    (False, TypeError, r"False"),
    ("10", TypeError, r"'10'"),
]


@pytest.mark.parametrize(("ttl", "exc", "match"), TTL_CASES, ids=[repr(c[0]) for c in TTL_CASES])
def test_bad_ttl_for_a_lock(redis_nodes, untouched, ttl, exc, match) -> None:
    rl = Redlock(redis_nodes.urls)
    try:
        _raises(untouched, exc, match, lambda: rl.lock("k", ttl=ttl))
    finally:
        rl.close()


@pytest.mark.parametrize(("ttl", "exc", "match"), TTL_CASES, ids=[repr(c[0]) for c in TTL_CASES])
def test_bad_ttl_for_the_client(redis_nodes, untouched, ttl, exc, match) -> None:
    _raises(untouched, exc, match, lambda: Redlock(redis_nodes.urls, ttl=ttl))


def test_ttl_above_max_ttl(redis_nodes, untouched) -> None:
    _raises(
        untouched,
        ValueError,
        r"\b5\b.*max_ttl.*\b2\b|max_ttl.*\b2\b.*\b5\b",
        lambda: Redlock(redis_nodes.urls, ttl=5, max_ttl=2),
    )
    rl = Redlock(redis_nodes.urls, ttl=1.0, max_ttl=2.0)
    try:
        _raises(untouched, ValueError, r"\b3\b.*max_ttl", lambda: rl.lock("k", ttl=3))
        _raises(untouched, ValueError, r"2\.5", lambda: rl.lock("k", ttl=2.5))
    finally:
        rl.close()


@pytest.mark.parametrize(
    ("timeout", "exc", "match"),
    [
        (-1, ValueError, r"-1"),
        (-0.001, ValueError, r"-0\.001"),
        (float("nan"), ValueError, r"nan"),
        (True, TypeError, r"True"),
        ("5", TypeError, r"'5'"),
    ],
    ids=["-1", "-0.001", "nan", "True", "'5'"],
)
def test_bad_timeout(redis_nodes, untouched, timeout, exc, match) -> None:
    rl = Redlock(redis_nodes.urls)
    try:
        _raises(untouched, exc, match, lambda: rl.lock("k", timeout=timeout))
        lock = rl.lock("k")
        _raises(untouched, exc, match, lambda: lock.acquire(timeout=timeout))
        assert not lock.held
    finally:
        rl.close()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"node_timeout": 0}, ValueError, r"node_timeout.*\b0\b"),
        ({"node_timeout": -0.05}, ValueError, r"-0\.05"),
        ({"node_timeout": math.nan}, ValueError, r"nan"),
        ({"node_timeout": True}, TypeError, r"True"),
        ({"node_timeout": 1.0, "ttl": 1.0}, ValueError, r"node_timeout 1\.0.*ttl 1\.0"),
        ({"node_timeout": 2.0, "ttl": 1.0}, ValueError, r"node_timeout 2\.0.*ttl 1\.0"),
        ({"retry_count": -1}, ValueError, r"-1"),
        ({"retry_count": True}, TypeError, r"True"),
        ({"retry_delay": -0.1}, ValueError, r"-0\.1"),
        ({"drift_factor": math.nan}, ValueError, r"nan"),
        ({"drift_factor": 0.5}, ValueError, r"0\.5"),
        ({"max_ttl": 0}, ValueError, r"max_ttl.*\b0\b"),
        ({"key_prefix": ""}, ValueError, r"''"),
        ({"key_prefix": "a*b"}, ValueError, r"'a\*b'"),
        ({"key_prefix": 5}, TypeError, r"\b5\b"),
    ],
    ids=lambda v: ",".join(f"{k}={w!r}" for k, w in v.items()) if isinstance(v, dict) else "",
)
def test_bad_client_options(redis_nodes, untouched, kwargs, exc, match) -> None:
    _raises(untouched, exc, match, lambda: Redlock(redis_nodes.urls, **kwargs))


def test_lock_ttl_not_above_node_timeout(redis_nodes, untouched) -> None:
    rl = Redlock(redis_nodes.urls, node_timeout=0.05)
    try:
        _raises(untouched, ValueError, r"0\.05|0\.04", lambda: rl.lock("k", ttl=0.04))
        _raises(untouched, ValueError, r"0\.05", lambda: rl.lock("k", ttl=0.05))
    finally:
        rl.close()


def test_bad_extend_ttl_leaves_the_lock_alone(redis_nodes, make_redlock) -> None:
    rl = make_redlock(redis_nodes, max_ttl=60)
    lock = rl.lock("ext-bad", ttl=5.0)
    assert lock.acquire(blocking=False)
    watcher = Untouched(redis_nodes)
    try:
        for bad, exc, match in [
            (-1, ValueError, r"-1"),
            (math.nan, ValueError, r"nan"),
            (True, TypeError, r"True"),
            (61, ValueError, r"61"),
        ]:
            with pytest.raises(exc, match=match):
                lock.extend(bad)
            now = watcher._read()
            assert [b - a for a, b in zip(watcher.counts, now, strict=True)] == [1, 1, 1], bad
            watcher.counts = watcher._read()
        assert lock.held and lock.check()
    finally:
        watcher.close()
    lock.release()


# --------------------------------------------------------------------------- nodes


def _node_cases(cluster: RedisCluster) -> list[tuple[list[Any], type[Exception], str]]:
    u = cluster.urls
    port = cluster[0].port
    return [
        ([], ValueError, r"empty"),
        ([f"http://127.0.0.1:{port}/0", u[1], u[2]], ValueError, rf"'http://127.0.0.1:{port}/0'"),
        ([f"127.0.0.1:{port}", u[1], u[2]], ValueError, rf"'127.0.0.1:{port}'"),
        (["redis:///0", u[1], u[2]], ValueError, r"'redis:///0'.*host"),
        (["redis://:6379/0", u[1], u[2]], ValueError, r"'redis://:6379/0'.*host"),
        (["redis://127.0.0.1:99999/0", u[1], u[2]], ValueError, r"'redis://127.0.0.1:99999/0'"),
        (["redis://127.0.0.1:abc/0", u[1], u[2]], ValueError, r"'redis://127.0.0.1:abc/0'"),
        ([f"redis://127.0.0.1:{port}/x", u[1], u[2]], ValueError, rf":{port}/x'.*'x'"),
        ([f"redis://127.0.0.1:{port}/0/1", u[1], u[2]], ValueError, rf":{port}/0/1'"),
        (["unix://", u[1], u[2]], ValueError, r"'unix://'"),
        ([123, u[1], u[2]], TypeError, r"123"),
        ([None, u[1], u[2]], TypeError, r"None"),
        ([{"url": u[0]}, u[1], u[2]], ValueError, r"url"),
        ([u[0], u[0], u[1]], ValueError, re.escape(u[0])),
        (
            [f"redis://localhost:{port}/0", f"redis://127.0.0.1:{port}/0", u[1]],
            ValueError,
            rf"localhost:{port}.*127\.0\.0\.1:{port}",
        ),
        (
            [f"redis://127.0.0.1:{port}", f"redis://127.0.0.1:{port}/0", u[1]],
            ValueError,
            rf"127\.0\.0\.1:{port}",
        ),
        (
            [f"redis://127.0.0.1:{port}/0", f"rediss://127.0.0.1:{port}/0", u[1]],
            ValueError,
            rf"127\.0\.0\.1:{port}",
        ),
        (u[0], TypeError, re.escape(u[0])),
    ]


CASE_IDS = [
    "empty",
    "http-scheme",
    "no-scheme",
    "no-host",
    "no-host-port",
    "port-range",
    "port-text",
    "db-text",
    "db-path",
    "unix-no-path",
    "int-node",
    "none-node",
    "dict-no-URL",
    "same-url",
    "localhost-vs-127",
    "default-db",
    "redis-vs-rediss",
    "string-not-list",
]


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_bad_nodes(redis_nodes, untouched, case: int) -> None:
    nodes, exc, match = _node_cases(redis_nodes)[case]
    _raises(untouched, exc, match, lambda: Redlock(nodes))


def test_two_databases_of_one_server_are_not_independent_nodes() -> None:
    from django_redlock import Redlock

    with pytest.raises(ValueError, match="same Redis server"):
        Redlock(["redis://127.0.0.1:7000/0", "redis://127.0.0.1:7000/1", "redis://h:1/0"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key_prefix": "app:locks"}, ValueError, r"'app:locks'"),  # would share key spaces
        ({"key_prefix": "a\x00b"}, ValueError, r"a\\x00b"),
        ({"retry_count": 10**6}, ValueError, r"1000000"),
        ({"ttl": 10**400}, ValueError, r"out of range"),
    ],
)
def test_more_bad_settings_are_refused_up_front(kwargs, error, match) -> None:
    from django_redlock import Redlock

    with pytest.raises(error, match=match):
        Redlock(["redis://127.0.0.1:7000/0"], **kwargs)


def test_a_name_that_is_not_valid_unicode_is_refused() -> None:
    from django_redlock import Redlock

    rl = Redlock(["redis://127.0.0.1:7000/0"])
    with pytest.raises(ValueError, match="surrogate"):
        rl.lock("bad\ud800name")


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:0/0", "rediss://127.0.0.1:0/0", "redis://127.0.0.1:65536/0"],
)
def test_a_node_port_outside_1_to_65535_is_refused_at_configuration(url: str) -> None:
    """Port 0 used to pass, then the sync acquire raised a bare ``KeyError: 'port'``."""
    with pytest.raises(ValueError, match=r"invalid port \(ports are 1-65535\)"):
        Redlock([url])
    with pytest.raises(ValueError, match=r"invalid port"):
        AsyncRedlock([{"URL": url}])


#: Redis's SELECT takes 0 .. databases-1, and ``databases`` is a 32-bit int setting.
LAST_DB = 2**31 - 1


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:7000/99999999999", "99999999999"),
        ("redis://127.0.0.1:7000/" + "9" * 23, "9" * 23),
        (f"redis://127.0.0.1:7000/{LAST_DB + 1}", str(LAST_DB + 1)),
        ("redis://127.0.0.1:7000/0?db=-5", "-5"),
        ("redis://127.0.0.1:7000?db=-5", "-5"),
        ("unix:///tmp/redis.sock?db=-5", "-5"),
        ("unix:///tmp/redis.sock?db=99999999999", "99999999999"),
        ("redis+sentinel://127.0.0.1:26379/mymaster/99999999999", "99999999999"),
    ],
)
def test_a_database_number_out_of_range_is_refused_at_configuration(url: str, shown: str) -> None:
    """They used to pass, then every operation failed with 'value is out of range'."""
    for build in (Redlock, AsyncRedlock):
        with pytest.raises(ValueError, match=rf"database number {shown}\b.*2147483647"):
            build([url])
        with pytest.raises(ValueError, match=rf"database number {shown}\b"):
            build([{"URL": url}])


def test_the_largest_database_number_is_accepted() -> None:
    Redlock([f"redis://127.0.0.1:7000/{LAST_DB}"]).close()
    Redlock([f"redis://127.0.0.1:7000/0?db={LAST_DB}"]).close()


@pytest.mark.parametrize("options", [[], None, 0, "", False])
def test_node_options_that_are_not_a_dict_are_refused(options: Any) -> None:
    """A falsy non-dict used to pass as "no options"."""
    with pytest.raises(
        TypeError, match=rf"node OPTIONS must be a dict, got {re.escape(repr(options))}"
    ):
        Redlock([{"URL": "redis://127.0.0.1:7000/0", "OPTIONS": options}])


def test_empty_node_options_are_accepted() -> None:
    Redlock([{"URL": "redis://127.0.0.1:7000/0", "OPTIONS": {}}]).close()
    Redlock([{"URL": "redis://127.0.0.1:7000/0"}]).close()


NODES = [f"redis://10.0.0.{i}:6379/0" for i in (1, 2, 3)]


@pytest.mark.parametrize("heartbeat", [0.001, 0.05, 0.0999])
def test_a_fair_heartbeat_that_would_make_waiters_poll_hard_is_refused(heartbeat) -> None:
    """A waiter asks the nodes every third of its heartbeat: 1 ms made one waiter send about
    48,000 commands a second."""
    from django_redlock import Redlock

    with pytest.raises(ValueError, match=rf"fair_heartbeat must be at least 0\.1 .*{heartbeat}"):
        Redlock(NODES, fair_heartbeat=heartbeat)
    assert Redlock(NODES, fair_heartbeat=0.1).fair_heartbeat == 0.1


def test_a_fair_heartbeat_setting_below_the_floor_is_e008() -> None:
    from django.core.checks import run_checks
    from django.test import override_settings

    with override_settings(REDLOCK={"NODES": NODES, "FAIR_HEARTBEAT": 0.01}):
        found = [m for m in run_checks() if m.id == "django_redlock.E008"]
    assert found and "fair_heartbeat must be at least 0.1" in found[0].msg
