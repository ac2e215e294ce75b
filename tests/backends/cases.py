"""Checks every lock backend must pass, written once and run by each backend's test file.

The ``test_*`` functions are imported into each backend's test module, which provides the
fixtures they take: ``make`` (builds a manager in this process), ``name`` (a fresh lock name)
and ``wake_within`` (how soon a release must wake a waiter there). The multi-process helpers
also take ``spec`` (how tests/backends/contender.py builds the same backend in a child
process) and ``env`` (the child's environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from html import unescape as html_unescape
from pathlib import Path
from typing import Any

import pytest

from django_redlock import LockLost, LockNotAcquired, LockNotOwned
from django_redlock.backends.base import AsyncLocks, LockManager, glob_escape
from tests.faults.history import HistoryWriter, find_overlaps, load_events, load_holds
from tests.helpers import REPO_ROOT, wait_until

Make = Callable[..., Any]


@contextlib.contextmanager
def managers(build: Make) -> Iterator[Make]:
    """A ``make`` fixture's body: ``build(**options)`` made managers, closed at the end."""
    made: list[Any] = []

    def make(**options: Any) -> Any:
        made.append(build(**options))
        return made[-1]

    try:
        yield make
    finally:
        for locks in made:
            locks.close()


def dead_pid() -> int:
    """The pid of a process of this host that has exited (a holder that is gone)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def svc_settings(entry: dict[str, Any]) -> dict[str, Any]:
    """``REDLOCK`` naming backend ``entry`` "svc" beside a Redlock default."""
    return {"NODES": ["redis://127.0.0.1:6379/0"], "BACKENDS": {"svc": entry}}


@contextlib.contextmanager
def another_holder(entry: dict[str, Any]) -> Iterator[Any]:
    """Backend ``entry`` built apart from the registry's: a holder other than the admin's
    or the management command's own manager."""
    from django_redlock.backends.registry import build_backend

    other = build_backend("svc", entry)
    try:
        yield other
    finally:
        other.close()


def admin_node_page(
    admin_client: Any,
    entry: dict[str, Any],
    name: str,
    *,
    heading: str,
    columns: list[str],
    leftover: Callable[[Any, str], None] | None = None,
) -> None:
    """The admin's node health page, switched to backend ``entry`` (alias "svc"), names the
    service's kind and its nodes in ``heading``, shows exactly ``columns`` (those its
    ``health()`` fills in), and any lock count there is the number of locks the list shows,
    whatever ``leftover(manager, name)`` left behind on the service."""
    from django.test import override_settings

    url = "/admin/django_redlock/lock/"
    with another_holder(entry) as other, override_settings(REDLOCK=svc_settings(entry)):
        held = [other.lock(f"{name}/held-{i}", ttl=30) for i in range(2)]
        assert all(lock.acquire(blocking=False) for lock in held)
        for i in range(3):  # released locks: gone from the list, so from the count too
            with other.lock(f"{name}/done-{i}", ttl=30):
                pass
        if leftover is not None:
            leftover(other, name)
        html = admin_client.get(url + "nodes/", {"using": "svc"}).content.decode()
        assert f"<h1>{heading}</h1>" in html, re.search(r"<h1>.*?</h1>", html)
        assert "Redis" not in html or heading.startswith("Redis")
        table = html[html.index('id="redlock-health"') :]
        assert re.findall(r'<th scope="col">([^<]*)</th>', table) == columns
        cells = re.findall(r"<tr[^>]*>\s*(<td.*?)</tr>", table, re.S)
        assert cells and all(cell.count("<td") == len(columns) for cell in cells), cells
        assert 'alt="yes"' in table
        listed = admin_client.get(url).content.decode()  # still on "svc"
        shown = set(re.findall(r'<tr[^>]*data-key="([^"]+)"', listed))
        counts = re.findall(r'<td data-col="locks">(\d+)</td>', table)
        if "Locks" in columns:
            assert counts == [str(len(shown))], (counts, shown)
            assert {lock.name for lock in held} <= shown
        else:
            assert counts == []
        for lock in held:
            lock.release()


def admin_round_trip(admin_client: Any, entry: dict[str, Any], name: str) -> None:
    """The admin page, switched to backend ``entry`` (alias "svc"), lists its locks with
    their holders and stuck flags, shows one's details, force-releases one through the
    confirmation page, and releases the rest by pattern."""
    from django.test import override_settings

    redlock = svc_settings(entry)
    url = "/admin/django_redlock/lock/"
    with another_holder(entry) as other:
        alive = other.lock(f"{name}/alive", ttl=30, meta={"job": "round-trip"})
        gone = other.lock(f"{name}/gone", ttl=30, meta={"pid": dead_pid()})
        assert alive.acquire(blocking=False) and gone.acquire(blocking=False)
        with override_settings(REDLOCK={**redlock, "STUCK_AFTER": 3600}):
            html = admin_client.get(url, {"using": "svc", "q": name}).content.decode()
            assert "<strong>svc</strong>" in html and '<a href="?using=default">' in html
            rows = dict(re.findall(r'<tr[^>]*data-key="([^"]+)"(.*?)</tr>', html, re.S))
            assert set(rows) == {alive.name, gone.name}, set(rows)
            assert f":{os.getpid()}" in rows[alive.name]  # the holder's host:pid
            assert "redlock-flag" not in rows[alive.name]
            assert '<span class="redlock-flag">holder gone</span>' in rows[gone.name]
            detail = admin_client.get(url + "detail/", {"name": alive.name})  # still on svc
            assert detail.status_code == 200 and alive.token in detail.content.decode()
        with override_settings(REDLOCK={**redlock, "STUCK_AFTER": 0.001}):
            html = admin_client.get(url, {"q": name}).content.decode()  # still "svc"
            assert html.count('<span class="redlock-flag">held too long</span>') == 2
            # Force release of one lock: the confirmation page, then the POST it makes.
            confirm = admin_client.get(url + "release/", {"name": alive.name}).content.decode()
            assert "redlock-release-list" in confirm and alive.name in confirm
            assert f'name="token" value="{alive.token}"' in confirm
            admin_client.post(
                url + "release/", {"name": alive.name, "token": alive.token, "confirm": "yes"}
            )
            assert not alive.check() and other.locked(gone.name)
            with pytest.raises(LockLost):
                alive.release()
            # Release by pattern: its confirmation lists the matches and posts them back.
            again = other.lock(f"{name}/again", ttl=30)
            assert again.acquire(blocking=False)
            page = admin_client.get(url + "release/", {"pattern": f"{name}/*"}).content.decode()
            assert "2 locks match" in page and gone.name in page and again.name in page
            selection = html_unescape(re.search(r'name="selection" value="([^"]*)"', page)[1])
            assert sorted(json.loads(selection)) == sorted(
                [[gone.name, gone.token], [again.name, again.token]]
            )
            done = admin_client.post(
                url + "release/", {"selection": selection, "confirm": "yes"}, follow=True
            )
            assert "Force-released 2 locks" in done.content.decode()
            assert list(other.live_locks(f"{name}/*")) == []
            assert not gone.check() and not again.check()


