"""docs/usage.rst's promises that tests/test_decorators*.py and tests/test_signals.py leave
out, against the real nodes of the ``redlock_settings`` fixture: the ``Retry-After`` added to a
custom 429/503 answer, an async ``on_locked`` for an async view, a busy body that never names
the lock, ``current_lock()`` unset inside a generator, and the structured log fields."""

from __future__ import annotations

import datetime
import enum
import json
import logging
import re
import time
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.http import HttpResponse
from django.test import RequestFactory

from django_redlock import LockLost, LockNotAcquired, LockNotOwned, get_redlock, locked
from django_redlock.decorators import current_lock, make_key
from tests.helpers import held_by_someone_else

pytestmark = pytest.mark.usefixtures("redlock_settings")
rf = RequestFactory()


@pytest.mark.parametrize("status", [429, 503])
def test_a_custom_answer_of_429_or_503_gets_retry_after(status):
    @locked("promises:ra", on_locked=lambda request, exc: HttpResponse("later", status=status))
    def view(request):
        return HttpResponse("ok")

    with held_by_someone_else("promises:ra", ttl=6):
        response = view(rf.get("/"))
    assert response.status_code == status
    assert 1 <= int(response["Retry-After"]) <= 6


def test_a_custom_answer_that_sets_retry_after_keeps_it():
    def answer(request, exc):
        response = HttpResponse("later", status=423)
        response["Retry-After"] = "42"
        return response

    @locked("promises:keep", on_locked=answer)
    def view(request):
        return HttpResponse("ok")

    with held_by_someone_else("promises:keep"):
        assert view(rf.get("/"))["Retry-After"] == "42"


def test_an_async_view_may_answer_with_an_async_callable():
    async def answer(request, exc):
        return HttpResponse(f"busy {exc.retry_after > 0}", status=423)

    @locked("promises:async", on_locked=answer)
    async def view(request):
        return HttpResponse("ok")

    with held_by_someone_else("promises:async", ttl=5):
        response = async_to_sync(view)(rf.get("/"))
    assert response.status_code == 423 and response.content == b"busy True"
    assert 1 <= int(response["Retry-After"]) <= 5


@pytest.mark.parametrize("accept", ["application/json", "text/plain", "*/*"])
def test_the_busy_body_never_names_the_lock(accept):
    @locked("promises:secret-{n}")
    def view(request, n):
        return HttpResponse("ok")

    with held_by_someone_else("promises:secret-7"):
        response = view(rf.get("/", HTTP_ACCEPT=accept), n=7)
    assert response.status_code == 423
    assert b"secret" not in response.content and b"promises" not in response.content
    kind = "application/json" if accept == "application/json" else "text/plain"
    assert response["Content-Type"].startswith(kind)


def test_current_lock_is_not_set_inside_a_generator():
    @locked("promises:gen")
    def rows():
        yield current_lock()
        yield get_redlock().locked("promises:gen")

    assert list(rows()) == [None, True]
    assert not get_redlock().locked("promises:gen")


def test_log_records_carry_the_structured_fields(caplog):
    caplog.set_level(logging.DEBUG, logger="django_redlock")
    rl = get_redlock()
    with rl.lock("promises:log") as lock:
        token = lock.token
        with pytest.raises(LockNotAcquired):
            with rl.lock("promises:log", owner="other", timeout=0.05):
                pass
    records = {
        r.lock_event: r for r in caplog.records if getattr(r, "lock_name", None) == "promises:log"
    }
    assert {"acquired", "released", "contended"} <= set(records)
    for kind in ("acquired", "released", "contended"):
        record = records[kind]
        assert record.levelno == logging.DEBUG
        for field in ("lock_token", "lock_reason", "lock_waited", "lock_held"):
            assert hasattr(record, field), (kind, field)
    assert records["acquired"].lock_token == records["released"].lock_token == token
    assert records["acquired"].lock_waited >= 0 and records["released"].lock_held >= 0
    assert records["contended"].lock_token is None

    caplog.clear()
    assert rl.lock("promises:gone", ttl=5).acquire(blocking=False)
    rl.force_release("promises:gone")
    levels = {
        r.lock_event: r.levelno
        for r in caplog.records
        if getattr(r, "lock_name", None) == "promises:gone"
    }
    assert levels["lost"] == levels["force_released"] == logging.WARNING, levels


