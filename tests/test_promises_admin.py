"""docs/admin.rst's promises that tests/test_admin*.py leave out, with Django's test client
against real nodes: the list reads the nodes with SCAN, never KEYS (the nodes' own command
statistics say so), the banner about a node that holds none of the listed locks, and pages
without inline scripts (a strict CSP works) that refresh every 5 s when asked."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin import AdminSite
from django.test import Client
from django.urls import path

from django_redlock.admin import LockAdmin
from django_redlock.models import Lock

pytestmark = pytest.mark.django_db
LIST = "/admin/django_redlock/lock/"
NODES = LIST + "nodes/"


def command_calls(node, command: str) -> int:
    with node.client(socket_timeout=5) as c:
        return int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_the_list_scans_and_never_sends_keys(client: Client, lock_viewer, holder, redis_nodes):
    for i in range(3):
        assert holder.lock(f"adm:scan:{i}").acquire(blocking=False)
    for node in redis_nodes:
        with node.client(socket_timeout=5) as c:
            c.config_resetstat()
    client.force_login(lock_viewer)
    response = client.get(LIST, {"q": "adm:scan:*"})
    assert response.status_code == 200 and b"adm:scan:2" in response.content
    for node in redis_nodes:
        assert command_calls(node, "keys") == 0
        assert command_calls(node, "scan") >= 1


def test_a_node_holding_none_of_the_listed_locks_gets_a_banner(
    client: Client, lock_viewer, holder, redis_nodes
):
    for i in range(3):
        assert holder.lock(f"adm:gone:{i}").acquire(blocking=False)
    with redis_nodes[0].client(socket_timeout=5) as c:
        c.delete(*(f"redlock:lock:adm:gone:{i}" for i in range(3)))
    client.force_login(lock_viewer)
    page = client.get(LIST).content.decode()
    assert "holds none of the 3 listed locks" in page
    assert "may be unreachable or have restarted empty" in page
    assert str(redis_nodes[0].port) in page.split("holds none of")[0].rsplit("<p", 1)[1]


@pytest.mark.parametrize("url", [LIST, NODES])
def test_no_inline_script_and_a_five_second_refresh(client: Client, lock_viewer, holder, url):
    assert holder.lock("adm:csp").acquire(blocking=False)
    client.force_login(lock_viewer)
    page = client.get(url).content.decode()
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert scripts and all("src=" in tag for tag in scripts), scripts
    assert not re.search(r"\son[a-z]+=", page), "an inline event handler"
    assert 'id="redlock-autorefresh" data-interval="5"' in page


# docs/admin.rst, "Customising": a subclass changes the page size and the refresh interval,
# and may be registered on another admin site. This module is that site's URLconf.
class MyLockAdmin(LockAdmin):
    list_per_page = 50
    refresh_interval = 10


ops_site = AdminSite(name="ops")
ops_site.register(Lock, MyLockAdmin)
urlpatterns = [path("ops/", ops_site.urls)]


def test_a_subclass_on_another_site_sets_page_size_and_refresh(
    client: Client, admin_user, holder, settings, redis_nodes
):
    settings.ROOT_URLCONF = __name__
    for i in range(60):
        assert holder.lock(f"adm:page:{i:02d}").acquire(blocking=False)
    client.force_login(admin_user)
    first = client.get("/ops/django_redlock/lock/")
    assert first.status_code == 200
    page = first.content.decode()
    assert page.count('<tr class="redlock-row') == 50
    assert 'data-interval="10"' in page
    assert 'href="/ops/"' in page  # the breadcrumb points at this site, not the default one
    second = client.get("/ops/django_redlock/lock/", {"p": 2}).content.decode()
    assert second.count('<tr class="redlock-row') == 10
