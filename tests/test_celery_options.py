"""LockedTask's per-call options and raw headers, ``lock_dedupe`` on a service without leases,
and the worker's ``revoke`` with ``REDLOCK["BACKENDS"]`` set (docs/celery.rst "Per-call
options", "Duplicates at enqueue time", "Revoking"; docs/checks.rst E012, E107).

The worker tests run a real Celery worker (threads pool, in this process) on a real Redis
broker, real lock nodes and a real etcd; the refusals at send time need no worker (nothing is
sent), and are checked against a broker that would have taken the message.
"""

from __future__ import annotations

import uuid
from typing import Any

import celery
import pytest
from celery import signals as celery_signals

from django_redlock.backends.registry import get_locks
from django_redlock.celery import LockedTask, _note_revoked, _revoked_name
from testproject import tasks
from tests import test_celery
from tests.backends import servers
from tests.celery_support import TIMEOUT, Run, drop_queue

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]

#: The fixtures of tests/test_celery.py: the Redlock the tasks use, the in-process worker.
rl = test_celery.rl
worker = test_celery.worker
#: A queue no worker of these tests reads: a task sent there stays queued.
PARKED = "redlock-test-unread-options"
ETCD_ALIAS = "options-etcd"
ZK = {
    "BACKEND": "django_redlock.backends.zookeeper.ZooKeeperLocks",
    # Never contacted: building the backend opens no session, and a refusal sends nothing.
    "OPTIONS": {"hosts": "127.0.0.1:1", "connect_timeout": 1},
}

#: De-duplicated on an etcd backend: registered before the module's worker starts (a worker
#: knows the tasks registered when it starts). Elsewhere its alias is not configured, and the
#: worker's revoke skips it.


@tasks.app.task(
    name="tests.options.etcd_dedupe",
    base=LockedTask,
    bind=True,
    lock_key="options:{key}",
    lock_dedupe=True,
    lock_using=ETCD_ALIAS,
)
def etcd_dedupe(self: Any, key: str) -> dict[str, Any]:
    return {"key": key, "task_id": self.request.id}


#: Raw ``redlock`` headers a worker must refuse, the error and what it names.
MALFORMED = [
    ({"tll": 5}, TypeError, "unknown fields in the redlock header: 'tll'"),
    ("notadict", TypeError, "the redlock header must be a dict"),
    ({"ttl": -1}, ValueError, "lock_ttl must be finite and > 0"),
]
MALFORMED_IDS = ["unknown-field", "not-a-dict", "bad-value"]


@pytest.fixture(scope="module")
def etcd_server():
    with servers.etcd() as server:
        yield server


