pytest_plugins = ["django_redlock.testing"]

import os as _os  # noqa: E402

import pytest as _pytest  # noqa: E402


# ---- REDLOCK_REQUIRE_ALL=1 (set by .ci/run): a skipped test is a failed test --------------
@_pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """CI provides every optional service (.ci/run installs Chromium, ZooKeeper, etcd and
    RabbitMQ, and starts PostgreSQL and MariaDB), so a test that still skips means something
    is missing there: report it as a failure, not a skip."""
    outcome = yield
    report = outcome.get_result()
    if (
        _os.environ.get("REDLOCK_REQUIRE_ALL") == "1"
        and report.skipped
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped under REDLOCK_REQUIRE_ALL=1: {report.longrepr}"


# ---- core tests (tests/test_core_*.py): Redlock clients closed after each test --------------
import contextlib as _core_contextlib  # noqa: E402

import pytest as _core_pytest  # noqa: E402


@_core_pytest.fixture
def make_redlock():
    """``make_redlock(cluster_or_urls, **kwargs) -> Redlock``; every client made is closed at
    teardown, so no socket to a node outlives the test that opened it."""
    from django_redlock import Redlock

    made = []

    def factory(nodes, **kwargs):
        urls = list(getattr(nodes, "urls", nodes))
        redlock = Redlock(urls, **kwargs)
        made.append(redlock)
        return redlock

    yield factory
    for redlock in made:
        with _core_contextlib.suppress(Exception):
            redlock.close()


# ---- end of core tests block ------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Django layer (conf / decorators / checks / management): settings pointed at real nodes.
# ---------------------------------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture
def redlock_settings(settings, redis_nodes):
    """``settings.REDLOCK`` pointing at the shared 3-node cluster (emptied for the test).

    Assigning through pytest-django's ``settings`` fixture sends ``setting_changed``, so the
    cached ``get_redlock()`` / ``get_async_redlock()`` are rebuilt for the test and again
    after it. Returns the REDLOCK dict; change keys by assigning a new dict to
    ``settings.REDLOCK``.
    """
    # A generous node timeout: the test machine is shared, and a node answering late under
    # load must not turn a "busy" answer into a QuorumError (503) and flake a test.
    settings.REDLOCK = {"NODES": list(redis_nodes.urls), "TTL": 10.0, "NODE_TIMEOUT": 0.5}
    yield settings.REDLOCK
    from django_redlock.conf import reset

    reset()


# ---- end of Django layer block ----------------------------------------------------------------


# ------------------------------------------------------------------------------------------
# Admin page fixtures (tests/test_admin.py, tests/test_admin_browser.py). Owned by the admin
# work; settings point at the shared embedded nodes, users carry the Lock model permissions.
# ------------------------------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture
def admin_redlock_settings(settings, redis_nodes):
    """pytest-django's ``settings`` with ``REDLOCK`` pointed at the embedded 3-node cluster
    (10 s default TTL); assign ``settings.REDLOCK`` again to change it within a test."""
    settings.REDLOCK = {"NODES": list(redis_nodes.urls), "TTL": 10}
    return settings


def _staff_user(django_user_model, username, *perms):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user(
        username=username, password="pw-" + username, is_staff=True
    )
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_redlock", codename=codename)
        )
    return user


@pytest.fixture
def lock_staff(db, django_user_model):
    """Staff without any lock permission."""
    return _staff_user(django_user_model, "staff")


@pytest.fixture
def lock_viewer(db, django_user_model):
    """Staff with ``django_redlock.view_lock`` only."""
    return _staff_user(django_user_model, "viewer", "view_lock")


@pytest.fixture
def lock_releaser(db, django_user_model):
    """Staff with ``view_lock`` and ``release_lock``."""
    return _staff_user(django_user_model, "releaser", "view_lock", "release_lock")


# ---- lock semantics tests (test_core_renewal/waiting/reentrancy/fencing/guard, ----------------
# ---- test_fencing_orm): what the nodes served, and the events a Redlock emitted ---------------
import threading as _sem_threading  # noqa: E402


def _sem_node_calls(nodes):
    """Per node: ``{command: calls}`` from ``INFO commandstats`` (read on a fresh connection; the
    INFO itself is counted only after its reply, so it never shows in its own answer)."""
    found = []
    for node in nodes:
        stats = node.info("commandstats")
        found.append(
            {
                k[len("cmdstat_") :]: int(v["calls"])
                for k, v in stats.items()
                if k.startswith("cmdstat_")
            }
        )
    return found


@pytest.fixture
def node_calls():
    """``node_calls(nodes) -> [{command: calls}, ...]``: commands each real node has served.

    Subtract two readings to count what a piece of code sent; scripts show as ``evalsha`` (and
    ``eval`` after a NOSCRIPT), the commands they ran inside as themselves (``pexpire``...)."""
    return _sem_node_calls


