"""Lock events arrive as Django signals (sent from the shared Redlock's core listener)."""

from __future__ import annotations

import contextlib
import logging
import time

import django
import pytest

from django_redlock import LockNotAcquired, Redlock, get_redlock, locked
from django_redlock.signals import (
    lock_acquired,
    lock_contended,
    lock_force_released,
    lock_lost,
    lock_released,
)

pytestmark = pytest.mark.usefixtures("redlock_settings")


@contextlib.contextmanager
def capture(*signals):
    got = []

    def receiver(signal, sender, **kwargs):
        got.append((signal, sender, kwargs))

    for signal in signals:
        signal.connect(receiver, weak=False)
    try:
        yield got
    finally:
        for signal in signals:
            signal.disconnect(receiver)


ALL = (lock_acquired, lock_released, lock_contended, lock_lost, lock_force_released)


def test_acquired_and_released_carry_name_token_meta_and_timings():
    with capture(*ALL) as got:

        @locked("sig:{n}", meta={"purpose": "test"})
        def job(n):
            return get_redlock().lock_info(f"sig:{n}").token

        token = job(1)
    assert [g[0] for g in got] == [lock_acquired, lock_released]
    (_, sender, acquired), (_, _, released) = got
    assert sender is Redlock
    assert acquired["redlock"] is get_redlock()
    assert acquired["name"] == released["name"] == "sig:1"
    assert acquired["token"] == released["token"] == token
    assert acquired["meta"]["purpose"] == "test" and acquired["meta"]["function"].endswith("job")
    assert acquired["waited"] >= 0 and released["held"] >= 0
    assert acquired["event"].kind == "acquired"


def test_contended_has_retry_after():
    holder = get_redlock().lock("sig", 10, owner="other")
    assert holder.acquire(blocking=False)
    try:
        with capture(lock_contended) as got, pytest.raises(LockNotAcquired):
            with locked("sig"):
                pass
    finally:
        holder.release()
    assert len(got) == 1
    kwargs = got[0][2]
    assert kwargs["name"] == "sig" and kwargs["token"] is None
    assert 0 < kwargs["retry_after"] <= 10


def test_force_release_sends_lost_and_force_released():
    lock = get_redlock().lock("sig")
    assert lock.acquire(blocking=False)
    token = lock.token
    with capture(lock_lost, lock_force_released) as got:
        assert get_redlock().force_release("sig") == 3
    kinds = {g[0]: g[2] for g in got}
    assert kinds[lock_force_released]["nodes"] == 3
    assert kinds[lock_force_released]["name"] == "sig"
    assert kinds[lock_lost]["token"] == token
    assert "force" in kinds[lock_lost]["reason"]


def test_a_hold_ends_once_lost_or_released_never_both():
    from django_redlock import LockLost, LockNotOwned

    forced = get_redlock().lock("sig:forced", 10)
    assert forced.acquire(blocking=False)
    with capture(lock_released, lock_lost) as got:
        get_redlock().force_release("sig:forced")
        with pytest.raises(LockLost):
            forced.release()
    assert [g[0] for g in got] == [lock_lost]

    ran_out = get_redlock().lock("sig:ran-out", 0.6)
    assert ran_out.acquire(blocking=False)
    while get_redlock().locked("sig:ran-out"):  # the nodes expire it
        time.sleep(0.02)
    with capture(lock_released, lock_lost) as got:
        with pytest.raises(LockNotOwned):
            ran_out.release()
    assert [g[0] for g in got] == [lock_lost]
    assert "ran out" in got[0][2]["reason"]


def test_a_failing_receiver_never_breaks_locking(caplog):
    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    lock_acquired.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django_redlock"):
            with locked("sig") as lock:
                assert lock.held
    finally:
        lock_acquired.disconnect(broken)
    assert not get_redlock().locked("sig")
    assert "receiver bug" in caplog.text or "failed" in caplog.text


