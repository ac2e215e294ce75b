"""The sync client's connections to a node: as many as its threads use at once, on a busy host
too, fewer again once it goes idle, and never more than ``max_connections``.

Each node's connections are counted by the node itself (``CLIENT LIST``, by the client name the
test gives them), while threads take and release locks of distinct keys beside CPU burners.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import redis

from bench.load import Burners
from django_redlock import Redlock
from django_redlock.core.nodes import IDLE_FOR, MIN_IDLE, TRIM_EVERY
from django_redlock.testing import RedisCluster

NAME = "pool-test"


def connections(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("name") == NAME)


def named(urls: list[str], **options: object) -> list[dict[str, object]]:
    return [{"URL": url, "OPTIONS": {"client_name": NAME, **options}} for url in urls]


def hammer(
    rl: Redlock, threads: int, seconds: float, clients: list[redis.Redis]
) -> tuple[int, list[str], list[int]]:
    """``threads`` threads acquire and release distinct keys for ``seconds``; returns the
    cycles, the errors, and the most connections each node saw (sampled as they run)."""
    stop = time.monotonic() + seconds
    cycles = [0] * threads
    errors: list[str] = []

    def loop(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            try:
                lock = rl.lock(f"pool:{i}:{n}", ttl=5)
                n += 1
                if lock.acquire(blocking=False):
                    lock.release()
                    cycles[i] += 1
            except Exception as exc:
                errors.append(repr(exc)[:200])

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    most = [0] * len(clients)
    while any(w.is_alive() for w in workers):
        for i, client in enumerate(clients):
            most[i] = max(most[i], connections(client))
        workers[0].join(0.2)
    for w in workers:
        w.join()
    return sum(cycles), errors, most


def eventually(what: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.2)  # polling the node: no event tells when a connection closes
    return what()


@pytest.fixture
def cluster():
    c = RedisCluster(3)
    try:
        yield c
    finally:
        c.stop()


def bound(threads: int) -> int:
    # Each thread holds one connection per node during an operation, and a hedged copy may
    # hold one more; a few more owe replies that come late on a busy host.
    return 2 * threads + 8


@pytest.mark.slow
# Eight threads beside burners run with the load scenarios (CI runs them as a step of its own).
@pytest.mark.load
@pytest.mark.parametrize("threads", [4, 8])
def test_connections_stay_bounded_on_a_busy_host_and_shrink_when_idle(cluster, threads):
    clients = [node.client() for node in cluster.nodes]
    rl = Redlock(named(cluster.urls))
    try:
        with Burners():
            cycles, errors, most = hammer(rl, threads, 8.0, clients)
        assert not errors, errors[:3]
        assert cycles > 0
        assert max(most) <= bound(threads), (most, cycles)
        # Idle: down to MIN_IDLE per node within IDLE_FOR (and a trim or two).
        assert eventually(
            lambda: all(connections(c) <= MIN_IDLE for c in clients),
            IDLE_FOR + 4 * TRIM_EVERY + 5,
        ), [connections(c) for c in clients]
        lock = rl.lock("pool:after-idle", ttl=5)
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        rl.close()
    assert eventually(lambda: all(connections(c) == 0 for c in clients), 5)


_VICTIM = """
import sys
from django_redlock import Redlock
rl = Redlock(sys.argv[1:])
lock = rl.lock("pool:victim", ttl=5)
print(lock.acquire(blocking=True, timeout=5))
lock.release()
rl.close()
"""


@pytest.mark.load
@pytest.mark.slow
def test_a_second_process_is_not_refused_by_nodes_with_few_clients_allowed():
    threads = 8
    cluster = RedisCluster(3, extra_args=["--maxclients", str(bound(threads) + 8)])
    try:
        clients = [node.client() for node in cluster.nodes]
        rl = Redlock(named(cluster.urls))
        result: list[subprocess.CompletedProcess[str]] = []
        try:
            with Burners():

                def victim() -> None:
                    # A fresh process, once the busy one holds its connections.
                    eventually(lambda: connections(clients[0]) >= threads // 2, 10)
                    result.append(
                        subprocess.run(
                            [sys.executable, "-c", _VICTIM, *cluster.urls],
                            capture_output=True,
                            text=True,
                            timeout=60,
                        )
                    )

                second = threading.Thread(target=victim)
                second.start()
                cycles, errors, most = hammer(rl, threads, 8.0, clients)
                second.join()
        finally:
            rl.close()
        assert not errors, errors[:3]
        assert cycles > 0
        assert result and result[0].returncode == 0, result[0].stderr[-2000:]
        assert result[0].stdout.strip() == "True", result[0].stdout
        assert max(most) <= bound(threads), most
    finally:
        cluster.stop()


@pytest.mark.slow
def test_max_connections_caps_each_node_and_operations_wait_for_one(cluster):
    cap = 2
    clients = [node.client() for node in cluster.nodes]
    rl = Redlock(named(cluster.urls, max_connections=cap), node_timeout=0.5)
    try:
        with Burners():
            cycles, errors, most = hammer(rl, 6, 5.0, clients)
        assert not errors, errors[:3]
        assert cycles > 0
        assert max(most) <= cap, most
    finally:
        rl.close()


@pytest.mark.parametrize("bad", [0, -1, "4", 2.5, True])
def test_a_bad_max_connections_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=f"max_connections must be .* got {bad!r}"):
        Redlock([{"URL": "redis://127.0.0.1:1/0", "OPTIONS": {"max_connections": bad}}])