def settings_round_trip(entry: dict[str, Any], name: str) -> None:
    """``@locked(using="svc")`` on backend ``entry`` takes the project-wide ``REDLOCK``
    defaults as it does on the Redlock: ``REENTRANT`` (a nested ``@locked``/``locked()`` on
    the same key re-enters, sync and async) and ``META`` (stored with the holder)."""
    from django.test import override_settings

    from django_redlock import get_locks, locked

    seen: list[Any] = []

    @locked(name, using="svc", ttl=10)
    def inner() -> None:
        seen.append(get_locks("svc").lock_info(name).meta)

    @locked(name, using="svc", ttl=10, meta={"mine": 1})
    def outer() -> None:
        with locked(name, using="svc", ttl=10):
            inner()

    @locked(name, using="svc", ttl=10)
    async def ainner() -> str:
        return "inner ran"

    @locked(name, using="svc", ttl=10)
    async def aouter() -> str:
        return await ainner()

    with override_settings(REDLOCK={**svc_settings(entry), "META": {"service": "web"}}):
        outer()
        assert asyncio.run(aouter()) == "inner ran"
        assert not get_locks("svc").locked(name)
    assert len(seen) == 1 and seen[0]["service"] == "web" and seen[0]["mine"] == 1, seen


def cli_round_trip(entry: dict[str, Any], name: str) -> None:
    """``manage.py redlock --using svc`` on backend ``entry``: list (table and JSON, with the
    holder-gone and held-too-long flags), check, release (``--force``) and release
    ``--pattern`` (``--yes``)."""
    from io import StringIO

    from django.core.management import CommandError, call_command
    from django.test import override_settings

    def run(*args: str) -> str:
        out = StringIO()
        call_command("redlock", "--using", "svc", *args, stdout=out)
        return out.getvalue()

    redlock = svc_settings(entry)
    with another_holder(entry) as other:
        alive = other.lock(f"{name}/alive", ttl=30, meta={"job": "cli"})
        gone = other.lock(f"{name}/gone", ttl=30, meta={"pid": dead_pid()})
        spare = other.lock(f"{name}/spare", ttl=30)
        assert alive.acquire(blocking=False) and gone.acquire(blocking=False)
        assert spare.acquire(blocking=False)
        with override_settings(REDLOCK={**redlock, "STUCK_AFTER": 3600}):
            rows = {
                r["name"]: r for r in json.loads(run("list", "--pattern", f"{name}/*", "--json"))
            }
            assert {n: r["token"] for n, r in rows.items()} == {
                lock.name: lock.token for lock in (alive, gone, spare)
            }
            assert rows[alive.name]["flags"] == [] and not rows[alive.name]["stuck"]
            assert rows[gone.name]["flags"] == ["holder gone"] and rows[gone.name]["stuck"]
            table = run("list", "--pattern", f"{name}/*")
            assert re.search(rf"{re.escape(gone.name)} .*holder gone", table), table
            assert "3 lock(s)" in table
            assert "OK: 1/1" in run("check")
        with override_settings(REDLOCK={**redlock, "STUCK_AFTER": 0.001}):
            rows = {
                r["name"]: r for r in json.loads(run("list", "--pattern", f"{name}/*", "--json"))
            }
            assert all("held too long" in r["flags"] for r in rows.values()), rows
            with pytest.raises(CommandError, match="--force"):
                run("release", alive.name)
            assert alive.check()
            assert f"Released {alive.name!r} on 1 of 1 node(s)" in run(
                "release", alive.name, "--force"
            )
            assert not alive.check() and gone.check() and spare.check()
            with pytest.raises(CommandError, match="--yes") as refused:
                run("release", "--pattern", f"{name}/*")
            assert refused.value.returncode == 3 and gone.check() and spare.check()
            out = run("release", "--pattern", f"{name}/*", "--yes")
            assert "2 lock(s) match" in out and "Released 2 of 2 lock(s)." in out
            assert list(other.live_locks(f"{name}/*")) == []
            assert not gone.check() and not spare.check()


def child(spec: dict[str, Any], env: dict[str, str] | None = None, **popen: Any) -> Any:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends.contender", json.dumps(spec)],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        **popen,
    )


def test_basics(make: Make, name: str) -> None:
    """Acquire, exclusion, check, extend, release, info, token-compared release."""
    locks = make()
    assert isinstance(locks, LockManager)
    a = locks.lock(name, ttl=5, fencing=True, meta={"job": "basics"})
    b = locks.lock(name, ttl=5, fencing=True)
    assert a.acquire(blocking=False)
    assert a.held and a.validity > 0 and a.token and a.fence is not None
    assert not b.acquire(blocking=False)  # one holder at a time
    assert locks.locked(name)
    assert a.check() and a.extend(5)
    info = locks.lock_info(name)
    assert info is not None and info.token == a.token and info.fence == a.fence
    assert info.meta["job"] == "basics" and info.meta["pid"] == os.getpid()
    assert [i.name for i in locks.live_locks(name)] == [name]
    assert name not in [i.name for i in locks.live_locks(name + "-other*")]
    first = a.fence
    a.release()
    assert not a.held and not locks.locked(name) and locks.lock_info(name) is None
    with pytest.raises(LockNotOwned):
        a.release()
    with b:  # the context manager
        assert b.held and b.fence > first  # fences increase after the row was deleted
    assert not locks.locked(name)
    health = locks.health()[0]
    assert health.reachable
    # named as the service it is (manage.py redlock check shows it), never "redis-server"
    assert health.server in ("sqlite", "postgresql", "mysql", "mariadb", "etcd", "zookeeper")
    assert health.software is None or health.software.startswith(f"{health.server} ")


