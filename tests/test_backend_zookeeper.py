"""The ZooKeeper lock backend against a real ZooKeeper server started for this module."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient  # in the test extra: a missing kazoo is an error here

from django_redlock import LockLost, QuorumError
from django_redlock.backends.zookeeper import ZooKeeperLocks, ZooKeeperUnreachable
from tests.backends import cases, servers
from tests.backends.cases import (  # noqa: F401  (shared cases, run with this module's fixtures)
    test_a_cancelled_async_acquire_leaves_no_lock,
    test_a_holder_learns_of_a_force_release_within_a_second,
    test_a_waiter_that_waits_longer_than_its_ttl_still_excludes,
    test_acquire_waits_until_acquired_unless_retries_bound_it,
    test_async_twin,
    test_auto_renew,
    test_bad_input,
    test_basics,
    test_force_release,
    test_handover,
    test_names,
    test_names_that_a_collation_would_equate_are_distinct_locks,
    test_not_connected_until_used,
    test_waiter_wakes_on_release,
    test_waiters_are_served_in_arrival_order,
)
from tests.helpers import REPO_ROOT, wait_until


@pytest.fixture(scope="module")
def zk_server():
    with servers.zookeeper() as server:
        yield server


@pytest.fixture
def root() -> str:
    return f"/redlock-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make(zk_server, root):
    with cases.managers(
        lambda **options: ZooKeeperLocks(
            zk_server.address, root=root, **{"session_timeout": 4.0, **options}
        )
    ) as make:
        yield make


@pytest.fixture
def make_dead():
    return lambda: ZooKeeperLocks(f"127.0.0.1:{servers.free_port()}", connect_timeout=1.0)


@pytest.fixture
def queue_length():
    return lambda locks, name: len(locks._zk().get_children(locks._dir(name)))


@pytest.fixture
def wake_within() -> float:
    return 0.2


@pytest.fixture
def name() -> str:
    return f"zk/{uuid.uuid4().hex[:8]}"  # a "/" in a name is fine: names are quoted


def spec(zk_server, root, name, **options):
    return {
        "backend": "django_redlock.backends.zookeeper.ZooKeeperLocks",
        "options": {"hosts": zk_server.address, "root": root, **options},
        "name": name,
        "rounds": 15,
    }


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="root"):
        ZooKeeperLocks("127.0.0.1:1", root="relative")
    with pytest.raises(ValueError, match="hosts"):
        ZooKeeperLocks("")


def test_session_loss_is_lock_loss(make, zk_server, name) -> None:
    locks = make()
    events: list[str] = []
    lost = threading.Event()
    locks.listeners.append(lambda e: (events.append(e.kind), e.kind == "lost" and lost.set()))
    lock = locks.lock(name)
    assert lock.acquire(blocking=False) and lock.held
    # Expire the session the ZooKeeper way: another client connects with the same session
    # id and password, then closes it.
    session_id, password = locks.client.client_id
    intruder = KazooClient(zk_server.address, client_id=(session_id, password))
    intruder.start(5)
    intruder.stop()
    intruder.close()
    assert lost.wait(15), events
    assert not lock.held and lock.lost
    with pytest.raises(LockLost):
        lock.release()
    other = make().lock(name)
    assert other.acquire(timeout=10)
    other.release()


def test_session_lock_has_no_lease(make, name) -> None:
    """validity is infinite while connected; extend() only confirms the node."""
    lock = make().lock(name, ttl=1)
    assert lock.acquire(blocking=False)
    assert lock.validity == float("inf") and lock.held
    time.sleep(1.2)  # longer than the ttl: nothing runs out
    assert lock.held and lock.check() and lock.extend(1)
    assert lock.validity == float("inf")
    lock.release()


EDGE_NAMES = [".", "..", "...", ".x", "%2E", "/", "a/../b", "zookeeper", "x" * 512, "\u00fc" * 512]


@pytest.mark.parametrize("edge", EDGE_NAMES, ids=lambda n: repr(n[:12]))
def test_accepts_any_name_but_nul(make, edge) -> None:
    """docs/backends.rst: "Lock names are at most 512 characters (any but NUL, ...)", also the
    names ZooKeeper reads as path steps ("." and "..") or reserves ("zookeeper" at the top)."""
    locks = make()
    lock = locks.lock(edge)
    assert lock.acquire(blocking=False)
    assert locks.locked(edge)
    assert not make().lock(edge).acquire(blocking=False)  # it excludes another holder
    assert [i.name for i in locks.live_locks()] == [edge]  # listed under its own name
    lock.release()
    assert not locks.locked(edge)
    assert make().lock(edge).acquire(blocking=False)


def test_dot_names_are_distinct_locks(make) -> None:
    """The names ".", ".." and the ones their escapes spell are four locks, each listed as
    itself."""
    locks = make()
    names = [".", "..", "%2E", "%2E%2E"]
    held = [locks.lock(n) for n in names]
    assert all(lock.acquire(blocking=False) for lock in held)
    assert sorted(i.name for i in locks.live_locks()) == sorted(names)
    for lock in held:
        lock.release()


def test_lock_nodes_keep_their_names(make, zk_server, root) -> None:
    """Names other than "." and ".." map to the same znode as before (percent-encoded, dots
    kept), so a lock held by an older version's process excludes this one's."""
    locks = make()
    lock = locks.lock("a.b/c d")
    assert lock.acquire(blocking=False)
    client = KazooClient(zk_server.address)
    client.start(10)
    try:
        assert client.get_children(root) == ["a.b%2Fc%20d"]
    finally:
        client.stop()
        client.close()
    lock.release()


def test_contention_across_processes(zk_server, root, name, tmp_path: Path) -> None:
    cases.contention(spec(zk_server, root, name), {}, tmp_path)


@pytest.mark.faults
def test_holder_sigkill_recovered_within_one_session_timeout(make, zk_server, root, name) -> None:
    cases.holder_killed(make, spec(zk_server, root, name, session_timeout=2.0), {}, bound=2.0 + 1.5)


@pytest.mark.django_db
def test_admin_lists_and_force_releases(admin_client, zk_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
        "OPTIONS": {"hosts": zk_server.address, "root": root},
    }
    cases.admin_round_trip(admin_client, entry, name)


@pytest.mark.django_db
def test_admin_node_page_names_the_service_and_its_columns(
    admin_client, zk_server, root, name
) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
        "OPTIONS": {"hosts": zk_server.address, "root": root},
    }
    cases.admin_node_page(
        admin_client,
        entry,
        name,
        heading="ZooKeeper servers",
        columns=["Servers", "Reachable", "Latency", "Locks"],
    )


def test_locked_takes_the_reentrant_and_meta_settings(zk_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
        "OPTIONS": {"hosts": zk_server.address, "root": root},
    }
    cases.settings_round_trip(entry, name)


@pytest.mark.django_db
def test_management_command_round_trip(zk_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
        "OPTIONS": {"hosts": zk_server.address, "root": root},
    }
    cases.cli_round_trip(entry, name)


def outcomes(calls: dict[str, Callable[[], Any]], within: float) -> dict[str, Any]:
    """Run the calls at once, each in its own thread: what each returned or raised. Fails
    naming the calls still blocked ``within`` seconds after the start (their daemon threads
    are left behind)."""
    results: dict[str, Any] = {}

    def run(label: str, call: Callable[[], Any]) -> None:
        try:
            results[label] = call()
        except Exception as exc:
            results[label] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(started + within - time.monotonic(), 0.0))
    blocked = [label for label in calls if label not in results]
    assert not blocked, f"still blocked {within} s after the start: {blocked}"
    return results


@pytest.mark.faults
def test_every_operation_is_bounded_when_zookeeper_is_down(name) -> None:
    """ZooKeeper SIGKILLed while this process holds locks (kazoo's blocking calls then wait
    for ever): every operation answers within connect_timeout (acquire(timeout=t) within
    t + connect_timeout), as a Redlock does with its nodes down: check() is False, health()
    names the outage (system check E105, ``redlock check``), the rest raise the backend's
    "unreachable" error naming the hosts."""
    with servers.zookeeper() as server:
        locks = ZooKeeperLocks(server.address, session_timeout=4.0, connect_timeout=2.0)
        try:
            # A server just started may take longer than connect_timeout to answer its
            # first requests on a loaded machine (JVM warm-up): wait until it answers.
            wait_until(lambda: locks.health()[0].reachable, timeout=60, interval=0.2)
            # One owner for all: each call below runs in a thread of its own.
            held = [locks.lock(f"{name}/{i}", owner="test") for i in range(3)]
            assert all(lock.acquire(blocking=False) for lock in held)
            server.kill()
            results = outcomes(
                {
                    "check": held[0].check,
                    "release": held[1].release,
                    "extend": held[2].extend,
                    "locked": lambda: locks.locked(held[0].name),
                    "lock_info": lambda: locks.lock_info(held[0].name),
                    "live_locks": lambda: list(locks.live_locks()),
                    "force_release": lambda: locks.force_release(held[0].name),
                    "acquire(blocking=False)": lambda: locks.lock(name).acquire(blocking=False),
                    "acquire(timeout=1)": lambda: locks.lock(name).acquire(timeout=1),
                    "health": locks.health,
                },
                within=1 + 2.0 + 3,
            )
        finally:
            started = time.monotonic()
            locks.close()
            closing = time.monotonic() - started
    assert results.pop("check") is False
    [health] = results.pop("health")
    assert not health.reachable and "unreachable" in health.error, health
    for label, outcome in results.items():
        # An acquire is refused as a Redlock's with too few nodes (a view answers 503).
        expected = QuorumError if label.startswith("acquire") else locks.unavailable()
        assert isinstance(outcome, expected), (label, outcome)
        assert "unreachable" in str(outcome) and server.address in str(outcome), (label, outcome)
    assert closing < 2.0 + 3


HOLD_THEN_CHECK = """
import sys
from django_redlock.backends.zookeeper import ZooKeeperLocks

