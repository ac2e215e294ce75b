"""Lock names come from clients (a key template's values are escaped in the key, a key
function's result is not): every log line that carries one writes it escaped (docs/usage.rst,
"Logging"), so a name cannot forge a log line or send terminal escapes. Real Redis nodes."""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

import pytest

from django_redlock import LockNotOwned, Redlock, get_redlock, locked
from django_redlock.core import printable
from django_redlock.signals import lock_lost
from django_redlock.testing import RedisCluster
from tests.helpers import held_everywhere

#: CR, LF, ESC, a backslash, and a backslash sequence that must not read as an escape.
EVIL = "inv\r\nCRITICAL django_redlock forged \x1b[2J\\x1b\\"
ESCAPED = "inv\\r\\nCRITICAL django_redlock forged \\x1b[2J\\\\x1b\\\\"
RAW = {"\r", "\n", "\x1b"}


def lines(caplog: Any, level: int = logging.WARNING) -> list[str]:
    """This package's lines (Django's own, such as send_robust's, are not ours to escape)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= level and r.name.startswith("django_redlock")
    ]


def assert_escaped(messages: list[str]) -> None:
    assert messages
    for message in messages:
        assert not RAW & set(message), repr(message)
        assert ESCAPED in message, repr(message)


def test_the_escaper_writes_what_usage_rst_shows() -> None:
    assert printable(EVIL) == ESCAPED
    assert printable("plain:name/é") == "plain:name/é"
    assert printable(ESCAPED) != ESCAPED  # a backslash is escaped too: nothing reads as EVIL


def test_a_force_released_and_lost_lock_logs_its_name_escaped(
    redis_nodes: RedisCluster, make_redlock, caplog
) -> None:
    """The operator's force release (same client: force_released and lost at once)."""
    rl = make_redlock(redis_nodes)
    lock = rl.lock(EVIL, ttl=10)
    assert lock.acquire(blocking=False)
    caplog.set_level(logging.WARNING, logger="django_redlock")
    held_everywhere(redis_nodes, EVIL)
    assert rl.force_release(EVIL) == 3
    kinds = {getattr(r, "lock_event", None) for r in caplog.records}
    assert {"force_released", "lost"} <= kinds, kinds
    assert_escaped(lines(caplog))
    with pytest.raises(LockNotOwned):
        lock.release()


def test_a_lock_lost_by_its_renewal_logs_its_name_escaped(
    redis_nodes: RedisCluster, make_redlock, caplog
) -> None:
    """Another client removes the lock: the holder's renewal finds it gone."""
    caplog.set_level(logging.WARNING, logger="django_redlock")
    rl, other = make_redlock(redis_nodes), make_redlock(redis_nodes)
    heard = threading.Event()
    rl.listeners.append(lambda e: e.kind == "lost" and heard.set())
    lock = rl.lock(EVIL, ttl=3, auto_renew=True)
    assert lock.acquire(blocking=False)
    held_everywhere(redis_nodes, EVIL)
    assert other.force_release(EVIL) == 3
    assert heard.wait(30)
    assert_escaped(lines(caplog))
    with pytest.raises(LockNotOwned):
        lock.release()


@pytest.mark.usefixtures("redlock_settings")
def test_locked_with_a_key_function_logs_its_names_escaped(caplog) -> None:
    """@locked(key=callable): the lost line, the failed release after a failed call, and a
    lock_lost receiver that raised, each with the raw name of the key function escaped."""
    caplog.set_level(logging.WARNING, logger="django_redlock")

    def broken_receiver(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"receiver broke on {kwargs['name']}")

    @locked(key=lambda name: name, ttl=10)
    def job(name: str) -> None:
        assert get_redlock().force_release(name) == 3
        raise ValueError("the job failed too")

    lock_lost.connect(broken_receiver, weak=False)
    try:
        with pytest.raises(ValueError):
            job(EVIL)
    finally:
        lock_lost.disconnect(broken_receiver)
    events = {getattr(r, "lock_event", None) for r in caplog.records}
    assert {"lost", "force_released", "release_failed"} <= events, events
    assert any("receiver" in m for m in lines(caplog, logging.ERROR)), lines(caplog)
    assert_escaped(lines(caplog))


def test_managers_of_other_services_log_through_the_same_escaper(
    redis_nodes: RedisCluster, caplog
) -> None:
    """The lines come from the core's events, whatever manager emits them: a Redlock built
    by hand without Django settings logs the same escaped form."""
    rl = Redlock(list(redis_nodes.urls))
    try:
        lock = rl.lock(EVIL + "plain", ttl=10)
        assert lock.acquire(blocking=False)
        caplog.set_level(logging.WARNING, logger="django_redlock")
        held_everywhere(redis_nodes, EVIL + "plain")
        assert rl.force_release(EVIL + "plain") == 3
        assert_escaped(lines(caplog))
    finally:
        rl.close()


# celery_test_app: a task of the test project's app run before the app is configured would
# fix its result backend to the defaults for the rest of the process, and a later module's
# worker would never see a result (tests/test_promises_celery.py).
@pytest.mark.usefixtures("redlock_settings", "celery_test_app")
def test_a_locked_task_with_a_key_function_logs_its_name_escaped(caplog) -> None:
    """A LockedTask whose lock_key is a function of its arguments: skipped because the lock
    is held, its WARNING names the lock escaped (and the holder, whose path is a client's)."""
    import uuid

    from django_redlock.celery import LockedTask
    from testproject import tasks

    caplog.set_level(logging.WARNING, logger="django_redlock")

    @tasks.app.task(
        name=f"tests.log_escaping.{uuid.uuid4().hex[:8]}",
        base=LockedTask,
        bind=True,
        lock_key=lambda name: name,
        on_locked="skip",
    )
    def task(self: Any, name: str) -> str:
        return "ran"

    holder = get_redlock().lock(EVIL, ttl=10, meta={"path": "/x\r\nforged\x1b[31m"})
    assert holder.acquire(blocking=False)
    try:
        assert task.apply(args=(EVIL,)).get() is None  # skipped, not run
    finally:
        holder.release()
    skipped = [m for m in lines(caplog) if "skipped" in m]
    assert skipped, lines(caplog)
    assert_escaped(skipped)


@pytest.mark.usefixtures("redlock_settings")
def test_the_audit_line_of_a_forced_release_writes_the_name_and_holder_escaped(caplog) -> None:
    """``manage.py redlock release --force`` audits the name and the holder (whose path is a
    client's) in the same escaped form, written once (no doubled backslashes)."""
    from django.core.management import call_command

    holder = get_redlock().lock(EVIL, ttl=10, meta={"path": "/x\r\nforged\x1b[31m"})
    assert holder.acquire(blocking=False)
    with caplog.at_level(logging.WARNING, logger="django_redlock.audit"):
        call_command("redlock", "release", EVIL, "--force", stdout=io.StringIO())
    audited = [m for m in lines(caplog) if "released lock" in m]
    assert_escaped(audited)
    assert "/x\\r\\nforged\\x1b[31m" in audited[0]
