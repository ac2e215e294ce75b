"""REDLOCK["BACKENDS"]: get_locks(alias), rebuilt on setting changes, signals, system checks."""

from __future__ import annotations

import asyncio
import math
import os
import re
import threading

import pytest
from django.core import checks
from django.test import override_settings

from django_redlock import get_async_locks, get_async_redlock, get_locks, get_redlock
from django_redlock.backends.base import AsyncLocks, LockManager
from django_redlock.backends.database import DatabaseLocks
from django_redlock.signals import lock_acquired, lock_released
from tests.backends.servers import free_port

DB = {"BACKEND": "django_redlock.backends.database.DatabaseLocks", "OPTIONS": {"using": "default"}}


def redlock_with(backends) -> dict:
    return {"NODES": ["redis://127.0.0.1:6379/0"], "BACKENDS": backends}


def test_default_alias_is_the_redlock() -> None:
    assert get_locks() is get_redlock()
    assert get_locks("default") is get_redlock()
    assert get_async_locks() is get_async_redlock()
    assert isinstance(get_redlock(), LockManager)  # Redlock offers the backend interface


def test_alias_built_once_and_rebuilt_on_change() -> None:
    with override_settings(REDLOCK=redlock_with({"db": DB})):
        first = get_locks("db")
        assert isinstance(first, DatabaseLocks) and get_locks("db") is first
        assert isinstance(get_async_locks("db"), AsyncLocks)
        assert get_async_locks("db").manager is first
    with override_settings(REDLOCK=redlock_with({"db": {**DB, "OPTIONS": {"ttl": 7}}})):
        second = get_locks("db")
        assert second is not first and second.ttl == 7
    with pytest.raises(ValueError, match="no lock backend 'db'"):
        get_locks("db")


def test_alias_shared_by_threads_and_rebuilt_when_databases_change(settings) -> None:
    with override_settings(REDLOCK=redlock_with({"db": DB})):
        first = get_locks("db")
        seen: list[object] = []
        thread = threading.Thread(target=lambda: seen.append(get_locks("db")))
        thread.start()
        thread.join(10)
        assert seen == [first]
        # Django warns that overriding DATABASES is unusual; the same value is harmless.
        with pytest.warns(UserWarning, match="DATABASES"):
            with override_settings(DATABASES=settings.DATABASES):
                assert get_locks("db") is not first


def test_backends_can_replace_the_default() -> None:
    with override_settings(REDLOCK={"BACKENDS": {"default": DB}}):
        assert isinstance(get_locks(), DatabaseLocks)


@pytest.mark.django_db(transaction=True)
def test_backend_events_are_django_signals() -> None:
    seen: list[tuple[str, object]] = []

    def receiver(signal_name):
        def receive(sender, redlock, name, **kwargs):
            seen.append((signal_name, redlock, name))

        return receive

    on_acquired, on_released = receiver("acquired"), receiver("released")
    lock_acquired.connect(on_acquired)
    lock_released.connect(on_released)
    try:
        with override_settings(REDLOCK=redlock_with({"db": DB})):
            locks = get_locks("db")
            with locks.lock("registry:signals", ttl=5):
                pass
    finally:
        lock_acquired.disconnect(on_acquired)
        lock_released.disconnect(on_released)
    assert seen == [
        ("acquired", locks, "registry:signals"),
        ("released", locks, "registry:signals"),
    ]


@pytest.mark.django_db(transaction=True)
def test_async_alias() -> None:
    async def run() -> None:
        locks = get_async_locks("db")
        async with locks.lock("registry:async", ttl=5) as lock:
            assert lock.held and await locks.locked("registry:async")
        assert not await locks.locked("registry:async")

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        asyncio.run(run())


E104 = "django_redlock.E104"
ZK = {
    "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
    "OPTIONS": {"hosts": "127.0.0.1:2181"},
}
ETCD = {
    "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
    "OPTIONS": {"endpoints": ["http://127.0.0.1:2379"]},
}


def ids(messages) -> list[str]:
    return sorted(m.id for m in messages if m.id.startswith("django_redlock.E1"))


