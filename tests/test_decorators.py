"""@locked on every kind of callable, against real Redis nodes (the redlock_settings fixture).

"Someone else holds the lock" is always a real lock taken on the same nodes by a different
owner (``owner="someone-else"``), never a mock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from decimal import Decimal
from uuid import UUID

import pytest
from asgiref.sync import async_to_sync
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import RequestFactory
from django.utils.decorators import method_decorator
from django.views import View
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from django_redlock import LockNotAcquired, get_redlock, locked
from django_redlock.core import MAX_KEY_LENGTH
from django_redlock.decorators import KeyTemplate, current_lock, make_key
from django_redlock.keys import client_id
from tests.helpers import held_by_someone_else

pytestmark = pytest.mark.usefixtures("redlock_settings")


def is_locked(name: str) -> bool:
    return get_redlock().locked(name)


# =========================================================================== keys


class TestKeys:
    def test_plain_values_stay_readable(self):
        assert make_key("order:{order_id}", order_id=42) == "order:42"
        assert make_key("post:{slug}", slug="hello-world") == "post:hello-world"
        assert make_key("u:{u}", u=UUID(int=1)) == "u:00000000-0000-0000-0000-000000000001"

    def test_separator_in_a_value_is_escaped(self):
        a = make_key("{a}:{b}", a="x:y", b="z")
        b = make_key("{a}:{b}", a="x", b="y:z")
        assert a != b
        assert a == "x%3Ay:z"

    def test_percent_is_escaped_so_escapes_cannot_be_forged(self):
        assert make_key("k:{v}", v="a%3Ab") != make_key("k:{v}", v="a:b")
        assert make_key("k:{v}", v="%") == "k:%25"

    def test_template_punctuation_between_fields_is_escaped(self):
        assert make_key("{a}-{b}", a="x-y", b="z") != make_key("{a}-{b}", a="x", b="y-z")
        # a separator that only occurs in the prefix is not escaped in values
        assert make_key("post-{slug}", slug="a-b") == "post-a-b"

    def test_tags_for_none_and_bool(self):
        keys = {
            make_key("k:{v}", v=v)
            for v in (None, "None", True, "True", False, "False", "%none", "")
        }
        assert len(keys) == 8
        assert make_key("k:{v}", v=None) == "k:%none"

    def test_int_and_its_digits_are_one_resource(self):
        # deliberate (docs/usage.rst): two keys for one order would break mutual exclusion
        assert make_key("order:{id}", id=42) == make_key("order:{id}", id="42")

    def test_glob_whitespace_and_control_characters_are_escaped(self):
        key = make_key("k:{v}", v="a*b?[c] d\n\x00")
        assert not any(c in key for c in "*?[] \n\x00")
        assert make_key("k:{v}", v="a b") != make_key("k:{v}", v="a\tb")

    def test_other_types(self):
        assert make_key("k:{v}", v=Decimal("1.5")) == "k:1.5"
        # containers: brackets are escaped in strings, ',' and '=' in items
        assert make_key("k:{v}", v=("a,b", {"x": 1}, None)) == "k:[a%2Cb,{x=1},%none]"
        assert make_key("k:{v}", v=["a", "b"]) != make_key("k:{v}", v=["a,b"])
        assert make_key("k:{v}", v={2, 1}) == make_key("k:{v}", v=[1, 2]) == "k:[1,2]"
        assert make_key("k:{v:05d}", v=42) == "k:00042"
        assert make_key("k:{v!r}", v="x") == "k:'x'"

    def test_objects_without_text_identity_are_refused(self):
        with pytest.raises(TypeError, match="no stable text"):
            make_key("k:{v}", v=object())

        class ShowsAddress:
            def __str__(self) -> str:
                return f"<ShowsAddress at 0x{id(self):x}>"

        with pytest.raises(TypeError, match="no stable text"):
            make_key("k:{v}", v=ShowsAddress())
        with pytest.raises(TypeError, match=r"lock key template 'k:\{v:>5\}': cannot format"):
            make_key("k:{v:>5}", v=object())
        with pytest.raises(ValueError, match="cannot format"):
            make_key("k:{v:d}", v="x")

    @pytest.mark.django_db
    def test_model_instances_are_refused(self, django_user_model):
        user = django_user_model(pk=1, username="u")
        with pytest.raises(TypeError, match=r"\{v\.pk\}"):
            make_key("k:{v}", v=user)
        assert make_key("k:{v.pk}", v=user) == "k:1"

    def test_long_keys_are_hashed_to_the_limit_and_stay_distinct(self):
        a = make_key("k:{v}", v="x" * 2000)
        b = make_key("k:{v}", v="x" * 1999 + "y")
        assert len(a) == len(b) == MAX_KEY_LENGTH
        assert a != b
        assert a.startswith("k:xxx") and "%sha256-" in a
        assert make_key("k:{v}", v="x" * 100) == "k:" + "x" * 100

    def test_bad_templates(self):
        with pytest.raises(ValueError, match="separated by a punctuation"):
            KeyTemplate("{a}{b}")
        with pytest.raises(ValueError, match="separated by a punctuation"):
            KeyTemplate("{a}x{b}")
        with pytest.raises(ValueError, match="positional"):
            KeyTemplate("order:{}")
        with pytest.raises(ValueError, match="positional"):
            KeyTemplate("order:{0}")
        with pytest.raises(ValueError, match="malformed"):
            KeyTemplate("order:{id")

    @hsettings(max_examples=300, deadline=None)
    @given(st.tuples(st.text(), st.text()), st.tuples(st.text(), st.text()))
    def test_distinct_inputs_never_collide(self, one, two):
        template = "{a}:{b}/{c}"
        key1 = make_key(template, a=one[0], b=one[1], c="x")
        key2 = make_key(template, a=two[0], b=two[1], c="x")
        assert (key1 == key2) == (one == two)

    @hsettings(max_examples=200, deadline=None)
    @given(
        st.one_of(st.none(), st.booleans(), st.text(), st.integers()),
        st.one_of(st.none(), st.booleans(), st.text(), st.integers()),
    )
    def test_distinct_values_never_collide_except_int_and_digits(self, x, y):
        if x == y and type(x) is type(y):
            return
        same = make_key("k:{v}", v=x) == make_key("k:{v}", v=y)
        int_vs_digits = {type(x), type(y)} == {int, str} and str(x) == str(y)
        assert same == int_vs_digits


# =========================================================================== decoration


class TestDecoration:
    def test_missing_argument_fails_at_decoration_time(self):
        with pytest.raises(ValueError, match="no argument named oder_id"):

            @locked("order:{oder_id}")
            def pay(order_id):
                pass

    def test_kwargs_functions_are_checked_at_call_time(self):
        @locked("order:{order_id}")
        def pay(**kwargs):
            return "ok"

        assert pay(order_id=1) == "ok"
        with pytest.raises(ValueError, match="no argument 'order_id'"):
            pay(other=1)

    def test_usage_errors(self):
        with pytest.raises(TypeError, match=r"@locked\('name"):

            @locked
            def f():
                pass

        with pytest.raises(TypeError, match="not both"):
            locked("k", key=lambda: "k")
        with pytest.raises(ValueError, match="wait"):
            locked("k", wait=-1)
        with pytest.raises(TypeError):
            locked("k", meta=["x"])

    def test_wraps_and_exposes_the_decorator(self):
        @locked("k")
        def job():
            """Doc."""

        assert job.__name__ == "job" and job.__doc__ == "Doc."
        assert job.locked.template.template == "k"


# =========================================================================== plain callables


class TestPlainFunctions:
    def test_holds_the_lock_during_the_call_and_releases_after(self):
        @locked("job:{name}")
        def job(name):
            assert current_lock().held
            return is_locked(f"job:{name}")

        assert job("a") is True
        assert not is_locked("job:a")
        assert current_lock() is None

    def test_raises_lock_not_acquired_when_held(self):
        calls = []

        @locked("job:{name}")
        def job(name):
            calls.append(name)

        with held_by_someone_else("job:a"), pytest.raises(LockNotAcquired) as info:
            job("a")
        assert calls == []
        assert info.value.name == "job:a"
        assert 0 < info.value.retry_after <= 10

    def test_on_locked_value_instead_of_raising(self):
        @locked("job", on_locked=lambda exc: ("skipped", exc.name))
        def job():
            return "ran"

        with held_by_someone_else("job"):
            assert job() == ("skipped", "job")
        assert job() == "ran"

    def test_released_when_the_function_raises(self):
        @locked("job")
        def job():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            job()
        assert not is_locked("job")

    def test_wait_serializes_threads(self):
        inside = threading.Event()
        release = threading.Event()
        order = []

        @locked("job", wait=30)
        def job(tag):
            order.append(("in", tag))
            if tag == "first":
                inside.set()
                assert release.wait(30)
            order.append(("out", tag))

        first = threading.Thread(target=job, args=("first",))
        first.start()
        assert inside.wait(30)
        second = threading.Thread(target=job, args=("second",))
        second.start()
        release.set()
        first.join(30)
        second.join(30)
        assert order == [("in", "first"), ("out", "first"), ("in", "second"), ("out", "second")]

    def test_methods_with_self_fields(self):
        class Account:
            def __init__(self, pk):
                self.pk = pk

            @locked("account:{self.pk}")
            def sync(self):
                return current_lock().name

        assert Account(7).sync() == "account:7"

    def test_key_callable(self):
        @locked(key=lambda a, b: f"sum:{a + b}")
        def add(a, b):
            return current_lock().name

        assert add(1, 2) == "sum:3"

    def test_meta_records_the_function(self):
        @locked("job", meta={"purpose": "test"})
        def job():
            return get_redlock().lock_info("job").meta

        meta = job()
        assert meta["function"].endswith("job")
        assert meta["purpose"] == "test"

    def test_nested_calls_are_reentrant_in_one_thread(self):
        @locked("job")
        def inner():
            return current_lock().name

        @locked("job")
        def outer():
            return inner()

        assert outer() == "job"
        assert not is_locked("job")

    def test_fencing(self):
        @locked("ledger", fencing=True)
        def write():
            return current_lock().fence

        first, second = write(), write()
        assert first is not None and second > first

    def test_generator_holds_the_lock_while_it_runs(self):
        @locked("gen:{n}")
        def numbers(n):
            yield from range(n)

        gen = numbers(3)
        assert not is_locked("gen:3")  # nothing taken until it starts
        assert next(gen) == 0
        assert is_locked("gen:3")
        assert list(gen) == [1, 2]
        assert not is_locked("gen:3")
        gen2 = numbers(3)
        next(gen2)
        gen2.close()
        assert not is_locked("gen:3")


class TestContextManager:
    def test_with_block(self):
        with locked("cm") as lock:
            assert lock.held and is_locked("cm")
            assert (
                get_redlock()
                .lock_info("cm")
                .meta["code"]
                .split(":")[0]
                .endswith("test_decorators.py")
            )
        assert not is_locked("cm")

    def test_with_values(self):
        with locked("order:{id}").using(id="a:b") as lock:
            assert lock.name == "order:a%3Ab"

    def test_not_acquired_raises(self):
        with held_by_someone_else("cm"), pytest.raises(LockNotAcquired), locked("cm"):
            pass

    def test_released_when_the_block_raises(self):
        with pytest.raises(KeyError), locked("cm"):
            raise KeyError
        assert not is_locked("cm")

    def test_one_object_entered_by_many_threads(self):
        guard = locked("cm", wait=30)
        inside = []
        barrier = threading.Barrier(4)

        def work():
            barrier.wait(30)
            with guard:
                inside.append(1)
                assert len(inside) == 1
                inside.pop()

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not is_locked("cm")


# =========================================================================== views


rf = RequestFactory()


@locked("order:{order_id}")
def pay_view(request, order_id):
    meta = get_redlock().lock_info(current_lock().name).meta
    return JsonResponse({"lock": current_lock().name, "meta": meta})


class TestViews:
    def test_function_view_ok(self):
        response = pay_view(rf.post("/pay/"), order_id=5)
        assert response.status_code == 200
        data = json.loads(response.content)
        assert data["lock"] == "order:5"
        assert data["meta"]["view"].endswith("pay_view")
        assert data["meta"]["path"] == "/pay/" and data["meta"]["method"] == "POST"
        assert not is_locked("order:5")

    def test_423_with_retry_after_and_text_body(self, client):
        with held_by_someone_else("order:1", ttl=8.2):
            response = client.get("/orders/1/pay/")
        assert response.status_code == 423
        assert 1 <= int(response["Retry-After"]) <= 9
        assert response["Content-Type"].startswith("text/plain")
        assert b"try again" in response.content

    def test_423_json_when_the_client_asks(self, client):
        with held_by_someone_else("order:1", ttl=3):
            response = client.get("/orders/1/pay/", HTTP_ACCEPT="application/json")
        assert response.status_code == 423
        body = response.json()
        assert body["error"] == "locked"
        assert body["retry_after"] == int(response["Retry-After"]) == 3

    def test_html_preferred_gets_text(self, client):
        with held_by_someone_else("order:1"):
            response = client.get("/orders/1/pay/", HTTP_ACCEPT="text/html,application/json;q=0.9")
        assert response["Content-Type"].startswith("text/plain")

    def test_on_locked_callable(self):
        @locked("k", on_locked=lambda request, exc: HttpResponse("busy", status=409))
        def view(request):
            return HttpResponse("ok")

        with held_by_someone_else("k"):
            response = view(rf.get("/"))
        assert response.status_code == 409 and response.content == b"busy"
        assert "Retry-After" not in response

    def test_on_locked_423_gets_retry_after_added(self):
        @locked("k", on_locked=lambda request, exc: HttpResponse("mine", status=423))
        def view(request):
            return HttpResponse("ok")

        with held_by_someone_else("k", ttl=5):
            response = view(rf.get("/"))
        assert response["Retry-After"] == "5"

    def test_locked_response_setting(self, client, settings, redlock_settings):
        settings.REDLOCK = {
            **redlock_settings,
            "LOCKED_RESPONSE": "testproject.views.busy_response",
        }
        with held_by_someone_else("order:1", ttl=4):
            response = client.get("/orders/1/pay/")
        assert response.status_code == 409
        assert response.json() == {"code": "busy", "retry_after": 4}

    def test_503_when_too_few_nodes_answer(self, settings, redis_cluster_factory, caplog):
        cluster = redis_cluster_factory(3)
        settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0}
        cluster[0].kill()
        cluster[1].kill()
        with caplog.at_level(logging.WARNING, logger="django_redlock"):
            response = pay_view(rf.get("/", HTTP_ACCEPT="application/json"), order_id=1)
        assert response.status_code == 503
        assert json.loads(response.content)["error"] == "unavailable"
        assert int(response["Retry-After"]) >= 1
        # An operator must learn why requests fail: a warning naming the nodes that failed.
        record = next(r for r in caplog.records if getattr(r, "lock_event", None) == "unavailable")
        assert record.levelno == logging.WARNING and record.lock_name == "order:1"
        assert cluster.urls[0] in record.getMessage() and cluster.urls[1] in record.getMessage()

    def test_a_refused_or_unavailable_request_logs_its_path_escaped(
        self, settings, redis_cluster_factory, caplog
    ):
        """A client's path cannot forge log lines or send terminal escapes into the log: CR,
        LF and ESC are written as Django's request logger writes them (``\\r``, ``\\x1b``)."""
        path = "/y%0d%0aCRITICAL%20django_redlock%20forged%1b%5b31m/"  # as a client sends it
        with caplog.at_level(logging.INFO, logger="django_redlock"):
            with held_by_someone_else("order:1"):
                assert pay_view(rf.get(path), order_id=1).status_code == 423
            cluster = redis_cluster_factory(3)
            settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0}
            cluster[0].kill()
            cluster[1].kill()
            assert pay_view(rf.get(path), order_id=1).status_code == 503
        messages = {
            r.lock_event: r.getMessage() for r in caplog.records if hasattr(r, "lock_event")
        }
        assert set(messages) == {"refused", "unavailable"}
        for message in messages.values():
            assert "/y\\r\\nCRITICAL django_redlock forged\\x1b[31m/" in message, message
            assert not {"\r", "\n", "\x1b"} & set(message), message

    def test_released_when_the_view_raises(self):
        @locked("k")
        def view(request):
            raise ValueError("bad")

        with pytest.raises(ValueError):
            view(rf.get("/"))
        assert not is_locked("k")

    def test_user_keyed_view(self, admin_client, admin_user):
        response = admin_client.get("/profile/")
        assert response.json()["lock"] == f"profile:{admin_user.pk}"

    def test_user_id_in_meta_when_loaded(self, admin_client, admin_user):
        response = admin_client.get("/profile/")
        assert response.status_code == 200
        # the template read request.user, so the meta has it (no extra query otherwise)
        info_meta = []

        @locked("p:{request.user.pk}")
        def view(request):
            info_meta.append(get_redlock().lock_info(current_lock().name).meta)
            return HttpResponse()

        request = rf.get("/")
        request.user = admin_user
        view(request)
        assert info_meta[0]["user"] == admin_user.pk

    def test_anonymous_user_key(self, client):
        assert client.get("/profile/").json()["lock"] == "profile:%none"

    def test_sync_class_based_view(self, client):
        assert client.get("/invoices/3/").json()["lock"] == "invoice:3"
        with held_by_someone_else("invoice:3"):
            assert client.get("/invoices/3/").status_code == 423

    def test_method_decorator_on_a_handler(self):
        class V(View):
            @method_decorator(locked("thing:{pk}"))
            def get(self, request, pk):
                return HttpResponse(current_lock().name)

        assert V.as_view()(rf.get("/"), pk=9).content == b"thing:9"

    def test_method_without_method_decorator_finds_the_request(self):
        class V(View):
            @locked("thing:{pk}")
            def get(self, request, pk):
                return HttpResponse(current_lock().name)

        view = V.as_view()
        assert view(rf.get("/"), pk=1).content == b"thing:1"
        with held_by_someone_else("thing:1"):
            assert view(rf.get("/"), pk=1).status_code == 423

    def test_a_function_called_from_a_view_reenters_its_lock(self):
        @locked("order:{order_id}")
        def charge(order_id):
            return current_lock().name

        @locked("order:{order_id}")
        def view(request, order_id):
            return HttpResponse(charge(order_id))

        assert view(rf.get("/"), order_id=2).content == b"order:2"

    def test_two_requests_on_one_thread_are_different_owners(self):
        # ASGI runs every sync view on one thread: the owner must be the request
        second = []

        @locked("k")
        def inner_view(request):
            return HttpResponse("inner")

        @locked("k")
        def outer_view(request):
            second.append(inner_view(rf.get("/other/")).status_code)
            return HttpResponse("outer")

        assert outer_view(rf.get("/")).status_code == 200
        assert second == [423]

    def test_fenced_view(self, client):
        first = client.get("/ledger/acc-1/").json()["fence"]
        second = client.get("/ledger/acc-1/").json()["fence"]
        assert second > first

    def test_streaming_released_when_the_stream_ends(self, client):
        response = client.get("/exports/report.csv")
        assert response.status_code == 200
        assert is_locked("export:report")  # still streaming
        body = b"".join(response.streaming_content)
        assert body.startswith(b"id,name")
        assert not is_locked("export:report")

    @pytest.mark.django_db  # close() sends request_finished, which touches the database
    def test_streaming_released_when_closed_early(self):
        @locked("s")
        def view(request):
            return StreamingHttpResponse(iter([b"a", b"b"]))

        response = view(rf.get("/"))
        assert is_locked("s")
        response.close()  # the server closes it when the client goes away
        assert not is_locked("s")

    def test_streaming_second_request_refused_while_streaming(self, client):
        response = client.get("/exports/x.csv")
        assert client.get("/exports/x.csv").status_code == 423
        b"".join(response.streaming_content)
        assert client.get("/exports/x.csv").status_code == 200