def test_expiry_and_loss(make: Make, name: str) -> None:
    """A lease runs out: the next holder takes it over; the old holder's release raises
    LockLost and leaves the new holder alone."""
    locks = make()
    # A grant that took longer than its ttl is refused (as the Redlock refuses one): the
    # manager's connection is opened first, and the lease is long enough for one round trip
    # on a loaded host (0.5 s, connecting included, was refused on MariaDB beside two CPU
    # burners).
    assert not locks.locked(name)
    old = locks.lock(name, ttl=1.0, fencing=True)
    assert old.acquire(blocking=False)
    new = locks.lock(name, ttl=5, fencing=True)
    assert new.acquire(timeout=5)  # woken at the old lease's end at the latest
    assert new.fence > old.fence
    assert not old.held and not old.check() and not old.extend()
    with pytest.raises(LockLost):
        old.release()
    assert new.check() and locks.lock_info(name).token == new.token
    new.release()


def test_force_release(make: Make, name: str) -> None:
    locks = make()
    lost: list[Any] = []
    locks.listeners.append(lambda e: lost.append(e.kind))
    lock = locks.lock(name, ttl=5)
    assert lock.acquire(blocking=False)
    assert locks.force_release(name, token="not-the-holder") == 0
    assert locks.locked(name)
    assert locks.force_release(name) == 1
    assert "force_released" in lost
    assert not locks.locked(name) and not lock.check()
    with pytest.raises(LockLost):
        lock.release()
    assert locks.force_release(name) == 0


def test_a_holder_learns_of_a_force_release_within_a_second(make: Make, name: str) -> None:
    """An operator force-releases a held lock from another manager: the holder's ``held``
    turns False and its ``lost`` event fires within 1 s (it stayed True for a third of the
    lease on the database and etcd backends), long before its 30 s lease would end."""
    locks = make()
    lost: list[Any] = []
    heard = threading.Event()
    locks.listeners.append(lambda e: e.kind == "lost" and (lost.append(e), heard.set()))
    lock = locks.lock(name, ttl=30)
    assert lock.acquire(blocking=False) and lock.held
    assert make().force_release(name) == 1
    removed = time.monotonic()
    assert heard.wait(10), "the holder was not told"
    told = time.monotonic() - removed
    assert not lock.held and lock.lost and lock.validity == 0
    assert [e.token for e in lost] == [lock.token], lost
    assert told < 1.0, f"the holder learnt it after {told:.2f} s"
    with pytest.raises(LockLost):
        lock.release()
    again = make().lock(name, ttl=5)  # the name is free, and a new holder is not disturbed
    assert again.acquire(blocking=False)
    assert again.check() and again.held
    again.release()
    assert lost == lost[:1]


def test_bad_input(make: Make, name: str) -> None:
    locks = make()
    for bad, error in [
        ("", ValueError),
        (None, TypeError),
        (b"bytes", TypeError),
        ("x" * 600, ValueError),
    ]:
        with pytest.raises(error):
            locks.lock(bad)
    with pytest.raises(ValueError, match="ttl"):
        locks.lock(name, ttl=0)
    with pytest.raises(ValueError, match="ttl"):
        locks.lock(name, ttl=float("nan"))
    for huge in (float("inf"), 1e306):
        with pytest.raises(ValueError, match="ttl"):
            locks.lock(name, ttl=huge)
    with pytest.raises(TypeError, match="meta"):
        locks.lock(name, meta=["not", "a", "dict"])
    with pytest.raises(ValueError, match="timeout"):
        locks.lock(name).acquire(timeout=-1)
    with pytest.raises(TypeError, match="reentrant"):
        locks.lock(name, reentrant="no")  # truthy: refused rather than read as True
    with pytest.raises(ValueError, match="retries"):
        locks.lock(name, retries=-1)
    with pytest.raises(ValueError, match="retries"):
        locks.lock(name).acquire(retries=-1)
    if not locks.fair:
        with pytest.raises(ValueError, match="fair"):
            locks.lock(name, fair=True)
    for token, error in [(5, TypeError), (b"tok", TypeError), ("", ValueError)]:
        with pytest.raises(error, match="token"):
            locks.release_token(name, token)
        with pytest.raises(error, match="token"):
            locks.extend_token(name, token, 5)
        with pytest.raises(error, match="token"):
            locks.force_release(name, token)
    with pytest.raises(ValueError, match="ttl"):
        locks.extend_token(name, "some-token", float("nan"))
    assert not locks.locked(name) and locks.lock_info(name) is None  # nothing half-taken


def test_handover(make: Make, name: str) -> None:
    """detach() in one manager, extend_token/release_token in another (how LockedTask hands
    an enqueue-time lock to the worker)."""
    locks, other = make(), make()
    lock = locks.lock(name, ttl=5)
    assert lock.acquire(blocking=False)
    token = lock.detach()
    assert not lock.held and locks.locked(name)
    assert other.extend_token(name, token, 5)
    assert not other.extend_token(name, "someone-else", 5)
    assert other.release_token(name, "someone-else") == 0 and locks.locked(name)
    assert other.release_token(name, token) == 1
    assert not locks.locked(name) and not other.extend_token(name, token, 5)


def test_auto_renew(make: Make, name: str) -> None:
    locks = make()
    # Renewed every 0.5 s: a loaded host may run a renewal up to a second late (a 0.6 s
    # lease lost to one late renewal on MariaDB at load 20).
    lock = locks.lock(name, ttl=1.5, auto_renew=True)
    assert lock.acquire(blocking=False)
    deadline = time.monotonic() + 3.2  # more than two leases
    while time.monotonic() < deadline:
        assert lock.held
        time.sleep(0.1)
    assert lock.check()
    lock.release()
    assert not locks.locked(name)


def test_waiter_wakes_on_release(make: Make, name: str, wake_within: float) -> None:
    """A blocked waiter gets the lock soon after the release, long before the lease ends."""
    locks = make()
    holder = locks.lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    got = threading.Event()
    times: list[float] = []

    def wait() -> None:
        lock = make().lock(name, ttl=5)
        assert lock.acquire(timeout=20)
        times.append(time.monotonic())
        got.set()
        lock.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # let the waiter block (a waiter that is late only waits less)
    released = time.monotonic()
    holder.release()
    assert got.wait(20)
    thread.join()
    assert times[0] - released < wake_within, times[0] - released