def test_a_failing_receiver_is_skipped_and_the_others_still_run(caplog):
    """An alerting receiver must not be silenced by an unrelated app's broken one."""
    seen = []

    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    def alert(name, **kwargs):
        seen.append(name)

    lock_acquired.connect(broken, weak=False)
    lock_acquired.connect(alert, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django_redlock"):
            with locked("sig"):
                pass
    finally:
        lock_acquired.disconnect(broken)
        lock_acquired.disconnect(alert)
    assert seen == ["sig"]
    record = next(
        r for r in caplog.records if r.name == "django_redlock" and "receiver bug" in r.getMessage()
    )
    assert "broken" in record.getMessage() and "lock_acquired" in record.getMessage()


def test_refused_view_is_logged(client, caplog):
    holder = get_redlock().lock("order:8", owner="other")
    assert holder.acquire(blocking=False)
    try:
        with caplog.at_level(logging.INFO, logger="django_redlock"):
            assert client.get("/orders/8/pay/").status_code == 423
    finally:
        holder.release()
    record = next(r for r in caplog.records if getattr(r, "lock_event", None) == "refused")
    assert record.lock_name == "order:8" and "GET /orders/8/pay/" in record.getMessage()


def test_async_redlock_sends_the_same_signals():
    import asyncio

    from django_redlock.core.asyncio import AsyncRedlock

    @locked("asig")
    async def job():
        return "ok"

    with capture(lock_acquired, lock_released) as got:
        assert asyncio.run(job()) == "ok"
    assert [g[0] for g in got] == [lock_acquired, lock_released]
    assert got[0][1] is AsyncRedlock and got[0][2]["name"] == "asig"


def test_force_release_of_an_unheld_lock_sends_no_force_released():
    """docs/usage.rst: ``lock_force_released`` means an operator removed a lock; ``release
    --force`` of a lock no node had is an error, not a release, so nothing is sent (an alert
    wired to the signal must not fire for nothing)."""
    from django.core.management import CommandError, call_command

    assert not get_redlock().locked("sig:nobody")
    with capture(lock_force_released) as got, pytest.raises(CommandError):
        call_command("redlock", "release", "sig:nobody", "--force")
    assert got == []


@pytest.mark.django_db
def test_admin_release_of_a_retaken_lock_sends_no_force_released(client):
    """docs/admin.rst: a lock taken by another holder since the confirmation page was shown is
    left alone and reported, and no ``lock_force_released`` is sent for it."""
    import json

    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("sig-admin", password="p"))
    rl = get_redlock()
    first = rl.lock("sig:retaken", ttl=60)
    assert first.acquire(blocking=False)
    stale = first.token
    first.release()
    second = rl.lock("sig:retaken", ttl=60)
    assert second.acquire(blocking=False)
    try:
        with capture(lock_force_released) as got:
            client.post(
                "/admin/django_redlock/lock/release/",
                {"selection": json.dumps([["sig:retaken", stale]]), "confirm": "yes"},
                follow=True,
            )
        assert second.check()  # left alone
        assert got == []
    finally:
        second.release()


def _receiver_failures(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    """The records, on any logger, that tell of a receiver failing with ``text``."""
    return [
        r
        for r in caplog.records
        if r.exc_info and r.exc_info[1] is not None and text in str(r.exc_info[1])
    ]


@contextlib.contextmanager
def connected(signal, *receivers):
    for receiver in receivers:
        signal.connect(receiver, weak=False)
    try:
        yield
    finally:
        for receiver in receivers:
            signal.disconnect(receiver)


def test_a_failing_receiver_is_logged_once_with_the_lock_and_its_traceback(caplog):
    """Django's send_robust logs a failing receiver itself ("django.dispatch", Django 4.1 and
    later): with send_event's own record that made two per failure. One record per failing
    receiver, on any logger, naming the lock and the event, with the traceback; the other
    receivers still run."""
    seen = []

    def broken(**kwargs):
        raise RuntimeError("first receiver bug")

    def also_broken(**kwargs):
        raise ValueError("second receiver bug")

    def alert(name, **kwargs):
        seen.append(name)

    with connected(lock_acquired, broken, alert, also_broken), caplog.at_level(logging.ERROR):
        with locked("sig:once"):
            pass
    assert seen == ["sig:once"]
    for text, receiver in (("first receiver bug", "broken"), ("second receiver bug", "also")):
        [record] = _receiver_failures(caplog, text)
        assert record.name == "django_redlock" and record.levelno == logging.ERROR
        assert record.lock_name == "sig:once" and record.lock_event == "acquired"
        assert receiver in record.getMessage() and "lock_acquired" in record.getMessage()
        assert record.exc_info[2] is not None  # the traceback, down to the receiver's raise
        assert text in caplog.text.split(record.getMessage(), 1)[1]


def test_a_failure_inside_a_receiver_of_another_signal_is_still_logged(caplog):
    """Only the lock signals' own receivers are logged by send_event: a receiver that sends
    another signal robustly leaves that signal's failures to Django's record."""
    from django.dispatch import Signal

    other = Signal()

    def nested_broken(**kwargs):
        raise RuntimeError("nested receiver bug")

    def relay(**kwargs):
        other.send_robust(sender=None)

    with connected(other, nested_broken), connected(lock_acquired, relay):
        with caplog.at_level(logging.ERROR), locked("sig:nested"):
            pass
    [record] = _receiver_failures(caplog, "nested receiver bug")
    assert record.name == "django.dispatch"


# Django runs async receivers from 5.0 on; there is nothing of theirs to log before (and a
# skip would fail CI's runs, where every skip is a failure).
if django.VERSION >= (5, 0):

    def test_a_failing_async_receiver_is_logged_once(caplog):
        async def broken_async(**kwargs):
            raise RuntimeError("async receiver bug")

        with connected(lock_acquired, broken_async), caplog.at_level(logging.ERROR):
            with locked("sig:async-once"):
                pass
        [record] = _receiver_failures(caplog, "async receiver bug")
        assert record.name == "django_redlock" and record.lock_name == "sig:async-once"