hosts, root, name = sys.argv[1:]
locks = ZooKeeperLocks(hosts, root=root, session_timeout=2.0, connect_timeout=2.0)
lock = locks.lock(name)
assert lock.acquire(blocking=False)
print("acquired", flush=True)
sys.stdin.readline()
try:
    print("check", lock.check(), flush=True)
except Exception as exc:
    print("raised", type(exc).__name__, exc, flush=True)
locks.close()
"""


def test_check_is_false_after_the_session_expired(make, zk_server, root, name) -> None:
    """A holder paused (SIGSTOP) past its session and resumed: its lock node went with the
    session, so check() is False: the first request after the pause fails with
    SessionExpiredError or ConnectionLoss, which must not escape check()."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THEN_CHECK, zk_server.address, root, name],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "acquired\n"
        os.kill(holder.pid, signal.SIGSTOP)
        observer = make()
        # The server expires the paused holder's session and deletes its node.
        wait_until(lambda: not observer.locked(name), timeout=2.0 + 15, interval=0.05)
        holder.stdin.write("check\n")
        holder.stdin.flush()  # read at once on resuming, racing kazoo's reconnection
        os.kill(holder.pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert out == "check False\n"


@contextlib.contextmanager
def proxy_to(server: servers.Server, port: int = 0) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A TCP proxy process (tests/backends/freezable_proxy.py) in front of ``server``, on
    ``port`` (a free one by default): (its port, its process), killed when the block ends."""
    script = Path(servers.__file__).with_name("freezable_proxy.py")
    process = subprocess.Popen(
        [sys.executable, str(script), "127.0.0.1", str(server.port), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline()), process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()


@pytest.mark.parametrize("removed", ["while disconnected", "after the reconnection"])
def test_a_holder_hears_a_force_release_across_a_dropped_connection(
    make, zk_server, root, name, removed
) -> None:
    """The holder's connection drops and comes back with its session (a network blip, a
    server restart), and the lock is force-released and taken by another process, while it
    was away or after it came back: the holder hears it within a second (``held`` False, the
    ``lost`` event), although the connection took its node watch along (it stayed held for
    good)."""
    with proxy_to(zk_server) as (port, proxy):
        locks = ZooKeeperLocks(f"127.0.0.1:{port}", root=root, session_timeout=10.0)
        try:
            heard = threading.Event()
            locks.listeners.append(lambda e: e.kind == "lost" and heard.set())
            lock = locks.lock(name)
            assert lock.acquire(blocking=False) and lock.held
            session = locks.client.client_id
            proxy.kill()
            proxy.wait()
            wait_until(lambda: not lock.held, timeout=10)  # the connection is gone
            other = make()
            if removed == "while disconnected":
                assert other.force_release(name) == 1
                assert other.lock(name).acquire(blocking=False)
            with proxy_to(zk_server, port):
                wait_until(lambda: locks.client.connected, timeout=15)
                assert locks.client.client_id == session  # the same session: the node lived
                if removed == "after the reconnection":
                    wait_until(lambda: lock.held, timeout=5)
                    assert other.force_release(name) == 1
                    assert other.lock(name).acquire(blocking=False)
                since = time.monotonic()
                assert heard.wait(10), "the holder was not told"
                told = time.monotonic() - since
                assert not lock.held and lock.lost
                assert told < 1.0, f"the holder learnt it after {told:.2f} s"
                with pytest.raises(LockLost):
                    lock.release()
        finally:
            locks.close()


@pytest.mark.faults
def test_a_new_manager_is_bounded_when_zookeeper_is_frozen(name) -> None:
    """A manager with no session yet (a new worker process, ``manage.py``) whose ZooKeeper is
    frozen: each call answers within connect_timeout (acquire(timeout=t) within
    t + connect_timeout), naming the outage, as with a session already open (kazoo's own
    start() waited as long again to stop its connection attempt: 2 x connect_timeout)."""
    timeout = 2.0
    calls: dict[str, tuple[Callable[[ZooKeeperLocks], Any], float]] = {
        "health": (lambda locks: locks.health()[0].reachable, timeout),
        "acquire(timeout=1)": (lambda locks: locks.lock(name).acquire(timeout=1), 1 + timeout),
        "acquire(blocking=False)": (
            lambda locks: locks.lock(name).acquire(blocking=False),
            timeout,
        ),
        "locked": (lambda locks: locks.locked(name), timeout),
    }
    with servers.zookeeper() as server:
        for label, (call, bound) in calls.items():
            locks = ZooKeeperLocks(server.address, connect_timeout=timeout)
            try:
                with servers.frozen(server):
                    started = time.monotonic()
                    try:
                        outcome = call(locks)
                    except Exception as exc:
                        outcome = exc
                    took = time.monotonic() - started
                    assert took < bound + 0.5, (label, took, outcome)
                    if label == "health":
                        assert outcome is False, (label, outcome)
                    else:
                        expected = (
                            QuorumError if label.startswith("acquire") else locks.unavailable()
                        )
                        assert isinstance(outcome, expected), (label, outcome)
                        assert f"no answer within {timeout:g} s" in str(outcome), (label, outcome)
                # Thawed, the same manager connects and answers.
                wait_until(lambda locks=locks: locks.health()[0].reachable, timeout=30)
            finally:
                locks.close()
        # The connection attempt a frozen server holds up is not left for close() to wait out.
        locks = ZooKeeperLocks(server.address, connect_timeout=timeout)
        with servers.frozen(server):
            with pytest.raises(ZooKeeperUnreachable):
                locks.locked(name)
            started = time.monotonic()
            locks.close()
            assert time.monotonic() - started < 0.5
        assert not locks.locked(name)  # and the manager serves again on its next call
        locks.close()