def test_a_waiter_that_waits_longer_than_its_ttl_still_excludes(make: Make, name: str) -> None:
    """A waiter blocked for longer than its own lease gets a lock that is really held: valid,
    checked by the service, and refused to a third client (etcd once let its waiter's lease
    run out in the queue and handed it a lock whose key was gone)."""
    holder = make().lock(name, ttl=5)
    assert holder.acquire(blocking=False)
    # Two seconds, not one: from the grant to the check below is a thread's wake-up and two
    # round trips, which a loaded host has stretched past one second.
    waiter = make().lock(name, ttl=2, owner="waiter")  # acquired in a thread, released here
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(waiter.acquire(timeout=30)))
    thread.start()
    # Longer than the waiter's lease (etcd's shortest is 2 s too): it must keep its place.
    time.sleep(3.5)
    holder.release()
    thread.join(30)
    assert result == [True]
    try:
        assert waiter.held and waiter.validity > 0
        assert waiter.check()
        assert not make().lock(name, ttl=5).acquire(blocking=False)
    finally:
        waiter.release()


def test_acquire_waits_until_acquired_unless_retries_bound_it(make: Make, name: str) -> None:
    """``acquire()`` with blocking and no timeout waits until acquired (as threading.Lock,
    redis-py and kazoo); ``retries=N`` bounds it like the Redlock's retry loop (at most N x
    retry_delay here, woken by a release), ``retries=0`` is one attempt, and ``with`` raises
    LockNotAcquired once they ran out."""
    holder = make().lock(name, ttl=60)
    assert holder.acquire(blocking=False)
    locks = make(retry_count=2, retry_delay=0.3)
    start = time.monotonic()
    assert not locks.lock(name, ttl=5).acquire(retries=2)
    waited = time.monotonic() - start
    assert 0.55 <= waited < 5, waited
    with pytest.raises(LockNotAcquired):
        with locks.lock(name, ttl=5, retries=1):
            pass
    start = time.monotonic()
    assert not locks.lock(name, ttl=5, retries=0).acquire()
    assert time.monotonic() - start < 0.5

    def waiter(handle: Any) -> tuple[threading.Thread, list[bool]]:
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(handle.acquire()))
        thread.start()
        time.sleep(1.0)  # past retry_count x retry_delay: the waiter must still wait
        assert result == [], "it should still be waiting"
        return thread, result

    patient = make(retry_delay=20).lock(name, ttl=5, retries=3, owner="patient")
    thread, result = waiter(patient)
    holder.release()  # wakes it long before its three retries of 20 s
    thread.join(30)
    assert result == [True] and patient.check()
    forever = make().lock(name, ttl=5, owner="forever")
    thread, result = waiter(forever)  # no timeout, no retries: it waits until acquired
    patient.release()
    thread.join(30)
    assert result == [True] and forever.check()
    forever.release()
    assert not locks.locked(name)


def test_names(make: Make) -> None:
    """Any name up to 512 characters but NUL, glob and path characters included."""
    locks = make()
    tag = secrets.token_hex(4)
    for name in (f"{tag}:" + "ü/ *?[]%\\" * 60)[:512], f"{tag}:/a b/../c?", f"{tag}:*":
        lock = locks.lock(name, ttl=5)
        assert lock.acquire(blocking=False), name
        assert [i.name for i in locks.live_locks(glob_escape(name))] == [name]
        assert locks.lock_info(name).token == lock.token
        assert locks.force_release(name) == 1 and not locks.locked(name)
    with pytest.raises(ValueError, match="NUL"):
        locks.lock(f"{tag}:a\x00b")
    with pytest.raises(ValueError, match="513"):
        locks.lock("x" * 513)


def test_names_that_a_collation_would_equate_are_distinct_locks(make: Make) -> None:
    """Names differing only in case, accents or trailing spaces are different locks (a
    case- and accent-insensitive column once made them one on MariaDB)."""
    locks = make()
    tag = secrets.token_hex(4)
    for held, other in (("Invoice:42", "invoice:42"), ("report", "report "), ("café", "cafe")):
        held, other = f"{tag}:{held}", f"{tag}:{other}"
        lock = locks.lock(held, ttl=5)
        assert lock.acquire(blocking=False)
        try:
            assert not locks.locked(other) and locks.lock_info(other) is None
            assert [i.name for i in locks.live_locks(glob_escape(other))] == []
            assert locks.force_release(other) == 0 and lock.check()
            free = locks.lock(other, ttl=5)
            assert free.acquire(blocking=False), other
            free.release()
        finally:
            lock.release()


def test_not_connected_until_used(make_dead: Make, name: str) -> None:
    """Building a backend opens no connection: one pointing at a dead address builds at once
    (the system checks build every backend) and fails only when used."""
    start = time.monotonic()
    dead = make_dead()
    assert time.monotonic() - start < 0.5
    assert not dead.health()[0].reachable
    with pytest.raises(Exception):  # each client has its own error type
        dead.lock(name).acquire(blocking=False)
    dead.close()


def test_waiters_are_served_in_arrival_order(
    make: Make, name: str, queue_length: Callable[[Any, str], int]
) -> None:
    """Each waiter watches only its predecessor: served first come, first served."""
    locks = make()
    holder = locks.lock(name)
    assert holder.acquire(blocking=False)
    order: list[int] = []
    threads = []
    for i in range(4):
        queued = queue_length(locks, name)

        def wait(i: int = i) -> None:
            lock = make().lock(name)
            assert lock.acquire(timeout=30)
            order.append(i)
            lock.release()

        thread = threading.Thread(target=wait)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 10
        while queue_length(locks, name) == queued:  # its node/key is queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
    holder.release()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3]


def test_async_twin(make: Make, name: str) -> None:
    async def run() -> None:
        locks = AsyncLocks(make())
        async with locks.lock(name, ttl=5, fencing=True) as lock:
            assert lock.held and lock.fence is not None
            assert await locks.locked(name)
            assert await lock.check() and await lock.extend(5)
            other = locks.lock(name, ttl=5, blocking=False)
            assert not await other.acquire()
            with pytest.raises(LockNotAcquired):
                async with other:
                    pass
            infos = await locks.live_locks(name)
            assert [i.token for i in infos] == [lock.token]
        assert not await locks.locked(name)
        assert (await locks.health())[0].reachable
        await locks.close()

    asyncio.run(run())