# =========================================================================== async


def run(coro):
    return asyncio.run(coro)


class TestAsync:
    def test_async_function(self):
        @locked("ajob:{n}")
        async def job(n):
            assert current_lock().held
            await asyncio.sleep(0)
            return current_lock().name

        assert asyncio.iscoroutinefunction(job)
        assert run(job(1)) == "ajob:1"
        assert not is_locked("ajob:1")

    def test_async_function_not_acquired(self):
        @locked("ajob")
        async def job():
            return "ran"

        async def main():
            with held_by_someone_else("ajob"):
                with pytest.raises(LockNotAcquired):
                    await job()

        run(main())

    def test_async_tasks_exclude_each_other(self):
        @locked("ajob", wait=30)
        async def job(log, tag):
            log.append(("in", tag))
            await asyncio.sleep(0.01)
            log.append(("out", tag))

        async def main():
            log = []
            await asyncio.gather(job(log, 1), job(log, 2))
            return log

        log = run(main())
        assert log[0][0] == "in" and log[1] == ("out", log[0][1])

    def test_async_context_manager(self):
        async def main():
            async with locked("acm") as lock:
                assert lock.held and is_locked("acm")
            assert not is_locked("acm")

        run(main())

    def test_async_view_via_client(self, client):
        assert client.get("/reports/weekly/").json()["lock"] == "report:weekly"
        with held_by_someone_else("report:weekly"):
            response = client.get("/reports/weekly/")
        assert response.status_code == 423 and "Retry-After" in response

    def test_async_view_via_async_client(self, async_client):
        async def main():
            response = await async_client.get("/reports/monthly/")
            return response.json()

        assert run(main())["lock"] == "report:monthly"

    def test_async_class_based_view(self, client):
        assert client.get("/async-invoices/4/").json()["lock"] == "invoice:4"
        with held_by_someone_else("invoice:4"):
            assert client.get("/async-invoices/4/").status_code == 423

    def test_async_streaming_released_at_the_end(self, async_client):
        async def main():
            response = await async_client.get("/async-exports/a.csv")
            assert is_locked("export:a")
            chunks = [chunk async for chunk in response.streaming_content]
            return b"".join(chunks)

        assert run(main()).startswith(b"id,name")
        assert not is_locked("export:a")

    def test_async_on_locked_coroutine(self):
        async def refuse(request, exc):
            return HttpResponse("later", status=409)

        @locked("ak", on_locked=refuse)
        async def view(request):
            return HttpResponse("ok")

        with held_by_someone_else("ak"):
            response = run(view(rf.get("/")))
        assert response.status_code == 409

    def test_async_user_keyed_view_resolves_the_user(self, admin_user):
        from django.contrib.auth.models import AnonymousUser  # noqa: F401
        from django.utils.functional import SimpleLazyObject

        @locked("p:{request.user.pk}")
        async def view(request):
            return HttpResponse(current_lock().name)

        async def auser():
            return admin_user

        request: HttpRequest = rf.get("/")
        request.user = SimpleLazyObject(
            lambda: (_ for _ in ()).throw(AssertionError("sync user load from async code"))
        )
        request.auser = auser
        assert run(view(request)).content == f"p:{admin_user.pk}".encode()