def test_meta_values_json_cannot_write_are_stored_as_their_text():
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)

    @locked("promises:meta", meta={"when": when, "tags": {"a"}})
    def job():
        return dict(get_redlock().lock_info("promises:meta").meta)

    meta = job()
    assert meta["when"] == str(when) and meta["tags"] == str({"a"})


def test_meta_larger_than_max_meta_bytes_is_refused_at_decoration():
    from django_redlock.core import MAX_META_BYTES

    with pytest.raises(
        ValueError, match=rf"meta is \d+ bytes of JSON, the limit is {MAX_META_BYTES}"
    ):
        locked("promises:big", meta={"blob": "x" * MAX_META_BYTES})
    locked("promises:big", meta={"blob": "x" * (MAX_META_BYTES - 100)})


@pytest.mark.django_db
def test_user_in_meta_only_when_already_loaded_and_never_a_query(django_user_model):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils.functional import SimpleLazyObject

    user = django_user_model.objects.create_user(username="meta-user")
    seen = []

    @locked("promises:user:{n}")
    def view(request, n):
        seen.append(dict(get_redlock().lock_info(current_lock().name).meta))
        return HttpResponse()

    lazy = rf.get("/")
    lazy.user = SimpleLazyObject(lambda: django_user_model.objects.get(pk=user.pk))
    with CaptureQueriesContext(connection) as queries:
        view(lazy, n=1)
    assert "user" not in seen[0] and len(queries) == 0

    loaded = rf.get("/")
    loaded.user = user
    view(loaded, n=2)
    assert seen[1]["user"] == user.pk


def test_every_signal_has_every_documented_keyword_argument():
    from django_redlock import signals

    page = (Path(__file__).resolve().parent.parent / "docs" / "usage.rst").read_text()
    table = page.split("Every signal has these keyword arguments:", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^``(\w+)``", table, re.M))
    assert len(documented) == 11, documented
    kinds = ("lock_acquired", "lock_released", "lock_contended", "lock_lost")
    kinds += ("lock_force_released",)
    got: list[tuple[str, dict]] = []

    def receiver(signal, sender, **kwargs):
        got.append((sender, kwargs))

    for kind in kinds:
        getattr(signals, kind).connect(receiver, weak=False)
    try:
        rl = get_redlock()
        with rl.lock("promises:sig", fencing=True) as lock:
            fence = lock.fence
            assert not rl.lock("promises:sig", owner="other").acquire(blocking=False)
        assert rl.lock("promises:sig2").acquire(blocking=False)
        rl.force_release("promises:sig2")
    finally:
        for kind in kinds:
            getattr(signals, kind).disconnect(receiver)
    kinds_seen = [kwargs["event"].kind for _, kwargs in got]
    assert sorted(kinds_seen) == sorted(
        ["acquired", "contended", "released", "acquired", "lost", "force_released"]
    )
    for sender, kwargs in got:
        assert sender is type(get_redlock())
        assert documented <= set(kwargs), documented - set(kwargs)
    assert got[0][1]["fence"] == fence and got[0][1]["event"].kind == "acquired"


class Color(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    "value, text",
    [
        (42, "42"),
        (uuid.UUID(int=5), "00000000-0000-0000-0000-000000000005"),
        (datetime.date(2026, 1, 2), "2026-01-02"),
        (datetime.datetime(2026, 1, 2, 3, 4, 5), "2026-01-02T03%3A04%3A05"),
        (Color.RED, "red"),
        (Decimal("1.50"), "1.50"),
        (1.5, "1.5"),
        ("a:b", "a%3Ab"),
        ("{x} y", "%7Bx%7D%20y"),
        (False, "%false"),
    ],
)
def test_values_render_as_the_page_says(value, text):
    assert make_key("k:{v}", v=value) == f"k:{text}"


def test_equal_numbers_written_differently_give_the_keys_the_page_lists():
    assert make_key("k:{v}", v=Decimal("1.50")) != make_key("k:{v}", v=Decimal("1.5"))
    assert make_key("k:{v}", v=1) == make_key("k:{v}", v=Decimal("1")) == "k:1"
    assert make_key("k:{v}", v=1.0) == make_key("k:{v}", v=Decimal("1.0")) == "k:1.0"


def test_an_async_generator_holds_the_lock_from_its_first_item_to_its_end():
    @locked("promises:agen:{n}")
    async def numbers(n):
        for i in range(n):
            yield i

    async def run():
        gen = numbers(3)
        before = get_redlock().locked("promises:agen:3")
        first = await gen.__anext__()
        during = get_redlock().locked("promises:agen:3")
        rest = [i async for i in gen]
        after = get_redlock().locked("promises:agen:3")
        closing = numbers(3)
        await closing.__anext__()
        await closing.aclose()
        closed = get_redlock().locked("promises:agen:3")
        return before, first, during, rest, after, closed

    assert async_to_sync(run)() == (False, 0, True, [1, 2], False, False)


@pytest.mark.parametrize("accept", ["application/json", "text/plain"])
def test_too_few_nodes_is_503_with_retry_after_1(settings, redis_cluster_factory, accept):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.2}
    cluster[0].kill()
    cluster[1].kill()

    @locked("promises:down")
    def view(request):
        return HttpResponse("ok")

    response = view(rf.get("/", HTTP_ACCEPT=accept))
    assert response.status_code == 503 and response["Retry-After"] == "1"
    if accept == "application/json":
        assert json.loads(response.content)["error"] == "unavailable"