def test_a_cancelled_async_acquire_leaves_no_lock(make: Make, name: str) -> None:
    """A task waiting in ``await lock.acquire()`` is cancelled; its worker thread goes on and
    wins the lock when the holder releases: that grant is released, not left held by nobody
    until its lease (or, on ZooKeeper, its session) ends."""

    async def run() -> None:
        locks = AsyncLocks(make())
        events: list[tuple[str, str | None]] = []
        locks.listeners.append(lambda e: events.append((e.kind, e.token)))
        holder = locks.lock(name, ttl=30)
        assert await holder.acquire(blocking=False)
        first = holder.token
        lock = locks.lock(name, ttl=30)
        waiting = asyncio.create_task(lock.acquire())
        await asyncio.sleep(0.5)  # let it queue (a late one only waits less)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await holder.release()  # the worker thread now wins, for nobody

        def given_back() -> bool:
            won = [t for kind, t in events if kind == "acquired" and t != first]
            return bool(won) and ("released", won[0]) in events

        deadline = time.monotonic() + 20
        while not given_back():
            assert time.monotonic() < deadline, f"the won grant was left held: {events}"
            await asyncio.sleep(0.05)
        assert not lock.held and not await locks.locked(name)
        again = locks.lock(name, ttl=5)
        assert await again.acquire(blocking=False)
        await again.release()
        await locks.close()

    asyncio.run(run())


def contention(spec: dict[str, Any], env: dict[str, str], tmp: Path, processes: int = 4) -> None:
    """``processes`` children each do ``rounds`` read-pause-write cycles under the lock: no
    two valid holds overlap, fences strictly increase in grant order, no update is lost."""
    counter = tmp / "counter"
    counter.write_text("0")
    history = tmp / "history"
    history.mkdir()
    procs = [
        child(
            {
                **spec,
                "mode": "contend",
                "counter": str(counter),
                "history": str(history / f"{i}.jsonl"),
            },
            env,
        )
        for i in range(processes)
    ]
    for proc in procs:
        assert proc.wait(180) == 0
    holds = load_holds(load_events(history))
    assert len(holds) == processes * spec["rounds"]
    assert all(h.outcome == "ok" for h in holds), [h.outcome for h in holds]
    assert not find_overlaps(holds), [str(o) for o in find_overlaps(holds)]
    fences = [h.fence for h in sorted(holds, key=lambda h: h.acquired_at)]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert int(counter.read_text()) == processes * spec["rounds"]


