"""docs/migrating.rst, section "kazoo (ZooKeeper)": one test per row of its behaviour table,
against a real ZooKeeper. Each test runs kazoo's ``Lock`` and the guide's translation side by
side, so both columns of the table are checked, differences included; the last test runs the
guide's own code.
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout

from django_redlock import LockLost, LockNotAcquired, LockNotOwned
from django_redlock.backends.zookeeper import ZooKeeperLocks, znode_name
from tests.backends import cases, servers
from tests.helpers import REPO_ROOT, wait_until


@pytest.fixture(scope="module")
def zk_server() -> Iterator[servers.Server]:
    with servers.zookeeper() as server:
        yield server


@pytest.fixture
def root() -> str:
    return f"/kazoo-compat-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make(zk_server, root) -> Iterator[Any]:
    """Managers of the guide's translation (closed at the end)."""
    with cases.managers(
        lambda **options: ZooKeeperLocks(
            zk_server.address, root=root, **{"session_timeout": 4.0, **options}
        )
    ) as make:
        yield make


@pytest.fixture
def kazoo(zk_server) -> Iterator[Any]:
    """``kazoo()``: a started KazooClient (stopped at the end)."""
    made: list[KazooClient] = []

    def start() -> KazooClient:
        client = KazooClient(zk_server.address, timeout=4.0)
        client.start(30)
        made.append(client)
        return client

    yield start
    for client in made:
        client.stop()
        client.close()


@pytest.fixture
def path(root) -> str:
    return f"{root}-kazoo/report"


def expire_session(zk_server: servers.Server, client: KazooClient) -> None:
    """Expire ``client``'s session the ZooKeeper way: another client connects with the same
    session id and password, then closes it."""
    session_id, password = client.client_id
    intruder = KazooClient(zk_server.address, client_id=(session_id, password))
    intruder.start(30)
    intruder.stop()
    intruder.close()


def in_thread(target: Any) -> Any:
    return cases.run_owned(target, "other-thread")


def test_row_connects_on_first_use(zk_server, root) -> None:
    """``KazooClient(hosts).start()`` -> ``ZooKeeperLocks(hosts)``: connects on first use."""
    locks = ZooKeeperLocks(zk_server.address, root=root)
    try:
        assert not locks.client.connected  # building opened nothing
        lock = locks.lock("report")
        assert lock.acquire(blocking=False)
        assert locks.client.connected
        lock.release()
    finally:
        locks.close()


def test_row_identifier_is_metadata(make, kazoo, path) -> None:
    """``zk.Lock(path, identifier)`` -> ``locks.lock(name, meta={"id": identifier})``."""
    theirs = kazoo().Lock(path, "worker-1")
    assert theirs.acquire(blocking=False)
    assert theirs.contenders() == ["worker-1"]
    locks = make()
    ours = locks.lock("report", meta={"id": "worker-1"})
    assert ours.acquire(blocking=False)
    assert [c["id"] for c in locks.contenders("report")] == ["worker-1"]
    assert make().lock_info("report").meta["id"] == "worker-1"
    ours.release()
    theirs.release()


def test_row_acquire_blocks_until_acquired_in_arrival_order(make) -> None:
    """``lock.acquire()`` -> ``lock.acquire()``: blocks until acquired, in arrival order."""
    locks = make()
    holder = locks.lock("report", meta={"id": "holder"})
    assert holder.acquire(blocking=False)
    order: list[str] = []
    threads = []
    for waiter in ("first", "second"):
        lock = make().lock("report", meta={"id": waiter})

        def wait(lock: Any = lock, waiter: str = waiter) -> None:
            assert lock.acquire()  # no timeout: until acquired
            order.append(waiter)
            lock.release()

        threads.append(threading.Thread(target=wait))
        threads[-1].start()
        # queued before the next one arrives
        wait_until(lambda w=waiter: w in [c["id"] for c in locks.contenders("report")], 30)
    holder.release()
    for thread in threads:
        thread.join(60)
    assert order == ["first", "second"]


def test_row_non_blocking_acquire_is_false_when_held(make, kazoo, path) -> None:
    """``lock.acquire(blocking=False)`` -> the same: False at once when someone holds it."""
    assert kazoo().Lock(path).acquire(blocking=False)
    assert kazoo().Lock(path).acquire(blocking=False) is False
    assert make().lock("report").acquire(blocking=False)
    started = time.monotonic()
    assert make().lock("report").acquire(blocking=False) is False
    assert time.monotonic() - started < 5


