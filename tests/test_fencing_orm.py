"""The storage side of fencing: ``django_redlock.fencing.fenced_update`` against a real database
(SQLite here; PostgreSQL and MariaDB/MySQL through the ``*_on_postgres``/``*_on_mysql`` wrappers,
which rerun this file's ``rules``/``story`` tests in a subprocess with ``REDLOCK_TEST_DB`` set).

The story: holder A (a child process, fencing, 1 s lease) reads a row, is frozen (SIGSTOP) past
its lease before it writes; B takes the lock with a larger fence and writes; A resumes and writes
with its old fence: rejected, the row keeps B's write.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import FieldDoesNotExist
from django.db import connection, connections
from django.db.models import F

from django_redlock.fencing import afenced_update, fenced_update
from testproject.models import Account
from tests.helpers import database_unreachable, run_pytest

CTX = multiprocessing.get_context("fork")


# ---------------------------------------------------------------- the rule, row by row


@pytest.mark.django_db
def test_rules_stale_equal_and_greater_fences() -> None:
    account = Account.objects.create(name="rules", balance=100, fence=50)
    assert fenced_update(account, 49, balance=1) is False  # stale
    assert fenced_update(account, 50, balance=2) is False  # equal: the same holder's fence
    account.refresh_from_db()  # a holder may only write once per fence ... and the row
    assert (account.balance, account.fence) == (100, 50)  # is untouched by the losers
    assert fenced_update(account, 51, balance=3) is True  # greater: a newer holder
    assert (account.balance, account.fence) == (3, 51)  # the instance follows the row
    account.refresh_from_db()
    assert (account.balance, account.fence) == (3, 51)
    assert fenced_update(account, 51, balance=4) is False
    assert Account.objects.get(pk=account.pk).balance == 3
    # One holder writing the same row twice under one fence, when asked for.
    assert fenced_update(account, 51, allow_equal=True, balance=5) is True
    assert fenced_update(account, 50, allow_equal=True, balance=6) is False
    assert Account.objects.get(pk=account.pk).balance == 5


@pytest.mark.django_db(databases=["default", "second"])
def test_rules_an_instance_is_written_in_its_own_database() -> None:
    """An instance loaded with .using() is fenced and written in that database; a row with the
    same pk elsewhere is not touched (sync and async)."""
    there = Account.objects.using("second").create(name="there", balance=100, fence=10)
    here = Account.objects.create(pk=there.pk, name="here", balance=5, fence=None)
    loaded = Account.objects.using("second").get(pk=there.pk)
    assert fenced_update(loaded, 9, balance=1) is False  # stale against ITS row's fence
    assert fenced_update(loaded, 11, balance=99) is True
    assert async_to_sync(afenced_update)(loaded, 12, balance=98) is True
    assert Account.objects.using("second").values_list("balance", "fence").get(pk=there.pk) == (
        98,
        12,
    )
    assert Account.objects.values_list("balance", "fence").get(pk=here.pk) == (5, None)


@pytest.mark.django_db
def test_rules_null_fence_and_big_fences() -> None:
    account = Account.objects.create(name="fresh", balance=7)
    assert account.fence is None
    # Fences are seeded from the nodes' clocks in microseconds: they need a 64-bit column.
    big = int(time.time() * 1_000_000)
    assert fenced_update(account, big, balance=8) is True
    assert fenced_update(account, big + 1, balance=F("balance") + 1) is True
    account.refresh_from_db()
    assert (account.balance, account.fence) == (9, big + 1)
    assert fenced_update(account, big, balance=0) is False


@pytest.mark.django_db
def test_rules_queryset_and_custom_fence_field() -> None:
    rows = [
        Account.objects.create(name=f"q{i}", balance=0, fence=f)
        for i, f in enumerate([None, 5, 10])
    ]
    qs = Account.objects.filter(pk__in=[r.pk for r in rows])
    # Each row is judged on its own: the rows with a lower (or no) fence are written.
    assert fenced_update(qs, 10, balance=1) is True
    assert sorted(Account.objects.filter(balance=1).values_list("name", flat=True)) == ["q0", "q1"]
    assert fenced_update(qs, 10, balance=2) is False
    # Any integer column can carry the fence (here: the balance, for the sake of the test).
    assert fenced_update(rows[2], 3, fence_field="balance", name="renamed") is True
    assert Account.objects.get(pk=rows[2].pk).name == "renamed"


@pytest.mark.django_db
def test_rules_bad_arguments() -> None:
    account = Account.objects.create(name="bad")
    with pytest.raises(TypeError):
        fenced_update(account, None, balance=1)
    with pytest.raises(TypeError):
        fenced_update(account, "7", balance=1)
    with pytest.raises(TypeError):
        fenced_update(account, True, balance=1)
    with pytest.raises(ValueError, match="saved"):
        fenced_update(Account(name="unsaved"), 1, balance=1)
    with pytest.raises(ValueError, match="fence column"):
        fenced_update(account, 1, fence_field="balance", balance=2)
    with pytest.raises(FieldDoesNotExist):
        fenced_update(account, 1, fence_field="version", balance=1)

    class NoFence:  # a lock acquired without fencing=True
        fence = None

    with pytest.raises(ValueError, match="fencing=True"):
        fenced_update(account, NoFence(), balance=1)


@pytest.mark.django_db
def test_rules_async_variant() -> None:
    account = Account.objects.create(name="async", balance=0, fence=10)
    assert async_to_sync(afenced_update)(account, 9, balance=1) is False
    assert async_to_sync(afenced_update)(account, 11, balance=2) is True
    account.refresh_from_db()
    assert (account.balance, account.fence) == (2, 11)


@pytest.mark.django_db
def test_rules_with_a_real_fenced_lock(redis_nodes, make_redlock) -> None:
    """The lock object itself can be passed; its fence beats every earlier holder's."""
    rl = make_redlock(redis_nodes)
    account = Account.objects.create(name="lock", balance=0)
    fences = []
    for amount in (10, 20):
        with rl.lock("orm:with-lock", fencing=True) as lock:
            assert fenced_update(account, lock, balance=F("balance") + amount) is True
            fences.append(lock.fence)
    account.refresh_from_db()
    assert account.balance == 30 and account.fence == fences[1] > fences[0]
    assert fenced_update(account, fences[0], balance=0) is False


