"""Threads of one process that fan out at the same moment share rounds (core/fanout.py): while
one thread's fan-out is on the wire the others queue, and the queue goes out as the next round,
on one connection per node. Each thread still gets its own answer as soon as its own operation
is decided, a round is handed on to the thread of an operation still waiting, and an interrupt
leaves no other thread waiting. Real redis-server processes; SIGSTOP holds a round open while
the other threads queue behind it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import pytest

from tests.helpers import occupy, settled_tokens, tokens_on_nodes, wait_until, warm_up

pytestmark = pytest.mark.faults


class Interrupted(BaseException):
    """What the test's SIGINT handler raises (not KeyboardInterrupt, which would end the
    test session if it escaped)."""


def _taker(rl, name: str, results: dict) -> threading.Thread:
    def take() -> None:
        # Taken in this thread, released by the test's: the test is the handle's owner.
        lock = rl.lock(name, owner="test")
        results[name] = (lock, lock.acquire(blocking=False))

    thread = threading.Thread(target=take, name=f"take-{name}", daemon=True)
    thread.start()
    return thread


def _queued(rl, count: int) -> None:
    wait_until(lambda: len(rl._rounds._queue) == count)


def _acquires_run(node) -> int:
    """How many acquire commands (a plain ``SET`` or the acquire script) the node has run."""
    with node.client(socket_timeout=5) as client:
        stats = client.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("set", "evalsha", "eval")
    )


def _idle(rl) -> bool:
    return not rl._rounds._leading and not rl._rounds._queue


def test_fan_outs_started_meanwhile_go_out_together_as_the_next_round(
    redis_cluster_factory, make_redlock
) -> None:
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=5.0)
    warm_up(rl)
    results: dict = {}
    # A majority frozen: the first round waits for its quorum while seven threads queue.
    cluster[1].pause()
    cluster[2].pause()
    first = _taker(rl, "first", results)
    wait_until(lambda: rl._rounds._leading)
    names = [f"queued-{i}" for i in range(7)]
    others = [_taker(rl, name, results) for name in names]
    _queued(rl, 7)
    cluster[1].resume()
    cluster[2].resume()
    for thread in [first, *others]:
        thread.join(10)
        assert not thread.is_alive()
    for name in ["first", *names]:
        lock, acquired = results[name]
        assert acquired and lock.held
        wait_until(lambda lock=lock, name=name: tokens_on_nodes(cluster, name) == [lock.token] * 3)
    # The seven went out on one connection per node: at most the first round's and theirs
    # (each thread sending its own would have opened seven more per node).
    assert [1 <= len(node._idle) <= 2 for node in rl.nodes] == [True] * 3
    assert _idle(rl)
    for name in ["first", *names]:
        results[name][0].release()
    assert all(settled_tokens(cluster, name) == [None] * 3 for name in ["first", *names])


def test_an_operation_decided_at_quorum_does_not_wait_for_one_sharing_its_round(
    redis_cluster_factory, make_redlock
) -> None:
    """``free`` and ``busy`` go out in one round with node 2 frozen. ``free`` is granted by
    nodes 0 and 1 and returns at once; ``busy`` (another holder's) is refused by them and waits
    for node 2 until the node timeout, served by its own thread after ``free``'s left."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=2.0)
    warm_up(rl)
    for node in cluster:
        occupy(node, "busy", ms=30_000, token="other-holder")
    results: dict = {}
    cluster[1].pause()
    cluster[2].pause()
    leader = _taker(rl, "lead", results)
    wait_until(lambda: rl._rounds._leading)
    free = _taker(rl, "free", results)
    _queued(rl, 1)
    busy = _taker(rl, "busy", results)
    _queued(rl, 2)
    cluster[1].resume()  # the first round gets its quorum; node 2 stays frozen
    try:
        free.join(1.5)
        assert not free.is_alive(), "a fan-out decided at quorum waited for the frozen node"
        assert busy.is_alive(), "the refused attempt should still wait for the frozen node"
        lock, acquired = results["free"]
        assert acquired and settled_tokens(cluster[:2], "free") == [lock.token] * 2
        busy.join(5)
        assert not busy.is_alive() and results["busy"][1] is False
        leader.join(5)
        assert results["lead"][1] is True
    finally:
        cluster[2].resume()
    assert settled_tokens(cluster, "busy") == ["other-holder"] * 3
    assert _idle(rl)


@pytest.fixture
def interrupts() -> Callable[[], None]:
    """``interrupt()`` sends SIGINT to the main thread (where the test runs), whose handler
    raises :class:`Interrupted`."""

    def handler(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGINT, handler)
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    yield lambda: signal.pthread_kill(main, signal.SIGINT)
    signal.signal(signal.SIGINT, previous)


def test_the_main_thread_fans_out_alone_so_an_interrupt_strands_no_other_thread(
    redis_cluster_factory, make_redlock, interrupts
) -> None:
    """Signal handlers raise in the main thread, anywhere: it never joins the other threads'
    rounds. Here a thread leads a round stuck on a frozen majority with two threads queued;
    the main thread's acquire goes out at once on its own, is interrupted, and the others
    finish once the nodes run again."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=5.0)
    warm_up(rl)
    results: dict = {}
    cluster[1].pause()
    cluster[2].pause()
    leader = _taker(rl, "leader", results)
    wait_until(lambda: rl._rounds._leading)
    names = ["queued-1", "queued-2"]
    queued = [_taker(rl, name, results) for name in names]
    _queued(rl, 2)
    seen: list[int] = []

    def interrupt_the_main_thread() -> None:
        wait_until(lambda: tokens_on_nodes(cluster[:1], "main") != [None])  # its own, sent
        seen.append(len(rl._rounds._queue))  # not queued behind the others
        interrupts()
        cluster[1].resume()
        cluster[2].resume()

    helper = threading.Thread(target=interrupt_the_main_thread, daemon=True)
    helper.start()
    try:
        with pytest.raises(Interrupted):
            rl.lock("main").acquire(blocking=False)
    finally:
        cluster[1].resume()
        cluster[2].resume()
    helper.join(5)
    assert seen == [2]
    for thread in [leader, *queued]:
        thread.join(10)
        assert not thread.is_alive()
    for name in ["leader", *names]:
        lock, acquired = results[name]
        assert acquired and lock.held
        lock.release()
    assert _idle(rl)
    wait_until(lambda: tokens_on_nodes(cluster, "main") == [None] * 3)  # taken back


def test_one_slow_node_does_not_hold_up_the_threads_queued_behind(
    redis_cluster_factory, make_redlock
) -> None:
    """A refused attempt waits for every node, the frozen one up to the node timeout. A
    thread that arrives meanwhile for a free lock goes out once a majority answered the
    first: it returns at its own quorum, long before the refused attempt."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=1.0)
    warm_up(rl)
    for node in cluster:
        occupy(node, "busy", ms=30_000, token="other-holder")
    for node in rl.nodes:  # a second idle connection per node, as under concurrency
        node.checkin(node.connect(1.0))
    results: dict = {}
    before = [_acquires_run(node) for node in cluster]
    cluster[2].pause()
    try:
        refused = _taker(rl, "busy", results)
        # The refused attempt is on the wire and a majority ran it: it now waits for the
        # frozen node only.
        wait_until(lambda: all(_acquires_run(cluster[i]) > before[i] for i in (0, 1)))
        free = _taker(rl, "free", results)
        free.join(0.5)
        assert not free.is_alive(), "a free lock waited for the frozen node behind another"
        assert refused.is_alive(), "the refused attempt should still wait for the frozen node"
        lock, acquired = results["free"]
        assert acquired and lock.held
        refused.join(5)
        assert results["busy"][1] is False
    finally:
        cluster[2].resume()
    lock.release()


class _InterruptedAfterWaking:
    """A wake lock whose acquire is interrupted just after it succeeded (a signal handled
    right after the wake-up)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.raised = False

    def acquire(self) -> bool:
        self.lock.acquire()
        if not self.raised:
            self.raised = True
            raise Interrupted
        return True

    def release(self) -> None:
        self.lock.release()


def test_an_interrupt_just_after_the_wake_up_does_not_sleep_again() -> None:
    from django_redlock.core.fanout import FanOut, _sleep, _wake

    op = FanOut(3, lambda node, wire: b"")
    wake = op.wake = _InterruptedAfterWaking()  # type: ignore[assignment]
    outcome: list = []
    sleeper = threading.Thread(target=lambda: outcome.append(_sleep(op, wake)), daemon=True)
    sleeper.start()
    _wake(op, "lead")
    sleeper.join(5)
    assert not sleeper.is_alive(), "woken, interrupted, and asleep again for ever"
    assert isinstance(outcome[0], Interrupted) and op.role == "lead"


def test_an_interrupted_round_reports_what_it_never_sent_as_not_reached(redis_nodes) -> None:
    """Interrupted while connecting to node 1, a round never sent the other threads'
    commands there, nor to node 2: they must not count as on their way (a release so
    answered is kept for the node instead of being taken for done)."""
    from django_redlock.core.fanout import FanOut, Round
    from django_redlock.core.nodes import NOT_SENT, make_nodes, reached

    nodes = make_nodes(list(redis_nodes.urls), node_timeout=1.0)
    try:

        def interrupted(deadline: float):
            raise Interrupted

        nodes[1].checkout = interrupted  # type: ignore[method-assign]
        ops = [FanOut(3, lambda node, wire: b"*1\r\n$4\r\nPING\r\n") for _ in range(2)]
        with pytest.raises(Interrupted):
            Round(nodes, ops, 1.0).serve(ops[0])
        assert ops[1].finished
        assert ops[1].replies[1] is NOT_SENT and ops[1].replies[2] is NOT_SENT
        assert not reached(ops[1].replies[1]) and not reached(ops[1].replies[2])
    finally:
        for node in nodes:
            node.close()


def test_an_interrupted_acquire_takes_back_what_it_set(
    redis_cluster_factory, make_redlock, interrupts
) -> None:
    """The main thread's acquire is interrupted while a majority is frozen (node 0 granted
    it already): the SETs are taken back, so once the nodes run again no copy is left for
    the lease (30 s)."""
    cluster = redis_cluster_factory(3)
    rl = make_redlock(cluster, node_timeout=0.5, ttl=30.0)
    warm_up(rl)
    cluster[1].pause()
    cluster[2].pause()

    def interrupt_once_waiting() -> None:
        wait_until(lambda: tokens_on_nodes(cluster[:1], "taken-back") != [None])
        interrupts()

    helper = threading.Thread(target=interrupt_once_waiting, daemon=True)
    helper.start()
    try:
        with pytest.raises(Interrupted):
            rl.lock("taken-back").acquire(blocking=False)
    finally:
        cluster[1].resume()
        cluster[2].resume()
    helper.join(5)
    wait_until(lambda: tokens_on_nodes(cluster, "taken-back") == [None] * 3, timeout=3.0)
    assert _idle(rl)
