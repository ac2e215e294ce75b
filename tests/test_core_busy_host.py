"""A busy host is not an outage: with every node up, threads of one process that take locks
beside CPU burners (the host's load far above its cores) never get a :class:`QuorumError`.
A late reply there is late because this process, or the host, did not run: a non-blocking
acquire may find a key held by another thread, never "too few nodes answer at all".
"""

from __future__ import annotations

import threading
import time

import pytest

from bench.load import Burners
from django_redlock import Redlock
from django_redlock.core.errors import QuorumError
from django_redlock.testing import RedisCluster

#: Threads of one process (gunicorn's ``-k gthread`` runs a request on each): at 32 beside the
#: burners, 5 of 13 such runs got a ``QuorumError`` or more (load 7-15).
THREADS = 32
SECONDS = 8.0


def churn(rl: Redlock, threads: int, seconds: float) -> tuple[int, int, list[str]]:
    """``threads`` threads take one hot key (without waiting: another thread may hold it)
    and a key of their own in turn, for ``seconds``; returns the locks granted, the hot-key
    refusals, and the errors raised."""
    stop = time.monotonic() + seconds
    granted = [0] * threads
    held = [0] * threads
    errors: list[str] = []

    def loop(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            key = "busy:hot" if n % 2 else f"busy:{i}:{n}"
            n += 1
            lock = rl.lock(key, ttl=5)
            try:
                if lock.acquire(blocking=False):
                    lock.release()
                    granted[i] += 1
                else:
                    held[i] += 1
            except QuorumError as exc:
                errors.append(f"QuorumError: {exc}"[:300])
            except Exception as exc:
                errors.append(repr(exc)[:300])

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(granted), sum(held), errors


@pytest.mark.slow
@pytest.mark.load
@pytest.mark.xfail(
    strict=False,
    reason=(
        "not fixed: on a host whose load is far above its cores the nodes beside it answer "
        "later than the node timeout now and then; an operation then finds every connection "
        "of a node owing a late reply (refused at once) or its reply late, and a second node "
        "the same, so a non-blocking acquire raises QuorumError with every node up (8 errors "
        "in 5 of 13 runs of 8 s; measured: mostly this process's own 32 threads holding up "
        "the replies' reading, PING p99 8.7 ms with the burners alone, 167 ms with them). "
        "With the reply budget following the round trips (RFC 6298) the plain timeouts went "
        "(4 of 8 failing runs before, 1 of 8 and 3 of 10 after, load 4-14); what is left is "
        "'every connection owes a late reply' on two nodes at once. Since an operation waits "
        "for a connection in use to come back (or a new one) instead of refusing the node at "
        "once: 4 of 6 runs pass at load 8-20 (0 of 3 before, 7 errors in one); what is left "
        "is a plain timeout or 'no answer while connecting' (a node that missed lately is "
        "waited for a fifth of the node timeout) on two nodes at once, 1-6 errors. "
        "Sending behind the least late connection instead "
        "left plain timeouts (11 errors in 2 of 15 runs) and queued commands on a frozen "
        "minority node, which test_core_slow_minority forbids"
    ),
)
def test_a_busy_host_with_every_node_up_gets_no_quorum_error():
    cluster = RedisCluster(3)
    rl = Redlock(cluster.urls)
    try:
        with Burners():
            granted, held, errors = churn(rl, THREADS, SECONDS)
    finally:
        rl.close()
        cluster.stop()
    assert granted > 0
    assert held > 0  # the hot key was contended: a refusal there is "held", no error
    assert not errors, (len(errors), errors[:3])