# ---------------------------------------------------------------- the story


def _holder_a(urls, pipe, pk: int, direct: bool) -> None:
    """Holder A: takes the lock, reads the row, and is frozen before it writes."""
    from django_redlock import Redlock

    try:
        rl = Redlock(urls, ttl=1.0)
        lock = rl.lock("orm:story", fencing=True)
        assert lock.acquire(blocking=False)
        balance = 100 if not direct else Account.objects.get(pk=pk).balance
        pipe.send(("acquired", lock.fence, lock.held))
        pipe.recv()  # SIGSTOP lands while A waits here; "go" comes after SIGCONT
        held = lock.held
        if direct:  # A's own database connection
            won = fenced_update(Account.objects.get(pk=pk), lock.fence, balance=balance - 30)
            connections.close_all()
        else:  # in-memory SQLite lives in the test process: it runs A's statement
            pipe.send(("write", lock.fence, balance - 30))
            won = pipe.recv()
        pipe.send(("done", won, held))
    except BaseException as exc:
        pipe.send(("error", repr(exc), None))


def _recv(pipe, timeout: float = 10.0):
    assert pipe.poll(timeout), "holder A did not answer"
    return pipe.recv()


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP and fork")
@pytest.mark.django_db(transaction=True)
def test_story_paused_holder_write_is_rejected(redis_nodes, make_redlock) -> None:
    account = Account.objects.create(name="story", balance=100)
    direct = not (connection.vendor == "sqlite" and connection.is_in_memory_db())
    if direct:
        connections.close_all()  # the child opens its own connection, never shares ours
    ours, theirs = CTX.Pipe()
    child = CTX.Process(target=_holder_a, args=(list(redis_nodes.urls), theirs, account.pk, direct))
    child.start()
    try:
        kind, fence_a, held = _recv(ours)
        assert kind == "acquired" and held, (kind, fence_a)
        os.kill(child.pid, signal.SIGSTOP)
        # B waits for the lock. Frozen A cannot release it, so B gets it only once A's lease
        # has run out on the nodes: from then on A is frozen past its lease.
        b = make_redlock(redis_nodes, ttl=5.0).lock("orm:story", fencing=True)
        assert b.acquire(timeout=5)
        assert b.fence > fence_a
        assert fenced_update(Account.objects.get(pk=account.pk), b.fence, balance=150) is True
        os.kill(child.pid, signal.SIGCONT)
        ours.send("go")
        message = _recv(ours)
        if message[0] == "write":  # run A's statement for it (in-memory SQLite)
            _, fence, value = message
            ours.send(fenced_update(Account.objects.get(pk=account.pk), fence, balance=value))
            message = _recv(ours)
        kind, won, held_after = message
        assert kind == "done", message
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.join(5)
        if child.is_alive():
            child.kill()
    assert won is False, "the paused holder's late write went through"
    assert held_after is False  # A could also have seen it: its lease had run out
    account.refresh_from_db()
    assert (account.balance, account.fence) == (150, b.fence)  # B's write stands
    b.release()


# ---------------------------------------------------------------- the other databases


def _run_on(kind: str) -> None:
    if os.environ.get("REDLOCK_TEST_DB", "sqlite") != "sqlite":
        pytest.skip("already running against a database server")
    reason = database_unreachable(kind)
    if reason:
        pytest.skip(reason)  # a failure under REDLOCK_REQUIRE_ALL=1 (tests/conftest.py)
    env = dict(os.environ)
    env["REDLOCK_TEST_DB"] = kind
    # pytest-django appends this to the test database's name (test_test_<suffix>): several
    # runs on one server (engineers, CI jobs) never create or drop each other's database.
    env["TOX_PARALLEL_ENV"] = f"redlock{os.getpid()}_{uuid.uuid4().hex[:6]}"
    code, output = run_pytest(["tests/test_fencing_orm.py", "-k", "story or rules"], env, 180)
    assert code == 0, output[-4000:]
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) >= 7 and "skipped" not in output, output[-2000:]


@pytest.mark.postgres
def test_fencing_on_postgres() -> None:
    _run_on("postgres")


@pytest.mark.mysql
def test_fencing_on_mysql() -> None:
    _run_on("mysql")
