"""docs/configuration.rst: a password given in a node's URL "is never shown in logs, errors,
the admin page or manage.py redlock". Real password-protected nodes, one of them killed so
that errors and warnings name it; every page, command output, exception and log record of
the session is searched for the password."""

from __future__ import annotations

import logging
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from django_redlock import QuorumError, get_redlock

SECRET = "pw-9f2c-never-shown"
pytestmark = pytest.mark.django_db


def command(*args: str) -> str:
    out, err = StringIO(), StringIO()
    try:
        call_command("redlock", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return out.getvalue() + err.getvalue() + str(exc)
    return out.getvalue() + err.getvalue()


def test_a_url_password_shows_nowhere(settings, redis_cluster_factory, admin_user, caplog):
    cluster = redis_cluster_factory(3, password=SECRET)
    assert all(SECRET in url for url in cluster.urls)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.2}
    rl = get_redlock()
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        with rl.lock("sec:held", ttl=10):
            cluster[2].kill()
            client = Client()
            client.force_login(admin_user)
            for url in (
                "/admin/django_redlock/lock/",
                "/admin/django_redlock/lock/nodes/",
                "/admin/django_redlock/lock/detail/?name=sec:held",
                "/redlock/ready/",
            ):
                response = client.get(url)
                assert response.status_code in (200, 503), url
                seen.append(response.content.decode())
            seen += [command("list"), command("list", "--json"), command("check")]
            seen += [command("check", "--json"), command("release", "sec:held")]
            cluster[1].kill()
            with pytest.raises(QuorumError) as caught:
                rl.lock("sec:other", ttl=5).acquire(blocking=False)
            seen.append(str(caught.value) + repr(caught.value.failures))
            seen += [command("list"), command("check")]
            seen += [repr(rl), repr(rl.nodes), repr(rl.health())]
    seen += [record.getMessage() for record in caplog.records]
    seen += [str(record.__dict__) for record in caplog.records]
    assert any("127.0.0.1" in text for text in seen)  # the nodes are named...
    leaks = [text for text in seen if SECRET in text]
    assert not leaks, leaks[0][:500]  # ...never with their password
