"""The database backend against one database, run by tests/test_backend_database.py in a
subprocess per database (SQLite file, PostgreSQL, MariaDB) with tests/backends/db_settings.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

from django_redlock import QuorumError
from django_redlock.backends.database import DatabaseLocks
from testproject.models import Account
from tests.backends import cases, databases
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
    test_waiter_wakes_on_release,
)
from tests.helpers import wait_until

# Committed rows are what the lock connections see, hence transaction=True; the flush after each
# case is limited to the lock table and the project's models (flushing every installed app's
# tables took about a second per case on PostgreSQL and MariaDB).
pytestmark = pytest.mark.django_db(
    transaction=True, available_apps=["django_redlock", "testproject"]
)


@pytest.fixture(scope="session", autouse=True)
def _test_database_reaped() -> Any:
    """Sweep the test databases of dead runs, and have a reaper drop this run's if this
    process dies before pytest-django's teardown (pytest-timeout's os._exit, SIGKILL);
    after the run, drop it in case that teardown could not (a session still connected)."""
    from django.conf import settings

    kind = os.environ.get("REDLOCK_BACKEND_DB", "sqlite")
    if kind == "sqlite":  # a file in the run's temporary directory
        yield
        return
    name = settings.DATABASES["default"]["TEST"]["NAME"]
    databases.sweep(kind)
    reaper = databases.reap_on_exit(kind, name)
    try:
        yield
    finally:
        try:
            databases.drop(kind, name)
        finally:
            reaper.done()


PESSIMISTIC = connection.vendor != "sqlite"
#: The cases that drop a lock's connection from the server side (SQLite has no server).
server_only = pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has no server")


@pytest.fixture
def make():
    with cases.managers(lambda **options: DatabaseLocks("default", **options)) as make:
        yield make


@pytest.fixture
def wake_within() -> float:
    # PostgreSQL: NOTIFY wakes the waiter; elsewhere the backoff is capped at max_poll (0.2 s),
    # and the waiter's next poll is a thread's wake-up and a round trip to a server that a
    # loaded host schedules late too (1.02 s once beside four other test runs; a NOTIFY's
    # wake-up 0.22 s once in a full suite): well before the holder's 30 s lease, which is what
    # waking on release means. That it is the NOTIFY is the next test's.
    return 1.5


@pytest.fixture
def name() -> str:
    return f"db:{uuid.uuid4().hex[:8]}"


def child_spec(name: str, **options: Any) -> tuple[dict[str, Any], dict[str, str]]:
    spec = {
        "backend": "django_redlock.backends.database.DatabaseLocks",
        "options": {"using": "default", **options},
        "django": True,
        "name": name,
        "rounds": 15,
    }
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.backends.db_settings",
        "REDLOCK_BACKEND_DB_NAME": connection.settings_dict["NAME"],
    }
    return spec, env


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="names no database"):
        DatabaseLocks("nope")
    with pytest.raises(ValueError, match="request_timeout"):
        DatabaseLocks("default", request_timeout=0)


def test_contention_across_processes(name, tmp_path: Path) -> None:
    spec, env = child_spec(name)
    cases.contention(spec, env, tmp_path)


def test_holder_sigkill_recovered_within_one_lease(make, name) -> None:
    spec, env = child_spec(name)
    # A lease after the kill at most, plus what a loaded host adds to opening a manager's
    # connection and waking the waiter (3.1 s of a 3 s bound was seen on MariaDB under load).
    cases.holder_killed(make, {**spec, "ttl": 2.0}, env, bound=2.0 + 2.0)


def test_lock_has_its_own_connection(make, name) -> None:
    """The caller's atomic() block neither commits nor rolls back a lock."""
    locks = make()
    with pytest.raises(RuntimeError), transaction.atomic():
        if connection.vendor != "sqlite":  # SQLite has one writer: write after locking there
            Account.objects.create(name="before")
        first = locks.lock(name, ttl=5)
        assert first.acquire(blocking=False)
        first.release()  # commits only the lock's own statements
        second = locks.lock(name, ttl=5)
        assert second.acquire(blocking=False)
        Account.objects.create(name="inside")
        raise RuntimeError("roll the caller back")
    assert not Account.objects.filter(name__in=["before", "inside"]).exists()
    info = make().lock_info(name)  # the lock taken inside the rolled-back block stands
    assert info is not None and info.token == second.token
    second.release()