# docs/usage.rst, "Release": when the release fails, the lock was not exclusive the whole time.


def wait_until_free(name: str) -> None:
    while get_redlock().locked(name):  # the nodes expire the lease: no event to wait on
        time.sleep(0.02)


def test_a_plain_call_whose_lease_ran_out_raises_lock_not_owned():
    @locked("promises:ranout", ttl=1.0)
    def job():
        wait_until_free("promises:ranout")
        return "done"

    with pytest.raises(LockNotOwned) as caught:
        job()
    assert not isinstance(caught.value, LockLost)  # nobody was to renew it


def test_a_plain_call_whose_lock_was_force_released_raises_lock_lost():
    @locked("promises:forced")
    def job():
        get_redlock().force_release("promises:forced")
        return "done"

    with pytest.raises(LockLost):
        job()


def test_a_call_that_raised_keeps_its_exception_and_logs_the_release_error(caplog):
    @locked("promises:both")
    def job():
        get_redlock().force_release("promises:both")
        raise KeyError("its own")

    with caplog.at_level(logging.ERROR, logger="django_redlock"):
        with pytest.raises(KeyError, match="its own"):
            job()
    assert any(
        r.levelno == logging.ERROR and "promises:both" in r.getMessage() for r in caplog.records
    )


def test_a_view_whose_lock_was_lost_returns_its_response_and_logs_an_error(caplog):
    from django_redlock.signals import lock_lost

    lost = []

    def record(sender, name, **kwargs):
        lost.append(name)

    @locked("promises:view-lost")
    def view(request):
        get_redlock().force_release("promises:view-lost")
        return HttpResponse("the work is done")

    lock_lost.connect(record)
    try:
        with caplog.at_level(logging.ERROR, logger="django_redlock"):
            response = view(rf.get("/"))
    finally:
        lock_lost.disconnect(record)
    assert response.status_code == 200 and response.content == b"the work is done"
    assert lost == ["promises:view-lost"]
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "promises:view-lost" in error.getMessage()


def test_current_lock_is_the_innermost_and_comes_back_after_it():
    @locked("promises:inner")
    def inner():
        return current_lock().name

    @locked("promises:outer")
    def outer():
        before = current_lock().name
        during = inner()
        return before, during, current_lock().name

    assert outer() == ("promises:outer", "promises:inner", "promises:outer")
    assert current_lock() is None


def test_concurrent_tasks_each_see_their_own_current_lock():
    import asyncio

    @locked("promises:task:{n}")
    async def job(n, started, go):
        started.set()
        await go.wait()
        return current_lock().name

    async def main():
        events = [(asyncio.Event(), asyncio.Event()) for _ in range(3)]
        tasks = [asyncio.create_task(job(n, s, g)) for n, (s, g) in enumerate(events)]
        for started, _ in events:
            await started.wait()  # all three hold their locks at once
        for _, go in events:
            go.set()
        return await asyncio.gather(*tasks)

    assert async_to_sync(main)() == [f"promises:task:{n}" for n in range(3)]
