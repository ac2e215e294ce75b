"""A hot key handed from client to client: what each hand-off costs the nodes.

Each contender is a Redlock client of its own (its own local queue and release notices, as a
process of its own has), in a thread of this test. The cost is counted on the nodes themselves
(``INFO commandstats``), never through the code under test, and bounded per acquisition, so a
busy host changes how long the test takes, not what it asserts.
"""

from __future__ import annotations

import threading

from django_redlock.testing import RedisCluster
from tests.helpers import warm_up

CLIENTS = 6
ROUNDS = 15  #: acquisitions per client


def _take_turns(clients: list, name: str, fair: bool) -> list[int]:
    """Every client takes ``name`` ROUNDS times, blocking, and releases it at once."""
    counts = [0] * len(clients)
    start = threading.Barrier(len(clients))
    failures: list[str] = []

    def worker(index: int) -> None:
        start.wait()
        for _ in range(ROUNDS):
            lock = clients[index].lock(name, ttl=10.0, fair=fair)
            if not lock.acquire(timeout=30):
                failures.append(f"client {index} timed out")
                return
            counts[index] += 1
            lock.release()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    assert not failures, failures
    return counts


def _clients(nodes: RedisCluster, make_redlock) -> list:
    """CLIENTS Redlock clients, each warmed up (connections open, markers armed)."""
    clients = [make_redlock(nodes, ttl=10.0) for _ in range(CLIENTS)]
    for client in clients:
        warm_up(client)
    return clients


def _hand_offs(
    nodes: RedisCluster, make_redlock, node_calls, name: str, fair: bool, command: str
) -> tuple[list[int], int, list[int]]:
    """Warmed-up clients take turns on ``name``: each client's acquisitions, their total,
    and how many ``command`` calls each node ran meanwhile, fewest first."""
    clients = _clients(nodes, make_redlock)
    before = node_calls(nodes)
    counts = _take_turns(clients, name, fair=fair)
    after = node_calls(nodes)
    spent = [a.get(command, 0) - b.get(command, 0) for b, a in zip(before, after, strict=True)]
    return counts, sum(counts), sorted(spent)


def test_contenders_woken_by_one_release_do_not_split_the_vote(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    _, taken, sets = _hand_offs(
        redis_nodes, make_redlock, node_calls, "hot:plain", fair=False, command="set"
    )
    assert taken == CLIENTS * ROUNDS
    # The contenders a release wakes ask one node first and only its winner asks the others:
    # apart from that node, a node sees about one SET per acquisition (plus the attempts made
    # before anyone waited), where contenders that ask every node at once send each node one
    # SET per contender woken, every release, and undo the copies of a split vote (about 2.5
    # per acquisition here).
    for spent in sets[:-1]:
        assert spent <= 1.75 * taken, (sets, taken)


def test_fair_waiters_let_the_releases_ahead_of_them_go_by(
    redis_nodes: RedisCluster, make_redlock, node_calls
) -> None:
    counts, taken, attempts = _hand_offs(
        redis_nodes, make_redlock, node_calls, "hot:fair", fair=True, command="zrangebyscore"
    )
    # Fair shares: every client got every one of its turns (none timed out meanwhile).
    assert counts == [ROUNDS] * CLIENTS
    # The fair acquire script reads the line's heartbeats once per run: a waiter asks the
    # nodes when its turn comes, not on every release, and asks the lead node alone until it
    # is its turn. Apart from that node, a node runs it about twice per acquisition, where
    # waiters that all ask every node on every release run it about five times here.
    for spent in attempts[:-1]:
        assert spent <= 3 * taken, (attempts, taken)