class Published:
    """Messages the producer publishes (``before_task_publish``, sent in this process)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        self.names.append(str(sender))

    def __enter__(self) -> Published:
        celery_signals.before_task_publish.connect(self, weak=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        celery_signals.before_task_publish.disconnect(self)


def memory_app() -> Any:
    """An app whose broker takes any message (kombu's in-memory transport)."""
    name = f"options-{uuid.uuid4().hex[:8]}"
    return celery.Celery(name, broker="memory://", backend="cache+memory://")


def unique(name: str) -> str:
    """A task name of its own for each app a test makes (Celery warns on a name reused)."""
    return f"options.{name}.{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- per-call options


@pytest.mark.parametrize(
    ("send", "named"),
    [
        (lambda t: t.apply_async((1,), lock_tll=5), "unknown options: lock_tll"),
        (lambda t: t.s(1).set(lock_wiat=5).delay(), "unknown options: lock_wiat"),
        (lambda t: t.apply((1,), lock_tll=5), "unknown options: lock_tll"),
        (lambda t: t.apply_async((1,), lock_using="zk"), "never per call: lock_using"),
        (lambda t: t.apply_async((1,), lock_redlock=None), "never per call: lock_redlock"),
    ],
    ids=["apply_async-typo", "signature-typo", "apply-typo", "lock_using", "lock_redlock"],
)
def test_a_misnamed_per_call_option_is_refused_when_sent(rl, send, named) -> None:
    """docs/celery.rst "Per-call options": a ``lock_*`` keyword that is no per-call option is
    refused before anything is sent (a TypeError naming the task and the option), as
    ``LOCKED_TASK`` with the same name is E012; it was sent and run with the defaults."""
    app = memory_app()

    @app.task(
        base=LockedTask, bind=True, name=unique("sync"), lock_key="options:{x}", lock_redlock=rl
    )
    def sync(self, x: int) -> int:  # pragma: no cover - never runs
        return x

    with Published() as published, pytest.raises(TypeError, match=named) as caught:
        send(sync)
    assert sync.name in str(caught.value)
    assert published.names == []
    # The spelling it meant is sent (the broker takes it), so the refusal is the typo's.
    with Published() as published:
        sync.apply_async((1,), lock_ttl=5)
    assert published.names == [sync.name]


@pytest.mark.parametrize(("header", "error", "named"), MALFORMED, ids=MALFORMED_IDS)
def test_a_raw_header_is_judged_when_sent_through_the_task(rl, header, error, named) -> None:
    """``apply_async(headers={"redlock": ...})`` passes through LockedTask: judged at send time
    by the code the worker runs on a raw header."""
    app = memory_app()

    @app.task(
        base=LockedTask, bind=True, name=unique("sync"), lock_key="options:{x}", lock_redlock=rl
    )
    def sync(self, x: int) -> int:  # pragma: no cover - never runs
        return x

    with Published() as published, pytest.raises(error, match=named):
        sync.apply_async((1,), headers={"redlock": header})
    assert published.names == []


@pytest.mark.parametrize(("header", "error", "named"), MALFORMED, ids=MALFORMED_IDS)
def test_a_malformed_raw_header_fails_the_task_on_the_worker(
    worker, rl, celery_test_app, header, error, named
) -> None:
    """docs/celery.rst: a raw header sent with ``send_task`` (no LockedTask on the producer
    side) is checked by the worker, which fails the task with a ValueError or TypeError: an
    unknown field or a header that is no dict as a bad value does. Before, both ran the task
    with the defaults."""
    run = Run()
    result = celery_test_app.send_task(
        "testproject.critical", ("options-raw", run.id), headers={"redlock": header}
    )
    with pytest.raises(error, match=named):
        result.get(timeout=TIMEOUT)
    assert result.state == "FAILURE"
    assert run.all("started") == []  # the body never ran
    assert not rl.locked("demo:options-raw")
    # A well-formed raw header on the same worker runs.
    good = celery_test_app.send_task(
        "testproject.critical", ("options-raw", run.id), headers={"redlock": {"ttl": 5}}
    )
    assert good.get(timeout=TIMEOUT)["task_id"] == good.id


# --------------------------------------------------------------------------- dedupe, no lease


def zk_settings(rl_settings: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**rl_settings, "BACKENDS": {"zk": ZK}, **extra}


def test_dedupe_on_a_service_without_leases_is_refused_when_sent(settings, redlock_settings):
    """docs/celery.rst / docs/backends.rst: a ZooKeeper lock lives as long as its holder's
    session, so a queued marker there would follow the sending process, not
    ``lock_dedupe_ttl``: ``lock_dedupe`` on such a service is a ValueError at send time
    (the task's own, per call, or the project's LOCKED_TASK default); nothing is sent. The
    same task without de-duplication sends."""
    settings.REDLOCK = zk_settings(redlock_settings)
    app = memory_app()

    @app.task(
        base=LockedTask,
        bind=True,
        name=unique("own"),
        lock_key="zkd:{x}",
        lock_using="zk",
        lock_dedupe=True,
    )
    def own(self, x: int) -> None:  # pragma: no cover - never runs
        return None

    @app.task(base=LockedTask, bind=True, name=unique("plain"), lock_key="zkp:{x}", lock_using="zk")
    def plain(self, x: int) -> None:  # pragma: no cover - never runs
        return None

    with Published() as published:
        with pytest.raises(
            ValueError, match=r"task options\.own\.\w+: lock_dedupe .merge..*ZooKeeperLocks"
        ):
            own.delay(1)
        with pytest.raises(ValueError, match=r"per-call options\): lock_dedupe 'drop'.*E107"):
            plain.apply_async((1,), lock_dedupe="drop")
        assert published.names == []
        own.apply_async((1,), lock_dedupe=False)
        plain.delay(1)
        assert published.names == [own.name, plain.name]

    settings.REDLOCK = zk_settings(redlock_settings, LOCKED_TASK={"lock_dedupe": True})
    with Published() as published, pytest.raises(ValueError, match="lock_dedupe"):
        plain.delay(2)
    assert published.names == []


def test_check_e107_names_a_task_that_dedupes_on_a_service_without_leases(
    settings, redlock_settings
) -> None:
    """docs/checks.rst E107: the system check names each task whose ``lock_dedupe`` (its own
    or LOCKED_TASK's) would use a service without leases; tasks that do not de-duplicate
    there, and de-duplication on the Redlock, pass."""
    from django.core.checks import run_checks

    settings.REDLOCK = zk_settings(redlock_settings)
    app = memory_app()
    tag = uuid.uuid4().hex[:8]

    @app.task(base=LockedTask, name=f"{tag}.own", lock_using="zk", lock_dedupe="raise")
    def own(x: int) -> None:  # pragma: no cover - never runs
        return None

    @app.task(base=LockedTask, name=f"{tag}.plain", lock_using="zk")
    def plain(x: int) -> None:  # pragma: no cover - never runs
        return None

    @app.task(base=LockedTask, name=f"{tag}.redis", lock_dedupe=True)
    def on_redis(x: int) -> None:  # pragma: no cover - never runs
        return None

    def flagged() -> list[str]:
        return sorted(
            m.msg.split("'")[1]
            for m in run_checks(tags=["django_redlock"])
            if m.id == "django_redlock.E107" and tag in m.msg
        )

    assert flagged() == [f"{tag}.own"]
    settings.REDLOCK = zk_settings(redlock_settings, LOCKED_TASK={"lock_dedupe": True})
    assert flagged() == [f"{tag}.own", f"{tag}.plain"]


# --------------------------------------------------------------------------- revoke, backends


def test_a_revoke_notes_the_task_on_each_service_one_failing_or_not(rl) -> None:
    """The worker's revoke step writes ``celery:revoked:<id>`` on every lock service the app's
    LockedTasks use; a service that fails (an etcd nobody answers on) is logged and the
    others still get their note, and nothing is raised into the revoke's reply. A service
    without leases (ZooKeeper: no marker can live there) is not asked at all."""
    from django_redlock.backends.etcd import EtcdLocks
    from django_redlock.backends.zookeeper import ZooKeeperLocks

    dead = EtcdLocks(f"http://127.0.0.1:{servers.free_port()}", request_timeout=1.0)
    sessions = ZooKeeperLocks("127.0.0.1:1", connect_timeout=0.5)
    app = memory_app()

    def noop() -> None:  # pragma: no cover - never runs
        return None

    for service in (dead, rl, sessions):
        app.task(base=LockedTask, name=unique("note"), lock_redlock=service)(noop)
    task_id = uuid.uuid4().hex
    try:
        _note_revoked(app, [task_id])
        assert rl.locked(_revoked_name(task_id))
        assert rl.lock_info(_revoked_name(task_id)).ttl > rl.max_ttl - 5
        assert sessions._client.connected is False  # never asked
    finally:
        rl.force_release(_revoked_name(task_id))
        dead.close()
        sessions.close()


def test_revoke_replies_and_frees_a_backend_marker(
    worker, rl, settings, redlock_settings, etcd_server, celery_test_app, celery_broker_node
) -> None:
    """docs/celery.rst "Revoking" with ``REDLOCK["BACKENDS"]`` set: the revoke's reply is
    Celery's own (it was ``{'error': "ValueError('ttl must be finite and > 0, got inf')"}``),
    and once it is in, a ``lock_dedupe`` task on the backend (``lock_using``) is no longer
    merged into the revoked one: the next call sends a task of its own, which runs."""
    root = f"/redlock-options-{uuid.uuid4().hex[:8]}"
    etcd = {
        "BACKEND": "django_redlock.backends.etcd.EtcdLocks",
        "OPTIONS": {"endpoints": [etcd_server.address], "root": root},
    }
    settings.REDLOCK = {**redlock_settings, "BACKENDS": {ETCD_ALIAS: etcd}}
    key = uuid.uuid4().hex[:8]
    parked = etcd_dedupe.apply_async((key,), queue=PARKED)
    try:
        service = get_locks(ETCD_ALIAS)
        assert service.locked(f"options:{key}:queued")
        assert etcd_dedupe.delay(key).id == parked.id  # merged, as promised
        replies = celery_test_app.control.revoke(parked.id, reply=True, timeout=10, limit=1)
        assert replies, "the worker did not confirm the revoke"
        answers = [answer for reply in replies for answer in reply.values()]
        assert answers == [{"ok": f"tasks {{{parked.id!r}}} flagged as revoked"}]
        assert service.locked(_revoked_name(parked.id))
        fresh = etcd_dedupe.delay(key)
        assert fresh.id != parked.id, "merged into a revoked task: this call's work is lost"
        assert fresh.get(timeout=TIMEOUT) == {"key": key, "task_id": fresh.id}
    finally:
        drop_queue(celery_broker_node.url, PARKED)
        rl.force_release(_revoked_name(parked.id))
