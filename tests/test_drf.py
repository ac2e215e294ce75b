"""``@locked`` under Django REST framework: real DRF (TokenAuthentication and
SessionAuthentication), real embedded Redis nodes, the testproject's API views
(testproject/drf_views.py) in the three forms docs/usage.rst shows: an ``@api_view`` function,
an ``APIView`` method and ViewSet actions.

Two requests are truly concurrent: each runs in its own thread through Django's test client and
waits inside its critical section on a gate (testproject.views.gate) until the test opens it;
every synchronisation is on an event, never on a sleep.
"""

from __future__ import annotations

import json
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.test import Client, RequestFactory

pytest.importorskip("rest_framework", reason="Django REST framework is not installed")

from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view
from rest_framework.response import Response
from rest_framework.views import APIView

from django_redlock import get_redlock, locked
from django_redlock.drf import LockBusy
from testproject.views import gate

pytestmark = [
    pytest.mark.usefixtures("redlock_settings", "gates_on"),
    pytest.mark.django_db(transaction=True),
]

TIMEOUT = 30

#: (HTTP method, path, lock name prefix) of each form, for one resource id.
FORMS = {
    "api_view": ("post", "/api/orders/{id}/pay/", "api-order:{id}"),
    "APIView": ("post", "/api/invoices/{id}/", "api-invoice:{id}"),
    "ViewSet": ("put", "/api/accounts/{id}/", "api-account:{id}"),
    "@action": ("post", "/api/accounts/{id}/sync/", "api-account-sync:{id}"),
}


@pytest.fixture
def gates_on(settings):
    settings.TESTPROJECT_GATES = True


@pytest.fixture
def users(django_user_model):
    return [
        django_user_model.objects.create_user(username=name, password="pw-" + name)
        for name in ("ann", "bob")
    ]


def token_client(user) -> Client:
    """A client that authenticates with DRF's TokenAuthentication only (no session)."""
    token = Token.objects.create(user=user)
    return Client(headers={"Authorization": f"Token {token.key}"})


def session_client(user) -> Client:
    """A client signed in with a Django session (DRF's SessionAuthentication)."""
    client = Client()
    client.force_login(user)
    return client


CLIENTS = {"token": token_client, "session": session_client}


def send(client: Client, form: str, resource: int, gate_name: str | None = None):
    method, path, _ = FORMS[form]
    url = path.format(id=resource) + (f"?gate={gate_name}" if gate_name else "")
    return getattr(client, method)(url, data={}, content_type="application/json")


@pytest.mark.parametrize("auth", sorted(CLIENTS))
@pytest.mark.parametrize("form", list(FORMS))
def test_two_users_get_two_locks(form, auth, users):
    ann, bob = (CLIENTS[auth](user) for user in users)
    g = uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(send, client, form, 7, g) for client in (ann, bob)]
        # Both are inside their critical sections at the same time: two locks, not one.
        arrived = gate(g).wait_arrivals(2, TIMEOUT)
        gate(g).open()
        responses = [f.result(TIMEOUT) for f in futures]
    assert arrived, [r.status_code for r in responses if r is not None]
    assert [r.status_code for r in responses] == [200, 200]
    bodies = [r.json() for r in responses]
    prefix = FORMS[form][2].format(id=7)
    assert [b["user"] for b in bodies] == [u.pk for u in users]
    assert [b["lock"] for b in bodies] == [f"{prefix}:user:{u.pk}" for u in users]
    a, b = bodies
    assert a["start"] < b["end"] and b["start"] < a["end"], "the two users did not overlap"


@pytest.mark.parametrize("auth", sorted(CLIENTS))
@pytest.mark.parametrize("form", list(FORMS))
def test_one_user_twice_gets_423(form, auth, users):
    client = CLIENTS[auth](users[0])
    g = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(send, client, form, 8, g)
        assert gate(g).wait_arrivals(1, TIMEOUT)  # the first holds the lock...
        second = send(client, form, 8)  # ...while the same user asks again
        assert gate(g).arrived == 1
        gate(g).open()
        assert first.result(TIMEOUT).status_code == 200
    assert second.status_code == 423
    assert int(second["Retry-After"]) >= 1
    body = second.json()
    assert body["error"] == "locked"
    assert body["retry_after"] == int(second["Retry-After"])
    assert "another request" in body["detail"]
    # the lock is free again once the first request is done
    assert send(client, form, 8).status_code == 200