def holder_killed(make: Make, spec: dict[str, Any], env: dict[str, str], bound: float) -> float:
    """A holder is SIGKILLed: the lock is taken by someone else within ``bound`` seconds."""
    proc = child({**spec, "mode": "hold"}, env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("acquired"), line
        fence = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        lock = make().lock(spec["name"], ttl=5, fencing=True)
        assert lock.acquire(timeout=bound + 10)
        recovered = time.monotonic() - killed
        assert lock.fence > fence
        lock.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert recovered <= bound, f"recovered after {recovered:.2f} s, bound {bound} s"
    return recovered


# -- the handle rules, the same on every lock service -------------------------------------------
# tests/test_backend_parity.py runs these on the Redlock, the AsyncRedlock and every backend
# (and its asyncio twin). ``make(**options)`` builds a manager; ``amake()`` (async cases) an
# asyncio one, inside the running loop; ``leases``: whether the service's locks run out on
# their own (a ZooKeeper lock lives as long as its session instead).
AsyncMake = Callable[[], Any]


def run_owned(target: Callable[[], Any], thread_name: str = "other") -> Any:
    """``target()`` in a thread of its own: what it returned, or the exception it raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name=thread_name)
    thread.start()
    thread.join(60)
    assert outcome, f"{thread_name} did not finish"
    return outcome[0]


def rule_1_a_handle_belongs_to_whoever_acquired_it(make: Make, name: str) -> None:
    """A thread that did not acquire a shared handle gets LockNotOwned from release() and
    extend(), naming both owners, and nothing changes on the service; ``owner=`` makes a
    hold that any thread acting for that owner releases."""
    locks, observer = make(), make()
    lock = locks.lock(name, ttl=10)
    assert lock.acquire(blocking=False)
    token = lock.token
    for call in (lock.release, lock.extend):
        refused = run_owned(call, "intruder")
        assert isinstance(refused, LockNotOwned), refused
        assert "intruder" in str(refused) and "MainThread" in str(refused), refused
    assert lock.held and lock.token == token and lock.check()
    info = observer.lock_info(name)
    assert info is not None and info.token == token  # nothing was sent
    assert not observer.lock(name, ttl=5).acquire(blocking=False)
    lock.release()
    assert not observer.locked(name)
    job = locks.lock(name, ttl=10, owner="job-7")
    assert run_owned(lambda: job.acquire(blocking=False), "worker") is True
    assert job.held and observer.lock_info(name).token == job.token
    job.release()  # another thread, the same owner
    assert not observer.locked(name)


def rule_2_a_failed_attempt_never_touches_the_holders_lease(make: Make, name: str) -> None:
    """Eight threads race ``acquire(blocking=False)`` on one shared handle: exactly one
    wins, the others' failures leave its lease alone, and its release frees the lock.
    Meanwhile other threads asking the held handle get False (non-blocking, or after their
    timeout), never RuntimeError, and a blocking one waits until the holder releases."""
    locks, observer = make(), make()
    lock = locks.lock(name, ttl=10)
    start, release_now = threading.Barrier(8), threading.Event()
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def contender(i: int) -> None:
        try:
            start.wait(30)
            results[i] = lock.acquire(blocking=False)
            if results[i]:
                assert release_now.wait(60)
                lock.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(results) == 8 or errors, timeout=60)
    assert not errors, errors
    assert sorted(results.values()) == [False] * 7 + [True], results
    token = lock.token
    assert lock.held and lock.check() and observer.lock_info(name).token == token
    assert run_owned(lambda: lock.acquire(blocking=False)) is False
    assert run_owned(lambda: lock.acquire(timeout=0.3)) is False
    assert lock.token == token and observer.lock_info(name).token == token
    got: list[Any] = []

    def wait_for_it() -> None:
        try:
            got.append(lock.acquire())  # blocking, no timeout: until the holder releases
            lock.release()
        except BaseException as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait_for_it, name="waiter")
    waiter.start()
    waiter.join(1.0)
    assert got == [], "the waiter should still be waiting"
    release_now.set()
    for thread in [*threads, waiter]:
        thread.join(60)
    assert not errors, errors
    assert got == [True], got
    assert not observer.locked(name)


def rule_3_a_blocking_acquire_without_timeout_waits_until_acquired(make: Make, name: str) -> None:
    """No timeout, no retries: the waiter waits (here well past its retry policy of one
    retry 0.1 s apart) until the holder releases, as threading.Lock, redis-py and kazoo do."""
    holder = make().lock(name, ttl=30)
    assert holder.acquire(blocking=False)
    waiter = make(retry_count=1, retry_delay=0.1).lock(name, ttl=10, owner="waiter")
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    thread.join(1.5)
    assert got == [], "it gave up: acquire() without a timeout must wait"
    holder.release()
    thread.join(60)
    assert got == [True] and waiter.held and waiter.check()
    waiter.release()


def rule_4_the_holder_asking_again_does_not_re_enter(
    make: Make, name: str, *, leases: bool = True
) -> None:
    """Without reentrancy the holder acquiring its own handle again gets False at once
    (non-blocking), False after its timeout, and RuntimeError when it would wait for itself
    for ever; another handle of the same owner contends. Its hold is untouched. After its
    lease ran out, the handle can be acquired again."""
    locks, observer = make(), make()
    lock = locks.lock(name, ttl=2)
    assert lock.acquire(blocking=False)
    token = lock.token
    assert lock.acquire(blocking=False) is False
    started = time.monotonic()
    assert lock.acquire(timeout=0.5) is False
    assert time.monotonic() - started >= 0.45
    for forever in ({}, {"timeout": float("inf")}):
        with pytest.raises(RuntimeError, match="wait for itself"):
            lock.acquire(**forever)
    assert locks.lock(name, ttl=2).acquire(blocking=False) is False
    assert lock.held and lock.token == token and observer.lock_info(name).token == token
    if not leases:
        lock.release()
        return
    wait_until(lambda: not lock.held, timeout=30, interval=0.05)  # it ran out, unrenewed
    assert lock.acquire(timeout=30)  # the service may drop the old lease a moment later
    assert lock.token != token and observer.lock_info(name).token == lock.token
    lock.release()
    assert not observer.locked(name)


def rule_4_reentrancy_only_when_asked(make: Make, name: str) -> None:
    """``reentrant=True``: handles of the owner that holds the name share its hold (one
    token), which ends at the last release (also when one handle was acquired twice);
    another owner still contends."""
    locks, observer = make(), make()
    outer = locks.lock(name, ttl=10, reentrant=True)
    inner = locks.lock(name, ttl=10, reentrant=True)
    assert outer.acquire(blocking=False) and inner.acquire(blocking=False)
    assert inner.token == outer.token
    stranger = locks.lock(name, ttl=10, reentrant=True)
    assert run_owned(lambda: stranger.acquire(blocking=False)) is False
    inner.release()
    assert outer.held and observer.lock_info(name).token == outer.token
    outer.release()
    assert not observer.locked(name)
    # The owner's own handle acquired twice (python-redis-lock's AlreadyAcquired case): one
    # release leaves it held through that handle, the second frees it.
    again = locks.lock(name, ttl=10, reentrant=True)
    assert again.acquire(blocking=False) and again.acquire(blocking=False)
    again.release()
    assert again.held and observer.lock_info(name).token == again.token
    again.release()
    assert not again.held and not observer.locked(name)


def rule_4_reentry_never_joins_a_removed_hold(make: Make, name: str) -> None:
    """A reentrant acquire of a hold that was force-released, by this manager or by another
    one (an operator's ``redlock release --force``), joins nothing: it takes the lock anew
    (a fence above the old one) or not at all, so another owner and it are never both told
    they hold it."""
    locks, operator = make(), make()
    for remover in (locks, operator):
        outer = locks.lock(name, ttl=30, reentrant=True, fencing=True)
        assert outer.acquire(blocking=False)
        assert remover.force_release(name) >= 1
        inner = locks.lock(name, ttl=30, reentrant=True, fencing=True)
        assert inner.acquire(blocking=False)
        assert inner.token != outer.token and inner.fence > outer.fence
        assert operator.lock_info(name).token == inner.token
        stranger = operator.lock(name, ttl=30)
        assert stranger.acquire(blocking=False) is False
        inner.release()
        assert not operator.locked(name)
        with contextlib.suppress(LockLost, LockNotOwned):
            outer.release()
        assert not operator.locked(name)


async def arule_4_reentry_never_joins_a_removed_hold(amake: Callable[[], Any], name: str) -> None:
    """The asyncio twin of :func:`rule_4_reentry_never_joins_a_removed_hold`."""
    locks, operator = amake(), amake()
    for remover in (locks, operator):
        outer = locks.lock(name, ttl=30, reentrant=True, fencing=True)
        assert await outer.acquire(blocking=False)
        assert await remover.force_release(name) >= 1
        inner = locks.lock(name, ttl=30, reentrant=True, fencing=True)
        assert await inner.acquire(blocking=False)
        assert inner.token != outer.token and inner.fence > outer.fence
        assert not await operator.lock(name, ttl=30).acquire(blocking=False)
        await inner.release()
        with contextlib.suppress(LockLost, LockNotOwned):
            await outer.release()
        assert not await operator.locked(name)


def rule_racing_threads_never_overlap(make: Make, name: str, history: Path) -> None:
    """Six threads over two managers take one name ten times each, half of them through
    one shared handle, the rest through handles of their own: the recorded holds never
    overlap (tests/faults/history) and every release succeeds."""
    clients = [make(), make()]
    shared = clients[0].lock(name, ttl=10)
    writer = HistoryWriter(history / "holds.jsonl", "threads")
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(10):
                lock = shared if i % 2 else clients[i % 3 % 2].lock(name, ttl=10)
                started = time.monotonic()
                assert lock.acquire(timeout=60), "no lock within 60 s"
                now = time.monotonic()
                token = lock.token
                writer.acquired(name, token, lock.fence, now, now + lock.validity, started)
                time.sleep(0.002)
                writer.releasing(token, time.monotonic(), time.monotonic() + lock.validity)
                lock.release()
                writer.outcome(token, "ok")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"t{i}") for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    writer.close()
    assert not errors, errors
    holds = load_holds(load_events(history))
    assert len(holds) == 60 and all(h.outcome == "ok" for h in holds)
    assert not find_overlaps(holds), [str(o) for o in find_overlaps(holds)]


async def arule_1_a_handle_belongs_to_the_task_that_acquired_it(
    amake: AsyncMake, name: str
) -> None:
    """Another task of the same loop cannot release or extend (LockNotOwned), and nothing
    changes on the service."""
    locks, observer = amake(), amake()
    lock = locks.lock(name, ttl=10)
    assert await lock.acquire(blocking=False)
    token = lock.token

    async def intrude(call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except LockNotOwned as exc:
            return exc

    for call in (lock.release, lock.extend):
        refused = await asyncio.create_task(intrude(call))
        assert isinstance(refused, LockNotOwned), refused
    assert lock.held and (await observer.lock_info(name)).token == token
    await lock.release()
    assert not await observer.locked(name)


async def arule_2_racing_tasks_on_one_handle(amake: AsyncMake, name: str) -> None:
    """Eight tasks race ``acquire(blocking=False)`` on one shared handle: one wins, its
    lease is intact, and the winning task's release frees the lock."""
    locks, observer = amake(), amake()
    lock = locks.lock(name, ttl=10)
    release_now = asyncio.Event()
    results: list[bool] = []

    async def contender() -> None:
        won = await lock.acquire(blocking=False)
        results.append(won)
        if won:
            await release_now.wait()
            await lock.release()

    tasks = [asyncio.create_task(contender()) for _ in range(8)]
    while len(results) < 8:
        await asyncio.sleep(0.01)
    assert sorted(results) == [False] * 7 + [True], results
    assert lock.held and (await observer.lock_info(name)).token == lock.token
    release_now.set()
    await asyncio.gather(*tasks)
    assert not await observer.locked(name)


async def arule_3_and_4_waiting_and_asking_again(amake: AsyncMake, name: str) -> None:
    """``await acquire()`` without a timeout waits until acquired; the holding task asking
    its handle again gets False (non-blocking, after a timeout) or RuntimeError (for ever)."""
    locks, observer = amake(), amake()
    holder = observer.lock(name, ttl=30)
    assert await holder.acquire(blocking=False)
    lock = locks.lock(name, ttl=10)
    waiting = asyncio.create_task(lock.acquire())
    done, _ = await asyncio.wait([waiting], timeout=1.5)
    assert not done, "acquire() without a timeout gave up"
    await holder.release()
    assert await asyncio.wait_for(waiting, 60)
    assert await lock.acquire(blocking=False) is False
    assert await lock.acquire(timeout=0.3) is False
    with pytest.raises(RuntimeError, match="wait for itself"):
        await lock.acquire()
    assert lock.held and (await observer.lock_info(name)).token == lock.token
    await lock.release()
    assert not await observer.locked(name)


#: Handle options every lock service refuses alike, before anything is sent: (options, the
#: exception, the argument its message names). Each message also shows the value passed.
BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"fencing": "yes"}, TypeError, "fencing"),
    ({"auto_renew": 1}, TypeError, "auto_renew"),
    ({"blocking": None}, TypeError, "blocking"),
    ({"blocking": "no"}, TypeError, "blocking"),  # truthy: read as a bool it would wait
    ({"fair": "yes"}, TypeError, "fair"),
    ({"reentrant": "y"}, TypeError, "reentrant"),
    ({"renew_for": 10}, ValueError, "renew_for"),  # caps auto-renewal: alone, it is refused
    ({"renew_for": 0, "auto_renew": True}, ValueError, "renew_for"),
    ({"renew_for": "10", "auto_renew": True}, TypeError, "renew_for"),
    ({"owner": [1]}, TypeError, "owner"),  # it keys the reentrancy table
    ({"retries": True}, TypeError, "retries"),
    ({"retries": 1.5}, TypeError, "retries"),
    ({"retries": -1}, ValueError, "retries"),
    ({"ttl": "10"}, TypeError, "ttl"),
    ({"ttl": 0}, ValueError, "ttl"),
    ({"ttl": float("nan")}, ValueError, "ttl"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": "5"}, TypeError, "timeout"),
    ({"meta": [1]}, TypeError, "meta"),
]