def test_fence_counter_survives_force_release(make, name) -> None:
    locks = make()
    fences = []
    for _ in range(3):
        lock = locks.lock(name, fencing=True)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        assert locks.force_release(name) == 1
    assert fences == sorted(set(fences))


def test_expiry_is_read_from_the_database_clock(make, name) -> None:
    locks = make()
    lock = locks.lock(name, ttl=3)
    assert lock.acquire(blocking=False)
    info = locks.lock_info(name)
    assert 2.0 < info.ttl <= 3.0 and info.lease == 3.0
    assert abs(locks.health()[0].clock_offset) < 5
    lock.release()


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_holder_sigkill_frees_at_once(make, name) -> None:
    """The dead holder's connection ends its transaction: free long before its 30 s lease."""
    spec, env = child_spec(name, pessimistic=True)
    cases.holder_killed(lambda: make(pessimistic=True), {**spec, "ttl": 30.0}, env, bound=5.0)


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_wait_honours_a_fraction_of_a_second(make, name) -> None:
    """A blocked pessimistic acquire gives up at its timeout, not at the next whole second
    (MariaDB's innodb_lock_wait_timeout counts whole seconds; MySQL's does, too)."""
    locks = make(pessimistic=True)
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    whole_seconds = connection.vendor == "mysql" and not connection.mysql_is_mariadb
    try:
        for timeout in (0.2, 0.6):
            expected = 1.0 if whole_seconds else timeout
            # Every attempt waits its timeout at least. A loaded host adds to any one attempt
            # (0.62 s for 0.2 s beside two CPU burners), while a wait rounded up to the next
            # whole second takes 1 s every time: the fastest of up to three is compared.
            waits: list[float] = []
            while len(waits) < 3 and (not waits or min(waits) >= expected + 0.3):
                start = time.monotonic()
                assert not locks.lock(name, ttl=5).acquire(timeout=timeout)
                waits.append(time.monotonic() - start)
                assert waits[-1] >= expected, (timeout, waits)
            assert min(waits) < expected + 0.3, (timeout, waits)
    finally:
        holder.release()


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_contention(name, tmp_path: Path) -> None:
    spec, env = child_spec(name, pessimistic=True)
    cases.contention(spec, env, tmp_path)


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_basics(make, name) -> None:
    cases.test_basics(lambda: make(pessimistic=True), name)
    locks = make(pessimistic=True)
    for _ in range(20):  # a release frees the row at once: the next try-lock never fails
        lock = locks.lock(name, ttl=5)
        assert lock.acquire(blocking=False)
        lock.release()


def test_pessimistic_refused_on_sqlite() -> None:
    if connection.vendor == "sqlite":
        with pytest.raises(ValueError, match="pessimistic"):
            DatabaseLocks("default", pessimistic=True)
    else:
        assert DatabaseLocks("default", pessimistic=True).pessimistic
    assert os.environ.get("REDLOCK_BACKEND_DB")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's")
def test_postgres_waiter_is_woken_by_notify_not_polling(make, name) -> None:
    # With polling every 5 s at most, only the NOTIFY can wake the waiter this soon (room for
    # a loaded host: 0.22 s once in a full suite).
    cases.test_waiter_wakes_on_release(lambda: make(max_poll=5.0), name, wake_within=0.5)


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_cut_connection_is_a_lost_lock(make, name) -> None:
    """The row lock is the lock: when its connection is cut, the next waiter gets it and the
    old holder finds out at check() and release()."""
    from django_redlock import LockLost

    holder = make(pessimistic=True).lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    kill(holder._lease.state.wrapper, wait=False)  # the holder's FOR UPDATE connection
    waiter = make(pessimistic=True).lock(name, ttl=30)
    assert waiter.acquire(timeout=10)
    assert not holder.check()
    with pytest.raises(LockLost):
        holder.release()
    assert waiter.check()
    waiter.release()


# -- dropped connections (pgbouncer, idle timeouts, failovers) ----------------------------------