@pytest.mark.parametrize(
    ("backends", "expected"),
    [
        ({"db": DB}, []),
        ({"zk": ZK, "etcd": ETCD}, []),
        (["not", "a", "dict"], ["django_redlock.E101"]),
        ([], ["django_redlock.E101"]),  # empty, but still not a dict
        ("", ["django_redlock.E101"]),
        (0, ["django_redlock.E101"]),
        (None, []),  # no backends, as when unset
        ({"db": {"OPTIONS": {}}}, ["django_redlock.E102"]),
        ({"db": {"BACKEND": "django_redlock.backends.nope.NoLocks"}}, ["django_redlock.E103"]),
        (
            {"zk": {"BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks"}},
            ["django_redlock.E104"],  # "hosts" missing
        ),
        ({"db": {**DB, "OPTIONS": {"using": "nowhere"}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"ttl": -1}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"pessimistic": True}}}, ["django_redlock.E104"]),  # SQLite
        ({"db": {**DB, "TIMEOUT": 3}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"retry_count": -1}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"retry_delay": "0.2"}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"max_poll": -1}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"max_poll": 0}}}, ["django_redlock.E104"]),
        ({"db": {**DB, "OPTIONS": {"pessimistic": "no"}}}, ["django_redlock.E104"]),
        ({"zk": {**ZK, "OPTIONS": {**ZK["OPTIONS"], "session_timeout": -5}}}, [E104]),
        ({"zk": {**ZK, "OPTIONS": {**ZK["OPTIONS"], "connect_timeout": math.nan}}}, [E104]),
        ({"etcd": {**ETCD, "OPTIONS": {**ETCD["OPTIONS"], "request_timeout": -1}}}, [E104]),
        ({"etcd": {**ETCD, "OPTIONS": {**ETCD["OPTIONS"], "request_timeout": 0}}}, [E104]),
        # a falsy non-dict is not "no options"
        ({"db": {**DB, "OPTIONS": []}}, [E104]),
        ({"db": {**DB, "OPTIONS": None}}, [E104]),
        ({"db": {**DB, "OPTIONS": 0}}, [E104]),
        # an endpoint without a host used to fail only at first use
        ({"etcd": {**ETCD, "OPTIONS": {"endpoints": ["http://"]}}}, [E104]),
        ({"etcd": {**ETCD, "OPTIONS": {"endpoints": ["http://127.0.0.1:99999"]}}}, [E104]),
    ],
)
def test_checks(backends, expected) -> None:
    with override_settings(REDLOCK=redlock_with(backends)):
        messages = checks.run_checks(tags=["django_redlock"])
    assert ids(messages) == expected, [str(m) for m in messages]
    for message in messages:
        if message.id in expected:
            assert "REDLOCK['BACKENDS']" in message.msg or "BACKENDS" in message.msg


@pytest.mark.parametrize(
    ("entry", "expected", "text"),
    [
        ({"OPTIONS": {}}, "django_redlock.E102", "BACKEND"),
        ({"BACKEND": "django_redlock.backends.nope.NoLocks"}, "django_redlock.E103", "nope"),
        ({**DB, "OPTIONS": {"using": "nowhere"}}, E104, "nowhere"),
        ({**DB, "OPTIONS": []}, E104, "OPTIONS"),
        ({**DB, "TIMEOUT": 3}, E104, "TIMEOUT"),
        ({**ETCD, "OPTIONS": {"endpoints": ["http://"]}}, E104, "'http://'"),
    ],
)
def test_get_locks_on_a_broken_entry_raises_improperly_configured_with_the_check_id(
    entry, expected, text
) -> None:
    """As get_redlock() does for NODES: the id and message the system check reports."""
    from django.core.exceptions import ImproperlyConfigured

    with override_settings(REDLOCK=redlock_with({"broken": entry})):
        reported = [m for m in checks.run_checks(tags=["django_redlock"]) if m.id == expected]
        for get in (get_locks, get_async_locks):
            with pytest.raises(ImproperlyConfigured) as refused:
                get("broken")
            assert str(refused.value).startswith(f"{expected}: "), refused.value
            assert text in str(refused.value)
            assert reported and reported[0].msg in str(refused.value)


def test_get_locks_on_a_backends_setting_that_is_not_a_dict() -> None:
    from django.core.exceptions import ImproperlyConfigured

    with override_settings(REDLOCK=redlock_with([DB])):
        with pytest.raises(ImproperlyConfigured, match=r"^django_redlock\.E101: "):
            get_locks("db")
        assert get_locks() is get_redlock()  # the Redlock over NODES is not concerned