class _SemEventLog:
    """A Redlock listener that records every LockEvent and lets a test wait for one."""

    def __init__(self):
        self.events = []
        self._cond = _sem_threading.Condition()

    def __call__(self, event):
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind, name=None):
        with self._cond:
            return [e for e in self.events if e.kind == kind and name in (None, e.name)]

    def wait_for(self, kind, name=None, timeout=5.0):
        """The first ``kind`` event (for ``name``), waiting up to ``timeout``; None if none."""
        with self._cond:
            self._cond.wait_for(
                lambda: any(e.kind == kind and name in (None, e.name) for e in self.events), timeout
            )
        found = self.of(kind, name)
        return found[0] if found else None


@pytest.fixture
def event_log():
    """``event_log(redlock) -> log``: attaches a recorder to ``redlock.listeners``."""

    def attach(redlock):
        log = _SemEventLog()
        redlock.listeners.append(log)
        return log

    return attach


# ---- end of lock semantics block ----------------------------------------------------------------


import contextlib  # noqa: E402


# ---- Celery (tests/test_celery*.py): a Redis broker node of their own + the testproject app ----
# The lock nodes are the shared ``redis_nodes`` (emptied before every test); the broker and the
# result backend live on a separate embedded node so that emptying the lock nodes never wipes a
# queue a worker is consuming.
@pytest.fixture(scope="session")
def celery_broker_node():
    """One embedded redis-server used as Celery broker (db 0), result backend (db 1) and the
    example tasks' recorder (db 2)."""
    from django_redlock.testing import RedisNode

    with RedisNode() as node:
        yield node


@pytest.fixture(scope="session")
def celery_test_app(celery_broker_node):
    """``testproject.celery_app.app`` pointed at ``celery_broker_node``. LockedTask acknowledges
    late, so the Redis transport's visibility timeout stays long here (a message whose task
    runs longer comes back while it runs); tests/test_celery_crash.py sets a short one on the
    worker processes it kills."""
    pytest.importorskip("celery")
    from testproject.celery_app import app, configure

    configure(app, celery_broker_node.url, visibility_timeout=600)
    yield app
    # Drop AsyncResults (their __del__ unsubscribes on the backend) while the node still runs.
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        consumer = app.backend.result_consumer
        consumer.stop()
        consumer.subscribed_to.clear()
    # An in-process worker (start_worker) subscribes for the results of the retries it sends,
    # on its threads' own backends; when those AsyncResults are collected after the broker
    # node stopped, __del__ would try to reconnect and print noise at exit. Nothing waits for
    # a result any more at this point.
    from celery.result import AsyncResult

    AsyncResult.__del__ = lambda self: None
    with contextlib.suppress(Exception):
        app.close()


@pytest.fixture(scope="module")
def celery_thread_worker(celery_test_app):
    """A real worker (threads pool, concurrency 4) in this process, shared by a test module."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        celery_test_app,
        pool="threads",
        concurrency=4,
        perform_ping_check=False,
        shutdown_timeout=60,
        loglevel="WARNING",
    ) as worker:
        yield worker


# ---- end of Celery block -------------------------------------------------------------------------


# ---- async core tests (tests/test_core_async.py): AsyncRedlock clients closed after each test --
@pytest.fixture
def make_async_redlock():
    """``make_async_redlock(cluster_or_urls, **kwargs) -> AsyncRedlock``; every client made is
    closed at teardown (the tests drive it with ``asyncio.run``, whose loop shutdown already
    closes that loop's connections; this closes what is left)."""
    import asyncio as _asyncio

    from django_redlock.core.asyncio import AsyncRedlock

    made = []

    def factory(nodes, **kwargs):
        redlock = AsyncRedlock(list(getattr(nodes, "urls", nodes)), **kwargs)
        made.append(redlock)
        return redlock

    yield factory
    for redlock in made:
        with _core_contextlib.suppress(Exception):
            _asyncio.run(redlock.close())


# ---- end of async core tests block -------------------------------------------------------------


# ---- fault-injection suite (tests/faults/, tests/test_faults.py): --soak option + profile ------
pytest_plugins = [*pytest_plugins, "tests.faults.plugin"]
# ---- end of fault-injection block ----------------------------------------------------------------


# ---- Password hashing: the tests' users need none of PBKDF2's cost ----
@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing(django_test_environment):
    """Django's testing docs' advice: the default hasher costs most of a second per user
    created or logged in by password, which the admin and DRF tests do hundreds of times.
    MD5 is for the test run only; testproject's settings (and the demo) keep the default."""
    from django.test.utils import override_settings

    fast = override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"])
    fast.enable()
    yield
    fast.disable()


@pytest.fixture
def holder(admin_redlock_settings, redis_nodes):
    """A Redlock of its own beside the admin's, standing in for another process that holds
    locks (30 s leases)."""
    from django_redlock import Redlock

    rl = Redlock(list(redis_nodes.urls), ttl=30.0)
    yield rl
    rl.close()


@pytest.fixture
def fresh_readiness(monkeypatch):
    """The readiness view with no cached answer, before and after the test."""
    from django_redlock import views
    from django_redlock.probes import probes

    monkeypatch.setattr(views, "READY_CACHE", 0.0)
    probes.forget()
    yield
    probes.forget()
