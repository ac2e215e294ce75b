"""The reply budget follows the nodes' round trips: a node whose replies take longer than the
node timeout (a busy host, a far link) is waited for, up to a cap, instead of being counted
silent on every operation; a late reply backs the budget off, as TCP's retransmission timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from bench.lossy_proxy import LossyProxy, ProxyProcess
from django_redlock import AsyncRedlock, Redlock
from django_redlock.core.detector import REPLY_BUDGET_CAP, far_rto, reply_budget
from django_redlock.core.errors import QuorumError
from django_redlock.core.nodes import NodeDetector


def test_the_budget_is_the_node_timeout_while_a_quorum_answers_within_it():
    assert reply_budget(0.05, [0.001, 0.002, 0.3], 2) == 0.05
    assert reply_budget(0.05, [0.0, 0.0, 0.0], 2) == 0.05


def test_the_budget_follows_the_round_trips_of_a_quorum_not_of_the_slowest_node():
    # One node far slower (or silent, its rto backed off) does not stretch the wait.
    assert reply_budget(0.05, [0.01, 0.08, 0.4], 2) == 0.08
    assert reply_budget(0.05, [0.01, 0.02, 0.03, 0.2, 0.4], 3) == 0.05


def test_the_budget_is_capped_and_never_below_the_node_timeout():
    assert reply_budget(0.05, [2.0, 3.0, 4.0], 2) == REPLY_BUDGET_CAP
    assert reply_budget(2.0, [3.0, 4.0, 5.0], 2) == 2.0


def test_a_late_reply_doubles_the_node_s_wait_and_an_answer_brings_it_back():
    detector = NodeDetector(0.05)
    assert reply_budget(0.05, [detector.rto], 1) == 0.05
    detector.missed(1.0)
    assert detector.rto == pytest.approx(0.1)
    detector.missed(1.1)
    assert detector.rto == pytest.approx(0.2)
    for _ in range(4):
        detector.missed(1.2)
    assert detector.rto == REPLY_BUDGET_CAP
    # The pool's judgement of a late connection follows the measured round trips only: a
    # silent node's connections are not waited on longer.
    assert detector.budget() == 0.05
    # A miss while this process did not run says nothing about the node.
    excused = NodeDetector(0.05)
    excused.missed(1.0, excused=True)
    assert excused.rto == 0.0
    # Answers bring it back to what the round trips are (RFC 6298: srtt + 4 rttvar).
    for _ in range(60):
        detector.round_trip(0.002)
    assert detector.rto == pytest.approx(detector.srtt + 4 * detector.rttvar)
    assert detector.rto < 0.05
    slow = NodeDetector(0.05)
    for _ in range(3):
        slow.round_trip(0.09)
    assert slow.budget() == pytest.approx(slow.srtt + 4 * slow.rttvar)
    assert slow.budget() > 0.05
    # Round trips that barely vary leave a far node's reply the node timeout beyond its
    # smoothed round trip, as a near node's has, not four tiny deviations.
    for _ in range(30):
        slow.round_trip(0.09)
    assert 4 * slow.rttvar < 0.01
    assert slow.budget() == pytest.approx(slow.srtt + 0.05)


def test_a_far_quorum_s_wait_is_the_node_timeout_beyond_its_round_trip_at_least():
    assert far_rto(0.03, 0.01, 0.05) == 0.03  # within the node timeout: as measured
    assert far_rto(0.085, 0.081, 0.05) == pytest.approx(0.131)
    assert far_rto(0.4, 0.15, 0.05) == 0.4  # deviations, or a back-off, above that count
    assert far_rto(0.1, None, 0.05) == 0.1  # backed off before any round trip


def test_nodes_whose_round_trips_exceed_the_node_timeout_still_grant_locks(redis_cluster_factory):
    """Two of three nodes behind a link of 40 ms each way (80 ms round trips against the
    default 50 ms node timeout): every acquire needs one of them. With the budget fixed at
    the node timeout, each one raised QuorumError, and a blocking acquire never got the lock."""
    cluster = redis_cluster_factory(3)
    near = Redlock(cluster.urls)  # the cluster is in service: its markers are armed
    try:
        assert near.lock("far:near").acquire(blocking=False)
    finally:
        near.close()
    slow = [LossyProxy((node.host, node.port), delay=0.04) for node in cluster.nodes[1:]]
    with contextlib.ExitStack() as stack:
        for proxy in slow:
            stack.enter_context(proxy)
        rl = Redlock([cluster.nodes[0].url, *(proxy.url for proxy in slow)])
        stack.callback(rl.close)
        # The first, blocking acquires teach the budget (their late replies back it off), and
        # leave no connection owing a late reply behind them.
        for i in range(3):
            lock = rl.lock(f"far:first:{i}", ttl=10)
            assert lock.acquire(timeout=30)
            lock.release()
        outcomes = []
        for i in range(10):
            lock = rl.lock(f"far:{i}", ttl=10)
            try:
                got = lock.acquire(blocking=False)
            except QuorumError as exc:
                outcomes.append(f"QuorumError: {exc}")
                continue
            outcomes.append("granted" if got else "refused")
            if got:
                assert lock.validity > 9.0
                lock.release()
        assert outcomes == ["granted"] * 10, outcomes


def test_the_async_client_s_budget_follows_the_round_trips_too(redis_cluster_factory):
    """The same far nodes, through ``AsyncRedlock``."""
    cluster = redis_cluster_factory(3)
    near = Redlock(cluster.urls)
    try:
        assert near.lock("far:near").acquire(blocking=False)
    finally:
        near.close()

    async def main(urls: list[str]) -> list[str]:
        arl = AsyncRedlock(urls)
        try:
            for i in range(3):
                lock = arl.lock(f"far:first:{i}", ttl=10)
                assert await lock.acquire(timeout=30)
                await lock.release()
            outcomes = []
            for i in range(10):
                lock = arl.lock(f"far:{i}", ttl=10)
                try:
                    got = await lock.acquire(blocking=False)
                except QuorumError as exc:
                    outcomes.append(f"QuorumError: {exc}")
                    continue
                outcomes.append("granted" if got else "refused")
                if got:
                    await lock.release()
            return outcomes
        finally:
            await arl.close()

    with contextlib.ExitStack() as stack:
        slow = [
            stack.enter_context(LossyProxy((node.host, node.port), delay=0.04))
            for node in cluster.nodes[1:]
        ]
        outcomes = asyncio.run(main([cluster.nodes[0].url, *(proxy.url for proxy in slow)]))
    assert outcomes == ["granted"] * 10, outcomes


def _far_cluster(stack, redis_cluster_factory, delays, *, apart=False):
    """A cluster in service (markers armed), its first node reached directly and the others
    through links delaying each way by ``delays``; the URLs and the cluster. ``apart``: each
    link in a process of its own, which competes for the CPU as a network hop does, not for
    this process's interpreter lock (beside CPU burners, a link in this process delivered
    one reply in a hundred 80 to 360 ms late; one apart, 16 ms)."""
    cluster = redis_cluster_factory(1 + len(delays))
    near = Redlock(cluster.urls)
    try:
        assert near.lock("far:near").acquire(blocking=False)
    finally:
        near.close()
    urls = [cluster.nodes[0].url]
    for node, delay in zip(cluster.nodes[1:], delays, strict=True):
        if apart:
            urls += stack.enter_context(ProxyProcess([(node.host, node.port)], delay=delay)).urls
        else:
            urls.append(stack.enter_context(LossyProxy((node.host, node.port), delay=delay)).url)
    return urls, cluster


def test_a_node_found_down_does_not_shorten_the_wait_for_the_far_quorum(redis_cluster_factory):
    """The near node killed, the two far ones (80 and 150 ms round trips) are the quorum:
    the wait follows the slower of them. The killed node's own small estimate counted among
    the quorum's before, and every acquire raised QuorumError (25 of 25)."""
    with contextlib.ExitStack() as stack:
        urls, cluster = _far_cluster(stack, redis_cluster_factory, (0.04, 0.075))
        rl = Redlock(urls)
        stack.callback(rl.close)
        for i in range(3):
            lock = rl.lock(f"far:learn:{i}", ttl=10)
            assert lock.acquire(timeout=30)
            lock.release()
        cluster.nodes[0].kill()
        outcomes = []
        for i in range(10):
            lock = rl.lock(f"far:down:{i}", ttl=10)
            try:
                got = lock.acquire(timeout=30) if i == 0 else lock.acquire(blocking=False)
            except QuorumError as exc:
                outcomes.append(f"QuorumError: {exc}")
                continue
            outcomes.append("granted" if got else "refused")
            if got:
                lock.release()
        assert outcomes[1:] == ["granted"] * 9, outcomes