def test_row_timeout_returns_false_where_kazoo_raises(make, kazoo, path) -> None:
    """``acquire(timeout=t)``: kazoo raises LockTimeout; here False after ``t`` (and ``with``
    raises LockNotAcquired)."""
    assert kazoo().Lock(path).acquire(blocking=False)
    with pytest.raises(LockTimeout):
        kazoo().Lock(path).acquire(timeout=0.3)
    assert make().lock("report").acquire(blocking=False)
    started = time.monotonic()
    assert make().lock("report").acquire(timeout=0.3) is False
    assert time.monotonic() - started >= 0.3
    with pytest.raises(LockNotAcquired):
        with make().lock("report", timeout=0.3):
            pass


def test_row_release_returns_none_and_raises_when_not_held(make, kazoo, path) -> None:
    """``release()``: kazoo answers True, or False when not held; here None, LockNotOwned
    when not held, LockLost when the lock was lost while held."""
    theirs = kazoo().Lock(path)
    assert theirs.release() is False
    assert theirs.acquire(blocking=False) and theirs.release() is True
    locks = make()
    ours = locks.lock("report")
    with pytest.raises(LockNotOwned):
        ours.release()
    assert ours.acquire(blocking=False)
    assert ours.release() is None
    assert ours.acquire(blocking=False)
    assert make().force_release("report") == 1
    with pytest.raises(LockLost):
        ours.release()


def test_row_context_manager_binds_the_handle(make, kazoo, path) -> None:
    """``with lock:``: kazoo binds None; here the handle. Both hold inside, free after."""
    theirs = kazoo().Lock(path)
    with theirs as bound:
        assert bound is None and theirs.is_acquired
    assert not theirs.is_acquired
    observer = make()
    with make().lock("report") as lock:
        assert lock.held and observer.locked("report")
    assert not lock.held and not observer.locked("report")


def test_row_contenders_in_serving_order(make, kazoo, path) -> None:
    """``lock.contenders()`` -> ``locks.contenders(name)``: holder first, then waiters in
    order; kazoo lists identifiers, here each contender's metadata."""
    client = kazoo()
    holder = client.Lock(path, "holder")
    assert holder.acquire(blocking=False)
    waiting = threading.Thread(target=lambda: kazoo().Lock(path, "waiter").acquire(timeout=30))
    waiting.start()
    wait_until(lambda: len(holder.contenders()) == 2, timeout=30)
    assert holder.contenders() == ["holder", "waiter"]
    holder.release()
    waiting.join(60)

    locks = make()
    ours = locks.lock("report", meta={"id": "holder"})
    assert ours.acquire(blocking=False)
    waiter = make().lock("report", meta={"id": "waiter"}, owner="waiter")
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=30))
    thread.start()
    wait_until(lambda: len(locks.contenders("report")) == 2, timeout=30)
    assert [c["id"] for c in locks.contenders("report")] == ["holder", "waiter"]
    assert all(isinstance(c, dict) for c in locks.contenders("report"))
    ours.release()
    thread.join(60)
    assert waiter.held
    waiter.release()
    assert locks.contenders("report") == []


def test_row_held_turns_false_when_the_lock_is_lost(make, kazoo, path, zk_server) -> None:
    """``lock.is_acquired`` -> ``lock.held``: kazoo's flag stays True after its node was
    deleted; ``held`` turns False."""
    client = kazoo()
    theirs = client.Lock(path)
    assert theirs.acquire(blocking=False)
    for child in client.get_children(path):
        client.delete(f"{path}/{child}")  # what an operator's force release does
    assert theirs.is_acquired is True
    ours = make().lock("report")
    assert ours.acquire(blocking=False) and ours.held
    assert make().force_release("report") == 1
    wait_until(lambda: not ours.held, timeout=10)


def test_row_session_loss_is_reported(make, kazoo, path, zk_server) -> None:
    """Session lost: kazoo's node is gone while ``is_acquired`` stays True (a listener must
    notice); here ``held`` turns False, the ``lost`` event fires, ``release()`` raises
    LockLost."""
    client = kazoo()
    theirs = client.Lock(path)
    assert theirs.acquire(blocking=False)
    states: list[str] = []
    client.add_listener(states.append)
    expire_session(zk_server, client)
    wait_until(lambda: "LOST" in states, timeout=30)
    assert theirs.is_acquired is True

    locks = make()
    lost = threading.Event()
    locks.listeners.append(lambda event: event.kind == "lost" and lost.set())
    ours = locks.lock("report")
    assert ours.acquire(blocking=False)
    expire_session(zk_server, locks.client)
    assert lost.wait(30)
    assert not ours.held and ours.lost
    with pytest.raises(LockLost):
        ours.release()