def server_id(wrapper: Any) -> int:
    """The server's id of a lock connection: its backend pid, or its MariaDB/MySQL id."""
    raw = wrapper.connection
    return raw.info.backend_pid if connection.vendor == "postgresql" else raw.thread_id()


def dropped_by_the_server(wrapper: Any, sid: int) -> bool:
    """The server lists the connection no more, and the close has reached its client socket."""
    listed = (
        "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        if connection.vendor == "postgresql"
        else "SELECT 1 FROM information_schema.processlist WHERE id = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(listed, [sid])
        if cursor.fetchall():
            return False
    raw = wrapper.connection
    sock = raw if connection.vendor == "postgresql" else raw._sock  # psycopg / PyMySQL
    return bool(select.select([sock.fileno()], [], [], 0)[0])


def kill(wrapper: Any, *, wait: bool = True) -> None:
    """Drop a lock connection from the server side, from the test's own connection
    (pg_terminate_backend / KILL), as an idle timeout or a failover does; ``wait``: until
    the drop is complete, so that the next statement finds the connection dropped while idle."""
    sid = server_id(wrapper)
    if connection.vendor == "postgresql":
        statement, params = "SELECT pg_terminate_backend(%s)", [sid]
    else:
        statement, params = f"KILL {int(sid)}", []
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
    if wait:
        wait_until(lambda: dropped_by_the_server(wrapper, sid))


class LosesTheReply:
    """A driver cursor whose first statement containing ``needle`` runs on the server and
    commits, after which its connection is killed before the reply is read: to the caller,
    a reply lost in the network (the statement may have run)."""

    def __init__(self, cursor: Any, wrapper: Any, needle: str, fired: list[str]) -> None:
        self._cursor, self._wrapper, self._needle, self._fired = cursor, wrapper, needle, fired

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._cursor, attribute)

    def execute(self, sql: str, params: Any = None) -> Any:
        result = self._cursor.execute(sql, params)
        if not self._fired and self._needle in sql.upper():
            self._fired.append(sql)
            kill(self._wrapper)
            self._cursor.execute("SELECT 1")  # raises: the connection is gone
        return result


def lose_a_reply(locks: DatabaseLocks, needle: str) -> list[str]:
    """Make this thread's lock connection lose the reply of its next statement containing
    ``needle``; the list gets the statement once it ran."""
    wrapper = locks._connection()
    create, fired = wrapper.create_cursor, []

    def create_cursor(name: Any = None) -> Any:
        return LosesTheReply(create(name), wrapper, needle, fired)

    wrapper.create_cursor = create_cursor
    return fired


def cut_off(wrapper: Any) -> None:
    """The database goes away for a lock connection: it is dropped by the server, and every
    reconnection is refused (its settings now name a port nobody listens on)."""
    from tests.backends.servers import free_port

    wrapper.settings_dict["PORT"] = free_port()
    kill(wrapper)


@server_only
@pytest.mark.parametrize("pessimistic", [False, True], ids=["plain", "pessimistic"])
def test_release_with_the_database_unreachable_names_it(make, name, pessimistic) -> None:
    """release() and extend() when the database cannot be reached raise the package's
    QuorumError naming the lock, the database alias and the cause (release raised a raw
    OperationalError after a kill -9 of the server), and change nothing on the service."""
    from django.db import OperationalError

    locks = make(pessimistic=pessimistic)
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    token = holder.token
    cut_off(locks._connection())
    for call, verb in ((holder.extend, "extend"), (holder.release, "release")):
        with pytest.raises(QuorumError) as refused:
            call()
        message = str(refused.value)
        assert f"lock {name!r}" in message and f"database 'default' could not {verb}" in message
        assert f"{connection.vendor}:default:" in message  # the cause, under the node's name
        assert isinstance(refused.value.__cause__, OperationalError)
    assert not holder.held
    observer = make()
    info = observer.lock_info(name)  # still held by its token, until its lease ends
    assert info is not None and info.token == token
    assert observer.force_release(name) == 1


