"""The handle rules, checked the same way on every lock service: the Redlock, the AsyncRedlock,
and each backend (SQLite, PostgreSQL, MariaDB/MySQL, ZooKeeper, etcd) with its asyncio twin.

1. A handle belongs to whoever acquired it (``owner=``, else the task, else the thread):
   anyone else's ``release()``/``extend()`` raises LockNotOwned and sends nothing.
2. A failed attempt never touches another owner's lease (racing ``acquire(blocking=False)``
   on one shared handle: exactly one True); threads asking a handle another holds wait or
   get False, never RuntimeError.
3. ``acquire()`` with blocking and no timeout waits until acquired.
4. Reentrancy only with ``reentrant=True``; the holder asking its handle again gets False,
   False after its timeout, or RuntimeError (it would wait for itself for ever); a lease that
   ran out can be taken again.

Plus the history checker: racing threads, no two holds overlap. The cases live in
tests/backends/cases.py (``rule_*``). The database backends run in this process on
databases of their own (tests/backends/databases.py: dropped after, or by a reaper if the
run dies), registered as extra DATABASES aliases for the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from django_redlock import AsyncRedlock
from django_redlock.backends.base import AsyncLocks
from tests.backends import cases, databases, servers
from tests.helpers import database_unreachable, wait_until

SERVICES = [
    "redlock",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
    "zookeeper",
    "etcd",
]
#: Services whose locks run out on their own (a ZooKeeper lock lives as its session does).
LEASED = {"redlock", "sqlite", "postgres", "mysql", "etcd"}
#: ``SERVICES`` (with their marks) that are ``LEASED``.
LEASED_SERVICES = [s for s in SERVICES if (s.values[0] if hasattr(s, "values") else s) in LEASED]
#: Services that tell a holder when they end its lease (etcd deletes the key, and the
#: holder's watch sees it): its release raises LockLost from then on (docs/backends.rst).
HEARS_THE_LEASE_END = {"etcd"}


@contextlib.contextmanager
def lock_database(kind: str, tmp: Path) -> Iterator[str]:
    """A migrated database for the database backend, as the DATABASES alias it yields:
    an SQLite file, or a database of our own on the ``kind`` server."""
    from django.core.management import call_command
    from django.db import DEFAULT_DB_ALIAS, connections

    if kind != "sqlite":
        reason = database_unreachable(kind)
        if reason:
            pytest.skip(reason)
    alias = f"parity_{kind}"
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            entry = {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(tmp / "locks.sqlite3"),
                "OPTIONS": {"timeout": 30},
            }
        else:
            from testproject.databases import server_database

            entry = server_database(kind, stack.enter_context(databases.own_database(kind)))
        configured = connections.configure_settings({DEFAULT_DB_ALIAS: {}, alias: entry})
        connections.settings[alias] = configured[alias]
        try:
            call_command("migrate", database=alias, verbosity=0, interactive=False)
            yield alias
        finally:
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]


@pytest.fixture(scope="session")
def database_aliases(
    tmp_path_factory: pytest.TempPathFactory, django_db_blocker: Any
) -> Iterator[Callable[[str], str]]:
    """``alias(kind)``: the lock database of ``kind``, made on first use for the session."""
    made: dict[str, str] = {}
    with contextlib.ExitStack() as stack:

        def alias(kind: str) -> str:
            if kind not in made:
                with django_db_blocker.unblock():
                    made[kind] = stack.enter_context(
                        lock_database(kind, tmp_path_factory.mktemp(kind))
                    )
            return made[kind]

        yield alias
        stack.enter_context(django_db_blocker.unblock())  # the drops happen in here


@pytest.fixture(scope="module")
def zk_server() -> Iterator[servers.Server]:
    with servers.zookeeper() as server:
        yield server


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[servers.Server]:
    with servers.etcd() as server:
        yield server


@pytest.fixture(params=SERVICES)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def build(kind: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``build(**options)``: a new manager of the service under test (not yet closed)."""
    root = f"/redlock-parity-{uuid.uuid4().hex[:8]}"
    if kind == "redlock":
        nodes = request.getfixturevalue("redis_nodes")
        from django_redlock import Redlock

        yield lambda **options: Redlock(nodes.urls, **options)
    elif kind in ("sqlite", "postgres", "mysql"):
        from django_redlock.backends.database import DatabaseLocks

        alias = request.getfixturevalue("database_aliases")(kind)
        with request.getfixturevalue("django_db_blocker").unblock():
            yield lambda **options: DatabaseLocks(alias, **options)
    elif kind == "zookeeper":
        from django_redlock.backends.zookeeper import ZooKeeperLocks

        hosts = request.getfixturevalue("zk_server").address
        yield lambda **options: ZooKeeperLocks(
            hosts, root=root, **{"session_timeout": 4.0, **options}
        )
    else:
        from django_redlock.backends.etcd import EtcdLocks

        endpoint = request.getfixturevalue("etcd_server").address
        yield lambda **options: EtcdLocks([endpoint], root=root, **options)


