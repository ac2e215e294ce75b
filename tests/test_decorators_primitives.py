"""@locked(..., limit=N) (a semaphore per key) and @locked(..., shared=True) (a read lock), on
views and plain functions, sync and async, against real nodes (the redlock_settings fixture).
"Taken" is always real permits or a real writer held by another owner."""

from __future__ import annotations

import asyncio

import pytest
from django.http import HttpResponse
from django.test import RequestFactory

from django_redlock import LockNotAcquired, get_redlock, locked
from django_redlock.decorators import current_lock

pytestmark = pytest.mark.usefixtures("redlock_settings")
rf = RequestFactory()


def take(kind: str, name: str, count: int = 1, limit: int = 2) -> list:
    rl = get_redlock()
    holds = []
    for i in range(count):
        if kind == "permit":
            hold = rl.semaphore(name, limit, 10.0, owner=f"other-{i}")
        elif kind == "write":
            hold = rl.write_lock(name, 10.0, owner=f"other-{i}")
        else:
            hold = rl.read_lock(name, 10.0, owner=f"other-{i}")
        assert hold.acquire(blocking=False)
        holds.append(hold)
    return holds


def test_view_with_limit_answers_423_only_when_every_permit_is_taken() -> None:
    @locked("export:{client}", limit=2)
    def export(request, client):
        return HttpResponse(f"permit {current_lock().permit}")

    held = take("permit", "export:acme")
    response = export(rf.get("/"), client="acme")
    assert response.status_code == 200
    assert response.content.decode() == f"permit {1 - held[0].permit}"  # the free one
    held += take("permit", "export:acme")
    response = export(rf.get("/"), client="acme")
    assert response.status_code == 423 and "Retry-After" in response
    held.pop().release()
    assert export(rf.get("/"), client="acme").status_code == 200
    held[0].release()


def test_plain_function_with_limit_raises_when_full() -> None:
    @locked("job:{n}", limit=1)
    def job(n):
        return current_lock().name

    assert job(1) == "job:1"
    held = take("permit", "job:1", limit=1)
    with pytest.raises(LockNotAcquired, match="all permits of semaphore 'job:1' are taken"):
        job(1)
    held[0].release()
    assert list(get_redlock().live_locks("job:*")) == []


def test_limit_lets_n_calls_in_at_once() -> None:
    """Three calls inside at once: two permits held elsewhere, the call takes the third."""
    inside: list[int] = []

    @locked("nested:{n}", limit=3)
    def enter(n):
        inside.append(current_lock().permit)

    holds = take("permit", "nested:1", count=2, limit=3)
    enter(1)
    assert len(inside) == 1 and inside[0] not in {h.permit for h in holds}
    for h in holds:
        h.release()


def test_shared_view_reads_together_and_waits_for_a_writer() -> None:
    @locked("doc:{pk}", shared=True)
    def read(request, pk):
        return HttpResponse("read")

    readers = take("read", "doc:1", count=2)
    assert read(rf.get("/"), pk=1).status_code == 200  # readers share it
    for r in readers:
        r.release()
    writer = take("write", "doc:1")[0]
    response = read(rf.get("/"), pk=1)
    assert response.status_code == 423
    writer.release()
    assert read(rf.get("/"), pk=1).status_code == 200


def test_async_function_with_limit() -> None:
    @locked("ajob:{n}", limit=1)
    async def job(n):
        return current_lock().permit

    assert asyncio.run(job(5)) == 0
    held = take("permit", "ajob:5", limit=1)
    with pytest.raises(LockNotAcquired):
        asyncio.run(job(5))
    held[0].release()


def test_writer_waits_for_shared_readers_and_a_plain_lock_does_not() -> None:
    """``writer=True`` is the write side of the readers' lock: refused (423) while a reader
    holds the key, in once the readers left. A plain ``@locked`` on the same key is a plain
    lock, which the docs say does not see readers."""

    @locked("doc:{pk}", writer=True)
    def edit(request, pk):
        return HttpResponse(f"{current_lock().kind} {current_lock().fence}")

    @locked("doc:{pk}", writer=True, fencing=True)
    def edit_fenced(pk):
        return current_lock().fence

    @locked("doc:{pk}")
    def plain(pk):
        return "plain"

    readers = take("read", "doc:7", count=2)
    assert edit(rf.get("/"), pk=7).status_code == 423
    with pytest.raises(LockNotAcquired, match="write lock 'doc:7' is held by 2 readers"):
        edit_fenced(7)
    assert plain(7) == "plain"  # a plain lock ignores readers, as documented
    for reader in readers:
        reader.release()
    response = edit(rf.get("/"), pk=7)
    assert response.status_code == 200 and response.content.decode() == "write None"
    assert isinstance(edit_fenced(7), int)


def test_writer_holds_readers_out_while_inside() -> None:
    @locked("doc:{pk}", shared=True)
    def read(pk):
        return "read"

    @locked("doc:{pk}", writer=True)
    def write(pk):
        with pytest.raises(LockNotAcquired):
            read(pk)
        return "written"

    assert write(8) == "written"
    assert read(8) == "read"


def test_async_writer_waits_for_readers() -> None:
    @locked("adoc:{pk}", writer=True)
    async def write(pk):
        return current_lock().kind

    readers = take("read", "adoc:3")
    with pytest.raises(LockNotAcquired):
        asyncio.run(write(3))
    readers[0].release()
    assert asyncio.run(write(3)) == "write"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"writer": 1}, TypeError),
        ({"writer": True, "shared": True}, ValueError),
        ({"writer": True, "limit": 2}, ValueError),
        ({"writer": True, "reentrant": True}, ValueError),
        ({"writer": True, "fair": True}, ValueError),
        ({"shared": True, "fencing": True}, ValueError),
        ({"limit": 0}, ValueError),
        ({"limit": "3"}, TypeError),
        ({"limit": 2, "shared": True}, ValueError),
        ({"shared": 1}, TypeError),
        ({"limit": 2, "reentrant": True}, ValueError),
        ({"shared": True, "fair": True}, ValueError),
    ],
)
def test_bad_limit_or_shared_refused_at_decoration(kwargs, error) -> None:
    with pytest.raises(error):
        locked("k", **kwargs)


def test_backend_without_primitives_refuses_by_name(settings) -> None:
    settings.REDLOCK = {
        **settings.REDLOCK,
        "BACKENDS": {
            "db": {
                "BACKEND": "django_redlock.backends.database.DatabaseLocks",
                "OPTIONS": {"using": "default"},
            }
        },
    }

    @locked("b:{n}", limit=2, using="db")
    def job(n):
        return n

    with pytest.raises(NotImplementedError, match=r"DatabaseLocks \(database\) has no semaphore"):
        job(1)
    from django_redlock import get_async_locks, get_locks

    for method in ("semaphore", "read_lock", "write_lock"):
        with pytest.raises(NotImplementedError, match=f"no {method}"):
            getattr(get_locks("db"), method)("x", 2)
        with pytest.raises(NotImplementedError, match=f"no {method}"):
            getattr(get_async_locks("db"), method)("x", 2)