def test_etcd_endpoint_without_a_host_is_refused_by_the_constructor() -> None:
    from django_redlock.backends.etcd import EtcdLocks

    for bad in ("http://", "https://:2379", "http://127.0.0.1:99999", "http://127.0.0.1:0"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            EtcdLocks(endpoints=["http://127.0.0.1:2379", bad])
    EtcdLocks(endpoints=["http://127.0.0.1:2379", "https://[::1]:2379"]).close()


def test_sqlite_with_atomic_requests_is_warned_about(monkeypatch) -> None:
    """W101: under ATOMIC_REQUESTS a view that wrote holds SQLite's only write lock, so its
    lock cannot be released until the request ends."""
    from django.db import connections

    assert connections["default"].vendor == "sqlite"
    with override_settings(REDLOCK=redlock_with({"db": DB})):
        monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", False)
        assert not [m for m in checks.run_checks(tags=["django_redlock"]) if m.id.endswith("W101")]
        monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
        found = [m for m in checks.run_checks(tags=["django_redlock"]) if m.id.endswith("W101")]
    assert len(found) == 1 and "'db'" in found[0].msg and "ATOMIC_REQUESTS" in found[0].msg


def test_deploy_check_reports_an_unreachable_service() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    etcd = {"BACKEND": "django_redlock.backends.etcd.EtcdLocks", "OPTIONS": {"endpoints": [dead]}}
    with override_settings(REDLOCK=redlock_with({"etcd": etcd})):
        assert ids(checks.run_checks(tags=["django_redlock"])) == []
        deploy = checks.run_checks(tags=["django_redlock"], include_deployment_checks=True)
    found = [m for m in deploy if m.id == "django_redlock.E105"]
    assert len(found) == 1 and "'etcd'" in found[0].msg and dead in found[0].msg


@pytest.mark.django_db(transaction=True)
def test_locked_decorator_takes_the_lock_on_the_alias() -> None:
    from django_redlock import LockNotAcquired, locked

    seen: list[bool] = []

    @locked("registry:job:{n}", using="db", ttl=5)
    def job(n: int) -> str:
        locks = get_locks("db")
        seen.append(locks.locked(f"registry:job:{n}"))
        refused: list[BaseException] = []

        def other() -> None:
            try:
                job(n)
            except LockNotAcquired as exc:
                refused.append(exc)

        thread = threading.Thread(target=other)  # the same key on the same backend is taken
        thread.start()
        thread.join(10)
        assert len(refused) == 1
        return "done"

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        assert job(1) == "done"
        assert seen == [True]
        assert not get_locks("db").locked("registry:job:1")


@pytest.mark.django_db(transaction=True)
def test_locked_async_function_on_the_alias() -> None:
    from django_redlock import locked

    @locked("registry:ajob", using="db", ttl=5)
    async def ajob() -> bool:
        return await get_async_locks("db").locked("registry:ajob")

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        assert asyncio.run(ajob()) is True
        assert not get_locks("db").locked("registry:ajob")


@pytest.mark.django_db(transaction=True)
def test_locked_task_takes_the_lock_on_lock_using() -> None:
    """LockedTask(lock_using=alias) locks on that backend (run in-process with apply();
    tests/test_celery.py covers the worker machinery, which does not depend on the backend)."""
    import celery

    from django_redlock.celery import LockedTask

    app = celery.Celery("backend-registry", broker="memory://", backend="cache+memory://")

    @app.task(base=LockedTask, bind=True, lock_key="registry:task:{x}", lock_using="db")
    def task(self, x: int) -> list:
        info = get_locks("db").lock_info(f"registry:task:{x}")
        return [self.lock.held, info is not None and info.token == self.lock.token]

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        assert isinstance(task.get_redlock(), DatabaseLocks)
        assert task.apply(args=(1,)).get() == [True, True]
        assert not get_locks("db").locked("registry:task:1")


def test_a_per_call_lock_limit_on_a_service_without_semaphores_is_refused_when_sent() -> None:
    """docs/backends.rst: semaphores are the Redlock's only; a per-call lock_limit on a task
    whose lock_using names a backend is refused by apply_async (ValueError), not sent to fail
    on the worker with NotImplementedError."""
    import celery

    from django_redlock.celery import LockedTask

    app = celery.Celery("backend-registry", broker="memory://", backend="cache+memory://")

    @app.task(base=LockedTask, bind=True, lock_key="registry:limit:{x}", lock_using="db")
    def limited(self, x: int) -> None:  # pragma: no cover - never runs
        return None

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        with pytest.raises(ValueError, match=r"per-call options.*lock_limit 2.*DatabaseLocks"):
            limited.apply_async((1,), lock_limit=2)


@pytest.mark.django_db(transaction=True)
def test_management_command_using_alias() -> None:
    import io
    import json

    from django.core.management import CommandError, call_command

    def run(*args: str) -> tuple[str, int]:
        out = io.StringIO()
        try:
            call_command("redlock", *args, stdout=out)
        except SystemExit as exc:
            return out.getvalue(), int(exc.code or 0)
        return out.getvalue(), 0

    with override_settings(REDLOCK=redlock_with({"db": DB})):
        lock = get_locks("db").lock("registry:cli", ttl=30, meta={"job": "cli"})
        assert lock.acquire(blocking=False)
        listed, _ = run("--using", "db", "list", "--json")
        rows = json.loads(listed)
        assert [(r["name"], r["token"]) for r in rows] == [("registry:cli", lock.token)]
        out, code = run("--using", "db", "check")
        assert code == 0 and "OK: 1/1" in out
        assert "redis-server" not in out  # the database is named as what it is
        with pytest.raises(CommandError, match="no restart guard") as refused:
            run("--using", "db", "trust", "--yes")
        assert refused.value.returncode == 2
        with pytest.raises(CommandError, match="--force"):  # a live lock needs --force
            run("--using", "db", "release", "registry:cli")
        assert get_locks("db").locked("registry:cli")
        run("--using", "db", "release", "registry:cli", "--force")
        assert not get_locks("db").locked("registry:cli")
        with pytest.raises(CommandError, match="no lock backend 'nope'"):
            run("--using", "nope", "list")


@pytest.mark.django_db(transaction=True)
def test_admin_lists_and_force_releases_on_the_selected_backend(admin_client) -> None:
    with override_settings(REDLOCK=redlock_with({"db": DB})):
        locks = get_locks("db")
        lock = locks.lock("registry:admin", ttl=30, meta={"job": "admin"})
        assert lock.acquire(blocking=False)
        page = admin_client.get("/admin/django_redlock/lock/?using=db")
        html = page.content.decode()
        assert page.status_code == 200
        assert 'id="redlock-backends"' in html and "<strong>db</strong>" in html
        assert "registry:admin" in html and f"{os.getpid()}" in html  # the holder's pid
        # The choice sticks: the detail and release pages work on the same backend.
        detail = admin_client.get("/admin/django_redlock/lock/detail/?name=registry:admin")
        assert detail.status_code == 200 and lock.token in detail.content.decode()
        released = admin_client.post(
            "/admin/django_redlock/lock/release/",
            {"name": "registry:admin", "token": lock.token, "confirm": "yes"},
        )
        assert released.status_code == 302
        assert not locks.locked("registry:admin") and not lock.check()
        health = admin_client.get("/admin/django_redlock/lock/nodes/")
        assert health.status_code == 200 and "sqlite:default" in health.content.decode()


def test_retry_policy_comes_from_the_settings_unless_the_options_name_it() -> None:
    with override_settings(REDLOCK={**redlock_with({"db": DB}), "RETRY_COUNT": 7}):
        assert (get_locks("db").retry_count, get_locks("db").retry_delay) == (7, 0.2)
    options = {"using": "default", "retry_count": 1, "retry_delay": 0.5}
    with override_settings(REDLOCK=redlock_with({"db": {**DB, "OPTIONS": options}})):
        assert (get_locks("db").retry_count, get_locks("db").retry_delay) == (1, 0.5)


@pytest.mark.parametrize(
    "name, private",
    [
        (":memory:", True),
        ("file:locks?mode=memory", True),
        ("file:memorydb_default?mode=memory&cache=shared", False),  # Django's test database
        ("/var/db/locks.sqlite3", False),
    ],
)
def test_private_in_memory_sqlite_is_refused(monkeypatch, name, private) -> None:
    """E106, and ImproperlyConfigured at the first lock operation instead of locks that
    each connection keeps to itself."""
    from django.core.exceptions import ImproperlyConfigured
    from django.db import connections

    monkeypatch.setitem(connections["default"].settings_dict, "NAME", name)
    with override_settings(REDLOCK=redlock_with({"db": DB})):
        messages = checks.run_checks(tags=["django_redlock"])
        assert ids(messages) == (["django_redlock.E106"] if private else [])
        if private:
            assert "'db'" in messages[0].msg and repr(name) in messages[0].msg
            assert "cache=shared" in messages[0].msg
            lock = get_locks("db").lock("memory:x", ttl=5)
            with pytest.raises(ImproperlyConfigured, match="in-memory SQLite"):
                lock.acquire(blocking=False)
            assert not lock.held


def test_no_nodes_needed_when_backends_names_default() -> None:
    with override_settings(REDLOCK={"BACKENDS": {"default": DB}}):
        assert ids_all(checks.run_checks(tags=["django_redlock"])) == []
    with override_settings(REDLOCK={"BACKENDS": {"db": DB}}):  # the default is still Redlock
        assert "django_redlock.E002" in ids_all(checks.run_checks(tags=["django_redlock"]))


def ids_all(messages) -> list[str]:
    return sorted(m.id for m in messages)