@pytest.mark.parametrize("client", ["sync", "async"])
def test_auto_renewal_keeps_a_lock_on_far_nodes(client, redis_cluster_factory):
    """Renewal waits as operations do: on two far nodes (80 and 150 ms round trips) beside a
    near one, an auto-renewed lease of 1.5 s is kept for three of its lengths. The asyncio
    client renewed within the node timeout and lost it at the first renewal."""
    with contextlib.ExitStack() as stack:
        urls, _ = _far_cluster(stack, redis_cluster_factory, (0.04, 0.075))
        if client == "sync":
            rl = Redlock(urls)
            stack.callback(rl.close)
            lock = rl.lock("far:renewed", ttl=1.5, auto_renew=True)
            assert lock.acquire(timeout=30)
            until = time.monotonic() + 4.5
            while time.monotonic() < until:
                assert lock.lost is None and lock.held
                time.sleep(0.1)  # time passing is what is under test
            lock.release()
        else:

            async def main() -> None:
                arl = AsyncRedlock(urls)
                try:
                    lock = arl.lock("far:renewed", ttl=1.5, auto_renew=True)
                    assert await lock.acquire(timeout=30)
                    until = time.monotonic() + 4.5
                    while time.monotonic() < until:
                        assert lock.lost is None and lock.held
                        await asyncio.sleep(0.1)
                    await lock.release()
                finally:
                    await arl.close()

            asyncio.run(main())