def _refused(
    error: type[Exception], label: str, value: Any, call: Callable[..., Any], **options: Any
) -> None:
    with pytest.raises(error) as raised:
        call(**options)
    assert type(raised.value) is error, raised.value  # not a subclass of the other one
    message = str(raised.value)
    assert label in message and repr(value) in message, message


def rule_bad_options_are_refused_alike(make: Make, name: str) -> None:
    """Every option of :data:`BAD_OPTIONS` is refused by ``lock()`` with the same exception
    on every service, its message naming the argument and the value, and nothing is taken;
    ``acquire()``'s own ``retries`` and ``blocking`` are checked as ``lock()``'s."""
    locks = make()
    for options, error, label in BAD_OPTIONS:
        _refused(error, label, options[label], locks.lock, name=name, **options)
    lock = locks.lock(name, ttl=10)
    _refused(ValueError, "retries", -1, lock.acquire, retries=-1)
    _refused(TypeError, "retries", True, lock.acquire, retries=True)
    _refused(TypeError, "blocking", "no", lock.acquire, blocking="no")
    assert not lock.held and not locks.locked(name)  # nothing half-taken


async def arule_bad_options_are_refused_alike(amake: AsyncMake, name: str) -> None:
    """The asyncio handles refuse :data:`BAD_OPTIONS` as the blocking ones do."""
    locks = amake()
    for options, error, label in BAD_OPTIONS:
        _refused(error, label, options[label], locks.lock, name=name, **options)
    assert not await locks.locked(name)