@server_only
def test_a_dropped_idle_connection_is_replaced(make, name) -> None:
    """Every kind of call made after the server dropped the lock's idle connection goes
    through on a new connection (it raised OperationalError, and only the call after it
    worked)."""
    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    other = f"{name}:other"
    calls = {
        "check": holder.check,
        "locked": lambda: locks.locked(name),
        "extend": lambda: holder.extend(30),
        "lock_info": lambda: locks.lock_info(name).token == holder.token,
        "acquire": lambda: locks.lock(other, ttl=5).acquire(blocking=False),
        "force_release": lambda: locks.force_release(other) == 1,
        "acquire, fencing": lambda: locks.lock(other, ttl=5, fencing=True).acquire(False),
        "force_release, token": lambda: locks.release_token(other, locks.lock_info(other).token),
        "health": lambda: locks.health()[0].reachable,
    }
    for what, call in calls.items():
        kill(locks._connection())
        assert call(), what
    assert holder.held and not make().locked(other)
    holder.release()


@server_only
@pytest.mark.parametrize("wait", [True, False], ids=["dropped-while-idle", "dropping"])
def test_release_after_the_connection_dropped_frees_the_lock(make, name, wait) -> None:
    """It raised OperationalError and left the lock held until its 30 s lease ended.
    Not waiting for the drop to complete: the DELETE may meet the connection as it dies."""
    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    kill(locks._connection(), wait=wait)
    holder.release()
    assert not holder.held
    assert not make().locked(name)


@server_only
@pytest.mark.parametrize("fencing", [False, True], ids=["plain", "fencing"])
def test_a_take_whose_reply_was_lost_is_granted_once_with_no_orphan(make, name, fencing) -> None:
    """The statement that takes the lock (the INSERT; with fencing, the COMMIT) ran and its
    reply was lost: the retry on a new connection finds the row of its own token and grants
    it, rather than refusing and leaving the row held until its lease ends."""
    locks = make()
    first = locks.lock(name, ttl=30, fencing=fencing)
    assert first.acquire(blocking=False)  # opens the connection; a fence to compare with
    fence = first.fence
    first.release()
    lock = locks.lock(name, ttl=30, fencing=fencing)
    fired = lose_a_reply(locks, "COMMIT" if fencing else "INTO DJANGO_REDLOCK_DATABASELOCK (")
    assert lock.acquire(blocking=False)
    assert fired, "the take was not interrupted"
    assert [info.token for info in make().live_locks(name)] == [lock.token]
    assert not make().lock(name, ttl=5).acquire(blocking=False)  # no double grant
    if fencing:
        assert lock.fence > fence
        assert make().lock_info(name).fence == lock.fence
    lock.release()
    assert not make().locked(name)  # no orphan


@server_only
def test_a_release_whose_reply_was_lost_still_releases(make, name) -> None:
    """The DELETE ran and its reply was lost: the retry deletes nothing, and that is ours."""
    locks = make()
    lock = locks.lock(name, ttl=30)
    assert lock.acquire(blocking=False)
    fired = lose_a_reply(locks, "DELETE FROM DJANGO_REDLOCK_DATABASELOCK WHERE")
    lock.release()
    assert fired, "the release was not interrupted"
    assert not make().locked(name)


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_a_pessimistic_holder_whose_connection_died_checks_false(make, name) -> None:
    """The transaction was the lock: once anything notices that its connection died, the
    holder knows it lost the lock (check() raised OperationalError and held stayed True)."""
    from django_redlock import LockLost

    locks = make(pessimistic=True)
    for notice in ("check", "extend"):
        holder = locks.lock(name, ttl=30)
        assert holder.acquire(blocking=False)
        kill(holder._lease.state.wrapper)
        assert not getattr(holder, notice)(), notice
        assert not holder.held, notice
        with pytest.raises(LockLost):
            holder.release()
        assert not make().locked(name), notice  # its row went too, not at its lease's end