@pytest.mark.parametrize("client", ["sync", "async"])
def test_extend_and_check_right_after_an_acquire_on_far_nodes(client, redis_cluster_factory):
    """One near node and two far ones (80 and 150 ms round trips): an acquire is decided by
    the near node and the nearer far one, so the farthest one's replies come after the quorum
    answered and were never measured; its estimate stayed low, the quorum-th smallest one
    undershot the wait, and the first ``extend()`` or ``check()`` after an acquire answered
    False while the lock was held. Each is asked right after an acquire, 20 times."""
    with contextlib.ExitStack() as stack:
        urls, _ = _far_cluster(stack, redis_cluster_factory, (0.04, 0.075), apart=True)
        outcomes = []
        if client == "sync":
            rl = Redlock(urls)
            stack.callback(rl.close)
            for i in range(20):
                lock = rl.lock(f"far:extend:{i}", ttl=10)
                assert lock.acquire(timeout=30)
                outcomes.append((lock.extend(), lock.check()))
                lock.release()
        else:

            async def main() -> None:
                arl = AsyncRedlock(urls)
                try:
                    for i in range(20):
                        lock = arl.lock(f"far:extend:{i}", ttl=10)
                        assert await lock.acquire(timeout=30)
                        outcomes.append((await lock.extend(), await lock.check()))
                        await lock.release()
                finally:
                    await arl.close()

            asyncio.run(main())
        assert len(outcomes) == 20
        failed = {i: outcome for i, outcome in enumerate(outcomes) if outcome != (True, True)}
        assert not failed, failed
