"""The database backend against one database, run by tests/test_backend_database.py in a
subprocess per database (SQLite file, PostgreSQL, MariaDB) with tests/backends/db_settings.py.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

from django_redlock.backends.database import DatabaseLocks
from testproject.models import Account
from tests.backends import cases
from tests.backends.cases import (  # noqa: F401  (shared cases, run with this module's fixtures)
    test_a_waiter_that_waits_longer_than_its_ttl_still_excludes,
    test_async_twin,
    test_auto_renew,
    test_bad_input,
    test_basics,
    test_expiry_and_loss,
    test_force_release,
    test_handover,
    test_names,
    test_names_that_a_collation_would_equate_are_distinct_locks,
    test_timeout_none_is_the_retry_policy,
    test_waiter_wakes_on_release,
)

pytestmark = pytest.mark.django_db(transaction=True)

PESSIMISTIC = connection.vendor != "sqlite"


@pytest.fixture
def make():
    with cases.managers(lambda **options: DatabaseLocks("default", **options)) as make:
        yield make


@pytest.fixture
def wake_within() -> float:
    # PostgreSQL: NOTIFY wakes the waiter; elsewhere the backoff is capped at max_poll (0.2 s).
    return 0.15 if connection.vendor == "postgresql" else 0.5


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


def test_contention_across_processes(name, tmp_path: Path) -> None:
    spec, env = child_spec(name)
    cases.contention(spec, env, tmp_path)


def test_holder_sigkill_recovered_within_one_lease(make, name) -> None:
    spec, env = child_spec(name)
    cases.holder_killed(make, {**spec, "ttl": 2.0}, env, bound=2.0 + 1.0)


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
            start = time.monotonic()
            assert not locks.lock(name, ttl=5).acquire(timeout=timeout)
            waited = time.monotonic() - start
            expected = 1.0 if whole_seconds else timeout
            assert expected <= waited < expected + 0.3, (timeout, waited)
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
    # With polling every 5 s at most, only the NOTIFY can wake the waiter this soon.
    cases.test_waiter_wakes_on_release(lambda: make(max_poll=5.0), name, wake_within=0.15)


@pytest.mark.skipif(not PESSIMISTIC, reason="SQLite has no SELECT ... FOR UPDATE")
def test_pessimistic_cut_connection_is_a_lost_lock(make, name) -> None:
    """The row lock is the lock: when its connection is cut, the next waiter gets it and the
    old holder finds out at check() and release()."""
    from django_redlock import LockLost

    holder = make(pessimistic=True).lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    mutex = holder._lease.state  # the holder's FOR UPDATE connection
    if connection.vendor == "postgresql":
        cut = "SELECT pg_terminate_backend(%s)", [mutex.connection.info.backend_pid]
    else:
        cut = f"KILL {int(mutex.connection.thread_id())}", []
    with connection.cursor() as cursor:
        cursor.execute(*cut)
    waiter = make(pessimistic=True).lock(name, ttl=30)
    assert waiter.acquire(timeout=10)
    assert not holder.check()
    with pytest.raises(LockLost):
        holder.release()
    assert waiter.check()
    waiter.release()


def test_admin_round_trip(admin_client, name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }
    cases.admin_round_trip(admin_client, entry, name)


def test_management_command_round_trip(name) -> None:
    entry = {
        "BACKEND": "django_redlock.backends.database.DatabaseLocks",
        "OPTIONS": {"using": "default"},
    }
    cases.cli_round_trip(entry, name)


def test_waiter_never_sleeps_past_the_lease_end(make, name) -> None:
    """A holder that never releases: with polling capped at 5 s, only the rule "never sleep
    past the holder's lease end" gets the waiter in soon after the 1 s lease runs out."""
    holder = make().lock(name, ttl=1)
    assert holder.acquire(blocking=False)
    start = time.monotonic()
    waiter = make(max_poll=5.0).lock(name, ttl=5)
    assert waiter.acquire(timeout=10)
    assert time.monotonic() - start < 1.0 + 0.6
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
        with pytest.raises(OperationalError, match="locked"):
            locks.lock(name, ttl=5).acquire(blocking=False)
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
