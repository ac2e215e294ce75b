"""The etcd lock backend against a real etcd server started for this module."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from django_redlock import QuorumError
from django_redlock.backends.etcd import EtcdError, EtcdLocks, EtcdServerError
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
    test_expiry_and_loss,
    test_force_release,
    test_handover,
    test_names,
    test_names_that_a_collation_would_equate_are_distinct_locks,
    test_not_connected_until_used,
    test_waiter_wakes_on_release,
    test_waiters_are_served_in_arrival_order,
)
from tests.backends.refusing_proxy import RefusingProxy
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def etcd_server():
    with servers.etcd() as server:
        yield server


@pytest.fixture
def root() -> str:
    return f"/redlock-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make(etcd_server, root):
    with cases.managers(
        lambda **options: EtcdLocks([etcd_server.address], root=root, **options)
    ) as make:
        yield make


@pytest.fixture
def make_dead():
    return lambda: EtcdLocks(f"http://127.0.0.1:{servers.free_port()}", request_timeout=1.0)


@pytest.fixture
def queue_length():
    return lambda locks, name: int(locks._range(locks._prefix(name), count_only=True)["count"])


@pytest.fixture
def wake_within() -> float:
    return 0.2


@pytest.fixture
def name() -> str:
    return f"etcd/{uuid.uuid4().hex[:8]}"


def spec(etcd_server, root, name):
    return {
        "backend": "django_redlock.backends.etcd.EtcdLocks",
        "options": {"endpoints": [etcd_server.address], "root": root},
        "name": name,
        "rounds": 15,
    }


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        EtcdLocks(["127.0.0.1:2379"])
    with pytest.raises(ValueError, match="root"):
        EtcdLocks("http://127.0.0.1:2379", root="locks/")


def test_unreachable_is_a_clear_error(name) -> None:
    locks = EtcdLocks(f"http://127.0.0.1:{servers.free_port()}", request_timeout=1)
    with pytest.raises(QuorumError, match="unreachable") as refused:  # a 503 in a view
        locks.lock(name).acquire(blocking=False)
    assert isinstance(refused.value.__cause__, EtcdError)
    assert not locks.health()[0].reachable


def test_contention_across_processes(etcd_server, root, name, tmp_path: Path) -> None:
    cases.contention(spec(etcd_server, root, name), {}, tmp_path)


@pytest.mark.faults
def test_holder_sigkill_recovered_within_one_lease(make, etcd_server, root, name) -> None:
    # etcd's shortest lease is about 2 s (1.5 x the election timeout, rounded up).
    cases.holder_killed(make, {**spec(etcd_server, root, name), "ttl": 2.0}, {}, bound=2.0 + 1.5)


@pytest.mark.django_db
def test_admin_lists_and_force_releases(admin_client, etcd_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
        "OPTIONS": {"endpoints": [etcd_server.address], "root": root},
    }
    cases.admin_round_trip(admin_client, entry, name)


@pytest.mark.django_db
def test_admin_node_page_names_the_service_and_its_columns(
    admin_client, etcd_server, root, name
) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
        "OPTIONS": {"endpoints": [etcd_server.address], "root": root},
    }
    cases.admin_node_page(
        admin_client,
        entry,
        name,
        heading="etcd endpoints",
        columns=["Endpoint", "Reachable", "Latency", "Software"],
    )


def test_locked_takes_the_reentrant_and_meta_settings(etcd_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
        "OPTIONS": {"endpoints": [etcd_server.address], "root": root},
    }
    cases.settings_round_trip(entry, name)


@pytest.mark.django_db
def test_management_command_round_trip(etcd_server, root, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
        "OPTIONS": {"endpoints": [etcd_server.address], "root": root},
    }
    cases.cli_round_trip(entry, name)


def test_auto_renew_outlives_the_servers_shortest_lease(make, name) -> None:
    """etcd grants at least its minimum lease (about 2 s), so only a keepalive keeps a 2 s
    lock alive for 5 s; without auto_renew the same lock is gone by then."""
    locks = make()
    renewed = locks.lock(name, ttl=2, auto_renew=True)
    plain = locks.lock(f"{name}-plain", ttl=2)
    assert renewed.acquire(blocking=False) and plain.acquire(blocking=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert renewed.held
        time.sleep(0.2)
    assert renewed.check() and locks.locked(name)
    assert not plain.check() and not locks.locked(plain.name)
    renewed.release()


def test_check_is_false_when_etcd_is_down(name) -> None:
    """etcd gone while locks are held: check() is False (not known to be ours, as a Redlock's
    check() with its nodes down) instead of raising EtcdError; health() names the outage;
    acquire and release raise QuorumError from the "unreachable" error, the other operations
    that error itself, which unavailable() lists; each answers within request_timeout
    (acquire(timeout=t) within t + request_timeout)."""

    def timed(call: Callable[[], Any]) -> tuple[Any, float]:
        started = time.monotonic()
        try:
            outcome = call()
        except Exception as exc:
            outcome = exc
        return outcome, time.monotonic() - started

    with servers.etcd() as server:
        locks = EtcdLocks(server.address, request_timeout=1.0)
        try:
            held = [locks.lock(f"{name}/{i}", ttl=30) for i in range(2)]
            assert all(lock.acquire(blocking=False) for lock in held)
            server.kill()
            results = {
                label: timed(call)
                for label, call in {
                    "check": held[0].check,
                    "health": locks.health,
                    "release": held[1].release,
                    "locked": lambda: locks.locked(name),
                    "acquire(blocking=False)": lambda: locks.lock(name).acquire(blocking=False),
                    "acquire(timeout=1)": lambda: locks.lock(name).acquire(timeout=1),
                }.items()
            }
        finally:
            locks.close()
    slow = {label: seconds for label, (_, seconds) in results.items() if seconds > 1 + 1.0 + 3}
    assert not slow, slow
    assert results.pop("check")[0] is False
    [health] = results.pop("health")[0]
    assert not health.reachable and health.error, health
    for label, (outcome, _) in results.items():
        assert "unreachable" in str(outcome), (label, outcome)
        if label.startswith(("acquire", "release")):  # as a Redlock's with too few nodes: a 503
            assert isinstance(outcome, QuorumError), (label, outcome)
            outcome = outcome.__cause__
        assert isinstance(outcome, EtcdError), (label, outcome)
        assert isinstance(outcome, locks.unavailable()), (label, outcome)


def test_an_etcd_protocol_error_is_not_unavailable(make) -> None:
    """Only "could not reach etcd" is unavailable(): an error etcd answered with means
    something else, and check() must not hide it as "not ours"."""
    locks = make()
    with pytest.raises(EtcdError, match="HTTP 400") as raised:
        locks.gateway.post("/v3/kv/range", {"key": "not base64!"})
    assert not isinstance(raised.value, locks.unavailable())


def test_extend_rearms_the_lease_for_the_new_ttl(make, name) -> None:
    """extend(10) on a 3 s lock holds it for 10 s (it answered True and kept the 3 s lease, so
    another client took the lock at 3 s): at 4 to 6 s nobody else can take it, the fence is
    the same, and the service lists the 10 s lease."""
    locks = make()
    lock = locks.lock(name, ttl=3, fencing=True)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    assert lock.extend(10)
    extended = time.monotonic()
    assert lock.validity > 9
    other = make().lock(name, ttl=3)
    time.sleep(max(extended + 4 - time.monotonic(), 0))  # past the old 3 s lease
    assert not other.acquire(timeout=max(extended + 6 - time.monotonic(), 0.1))
    assert lock.held and lock.check() and lock.fence == fence
    info = make().lock_info(name)
    assert info.token == lock.token and info.fence == fence and info.lease == 10
    assert lock.extend(3)  # shorter works the same way
    assert make().lock_info(name).lease == 3
    lock.release()
    assert not make().locked(name)


def test_extend_token_rearms_the_lease_for_the_new_ttl(make, name) -> None:
    """The same through extend_token (a lock handed to another process)."""
    lock = make().lock(name, ttl=3)
    assert lock.acquire(blocking=False)
    token = lock.detach()
    worker = make()
    assert worker.extend_token(name, token, 10)
    extended = time.monotonic()
    other = make().lock(name, ttl=3)
    time.sleep(max(extended + 4 - time.monotonic(), 0))
    assert not other.acquire(timeout=max(extended + 6 - time.monotonic(), 0.1))
    info = worker.lock_info(name)
    assert info.token == token and info.lease == 10
    assert worker.release_token(name, token) == 1
    assert not worker.extend_token(name, token, 10)  # gone: False, and no lease is left over
    assert not worker.locked(name)


def test_auto_renewal_keeps_the_extended_ttl(make, name) -> None:
    """After extend(8), renewal goes on with 8 s leases (as the Redlock's does), rather than
    moving the key back to its first 2 s lease at the next keepalive."""
    locks = make()
    lock = locks.lock(name, ttl=2, auto_renew=True)
    assert lock.acquire(blocking=False)
    assert lock.extend(8)
    time.sleep(3)  # past several renewal periods of the 2 s lease
    assert lock.held and make().lock_info(name).lease == 8
    lock.release()


def test_a_grant_that_took_longer_than_its_ttl_is_refused(make, etcd_server, name) -> None:
    """etcd paused for longer than the lock's ttl while it grants the lock: the grant comes
    back with no validity left, so it is given back and not returned (as the Redlock refuses
    a lease whose validity ran out while the nodes answered); a caller that waits gets a
    fresh grant once the service answers in time."""
    locks = make()
    warm = locks.lock(f"{name}-warm", ttl=5)
    assert warm.acquire(blocking=False)  # connections open, server warm
    warm.release()

    def paused_acquire(**options: Any) -> tuple[Any, Any]:
        lock = locks.lock(name, ttl=1, owner="test")
        result: list[bool] = []
        os.kill(etcd_server.process.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=lambda: result.append(lock.acquire(**options)))
            thread.start()
            time.sleep(1.5)  # longer than the ttl: whatever it is granted has run out
        finally:
            os.kill(etcd_server.process.pid, signal.SIGCONT)
        thread.join(30)
        return result, lock

    result, lock = paused_acquire(blocking=False)
    assert result == [False] and not lock.held
    assert not make().locked(name)  # given back, not left to its lease
    result, lock = paused_acquire(timeout=10)
    assert result == [True] and lock.held and lock.validity > 0 and lock.check()
    lock.release()


def _calls(locks: EtcdLocks, name: str) -> dict[str, tuple[Callable[[], Any], Any]]:
    """One call of each kind a manager or its handle makes to etcd on ``name``, with what it
    answers while etcd serves (``...``: any answer)."""

    def acquire() -> bool:
        lock = locks.lock(f"{name}/taken", ttl=5)
        taken = lock.acquire(blocking=False)
        lock.release()
        return taken

    def check() -> bool:
        lock = locks.lock(f"{name}/checked", ttl=5)
        assert lock.acquire(blocking=False)
        try:
            return lock.check()
        finally:
            lock.release()

    return {
        "health": (lambda: [node.reachable for node in locks.health()], [True]),
        "locked": (lambda: locks.locked(name), False),
        "lock_info": (lambda: locks.lock_info(name), None),
        "live_locks": (lambda: [info.name for info in locks.live_locks()], ...),
        "force_release": (lambda: locks.force_release(name), 0),
        "acquire": (acquire, True),
        "check": (check, True),
    }


_KINDS = ["health", "locked", "lock_info", "live_locks", "force_release", "acquire", "check"]


@pytest.mark.parametrize(
    ("timed_out", "first"),
    [(kind, "health") for kind in [*_KINDS, "extend", "release"]]
    + [("health", kind) for kind in _KINDS if kind != "health"],
)
def test_a_call_after_a_timed_out_one_works_once_etcd_answers(
    etcd_server, root, name, timed_out, first
) -> None:
    """A call that timed out on a frozen etcd leaves no half-used connection behind: once
    etcd answers again, every kind of call of the same manager and thread works, the first
    one too (it raised "Request-sent" when the timed-out request's connection was reused).
    Each kind times out once, and each kind is once the first call after a freeze."""
    locks = EtcdLocks([etcd_server.address], root=root, request_timeout=1.0)
    try:
        calls = _calls(locks, name)
        if timed_out in ("extend", "release"):
            lock = locks.lock(f"{name}/{timed_out}", ttl=30)
            assert lock.acquire(blocking=False)
            call = getattr(lock, timed_out)
        else:
            call = calls[timed_out][0]
        with servers.frozen(etcd_server), contextlib.suppress(EtcdError, QuorumError):
            outcome = call()
            # The calls that do not raise tell the outage in their answer.
            assert outcome in ([False], False), outcome
        # A loaded host may take a while to serve the requests queued during the freeze: the
        # calls after it are not about speed.
        locks.gateway.timeout = 30.0
        for kind in [first, *(kind for kind in calls if kind != first)]:
            follow, expected = calls[kind]
            outcome = follow()
            assert expected is ... or outcome == expected, (kind, outcome)
    finally:
        locks.close()


def test_the_loss_watch_hears_a_force_release_after_etcd_froze(
    etcd_server, make, name, monkeypatch
) -> None:
    """The holder's loss watch lives through a freeze longer than its stream's idle timeout
    (the stream ends, and its reopening meets a silent etcd): once etcd answers, the holder
    hears a force release."""
    monkeypatch.setattr("django_redlock.backends.etcd.WATCH_IDLE", 1.0)
    locks = make(request_timeout=1.0)
    heard = threading.Event()
    locks.listeners.append(lambda e: e.kind == "lost" and heard.set())
    lock = locks.lock(name, ttl=30)
    assert lock.acquire(blocking=False)
    with servers.frozen(etcd_server):
        time.sleep(2.5)  # the freeze itself: past the idle timeout and a reopening's timeout
    assert lock.held  # a freeze is not a loss
    assert make().force_release(name) == 1
    assert heard.wait(30), "the holder was not told of the force release after the freeze"
    assert not lock.held and lock.lost


def _queued_lease(locks: EtcdLocks, name: str, place: int) -> str:
    """The lease of the key at ``place`` (0: the holder) in the line of ``name``."""
    kvs = locks._range(locks._prefix(name), sort_order="ASCEND", sort_target="CREATE")["kvs"]
    return str(kvs[place]["lease"])


def _waiting(locks: EtcdLocks, name: str, **options: Any) -> tuple[threading.Thread, list[Any]]:
    """A waiter's ``acquire(**options)`` on a thread of its own, once its key is in the line
    behind the holder's: the thread and what the acquire answered or raised."""
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(locks.lock(name, ttl=30).acquire(**options))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: int(locks._range(locks._prefix(name), count_only=True)["count"]) == 2)
    return thread, outcome


def test_a_waiter_whose_own_lease_is_gone_gives_up_with_false(make, name) -> None:
    """A waiter's lease ran out while it waited (etcd froze for longer than its ttl): at its
    timeout it withdraws from the line by revoking that lease, which etcd no longer has. That
    is nothing to clean up: the acquire answers False. It raised EtcdError (a RuntimeError,
    not the documented QuorumError: a view answered 500) 'etcd /v3/lease/revoke: HTTP 404:
    etcdserver: requested lease not found'."""
    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    thread, outcome = _waiting(make(), name, timeout=1.5)
    locks.gateway.post("/v3/lease/revoke", {"ID": _queued_lease(locks, name, 1)})
    thread.join(30)
    assert outcome == [False]
    assert holder.check()
    holder.release()
    assert not locks.locked(name)


def test_a_waiter_whose_withdrawal_fails_raises_quorum_error(make, name, monkeypatch) -> None:
    """Any other failure of the waiter's withdrawal is the documented error of a service that
    cannot answer: QuorumError naming etcd and the reason (a view answers 503)."""
    from django_redlock.backends import etcd

    def refused(self: Any, endpoint: str, path: str, body: Any, timeout: float) -> Any:
        if path == "/v3/lease/revoke":
            raise EtcdError(f"etcd {path}: HTTP 503: etcdserver: no leader")
        return post(self, endpoint, path, body, timeout)

    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    post = etcd._Gateway._post
    monkeypatch.setattr(etcd._Gateway, "_post", refused)
    thread, outcome = _waiting(make(), name, timeout=1.0)
    thread.join(30)
    [error] = outcome
    assert isinstance(error, QuorumError), error
    assert "etcd" in str(error) and "no leader" in str(error), error
    monkeypatch.undo()
    holder.release()


def test_a_waiter_while_etcd_froze_gets_a_documented_answer(etcd_server, make, name) -> None:
    """The outside tester's run: a waiter's acquire(timeout=1) while etcd froze for 4 s, past
    both leases (ttl 3), answers True, False or QuorumError; it raised EtcdError in 4 of 5
    rounds."""
    locks = make()
    holder = locks.lock(name, ttl=3)
    assert holder.acquire(blocking=False)
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(make().lock(name, ttl=3).acquire(timeout=1))
        except QuorumError as exc:
            outcome.append(exc)
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    with servers.frozen(etcd_server):
        time.sleep(4)
    thread.join(30)
    [answer] = outcome
    assert answer in (True, False) or isinstance(answer, QuorumError), answer


#: How etcd's gateway answers when the cluster cannot serve a request (gRPC Unavailable and
#: Unknown), and how a load balancer in front of it answers when etcd is gone.
REFUSALS = {
    "503-no-leader": (
        503,
        '{"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"}',
    ),
    "500-timed-out": (
        500,
        '{"error":"etcdserver: request timed out","code":2,'
        '"message":"etcdserver: request timed out"}',
    ),
    "502-from-a-balancer": (502, "<html><body><h1>502 Bad Gateway</h1></body></html>\n"),
}

#: Each request an operation sends, in the order it sends them.
STEPS = [
    ("acquire", "/v3/lease/grant"),
    ("acquire", "/v3/kv/txn"),
    ("acquire", "/v3/kv/range"),
    ("release", "/v3/kv/txn"),
    ("extend", "/v3/kv/range"),
    ("extend", "/v3/lease/keepalive"),
    ("extend(20)", "/v3/lease/grant"),
    ("extend(20)", "/v3/kv/txn"),
]


@pytest.fixture
def proxy(etcd_server):
    server = RefusingProxy(etcd_server.address)
    yield server
    server.close()


@pytest.fixture
def through(proxy, root):
    """A manager that talks to etcd through the proxy."""
    locks = EtcdLocks([proxy.address], root=root)
    yield locks
    locks.close()


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize(("call", "path"), STEPS)
def test_an_etcd_5xx_answer_is_a_quorum_error(
    proxy, through, make, name, call, path, refusal
) -> None:
    """etcd (or a balancer in front of it) answering 5xx to any request of acquire, release
    or extend is the Redlock's "could not get a verdict": QuorumError naming the lock and the
    answer (a view answers 503, a LockedTask treats it as unavailable lock nodes). It raised
    a bare EtcdError (a RuntimeError, so a 500 in a view), or for a balancer's HTML page a
    JSONDecodeError. A refused acquire leaves nothing in etcd; a refused release or extend
    leaves the lock held by its token, and the manager works once etcd answers again."""
    status, body = REFUSALS[refusal]
    direct = make()
    lock = through.lock(name, ttl=30)
    if call != "acquire":
        assert lock.acquire(blocking=False)
    token = lock.token
    operations = {
        "acquire": lambda: lock.acquire(blocking=False),
        "release": lock.release,
        "extend": lock.extend,
        "extend(20)": lambda: lock.extend(20),
    }
    with proxy.refusing(path, status, body), pytest.raises(QuorumError) as refused:
        operations[call]()
    assert proxy.refused.get(path), f"{call} sent no {path}"
    assert refused.value.name == name and f"HTTP {status}" in str(refused.value), refused.value
    assert isinstance(refused.value.__cause__, through.unavailable()), refused.value.__cause__
    if call == "acquire":
        assert not lock.held and not direct.locked(name)  # no key of the waiter is left
    else:
        assert direct.lock_info(name).token == token
    if call.startswith("extend"):
        assert lock.held and lock.extend() and lock.check()
        lock.release()
    else:
        direct.force_release(name)
    again = through.lock(name, ttl=30)
    assert again.acquire(blocking=False)
    again.release()
    assert not direct.locked(name)


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_check_is_false_while_etcd_answers_5xx(proxy, through, name, refusal) -> None:
    """Not known to be ours, as with etcd unreachable; not lost either. health() shows the
    endpoint unreachable, and the other calls raise EtcdServerError."""
    lock = through.lock(name, ttl=30)
    assert lock.acquire(blocking=False)
    status, body = REFUSALS[refusal]
    with proxy.refusing("/v3/kv/range", status, body):
        assert lock.check() is False
        with pytest.raises(EtcdServerError, match=f"HTTP {status}") as raised:
            through.locked(name)
        assert raised.value.status == status
    with proxy.refusing("/v3/maintenance/status", status, body):
        [health] = through.health()
    assert not health.reachable and f"HTTP {status}" in health.error
    assert lock.held and lock.check()
    lock.release()


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_waiter_whose_watch_is_refused_raises_quorum_error(
    proxy, through, make, queue_length, name, refusal
) -> None:
    """A waiter cannot wait for the holder's key when etcd refuses its watch: QuorumError
    (it re-sent the watch in a loop until its timeout and answered False; a balancer's page
    raised JSONDecodeError), and its key leaves the line."""
    direct = make()
    holder = direct.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    with proxy.refusing("/v3/watch", *REFUSALS[refusal]), pytest.raises(QuorumError) as refused:
        through.lock(name, ttl=30).acquire(timeout=5)
    assert "/v3/watch" in str(refused.value), refused.value
    assert queue_length(direct, name) == 1
    holder.release()