def dying_connections(locks: DatabaseLocks, count: int) -> list[int]:
    """The next ``count`` connections that ``locks`` opens or reopens are dropped by the
    server right after they connect, before any statement of the lock's (a storm of
    terminations at its worst moment). This thread's connection is patched as well as every
    one opened from now on. Returns ``[left]``: 0 once all ``count`` died."""
    left = [count]

    def dies_on_connect(wrapper: Any) -> Any:
        connect = wrapper.ensure_connection

        def ensure_connection() -> None:
            fresh = wrapper.connection is None
            connect()
            if fresh and left[0] > 0:
                left[0] -= 1
                try:
                    kill(wrapper)
                finally:
                    if threading.current_thread() is not threading.main_thread():
                        connection.close()  # kill()'s connection, opened in a thread of ours

        wrapper.ensure_connection = ensure_connection
        return wrapper

    dies_on_connect(locks._connection())
    open_connection = locks._open
    locks._open = lambda: dies_on_connect(open_connection())  # type: ignore[method-assign]
    return left


def kill_every_connection(seconds: float) -> int:
    """A storm: every connection to the test database but the test's own is terminated
    (pg_terminate_backend / KILL) again and again for ``seconds``. Returns how many died."""
    from django.db import Error

    killed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                killed += cursor.fetchone()[0]
            else:
                cursor.execute(
                    "SELECT id FROM information_schema.processlist "
                    "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
                for (sid,) in cursor.fetchall():
                    try:
                        cursor.execute(f"KILL {int(sid)}")
                        killed += 1
                    except Error:  # it ended meanwhile
                        pass
        time.sleep(0.01)  # the pace of the storm, not a wait for anything
    return killed


def heard_of_a_force_release(make: Any, locks: DatabaseLocks, lock: Any) -> float:
    """Force-release ``lock`` (of ``locks``) from another manager: seconds until its holder
    heard of it."""
    heard = threading.Event()
    locks.listeners.append(
        lambda event: event.kind == "lost" and event.name == lock.name and heard.set()
    )
    assert make().force_release(lock.name) == 1
    removed = time.monotonic()
    assert heard.wait(10), f"{lock.name}: the holder was not told within 10 s"
    assert not lock.held
    return time.monotonic() - removed


@server_only
@pytest.mark.parametrize("fault", ["storm", "dying-at-connect"])
def test_the_row_watch_outlives_the_deaths_of_its_connections(make, name, fault) -> None:
    """A holder still hears of a force release after every connection of the database was
    terminated again and again, or after the watch's new connections died as soon as they
    connected: its row watch reconnects (the watch's thread died of an error of its LISTEN
    on PostgreSQL, and from then on no force release was heard, also of locks taken later)."""
    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    if fault == "storm":
        assert kill_every_connection(1.5) > 0
    else:
        left = dying_connections(locks, 4)
        kill_every_connection(0)  # one round: the watch reconnects, and dies at once, 4 times
        wait_until(lambda: left[0] == 0, timeout=20)
    told = heard_of_a_force_release(make, locks, holder)
    assert told < BOUND, f"heard after {told:.2f} s"
    later = locks.lock(f"{name}:later", ttl=30)
    assert later.acquire(blocking=False)
    told = heard_of_a_force_release(make, locks, later)
    assert told < BOUND, f"a later lock: heard after {told:.2f} s"


#: How soon a holder hears of a force release once its database answers again: a lookup
#: every loss_check (0.25 s) after a reconnection; the rest is room for a loaded machine.
BOUND = 3.0


@server_only
@pytest.mark.parametrize("blocking", [False, True], ids=["non-blocking", "blocking"])
def test_an_acquire_whose_connections_die_is_refused_with_quorum_error(
    make, name, blocking
) -> None:
    """Every connection the acquire opens is dropped right after it connects: the acquire
    raises QuorumError from Django's OperationalError (a blocking one on PostgreSQL raised
    the driver's own error, from its LISTEN), and leaves no lock behind."""
    from django.db import OperationalError

    locks = make()
    dying_connections(locks, 1000)
    lock = locks.lock(name, ttl=30)
    with pytest.raises(QuorumError) as refused:
        lock.acquire(blocking=blocking, timeout=1 if blocking else None)
    assert isinstance(refused.value.__cause__, OperationalError)
    assert not lock.held
    assert not make().locked(name)


@server_only
@pytest.mark.parametrize("fencing", [False, True], ids=["plain", "fencing"])
def test_an_acquire_refused_after_its_take_ran_leaves_no_lock(make, name, fencing) -> None:
    """The take ran and its reply was lost, and its repeat's connection died too: the
    acquire raises QuorumError, and the row granted by the lost reply is deleted (it stayed,
    held by a token nobody has, until its 30 s lease ended)."""
    locks = make()
    assert not locks.locked(name)  # this thread's connection is open before the faults
    fired = lose_a_reply(locks, "COMMIT" if fencing else "INTO DJANGO_REDLOCK_DATABASELOCK (")
    # The repeat dies: the INSERT's; with fencing, the BEGIN of the replayed attempt and its
    # own repeat.
    dying_connections(locks, 2 if fencing else 1)
    lock = locks.lock(name, ttl=30, fencing=fencing)
    with pytest.raises(QuorumError):
        lock.acquire(blocking=False)
    assert fired, "the take was not interrupted"
    assert not make().locked(name)


@pytest.mark.django_db(transaction=True)  # the admin needs auth, sessions and contenttypes
def test_admin_round_trip(admin_client, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }
    cases.admin_round_trip(admin_client, entry, name)


@pytest.mark.django_db(transaction=True)  # the admin needs auth, sessions and contenttypes
def test_admin_node_page_names_the_database_and_counts_live_rows(admin_client, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }

    def expired(locks: Any, name: str) -> None:  # a row whose lease ran out stays until reused
        lapsed = locks.lock(f"{name}/lapsed", ttl=0.2)
        assert lapsed.acquire(blocking=False)
        wait_until(lambda: not locks.locked(lapsed.name))

    cases.admin_node_page(
        admin_client,
        entry,
        name,
        heading="Database",
        columns=["Database", "Reachable", "Latency", "Software", "Locks", "Clock offset"],
        leftover=expired,
    )


def test_management_command_round_trip(name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }
    cases.cli_round_trip(entry, name)


@pytest.mark.django_db(transaction=True)
def test_locked_takes_the_reentrant_and_meta_settings(name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }
    cases.settings_round_trip(entry, name)


def test_waiter_never_sleeps_past_the_lease_end(make, name) -> None:
    """A holder that never releases its 3 s lease. The waiter's pause doubles from 5 ms: the
    attempt after 2.56 s of them would next sleep 2.56 s more, and wake at 5.1 s; the rule
    "never sleep past the holder's lease end" wakes it as the lease runs out, at 3 s. The
    bound between the two leaves a loaded host two seconds."""
    holder = make().lock(name, ttl=3)
    assert holder.acquire(blocking=False)
    start = time.monotonic()
    waiter = make(max_poll=60.0).lock(name, ttl=5)
    assert waiter.acquire(timeout=30)
    assert time.monotonic() - start < 5.0
    waiter.release()


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's single writer")
def test_sqlite_lock_after_a_write_waits_for_the_busy_timeout(make, name, monkeypatch) -> None:
    """docs/backends.rst: a request that has written inside atomic() holds SQLite's write
    lock; a lock taken after that waits SQLite's busy timeout (here 0.5 s) and fails."""
    from django.db import OperationalError

    monkeypatch.setitem(connection.settings_dict, "OPTIONS", {"timeout": 0.5})
    locks = make()  # its connections take the busy timeout from the settings
    with transaction.atomic():
        Account.objects.create(name="written first")
        start = time.monotonic()
        with pytest.raises(QuorumError, match="locked") as refused:  # a 503 in a view
            locks.lock(name, ttl=5).acquire(blocking=False)
        assert isinstance(refused.value.__cause__, OperationalError)
        assert time.monotonic() - start >= 0.4
    lock = locks.lock(name, ttl=5)  # the write committed: the lock is free to take
    assert lock.acquire(blocking=False)
    lock.release()


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_mixed_modes_do_not_exclude_each_other(make, name) -> None:
    """docs/backends.rst: every user of a name must use the same mode, because a pessimistic
    handle takes the row over from a non-pessimistic holder whose lease still runs."""
    plain = make().lock(name, ttl=30)
    assert plain.acquire(blocking=False)
    pessimistic = make(pessimistic=True).lock(name, ttl=30)
    assert pessimistic.acquire(blocking=False)
    assert not plain.check() and pessimistic.check()
    pessimistic.release()


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
@pytest.mark.parametrize("how", ["connection-cut", "mixed-modes"])
def test_a_holder_hears_a_take_over_within_a_second(make, name, how) -> None:
    """docs/backends.rst: a holder hears within a second that its lock was taken over, its
    row held by another token: ``held`` turns False and ``lost`` fires without a call of its
    own. A pessimistic waiter takes the row over when the holder's connection was cut, and a
    pessimistic handle takes it over from a non-pessimistic holder. On PostgreSQL it read
    ``held`` True for 3.3-4.0 s after either (the take-over sent no NOTIFY: heard only at the
    row watch's 5 s safety net)."""
    locks = make(pessimistic=how == "connection-cut")
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    heard = threading.Event()
    locks.listeners.append(
        lambda event: event.kind == "lost" and event.name == name and heard.set()
    )
    time.sleep(0.5)  # the row watch is settled in its wait, as a holder's usually is
    if how == "connection-cut":
        kill(holder._lease.state.wrapper, wait=False)  # the holder's FOR UPDATE connection
    taker = make(pessimistic=True).lock(name, ttl=30)
    assert taker.acquire(timeout=10)
    taken = time.monotonic()
    assert heard.wait(1.0), f"{how}: not heard within 1 s of the take-over"
    assert not holder.held and time.monotonic() - taken < 1.0
    assert taker.check()
    taker.release()


@pytest.fixture
def frozen_alias() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A DATABASES alias ("frozen") for the test database reached through a proxy process
    (tests/backends/freezable_proxy.py) that the test can SIGSTOP. Default settings: no
    connect_timeout, nothing but HOST and PORT changed."""
    from django.db import connections

    entry = copy.deepcopy(connection.settings_dict)
    port = entry.get("PORT") or (5432 if connection.vendor == "postgresql" else 3306)
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("freezable_proxy.py")),
            entry.get("HOST") or "127.0.0.1",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        entry.update(HOST="127.0.0.1", PORT=proxy.stdout.readline().strip())
        connections.settings["frozen"] = entry
        yield "frozen", proxy
    finally:
        os.kill(proxy.pid, signal.SIGCONT)
        proxy.kill()
        proxy.wait()
        with contextlib.suppress(Exception):
            connections["frozen"].close()
        with contextlib.suppress(Exception):
            del connections["frozen"]
        connections.settings.pop("frozen", None)


#: How long a call on the frozen database may take before the test calls it hung: the
#: bound is about the acquire's timeout plus twice request_timeout (5 s); the rest is room
#: for a loaded machine. Without a bound the calls never returned.
HUNG = 60.0


@server_only
def test_a_connection_whose_set_up_meets_a_frozen_database_is_bounded(frozen_alias, name) -> None:
    """The database stops answering while a new lock connection is being set up: the driver
    has connected, and the statements Django runs on a new connection before handing it
    over (PostgreSQL's SET TIME ZONE, MySQL's server variables; here a ``connection_created``
    receiver's, which runs at the same place) get no answer. The driver's connect_timeout is
    over by then: the acquire still raises QuorumError, the set-up counts against
    request_timeout. (A PostgreSQL listener set up so by the row watch, under the lock every
    waiter takes to listen, once held each blocking acquire for ever on a loaded host.)"""
    from django.db.backends.signals import connection_created

    alias, proxy = frozen_alias
    locks = DatabaseLocks(alias, request_timeout=2)
    outcome: dict[str, Any] = {}

    def freeze(sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.alias == f"{alias}:locks":
            os.kill(proxy.pid, signal.SIGSTOP)
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")

    def run() -> None:
        try:
            outcome["result"] = locks.lock(name, ttl=60).acquire(timeout=1)
        except Exception as exc:
            outcome["result"] = exc

    connection_created.connect(freeze)
    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        thread.join(HUNG)
        hung = thread.is_alive()
    finally:
        connection_created.disconnect(freeze)
        os.kill(proxy.pid, signal.SIGCONT)
    try:
        assert not hung, "still setting a connection up on the frozen database"
        assert isinstance(outcome["result"], QuorumError), outcome["result"]
    finally:
        locks.close()


@server_only
def test_every_call_is_bounded_when_the_database_stops_answering(frozen_alias, name) -> None:
    """The database stops answering (every packet to it is swallowed, as in a network
    partition or a frozen server), with default settings: every call returns. An acquire
    raises QuorumError (also the blocking one with timeout=1, which had waited for ever),
    check() is False, release() raises QuorumError, health() reports the database
    unreachable and so do the deploy check and ``manage.py redlock check``. A take whose
    reply never came is deleted once the database answers again, not left until its lease
    ends."""
    from django.core.management import call_command
    from django.test import override_settings

    from django_redlock.backends.checks import check_backends_reachable

    alias, proxy = frozen_alias
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": alias},
    }
    locks = DatabaseLocks(alias)
    try:
        # Held by the threads that check and release them (a handle belongs to its thread).
        held = {key: locks.lock(f"{name}:{key}", ttl=60) for key in ("check", "release")}
        taken = {"blocking": f"{name}:t1", "non-blocking": f"{name}:nb"}
        calls: dict[str, Callable[[], Any]] = {
            "blocking": lambda: locks.lock(taken["blocking"], ttl=60).acquire(timeout=1),
            "non-blocking": lambda: locks.lock(taken["non-blocking"], ttl=60).acquire(
                blocking=False
            ),
            "check": held["check"].check,
            "release": held["release"].release,
            "force_release": lambda: locks.force_release(f"{name}:other"),
            "health": locks.health,
            "check --deploy": check_backends_reachable,
            "redlock check": lambda: call_command(
                "redlock", "--using", "svc", "check", stdout=io.StringIO()
            ),
        }
        results: dict[str, Any] = {}
        ready = threading.Barrier(len(calls) + 1)
        start = threading.Event()

        def run(key: str) -> None:
            # This thread's connection is open before the freeze.
            warm = held[key].acquire(blocking=False) if key in held else not locks.locked(name)
            ready.wait()
            if not warm:
                results[key] = AssertionError("not warmed up")
                return
            start.wait()
            try:
                results[key] = calls[key]()
            except Exception as exc:
                results[key] = exc

        with override_settings(REDLOCK=cases.svc_settings(entry)):
            threads = [threading.Thread(target=run, args=(key,), daemon=True) for key in calls]
            for thread in threads:
                thread.start()
            ready.wait()
            os.kill(proxy.pid, signal.SIGSTOP)
            start.set()
            end = time.monotonic() + HUNG
            for thread in threads:
                thread.join(max(end - time.monotonic(), 0))
            hung = [key for key, thread in zip(calls, threads, strict=True) if thread.is_alive()]
            # Where each hung call waits, and every thread of this process (a lock it
            # waits on is held by another): the failure's only clue on a busy CI host.
            frames = sys._current_frames()
            stacks = "".join(
                f"--- {thread.name}\n" + "".join(traceback.format_stack(frames[thread.ident]))
                for thread in threading.enumerate()
                if thread.ident in frames
            )
            os.kill(proxy.pid, signal.SIGCONT)
        assert not hung, f"still waiting on the frozen database: {hung}\n{stacks}"
        for key in ("blocking", "non-blocking", "release"):
            assert isinstance(results[key], QuorumError), (key, results[key])
        assert results["check"] is False
        assert isinstance(results["force_release"], Exception)
        assert [h.reachable for h in results["health"]] == [False]
        assert [m.id for m in results["check --deploy"]] == ["django_redlock.E105"]
        assert isinstance(results["redlock check"], Exception)

        # Each take was sent on an open connection (the blocking one's too, when its first
        # attempt got that far): its INSERT reaches the database when the proxy is resumed
        # (late, on a connection its client gave up on), granting a 60 s lease to a token
        # nobody holds. The sweep deletes it by token: it stops sweeping a take before the
        # lease ends only when a delete removed its row. Both sweeps are waited for: one
        # pass may remove one take's row before it comes to the other's.
        def swept(lock_name: str) -> bool:
            return all(pending != lock_name for pending, _ in locks._sweep.pending())

        wait_until(lambda: all(swept(n) for n in taken.values()), timeout=30, interval=0.1)
        fresh = DatabaseLocks("default")
        try:
            assert not any(fresh.locked(lock_name) for lock_name in taken.values())
        finally:
            fresh.close()
    finally:
        locks.close()