def test_refusal_is_rendered_by_drf_for_the_browsable_api(users):
    """The 423 is a DRF exception: DRF's negotiated renderer writes it (HTML for a browser,
    the browsable API), with the same Retry-After."""
    client = token_client(users[0])
    name = f"api-order:9:user:{users[0].pk}"
    lock = get_redlock().lock(name, 10.0, owner="someone-else")
    assert lock.acquire(blocking=False)
    try:
        response = client.post("/api/orders/9/pay/", HTTP_ACCEPT="text/html")
    finally:
        lock.release()
    assert response.status_code == 423
    assert response["Content-Type"].startswith("text/html")
    assert int(response["Retry-After"]) >= 1
    assert b"another request" in response.content


def test_an_unauthenticated_request_never_takes_the_lock(users):
    """DRF refuses it (401) before @locked runs: no lock was taken on its behalf."""
    taken = []
    from django_redlock.signals import lock_acquired

    def record(sender, name, **kwargs):
        taken.append(name)

    lock_acquired.connect(record)
    try:
        response = Client().post("/api/orders/5/pay/", content_type="application/json")
    finally:
        lock_acquired.disconnect(record)
    assert response.status_code in (401, 403)
    assert taken == []
    assert list(get_redlock().live_locks("api-order:*")) == []


def test_too_few_nodes_answer_503(settings, users):
    client = token_client(users[0])
    dead = []
    for _ in range(3):
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead.append(f"redis://127.0.0.1:{s.getsockname()[1]}/0")
    settings.REDLOCK = {"NODES": dead, "TTL": 10.0, "NODE_TIMEOUT": 0.2, "RETRY_COUNT": 0}
    response = client.post("/api/orders/6/pay/", HTTP_ACCEPT="application/json")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert json.loads(response.content)["error"] == "unavailable"


# ----------------------------------------------------------------- the wrong decorator order


def test_locked_above_api_view_is_refused_at_decoration():
    def pay(request):
        return Response({})

    with pytest.raises(TypeError, match=r"below @api_view") as info:
        locked("order:{client}")(api_view(["POST"])(pay))
    assert "anonymous for token and basic auth" in str(info.value)


def test_locked_on_as_view_is_refused_at_decoration():
    class Pay(APIView):
        def post(self, request):
            return Response({})

    with pytest.raises(TypeError, match=r"before Django REST framework authenticates"):
        locked("order:{client}")(Pay.as_view())


def test_locked_on_dispatch_is_refused_at_the_first_call():
    from django.utils.decorators import method_decorator

    @method_decorator(locked("order:{client}"), name="dispatch")
    class Pay(APIView):
        def post(self, request):
            return Response({})

    class Direct(APIView):
        @locked("order:{client}")
        def dispatch(self, request, *args, **kwargs):
            return super().dispatch(request, *args, **kwargs)

    for view in (Pay.as_view(), Direct.as_view()):
        with pytest.raises(TypeError, match=r"not on as_view\(\) or dispatch\(\)"):
            view(RequestFactory().post("/pay/"))
    assert list(get_redlock().live_locks("order:*")) == []


def test_on_locked_still_wins_under_drf(users):
    """An explicit ``on_locked`` answers instead of the DRF exception."""
    from django.http import JsonResponse

    @api_view(["POST"])
    @locked("custom:{client}", on_locked=lambda request, exc: JsonResponse({"busy": 1}, status=409))
    def pay(request):
        return Response({"ok": True})

    factory = RequestFactory()
    request = factory.post("/pay/")
    from rest_framework.test import force_authenticate

    force_authenticate(request, user=users[0])
    lock = get_redlock().lock(f"custom:user:{users[0].pk}", 10.0, owner="someone-else")
    assert lock.acquire(blocking=False)
    try:
        response = pay(request)
    finally:
        lock.release()
    assert response.status_code == 409
    assert json.loads(response.content) == {"busy": 1}
    assert LockBusy.status_code == 423


NO_DRF_IMPORT = """
import sys
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.admin", "django.contrib.sessions",
                    "django.contrib.messages", "django_redlock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    REDLOCK={"NODES": ["redis://127.0.0.1:1/0"], "NODE_TIMEOUT": 0.2, "RETRY_COUNT": 0},
    ROOT_URLCONF=[],
)
django.setup()
import django_redlock.admin, django_redlock.checks, django_redlock.decorators, django_redlock.keys
from django.test import RequestFactory
from django_redlock import locked

@locked("k:{client}")
def view(request):
    raise AssertionError("not reached: no node answers")

response = view(RequestFactory().get("/"))
print("STATUS", response.status_code)
bad = sorted(m for m in sys.modules if m == "rest_framework" or m.startswith("rest_framework."))
assert not bad, bad
print("OK")
"""


def test_drf_is_never_imported_by_the_package():
    """DRF is installed here, yet a project that does not use it never imports it: not at
    setup, not when @locked decorates or answers a plain view."""
    from tests.helpers import run_python

    result = run_python(NO_DRF_IMPORT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "STATUS 503" in result.stdout and "OK" in result.stdout