def test_row_the_holder_asking_again(make, kazoo, path) -> None:
    """kazoo: the holder's second ``acquire()`` blocks (until the lock is released
    elsewhere) and a timed one answers False; here RuntimeError (it would wait for itself),
    False without blocking or after a timeout; ``reentrant=True`` re-enters."""
    theirs = kazoo().Lock(path)
    assert theirs.acquire(blocking=False)
    assert theirs.acquire(timeout=0.3) is False
    again: list[bool] = []
    thread = threading.Thread(target=lambda: again.append(theirs.acquire()))
    thread.start()
    thread.join(1.0)
    assert again == [], "kazoo's second acquire() should block"
    theirs.release()
    thread.join(60)
    assert again == [True]
    theirs.release()

    locks = make()
    ours = locks.lock("report")
    assert ours.acquire(blocking=False)
    with pytest.raises(RuntimeError, match="wait for itself"):
        ours.acquire()
    assert ours.acquire(blocking=False) is False
    assert ours.acquire(timeout=0.3) is False
    assert ours.held
    ours.release()
    outer, inner = locks.lock("report", reentrant=True), locks.lock("report", reentrant=True)
    assert outer.acquire(blocking=False) and inner.acquire(blocking=False)
    inner.release()
    outer.release()
    assert not make().locked("report")


def test_row_only_the_owner_releases(make, kazoo, path) -> None:
    """kazoo lets any thread release; here only the acquiring thread, unless the handle
    names an ``owner``."""
    theirs = kazoo().Lock(path)
    assert theirs.acquire(blocking=False)
    assert in_thread(theirs.release) is True
    observer = make()
    ours = make().lock("report")
    assert ours.acquire(blocking=False)
    assert isinstance(in_thread(ours.release), LockNotOwned)
    assert observer.locked("report")
    ours.release()
    shared = make().lock("report", owner="job-7")
    assert shared.acquire(blocking=False)
    assert in_thread(shared.release) is None
    assert not observer.locked("report")


def test_row_no_persistent_locks(make) -> None:
    """``acquire(ephemeral=False)`` has no translation: the lock always ends with the
    session that holds it."""
    lock = make().lock("report")
    with pytest.raises(TypeError):
        lock.acquire(ephemeral=False)  # type: ignore[call-arg]
    assert not make().locked("report")


def test_row_fencing_tokens(make) -> None:
    """No kazoo equivalent: ``fencing=True`` gives the node's sequence number, strictly
    increasing per name."""
    fences = []
    for _ in range(3):
        lock = make().lock("report", fencing=True)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    assert fences == sorted(set(fences)) and len(fences) == 3


def test_row_kazoo_nodes_and_ours_do_not_exclude_each_other(make, kazoo, root) -> None:
    """Why the guide says to move every process of a lock at once: a kazoo Lock on the very
    directory of our lock nodes does not see ours, nor we its."""
    ours = make().lock("report")
    assert ours.acquire(blocking=False)
    theirs = kazoo().Lock(f"{root}/{znode_name('report')}")
    assert theirs.acquire(blocking=False)  # both hold "the same" lock
    assert ours.check()
    theirs.release()
    ours.release()


def guide_code(column: int) -> str:
    """The code of the guide's kazoo example, left (0) or right (1) column."""
    text = (REPO_ROOT / "docs" / "migrating.rst").read_text()
    section = text[text.index("kazoo (ZooKeeper)\n") :]
    blocks = re.findall(r"- ::\n\n((?:(?: {10}.*)?\n)+)", section)
    return "\n".join(line[10:] for line in blocks[column].splitlines())


def test_the_guides_code_runs(zk_server) -> None:
    """The guide's kazoo example and its translation run and print the same contenders."""
    printed = {}
    for column in (0, 1):
        code = guide_code(column).replace("10.0.0.5:2181", zk_server.address)
        built: list[str] = []
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(code, {"build_report": lambda built=built: built.append("report")})
        assert built == ["report"], column
        printed[column] = output.getvalue()
    assert printed[0] == printed[1] == "['worker-1']\n", printed