# =========================================================================== Retry-After, clients


class TestRetryAfter:
    def test_fixed_retry_after_instead_of_the_lease(self):
        @locked("ra:{n}", retry_after=2)
        def view(request, n):
            return HttpResponse("ok")

        with held_by_someone_else("ra:1", ttl=30):
            response = view(rf.get("/"), n=1)
        assert response.status_code == 423 and response["Retry-After"] == "2"

    def test_callable_gets_the_refusal_with_the_remaining_lease(self):
        seen = []

        def tenth(exc):
            seen.append(exc.retry_after)
            return exc.retry_after / 10

        @locked("ra:{n}", retry_after=tenth)
        def view(request, n):
            return HttpResponse("ok")

        with held_by_someone_else("ra:2", ttl=30):
            response = view(rf.get("/"), n=2)
        assert 25 < seen[0] <= 30
        assert response["Retry-After"] == str(math.ceil(seen[0] / 10))

    def test_default_is_the_typical_hold_not_the_lease(self):
        @locked("ra:{n}")
        def view(request, n):
            return HttpResponse("ok")

        with held_by_someone_else("ra:3", ttl=30):
            first = view(rf.get("/"), n=3)
        # Before any hold of its own the decorator only knows the holder's lease.
        assert 25 <= int(first["Retry-After"]) <= 30
        assert view(rf.get("/"), n=4).status_code == 200  # a hold of a few milliseconds
        with held_by_someone_else("ra:3", ttl=30):
            second = view(rf.get("/"), n=3)
        assert second["Retry-After"] == "1"

    def test_a_fresh_process_reads_the_typical_hold_the_holder_published(self):
        @locked("ra:{n}")
        def view(request, n):
            return HttpResponse("ok")

        holder = get_redlock().lock("ra:7", 30, owner="someone-else", meta={"typical_hold": 0.2})
        assert holder.acquire(blocking=False)
        try:
            response = view(rf.get("/"), n=7)  # this decorator never held its lock
        finally:
            holder.release()
        assert response.status_code == 423 and response["Retry-After"] == "1"

    def test_holders_publish_their_typical_hold(self):
        @locked("ra:{n}")
        def view(request, n):
            return JsonResponse(dict(current_lock().meta))

        view(rf.get("/"), n=5)
        meta = json.loads(view(rf.get("/"), n=6).content)
        assert 0 <= meta["typical_hold"] < 5

    @pytest.mark.parametrize("bad", [float("nan"), -1, float("inf"), "soon"])
    def test_bad_retry_after_is_refused(self, bad):
        with pytest.raises((TypeError, ValueError), match="retry_after"):
            locked("ra:x", retry_after=bad)

    @pytest.mark.parametrize("bad", [float("nan"), -1, "soon"])
    def test_bad_wait_is_refused(self, bad):
        with pytest.raises((TypeError, ValueError), match="wait"):
            locked("ra:x", wait=bad)


