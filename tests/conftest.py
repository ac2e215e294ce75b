pytest_plugins = ["django_redlock.testing"]


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
    settings.REDLOCK = {"NODES": list(redis_nodes.urls), "TTL": 10.0}
    yield settings.REDLOCK
    from django_redlock.conf import reset

    reset()


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
        found.append({k[len("cmdstat_"):]: int(v["calls"]) for k, v in stats.items()
                      if k.startswith("cmdstat_")})
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
            self._cond.wait_for(lambda: any(
                e.kind == kind and name in (None, e.name) for e in self.events), timeout)
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
