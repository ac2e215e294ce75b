"""docs/usage.rst's Django REST framework promises that tests/test_drf.py leaves out, with
real DRF and the real nodes of ``redlock_settings``: a throttled request never takes the lock,
a custom ``EXCEPTION_HANDLER`` receives ``LockBusy`` like any ``APIException`` (``wait`` set),
and ``REDLOCK["LOCKED_RESPONSE"]`` still answers instead when set."""

from __future__ import annotations

import contextlib
import json

import pytest
from django.test import RequestFactory

pytest.importorskip("rest_framework", reason="Django REST framework is not installed")

from rest_framework.decorators import api_view, throttle_classes
from rest_framework.response import Response
from rest_framework.test import force_authenticate
from rest_framework.throttling import BaseThrottle

from django_redlock import get_redlock, locked
from django_redlock.drf import LockBusy
from django_redlock.signals import lock_acquired

pytestmark = [pytest.mark.usefixtures("redlock_settings"), pytest.mark.django_db]
rf = RequestFactory()
SEEN: list[Exception] = []


def recording_handler(exc, context):
    """A project's EXCEPTION_HANDLER: records what it is given, then answers as DRF does."""
    from rest_framework.views import exception_handler

    SEEN.append(exc)
    return exception_handler(exc, context)


class Refuse(BaseThrottle):
    def allow_request(self, request, view):
        return False

    def wait(self):
        return 9


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="drf-promises")


def authenticated(user, path="/pay/"):
    request = rf.post(path)
    force_authenticate(request, user=user)
    return request


@contextlib.contextmanager
def held(name):
    lock = get_redlock().lock(name, 10.0, owner="someone-else")
    assert lock.acquire(blocking=False)
    try:
        yield
    finally:
        lock.release()


def test_a_throttled_request_never_takes_the_lock(user):
    taken = []

    def record(sender, name, **kwargs):
        taken.append(name)

    @api_view(["POST"])
    @throttle_classes([Refuse])
    @locked("throttled:{client}")
    def pay(request):
        return Response({"ok": True})

    lock_acquired.connect(record)
    try:
        response = pay(authenticated(user))
    finally:
        lock_acquired.disconnect(record)
    assert response.status_code == 429 and taken == []


def test_a_custom_exception_handler_receives_lock_busy(settings, user):
    settings.REST_FRAMEWORK = {
        **getattr(settings, "REST_FRAMEWORK", {}),
        "EXCEPTION_HANDLER": f"{__name__}.recording_handler",
    }
    SEEN.clear()

    @api_view(["POST"])
    @locked("handled:{client}")
    def pay(request):
        return Response({"ok": True})

    with held(f"handled:user:{user.pk}"):
        response = pay(authenticated(user))
    assert response.status_code == 423 and 1 <= int(response["Retry-After"]) <= 10
    assert len(SEEN) == 1 and isinstance(SEEN[0], LockBusy) and SEEN[0].wait


def test_the_locked_response_setting_still_answers_under_drf(settings, redlock_settings, user):
    settings.REDLOCK = {**redlock_settings, "LOCKED_RESPONSE": "testproject.views.busy_response"}

    @api_view(["POST"])
    @locked("setting:{client}")
    def pay(request):
        return Response({"ok": True})

    with held(f"setting:user:{user.pk}"):
        response = pay(authenticated(user))
    assert response.status_code == 409 and json.loads(response.content)["code"] == "busy"