class TestAnonymousClients:
    def test_request_user_pk_lumps_anonymous_users_together(self):
        from django.contrib.auth.models import AnonymousUser

        a, b = rf.get("/", REMOTE_ADDR="10.0.0.1"), rf.get("/", REMOTE_ADDR="10.0.0.2")
        a.user = b.user = AnonymousUser()
        assert make_key("cart:{u}", u=None) == "cart:%none"  # what {request.user.pk} gives

        keys = []

        @locked("cart:{client}")
        def view(request):
            keys.append(current_lock().name)
            return HttpResponse("ok")

        view(a)
        view(b)
        assert keys == ["cart:ip:10.0.0.1", "cart:ip:10.0.0.2"]

    def test_the_client_field_and_client_id_name_the_same_lock(self, django_user_model, db):
        """``"cart:{client}"`` and ``key=... f"cart:{client_id(request)}"`` are the two
        documented ways of keying on the client: one view of each kind on one resource
        exclude each other (each is refused while the other holds)."""
        from django.contrib.auth.models import AnonymousUser

        user = django_user_model.objects.create_user("pair", password="x")

        def anonymous():
            request = rf.get("/", REMOTE_ADDR="::1")
            request.user = AnonymousUser()
            return request

        def signed_in():
            return self._signed_in_request(user)

        inner: list[int] = []

        @locked("cart:{client}", wait=0)
        def by_template(request, again):
            # Another request of the same client, to a view of the other kind, meanwhile.
            other = threading.Thread(target=lambda: inner.append(by_key(again).status_code))
            other.start()
            other.join()
            return HttpResponse("ok")

        @locked(key=lambda request, **kw: f"cart:{client_id(request)}", wait=0)
        def by_key(request):
            return HttpResponse("ok")

        for request in (anonymous, signed_in):
            again = request()
            client_id(again)  # its user loaded here: the test database is this thread's
            assert by_template(request(), again=again).status_code == 200
        assert inner == [423, 423]
        assert client_id(anonymous()) == "ip:%3A%3A1"  # its own parts escaped
        assert client_id(signed_in()) == f"user:{user.pk}"

    def test_session_then_user(self, django_user_model, db):
        from django.contrib.sessions.backends.db import SessionStore

        request = rf.get("/", REMOTE_ADDR="10.0.0.1")
        request.session = SessionStore(session_key="abc123def456ghi789")
        assert client_id(request) == "session:abc123def456ghi789"
        request.user = django_user_model.objects.create_user("c", password="x")
        assert client_id(request) == f"user:{request.user.pk}"

    @staticmethod
    def _signed_in_request(user, factory=rf):
        """A request as the middleware leaves it: a session of ``user``, and ``request.user``
        lazy (nothing has read it yet)."""
        from django.conf import settings as django_settings
        from django.contrib.auth.middleware import AuthenticationMiddleware
        from django.contrib.sessions.middleware import SessionMiddleware
        from django.test import Client

        browser = Client()
        browser.force_login(user)
        request = factory.get("/")
        request.COOKIES[django_settings.SESSION_COOKIE_NAME] = browser.cookies[
            django_settings.SESSION_COOKIE_NAME
        ].value
        SessionMiddleware(lambda r: None).process_request(request)
        AuthenticationMiddleware(lambda r: None).process_request(request)
        return request

    def test_a_signed_in_user_is_one_client_in_every_session(self, django_user_model, db):
        """Two browsers of one user are one client: the second waits for the first even when
        nothing read ``request.user`` before the view (it was keyed by the session)."""
        user = django_user_model.objects.create_user("two-browsers", password="x")
        first, second = self._signed_in_request(user), self._signed_in_request(user)
        assert first.session.session_key != second.session.session_key
        statuses = []

        @locked("cart:{client}")
        def view(request):
            if request is first:
                statuses.append(view(second).status_code)  # the other browser, meanwhile
            return HttpResponse(current_lock().name)

        assert view(first).content.decode() == f"cart:user:{user.pk}"
        assert statuses == [423]

    def test_a_signed_in_user_is_one_client_in_async_views(self, django_user_model, db):
        from django.test import AsyncRequestFactory

        user = django_user_model.objects.create_user("async-browser", password="x")
        request = self._signed_in_request(user, AsyncRequestFactory())

        @locked("cart:{client}")
        async def view(request):
            return HttpResponse(current_lock().name)

        response = async_to_sync(view)(request)
        assert response.content.decode() == f"cart:user:{user.pk}"

    def test_an_argument_named_client_wins(self):
        @locked("x:{client}")
        def view(request, client):
            return HttpResponse(current_lock().name)

        assert view(rf.get("/"), client="acme").content == b"x:acme"


# =========================================================================== argument checks


@pytest.mark.parametrize("name", ["fair", "fencing", "auto_renew"])
def test_a_flag_that_is_not_a_bool_is_refused_at_decoration(name):
    with pytest.raises(TypeError, match=name):
        locked("flags:k", **{name: "yes"})


def test_a_wrong_on_locked_path_fails_the_first_call_before_any_lock_is_asked_for():
    calls = []

    @locked("onlocked:k", on_locked="no.such.path")
    def work():
        calls.append(is_locked("onlocked:k"))

    with pytest.raises(ImportError, match=r"on_locked='no\.such\.path'"):
        work()  # the lock is free: the path is checked all the same
    assert calls == [] and not is_locked("onlocked:k")


def test_renew_for_alone_turns_renewal_on_and_auto_renew_false_with_it_is_refused():
    with pytest.raises(ValueError, match="renew_for"):
        locked("renewfor:k", renew_for=5, auto_renew=False)

    @locked("renewfor:k", ttl=0.6, renew_for=5)
    def work():
        lock = current_lock()
        start = lock.validity
        # Past the first lease: only a renewal keeps it.
        threading.Event().wait(1.0)
        return start, lock.held

    _, held = work()
    assert held