def rule_a_release_after_the_lease_ran_out_raises(
    make: Make, name: str, hears_the_lease_end: bool
) -> None:
    """A lease that ran out with nobody to renew it: ``release()`` raises LockNotOwned (the
    lock was not exclusive the whole time); LockLost (a LockNotOwned) when the handle already
    knew the lock was gone, its ``lost`` set: ``check()`` found it gone, or the service told
    the holder when it ended the lease (``hears_the_lease_end``: etcd's watch sees the key
    deleted); the name is free after it either way.

    Three releases: as soon as ``held`` turned False (the service may still keep the lease a
    moment: nothing told the handle), after ``check()``, and after the service itself freed
    the name, where only a service that tells the holder makes it LockLost."""
    locks, observer = make(), make()
    for when in ("held turned False", "checked", "the service freed it"):
        lock = locks.lock(name, ttl=1)
        assert lock.acquire(blocking=False)
        wait_until(lambda lock=lock: not lock.held, timeout=30, interval=0.05)
        if when != "held turned False":
            # The service may keep a lease a moment longer (etcd grants at least 2 s).
            wait_until(lambda: not observer.locked(name), timeout=30, interval=0.05)
        if when == "checked":
            assert lock.check() is False
            assert lock.lost, when
        if when == "the service freed it":
            if hears_the_lease_end:
                wait_until(lambda lock=lock: lock.lost, timeout=30, interval=0.05)
            else:
                assert lock.lost is None, (when, lock.lost)
        knew = lock.lost is not None
        with pytest.raises(LockNotOwned) as raised:
            lock.release()
        if knew:
            assert type(raised.value) is LockLost, (when, raised.value)
        elif when == "held turned False" and hears_the_lease_end and lock.lost:
            # The service ended the lease while the release was on its way: told meanwhile.
            assert type(raised.value) in (LockLost, LockNotOwned), (when, raised.value)
        else:
            assert type(raised.value) is LockNotOwned, (when, raised.value)
        assert not lock.held and not observer.locked(name)
        again = observer.lock(name, ttl=10)
        assert again.acquire(blocking=False)
        again.release()


def _forked_worker(locks: Any, name: str, held: Any, history: Path, i: int) -> dict[str, Any]:
    """A forked child's run: the parent's lock is not held here (its handle says so, its
    release sends nothing, the name cannot be taken), then ``name`` taken five times
    through the parent's manager, each hold written to the history."""
    report: dict[str, Any] = {"errors": []}
    report["inherited_held"] = held.held
    report["inherited_check"] = held.check()
    try:
        held.release()  # the parent's hold: nothing is sent from here
    except Exception as exc:
        report["errors"].append(f"inherited release: {type(exc).__name__}: {exc}")
    report["parent_lock_taken"] = locks.lock(held.name, ttl=10).acquire(blocking=False)
    report["parent_lock_seen"] = locks.locked(held.name)
    writer = HistoryWriter(history / f"child-{i}.jsonl", f"child-{i}")
    try:
        for _ in range(5):
            lock = locks.lock(name, ttl=10)
            started = time.monotonic()
            if not lock.acquire(timeout=20):
                report["errors"].append("no lock within 20 s")
                continue
            now = time.monotonic()
            token = lock.token
            writer.acquired(name, token, lock.fence, now, now + lock.validity, started)
            time.sleep(0.002)
            writer.releasing(token, time.monotonic(), time.monotonic() + lock.validity)
            lock.release()
            writer.outcome(token, "ok")
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()
    return report


#: How long a forked child may take (its five holds take well under a second; a child that
#: hangs on a connection it shares with another process is killed and reported).
CHILD_BOUND = 120.0


def _via_os_fork(work: Callable[[], dict[str, Any]]) -> tuple[int, Any]:
    """Run ``work`` in a child made by ``os.fork()``: its pid, and a reader of its report."""
    import select

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: always leaves through os._exit (never into pytest's code)
        code = 1
        try:
            os.close(read_end)
            try:
                report = work()
            except BaseException as exc:
                report = {"errors": [f"{type(exc).__name__}: {exc}"]}
            os.write(write_end, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)

    def collect(deadline: float) -> Any:
        chunks = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([read_end], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    return {"errors": [f"os.fork child hung for {CHILD_BOUND} s"]}
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(read_end)
            os.waitpid(pid, 0)
        return json.loads(b"".join(chunks) or b'{"errors": ["no report"]}')

    return pid, collect


def _via_multiprocessing(work: Callable[[], dict[str, Any]]) -> tuple[int, Any]:
    """Run ``work`` in a multiprocessing child of the 'fork' start method (Celery's prefork
    pool starts its workers so)."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("fork")
    reports = context.Queue()

    def target() -> None:
        try:
            reports.put(work())
        except BaseException as exc:
            reports.put({"errors": [f"{type(exc).__name__}: {exc}"]})

    process = context.Process(target=target)
    process.start()

    def collect(deadline: float) -> Any:
        try:
            report = reports.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            report = {"errors": [f"multiprocessing child hung for {CHILD_BOUND} s"]}
            process.kill()
        process.join(30)
        return report

    assert process.pid is not None
    return process.pid, collect


def rule_forked_children_hold_none_of_the_parents_locks(
    make: Make, name: str, history: Path, start: str, children: int = 4
) -> None:
    """The parent takes and releases a lock, holds another, then forks ``children`` that
    contend on ``name`` through the parent's very manager (``start``: ``os.fork`` or
    multiprocessing's 'fork'). No child uses a connection, session or lease of the parent:
    no child holds the parent's lock, their holds never overlap, none fails; the parent's
    lock stays held, and the parent releases it cleanly afterwards."""
    locks = make()
    warm = locks.lock(f"{name}/warm", ttl=10)
    assert warm.acquire(blocking=False)
    warm.release()
    held = locks.lock(f"{name}/parent", ttl=30, owner="parent")
    assert held.acquire(blocking=False)
    fork = _via_os_fork if start == "os.fork" else _via_multiprocessing
    running = [
        fork(lambda i=i: _forked_worker(locks, name, held, history, i)) for i in range(children)
    ]
    deadline = time.monotonic() + CHILD_BOUND
    reports = [collect(deadline) for _, collect in running]
    for report in reports:
        assert report["errors"] == [], report
        assert report["inherited_held"] is False, report
        assert report["inherited_check"] is False, report
        assert report["parent_lock_taken"] is False, report
        assert report["parent_lock_seen"] is True, report
    holds = load_holds(load_events(history))
    assert len(holds) == 5 * children and all(h.outcome == "ok" for h in holds)
    assert not find_overlaps(holds), [str(o) for o in find_overlaps(holds)]
    # The parent's connections, session and lease are untouched: its lock is still its own.
    assert held.held and held.check()
    assert locks.locked(held.name)
    held.release()
    assert not locks.locked(held.name)
    again = locks.lock(name, ttl=10)
    assert again.acquire(timeout=30)
    again.release()