@pytest.fixture
def make(build: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    with cases.managers(build) as make:
        yield make


@pytest.fixture
def name(kind: str) -> str:
    return f"parity/{kind}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def abuild(kind: str, build: Callable[..., Any], request: pytest.FixtureRequest) -> Any:
    """``abuild()``: a new asyncio manager of the service (the AsyncRedlock, or a backend's
    asyncio twin); call it inside the running loop."""
    if kind == "redlock":
        urls = request.getfixturevalue("redis_nodes").urls
        return lambda: AsyncRedlock(urls)
    return lambda: AsyncLocks(build())


def run_async(abuild: Callable[[], Any], case: Callable[..., Any], name: str) -> None:
    """``case(amake, name)`` in a new event loop, every manager it made closed at its end."""

    async def main() -> None:
        made: list[Any] = []

        def amake() -> Any:
            made.append(abuild())
            return made[-1]

        try:
            await case(amake, name)
        finally:
            for locks in made:
                await locks.close()

    asyncio.run(main())


def test_rule_1_a_handle_belongs_to_whoever_acquired_it(make, name) -> None:
    cases.rule_1_a_handle_belongs_to_whoever_acquired_it(make, name)


def test_rule_2_a_failed_attempt_never_touches_the_holders_lease(make, name) -> None:
    cases.rule_2_a_failed_attempt_never_touches_the_holders_lease(make, name)


def test_rule_3_a_blocking_acquire_without_timeout_waits_until_acquired(make, name) -> None:
    cases.rule_3_a_blocking_acquire_without_timeout_waits_until_acquired(make, name)


def test_rule_4_the_holder_asking_again_does_not_re_enter(kind, make, name) -> None:
    cases.rule_4_the_holder_asking_again_does_not_re_enter(make, name, leases=kind in LEASED)


def test_rule_4_reentrancy_only_when_asked(make, name) -> None:
    cases.rule_4_reentrancy_only_when_asked(make, name)


def test_rule_4_reentry_never_joins_a_removed_hold(make, name) -> None:
    cases.rule_4_reentry_never_joins_a_removed_hold(make, name)


def test_racing_threads_never_overlap(make, name, tmp_path: Path) -> None:
    cases.rule_racing_threads_never_overlap(make, name, tmp_path)


def test_async_rule_1_a_handle_belongs_to_the_task_that_acquired_it(abuild, name) -> None:
    run_async(abuild, cases.arule_1_a_handle_belongs_to_the_task_that_acquired_it, name)


def test_async_rule_2_racing_tasks_on_one_handle(abuild, name) -> None:
    run_async(abuild, cases.arule_2_racing_tasks_on_one_handle, name)


def test_async_rules_3_and_4_waiting_and_asking_again(abuild, name) -> None:
    run_async(abuild, cases.arule_3_and_4_waiting_and_asking_again, name)


def test_async_rule_4_reentry_never_joins_a_removed_hold(abuild, name) -> None:
    run_async(abuild, cases.arule_4_reentry_never_joins_a_removed_hold, name)


def test_bad_options_are_refused_alike(make, name) -> None:
    cases.rule_bad_options_are_refused_alike(make, name)


def test_async_bad_options_are_refused_alike(abuild, name) -> None:
    run_async(abuild, cases.arule_bad_options_are_refused_alike, name)


def test_a_release_after_the_lease_ran_out_raises(kind, make, name) -> None:
    if kind in LEASED:
        cases.rule_a_release_after_the_lease_ran_out_raises(
            make, name, hears_the_lease_end=kind in HEARS_THE_LEASE_END
        )
        return
    # A ZooKeeper lock lives as its session does (docs/backends.rst): past its ttl it is
    # still held, and its release is a plain one.
    lock = make().lock(name, ttl=1)
    assert lock.acquire(blocking=False)
    time.sleep(1.5)  # nothing is to happen: no event to wait for
    assert lock.held and lock.check()
    lock.release()
    assert not make().locked(name)


def _rows_named(alias: str, name: str) -> int:
    """Rows of ``name`` in the lock table, live or not (the listing shows live ones only)."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM django_redlock_databaselock WHERE name = %s", [name])
        return int(cursor.fetchone()[0])


# Only where notes have leases: ZooKeeper refuses lock_dedupe, so it keeps no notes.
@pytest.mark.parametrize("kind", LEASED_SERVICES)
def test_a_revokes_note_lives_while_celery_remembers_the_revoke(
    kind, make, name, monkeypatch
) -> None:
    """docs/celery.rst "Revoking": a worker's note of a revoked task (``celery:revoked:<id>``)
    lives as long as a queued marker can there and no longer than Celery's workers remember
    the revoke (``REVOKE_EXPIRES``: on a database or etcd it lived a year), and once it ended
    it leaves nothing behind: etcd's lease deletes the key, the database's purge (once a
    minute, after a release) deletes the row, which nobody takes again."""
    import celery
    from celery.worker import state as worker_state

    from django_redlock.celery import LockedTask, _note_revoked, _revoked_name

    service = make()
    app = celery.Celery(f"parity-{uuid.uuid4().hex[:8]}", broker="memory://")

    def noop() -> None:  # pragma: no cover - never runs
        return None

    app.task(base=LockedTask, name=f"parity.note.{uuid.uuid4().hex[:8]}", lock_redlock=service)(
        noop
    )
    remembered = uuid.uuid4().hex
    _note_revoked(app, [remembered])
    info = service.lock_info(_revoked_name(remembered))
    longest = min(float(service.max_ttl), float(worker_state.REVOKE_EXPIRES))
    assert info is not None and longest - 60 < info.ttl <= longest
    service.force_release(_revoked_name(remembered))

    monkeypatch.setattr(worker_state, "REVOKE_EXPIRES", 1.0)
    forgotten = uuid.uuid4().hex
    _note_revoked(app, [forgotten])
    assert service.locked(_revoked_name(forgotten))
    wait_until(lambda: not service.locked(_revoked_name(forgotten)), timeout=10)
    if kind in ("sqlite", "postgres", "mysql"):
        from django_redlock.backends import database

        assert _rows_named(service.using, _revoked_name(forgotten)) == 1  # expired, not gone
        # A purge every 0 s rather than every minute: this manager's first release purges.
        monkeypatch.setattr(database, "PURGE_EVERY", 0.0)
        lock = make().lock(name, ttl=5)
        assert lock.acquire(blocking=False)
        lock.release()
        assert _rows_named(service.using, _revoked_name(forgotten)) == 0
    else:
        assert not any(i.name == _revoked_name(forgotten) for i in service.live_locks())


@pytest.mark.parametrize("start", ["os.fork", "multiprocessing"])
def test_forked_children_hold_none_of_the_parents_locks(make, name, start, tmp_path) -> None:
    cases.rule_forked_children_hold_none_of_the_parents_locks(make, name, tmp_path, start)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_forked_children_leave_a_pessimistic_parents_transaction_alone(
    kind, make, name, tmp_path
) -> None:
    # The parent's lock lives in a transaction on its own connection: a child's goodbye on
    # that connection would end the transaction, and the lock with it.
    cases.rule_forked_children_hold_none_of_the_parents_locks(
        lambda: make(pessimistic=True), name, tmp_path, "os.fork"
    )


@pytest.mark.parametrize("reserved", ["y#read", "y#read:0a1b", "x#permit:3"])
def test_names_of_the_reserved_hold_forms_are_refused(make, reserved) -> None:
    """docs/backends.rst: no lock may be named as a semaphore's slot or a reader's hold (the
    admin page and ``force_release`` would take it for one); a name as listed still works for
    ``locked``, ``lock_info`` and ``force_release`` (nothing held: False, None, 0)."""
    locks = make()
    with pytest.raises(ValueError, match=re.escape(repr(reserved)) + ".*reserved"):
        locks.lock(reserved)
    assert not locks.locked(reserved) and locks.lock_info(reserved) is None
    assert locks.force_release(reserved) == 0
