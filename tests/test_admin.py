"""The admin "Locks" page with Django's test client, against real embedded Redis nodes.

Locks are taken by a separate ``Redlock`` (as another process would) or written with the core's
key layout straight into the nodes (to build split or leftover states); what the nodes hold is
always checked with raw redis-py clients, never through the code under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import reverse

from django_redlock import LockLost, Redlock
from django_redlock.admin_views import (
    STALE_RENEWAL_FRACTION,
    format_duration,
    holder_summary,
    search_pattern,
)
from django_redlock.core.commands import lock_fields, lock_value
from django_redlock.models import Lock
from django_redlock.signals import lock_force_released

pytestmark = pytest.mark.django_db

REPO_ROOT = Path(__file__).resolve().parent.parent
LIST = "/admin/django_redlock/lock/"
DETAIL = LIST + "detail/"
NODES = LIST + "nodes/"
RELEASE = LIST + "release/"
XSS = "<script>alert(1)</script>"


@pytest.fixture
def holder(admin_redlock_settings, redis_nodes):
    """A Redlock of its own, standing in for another process holding locks."""
    rl = Redlock(list(redis_nodes.urls), ttl=30.0, max_ttl=120.0)
    yield rl
    rl.close()


def login(client: Client, user) -> Client:
    client.force_login(user)
    return client


def tokens(redis_nodes, name: str) -> list[str | None]:
    out = []
    for node in redis_nodes:
        with node.client(socket_timeout=5) as c:
            raw = c.get(f"redlock:lock:{name}")
            out.append(lock_fields(raw)["token"] if raw is not None else None)
    return out


def write_lock(
    node,
    name: str,
    token: str,
    *,
    ttl_ms: int = 30_000,
    renewals: int = 0,
    lease_ms: int | None = None,
    meta: dict | None = None,
) -> None:
    """One node's copy of a lock in the core's layout (core/scripts.py), for states the lock
    API cannot produce on purpose (split, leftovers, overdue renewals)."""
    with node.client(socket_timeout=5) as c:
        now_ms = int(time.time() * 1000)
        key = f"redlock:lock:{name}"
        value = lock_value(
            token,
            ttl_ms=lease_ms or ttl_ms,
            meta_json=json.dumps(meta or {"host": "elsewhere", "pid": 1}),
            renewals=renewals,
            acquired_ms=now_ms,
        )
        c.set(key, value, px=ttl_ms)


def row_keys(response) -> list[str]:
    return [
        unescape(k)
        for k in re.findall(
            r'<tr class="redlock-row[^"]*" data-key="([^"]*)"', response.content.decode()
        )
    ]


def row_html(response, name: str) -> str:
    html = response.content.decode()
    marker = f'data-key="{name}"'
    start = html.rindex("<tr", 0, html.index(marker))
    return html[start : html.index("</tr>", start)]


# -- the model and the admin index ------------------------------------------------------------


def test_model_is_unmanaged_with_view_and_release_permissions():
    assert Lock._meta.managed is False
    codenames = set(
        Permission.objects.filter(content_type=ContentType.objects.get_for_model(Lock)).values_list(
            "codename", flat=True
        )
    )
    assert codenames == {"view_lock", "release_lock"}


def test_no_migration_missing(capsys):
    from django.core.management import call_command

    call_command("makemigrations", "django_redlock", "--check", "--dry-run", verbosity=1)


def test_index_lists_locks_under_the_app(client, lock_viewer, admin_redlock_settings):
    login(client, lock_viewer)
    response = client.get("/admin/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "Distributed locks" in html
    assert f'href="{LIST}"' in html
    assert reverse("admin:django_redlock_lock_changelist") == LIST


def test_index_hides_locks_without_view_permission(client, lock_staff, admin_redlock_settings):
    login(client, lock_staff)
    assert f'href="{LIST}"' not in client.get("/admin/").content.decode()


# -- access control ---------------------------------------------------------------------------

ALL_URLS = [LIST, DETAIL + "?name=x", NODES, RELEASE + "?name=x"]


@pytest.mark.parametrize("url", ALL_URLS)
def test_anonymous_is_sent_to_login(client, admin_redlock_settings, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=")


@pytest.mark.parametrize("url", ALL_URLS)
def test_non_staff_user_is_sent_to_login(client, django_user_model, admin_redlock_settings, url):
    user = django_user_model.objects.create_user("plain", password="x")
    user.user_permissions.add(Permission.objects.get(codename="view_lock"))
    login(client, user)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


@pytest.mark.parametrize("url", ALL_URLS)
def test_staff_without_view_permission_gets_403(client, lock_staff, admin_redlock_settings, url):
    login(client, lock_staff)
    assert client.get(url).status_code == 403


def test_staff_without_view_permission_cannot_post_release(client, lock_staff, holder, redis_nodes):
    lock = holder.lock("guarded")
    assert lock.acquire()
    login(client, lock_staff)
    assert client.post(RELEASE, {"name": "guarded", "confirm": "yes"}).status_code == 403
    assert tokens(redis_nodes, "guarded") == [lock.token] * 3


def test_viewer_sees_locks_but_no_release_controls(client, lock_viewer, holder, redis_nodes):
    lock = holder.lock("report:7", meta={"user": "alice"})
    assert lock.acquire()
    login(client, lock_viewer)
    html = client.get(LIST).content.decode()
    assert "report:7" in html
    assert 'class="redlock-select"' not in html
    assert "redlock-release-selected" not in html
    detail = client.get(DETAIL + "?name=report:7").content.decode()
    assert "Force release" not in detail and RELEASE not in detail
    # GET of the confirmation and the POST itself are both refused.
    assert client.get(RELEASE + "?name=report:7").status_code == 403
    assert client.post(RELEASE, {"name": "report:7", "confirm": "yes"}).status_code == 403
    assert client.post(RELEASE, {"name": "report:7"}).status_code == 403
    assert tokens(redis_nodes, "report:7") == [lock.token] * 3


def test_releaser_sees_release_controls(client, lock_releaser, holder):
    assert holder.lock("job:1").acquire()
    login(client, lock_releaser)
    html = client.get(LIST).content.decode()
    assert 'class="redlock-select"' in html and "redlock-release-selected" in html
    assert (
        'href="' + RELEASE + "?name=job%3A1" in client.get(DETAIL + "?name=job:1").content.decode()
    )


# -- the list ---------------------------------------------------------------------------------


def test_list_shows_holder_times_nodes_renewals_and_fence(client, lock_viewer, holder):
    lock = holder.lock(
        "invoice:42",
        ttl=40,
        fencing=True,
        meta={"view": "shop.views.pay", "method": "POST", "path": "/pay/42/", "user": "alice"},
    )
    assert lock.acquire()
    assert lock.extend()
    task_lock = holder.lock(
        "sync:9", meta={"task": "app.tasks.sync", "task_id": "c0ffee-1", "worker": "celery@w1"}
    )
    assert task_lock.acquire()
    login(client, lock_viewer)
    response = client.get(LIST)
    assert response.status_code == 200
    row = row_html(response, "invoice:42")
    assert f"{os.uname().nodename}:{os.getpid()}" in row  # host:pid
    assert "thread MainThread" in row
    assert "view shop.views.pay" in row and "POST /pay/42/" in row and "user alice" in row
    assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT', row)  # absolute time ...
    assert re.search(r"\d+(\.\d s| ms)</span> ago", row)  # ... and relative
    countdown = float(re.search(r'class="field-ttl" data-countdown="([\d.]+)"', row).group(1))
    assert 35 < countdown <= 40
    assert '<td class="field-nodes">3/3</td>' in row
    assert '<td class="field-renewals">1</td>' in row
    fence = re.search(r'<td class="field-fence">(\d+)</td>', row).group(1)
    assert int(fence) == lock.fence
    task_row = row_html(response, "sync:9")
    assert "task id c0ffee-1" in task_row
    assert 'task app.tasks.sync <span class="redlock-quiet">on celery@w1</span>' in task_row


def test_empty_list(client, lock_viewer, admin_redlock_settings):
    login(client, lock_viewer)
    html = client.get(LIST).content.decode()
    assert "No live locks." in html


def test_search_by_substring_and_glob(client, lock_viewer, holder):
    for name in ("invoice:1", "invoice:2", "report:1", "weird*key"):
        assert holder.lock(name).acquire()
    login(client, lock_viewer)
    assert sorted(row_keys(client.get(LIST + "?q=invoice"))) == ["invoice:1", "invoice:2"]
    assert sorted(row_keys(client.get(LIST + "?q=*:1"))) == ["invoice:1", "report:1"]
    assert row_keys(client.get(LIST + "?q=" + quote("weird*"))) == ["weird*key"]
    # Without glob characters a search is literal: '*' in "d*k" would be a glob, "rd*" not.
    assert row_keys(client.get(LIST + "?q=nothing")) == []
    assert search_pattern("a[b") == "a[b"
    assert search_pattern("a]b") == "*a\\]b*"
    assert search_pattern("  ") == "*"


def test_sort_by_age_and_time_left(client, lock_viewer, holder):
    assert holder.lock("first", ttl=50).acquire()
    time.sleep(0.05)
    assert holder.lock("second", ttl=20).acquire()
    time.sleep(0.05)
    assert holder.lock("third", ttl=35).acquire()
    login(client, lock_viewer)
    assert row_keys(client.get(LIST)) == ["first", "second", "third"]  # default: oldest first
    assert row_keys(client.get(LIST + "?o=age")) == ["third", "second", "first"]
    assert row_keys(client.get(LIST + "?o=ttl")) == ["second", "third", "first"]
    assert row_keys(client.get(LIST + "?o=-ttl")) == ["first", "third", "second"]
    assert row_keys(client.get(LIST + "?o=key")) == ["first", "second", "third"]
    assert row_keys(client.get(LIST + "?o=bogus")) == ["first", "second", "third"]
    html = client.get(LIST + "?o=ttl").content.decode()
    assert 'class="column-ttl sortable sorted ascending"' in html
    assert 'href="?o=-ttl"' in html  # clicking again reverses


def test_pagination(client, lock_viewer, holder, redis_nodes):
    for node in redis_nodes:  # 230 locks in the core's layout, fast
        for i in range(230):
            write_lock(node, f"bulk:{i:03d}", f"t{i}")
    login(client, lock_viewer)
    first = client.get(LIST + "?o=key")
    assert row_keys(first) == [f"bulk:{i:03d}" for i in range(100)]
    assert "230 locks" in first.content.decode()
    assert 'href="?o=key&amp;p=3"' in first.content.decode()
    assert row_keys(client.get(LIST + "?o=key&p=3")) == [f"bulk:{i:03d}" for i in range(200, 230)]
    assert len(row_keys(client.get(LIST + "?o=key&p=999"))) == 30  # out of range: last page
    assert len(row_keys(client.get(LIST + "?o=key&p=x"))) == 100


def test_detail_per_node(client, lock_viewer, holder, redis_nodes):
    lock = holder.lock("detail:me", fencing=True, meta={"order": 42})
    assert lock.acquire()
    with redis_nodes[2].client(socket_timeout=5) as c:
        c.delete("redlock:lock:detail:me")
    login(client, lock_viewer)
    response = client.get(DETAIL + "?name=" + quote("detail:me"))
    assert response.status_code == 200
    html = response.content.decode()
    assert lock.token in html
    assert "2 of 3 hold this token (quorum 2)" in html
    per_node = html[html.index('id="redlock-per-node"') :]
    assert per_node.count('alt="yes"') == 2 and per_node.count('alt="no"') == 1
    for node in redis_nodes:
        assert node.url in per_node
    holder_table = html[html.index('id="redlock-holder"') :]
    assert '<th scope="row">order</th><td>42</td>' in holder_table
    assert '<th scope="row">pid</th><td>' + str(os.getpid()) in holder_table
    # In the list, 2/3 is flagged (a warning: still a quorum), but not stuck; one lock
    # missing on one node is no reason to call the node silent.
    listing = client.get(LIST)
    row = row_html(listing, "detail:me")
    assert '<td class="field-nodes redlock-warn">2/3</td>' in row
    assert "redlock-stuck" not in row
    assert "redlock-silent-node" not in listing.content.decode()


def test_detail_of_a_free_lock_is_404(client, lock_viewer, admin_redlock_settings):
    login(client, lock_viewer)
    response = client.get(DETAIL + "?name=gone")
    assert response.status_code == 404
    assert "No node holds this lock" in response.content.decode()
    assert client.get(DETAIL).status_code == 404


# -- stuck locks ------------------------------------------------------------------------------


def test_old_locks_are_stuck(client, lock_viewer, holder, settings):
    assert holder.lock("old-one").acquire()
    time.sleep(1.1)
    assert holder.lock("young-one").acquire()
    settings.REDLOCK = {**settings.REDLOCK, "STUCK_AFTER": 1.0}
    login(client, lock_viewer)
    response = client.get(LIST)
    assert "redlock-stuck" in row_html(response, "old-one").split(">")[0]
    assert '<span class="redlock-flag">held too long</span>' in row_html(response, "old-one")
    assert "redlock-stuck" not in row_html(response, "young-one")
    assert row_keys(client.get(LIST + "?stuck=old")) == ["old-one"]
    assert row_keys(client.get(LIST + "?stuck=any")) == ["old-one"]
    assert "Held too long (1)" in response.content.decode()


def test_stuck_after_none_turns_the_held_too_long_rule_off(client, lock_viewer, holder, settings):
    """Documented as the way to turn the rule off: a valid setting, not a broken one."""
    from io import StringIO

    from django.core import checks
    from django.core.management import call_command

    assert holder.lock("old-one").acquire()
    login(client, lock_viewer)
    base = settings.REDLOCK
    settings.REDLOCK = {**base, "STUCK_AFTER": 1e-6}  # the rule on: every lock is too old
    assert "held too long" in row_html(client.get(LIST), "old-one")
    settings.REDLOCK = {**base, "STUCK_AFTER": None}
    assert not [m for m in checks.run_checks() if m.id.startswith("django_redlock")]
    response = client.get(LIST)
    assert response.status_code == 200
    assert "held too long" not in row_html(response, "old-one")
    out = StringIO()
    call_command("redlock", "list", stdout=out)
    assert "old-one" in out.getvalue() and "held too long" not in out.getvalue()


def test_split_locks_are_stuck(client, lock_viewer, admin_redlock_settings, redis_nodes):
    # One node only (leftover of a failed acquire), and three different tokens.
    write_lock(redis_nodes[0], "leftover", "aaaa")
    for i, node in enumerate(redis_nodes):
        write_lock(node, "torn", f"token-{i}")
    for node in redis_nodes:
        write_lock(node, "healthy", "same")
    login(client, lock_viewer)
    response = client.get(LIST)
    for name, nodes in (("leftover", "1/3"), ("torn", "1/3")):
        row = row_html(response, name)
        assert "redlock-split" in row.split(">")[0]
        assert f'<td class="field-nodes redlock-bad">{nodes}</td>' in row
        assert '<span class="redlock-flag">split</span>' in row
        # Without a quorum nobody holds it: no countdown of a lease, only the leftovers'.
        assert '<td class="field-ttl redlock-bad">no quorum' in row and "copies gone in" in row
    assert "redlock-stuck" not in row_html(response, "healthy")
    assert sorted(row_keys(client.get(LIST + "?stuck=split"))) == ["leftover", "torn"]
    detail = client.get(DETAIL + "?name=torn").content.decode()
    assert detail.count('alt="other token"') == 2


def test_locks_that_stopped_renewing_are_stuck(
    client, lock_viewer, admin_redlock_settings, redis_nodes
):
    # Lease 30 s, renewed 3 times, last renewal 25 s ago (5 s left): overdue.
    for node in redis_nodes:
        write_lock(node, "silent", "tok", ttl_ms=5_000, lease_ms=30_000, renewals=3)
        # Same lease, renewed, 25 s left: healthy.
        write_lock(node, "renewing", "tok2", ttl_ms=25_000, lease_ms=30_000, renewals=3)
        # Never renewed and 5 s left: just a short lock running out, not stuck.
        write_lock(node, "ending", "tok3", ttl_ms=5_000, lease_ms=30_000, renewals=0)
    assert 25 / 30 > STALE_RENEWAL_FRACTION > 5 / 30
    login(client, lock_viewer)
    response = client.get(LIST)
    assert '<span class="redlock-flag">not renewing</span>' in row_html(response, "silent")
    assert "redlock-stuck" not in row_html(response, "renewing")
    assert "redlock-stuck" not in row_html(response, "ending")
    assert row_keys(client.get(LIST + "?stuck=stale")) == ["silent"]
    detail = client.get(DETAIL + "?name=silent").content.decode()
    assert re.search(r"30 s \(last set 2\d s ago\)", detail)  # 25 s, plus the test's own time


def test_lock_of_a_dead_process_on_this_host_is_stuck(client, lock_viewer, holder, redis_nodes):
    code = textwrap.dedent(f"""
        import os
        from django_redlock import Redlock
        rl = Redlock({list(redis_nodes.urls)!r}, ttl=60.0)
        assert rl.lock("orphan").acquire()
        print(os.getpid(), flush=True)
        os._exit(0)  # dies holding the lock: no release, no atexit
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    dead_pid = int(done.stdout.strip())
    assert holder.lock("alive").acquire()
    login(client, lock_viewer)
    response = client.get(LIST)
    row = row_html(response, "orphan")
    assert f":{dead_pid}<" in row
    assert '<span class="redlock-flag">holder gone</span>' in row
    assert "redlock-stuck" not in row_html(response, "alive")
    assert row_keys(client.get(LIST + "?stuck=dead")) == ["orphan"]


# -- node health ------------------------------------------------------------------------------


def test_node_health_panel(client, lock_viewer, holder, redis_nodes):
    assert holder.lock("counted").acquire()
    login(client, lock_viewer)
    html = client.get(NODES).content.decode()
    assert "3 of 3 nodes reachable, quorum 2: locks can be taken." in html
    table = html[html.index('id="redlock-health"') :]
    info = redis_nodes[0].info("server")
    # The server's own name and version (Valkey's redis_version is only its compatibility level)
    server = info.get("server_name", "redis")
    version = info.get("valkey_version") or info["redis_version"]
    assert table.count(f'<td data-col="software">{server}-server {version}</td>') == 3
    assert table.count('alt="yes"') == 3
    assert re.search(r"\d+\.\d\d ms", table)  # latency
    assert re.search(r"-?\d+\.\d ms", table)  # clock offset
    assert "Clock spread between nodes" in html
    assert "<h1>Redis nodes</h1>" in html
    assert re.findall(r'<th scope="col">([^<]*)</th>', table) == [
        "Node",
        "Reachable",
        "Latency",
        "Software",
        "Uptime",
        "Memory",
        "Lock keys",
        "Clock offset",
        "Restart guard",
    ]
    assert table.count('<td data-col="locks">1</td>') == 3  # the lock's key on every node
    assert "can vote" in table


def test_node_health_says_a_restarted_guard_starts_at_the_next_lock(
    client, lock_viewer, settings, redis_cluster_factory
):
    from django_redlock import get_redlock

    cluster = redis_cluster_factory(3)  # its own: a node restarted apart stays so
    settings.REDLOCK = {"NODES": cluster.urls}
    with get_redlock().lock("before"):  # every node armed
        pass
    cluster[2].restart(empty=True)
    login(client, lock_viewer)
    table = client.get(NODES).content.decode()
    table = table[table.index('id="redlock-health"') :]
    assert "guarded, votes 1 min 0 s after the next lock" in table


def test_node_health_shows_a_dead_node(client, lock_viewer, holder, redis_nodes):
    for name in ("still-held", "also-held", "held-too"):
        assert holder.lock(name).acquire()
    redis_nodes[1].kill()
    login(client, lock_viewer)
    html = client.get(NODES).content.decode()
    assert "2 of 3 nodes reachable, quorum 2: locks can be taken." in html
    table = html[html.index('id="redlock-health"') :]
    assert table.count('alt="no"') == 1
    # The list points at the node that holds nothing.
    listing = client.get(LIST).content.decode()
    assert f"{redis_nodes[1].url} holds none of the 3 listed locks" in listing
    assert listing.count('<td class="field-nodes redlock-warn">2/3</td>') == 3
    redis_nodes[0].kill()
    html = client.get(NODES).content.decode()
    assert "1 of 3 nodes reachable, quorum 2: no lock can be taken" in html


# -- force release ----------------------------------------------------------------------------


def test_force_release_selected_locks(client, lock_releaser, holder, redis_nodes):
    a = holder.lock("batch:a", meta={"user": "alice", "view": "shop.views.pay"})
    b = holder.lock("batch:b", fencing=True)
    keep = holder.lock("batch:keep")
    for lock in (a, b, keep):
        assert lock.acquire()
    received = []

    def receiver(sender, **kwargs):
        received.append(kwargs["name"])

    lock_force_released.connect(receiver)
    try:
        login(client, lock_releaser)
        # The list's checkboxes POST to the confirmation: nothing is released yet.
        confirm = client.post(RELEASE, {"name": ["batch:a", "batch:b"]})
        assert confirm.status_code == 200
        html = confirm.content.decode()
        assert "Remove these 2 locks from every node" in html
        assert 'name="token" value="' + a.token in html
        assert tokens(redis_nodes, "batch:a") == [a.token] * 3
        # The same confirmation by GET (the detail page's link).
        assert "Remove this lock" in client.get(RELEASE + "?name=batch:a").content.decode()
        done = client.post(
            RELEASE,
            {"name": ["batch:a", "batch:b"], "confirm": "yes", "token": [a.token, b.token]},
            follow=True,
        )
    finally:
        lock_force_released.disconnect(receiver)
    assert done.redirect_chain[-1][0] == LIST
    assert tokens(redis_nodes, "batch:a") == [None] * 3
    assert tokens(redis_nodes, "batch:b") == [None] * 3
    assert tokens(redis_nodes, "batch:keep") == [keep.token] * 3
    assert sorted(received) == ["batch:a", "batch:b"]
    messages = [str(m) for m in done.context["messages"]]
    assert messages == ["Force-released 2 locks: “batch:a” (3/3 nodes), “batch:b” (3/3 nodes)."]
    assert row_keys(done) == ["batch:keep"]
    # The admin log: one entry per lock, with the user and the holder's metadata.
    entries = {e.object_id: e for e in LogEntry.objects.all()}
    assert set(entries) == {"batch:a", "batch:b"}
    entry = entries["batch:a"]
    assert entry.user == lock_releaser
    assert entry.action_flag == DELETION
    assert entry.content_type == ContentType.objects.get_for_model(Lock)
    message = entry.get_change_message()
    for part in (
        "3 of 3 nodes",
        "user='alice'",
        "view='shop.views.pay'",
        f"pid={os.getpid()}",
        f"token={a.token!r}",
    ):
        assert part in message
    assert f"fence={b.fence}" in entries["batch:b"].change_message
    # "Recent actions" on the admin index lists them (no link: the lock is gone).
    index = client.get("/admin/").content.decode()
    assert "batch:a" in index[index.index('id="recent-actions-module"') :]
    # The former holder finds out.
    assert a.check() is False
    with pytest.raises(LockLost):
        a.release()


def test_release_by_pattern_across_pages(client, lock_releaser, holder, redis_nodes):
    from django_redlock.admin import LockAdmin

    locks = [holder.lock(f"report:{i:03d}") for i in range(12)] + [holder.lock("invoice:1")]
    for lock in locks:
        assert lock.acquire()
    login(client, lock_releaser)
    per_page, LockAdmin.list_per_page = LockAdmin.list_per_page, 5  # the matches span 3 pages
    try:
        listing = client.get(LIST + "?q=report:*").content.decode()
        assert 'id="redlock-release-matching"' in listing and "Release all 12 matching" in listing
        confirm = client.get(RELEASE + "?pattern=report:*")
    finally:
        LockAdmin.list_per_page = per_page
    html = confirm.content.decode()
    # How many and which, before anything is released.
    assert "12 locks match <code>report:*</code>" in html
    assert all(f">report:{i:03d}<" in html for i in range(12)) and "invoice:1" not in html
    assert tokens(redis_nodes, "report:000") == [locks[0].token] * 3
    # One field for the whole selection, however many match (the POST stays far below
    # DATA_UPLOAD_MAX_NUMBER_FIELDS).
    assert 'name="name"' not in html
    (selection,) = re.findall(r'name="selection" value="([^"]+)"', html)
    pairs = json.loads(unescape(selection))
    assert sorted(pairs) == sorted([lock.name, lock.token] for lock in locks[:12])
    done = client.post(RELEASE, {"selection": unescape(selection), "confirm": "yes"}, follow=True)
    assert "Force-released 12 locks" in str(next(iter(done.context["messages"])))
    assert all(tokens(redis_nodes, f"report:{i:03d}") == [None] * 3 for i in range(12))
    assert tokens(redis_nodes, "invoice:1") == [locks[-1].token] * 3
    # Each release audited on its own.
    assert sorted(LogEntry.objects.values_list("object_id", flat=True)) == [
        f"report:{i:03d}" for i in range(12)
    ]


def test_release_by_pattern_leaves_a_lock_that_changed_hands(client, lock_releaser, holder):
    first = holder.lock("report:moved")
    assert first.acquire()
    login(client, lock_releaser)
    html = client.get(RELEASE + "?pattern=report:*").content.decode()
    (selection,) = re.findall(r'name="selection" value="([^"]+)"', html)
    first.release()
    second = holder.lock("report:moved")  # someone else took it after the confirmation
    assert second.acquire()
    done = client.post(RELEASE, {"selection": unescape(selection), "confirm": "yes"}, follow=True)
    assert "another holder took them" in " ".join(str(m) for m in done.context["messages"])
    assert second.check() is True
    assert not LogEntry.objects.exists()
    second.release()


def test_release_by_pattern_needs_the_release_permission(client, lock_viewer, holder):
    assert holder.lock("report:x").acquire()
    login(client, lock_viewer)
    assert client.get(RELEASE + "?pattern=report:*").status_code == 403
    assert "redlock-release-matching" not in client.get(LIST + "?q=report:*").content.decode()


def test_release_by_pattern_without_match(client, lock_releaser, admin_redlock_settings):
    login(client, lock_releaser)
    html = client.get(RELEASE + "?pattern=nothing:*").content.decode()
    assert "No live lock matches <code>nothing:*</code>" in html


def test_release_of_a_lock_that_changed_hands_is_refused(
    client, lock_releaser, holder, redis_nodes
):
    first = holder.lock("handover")
    assert first.acquire()
    login(client, lock_releaser)
    seen = first.token
    page = client.get(RELEASE + "?name=handover").content.decode()
    assert f'name="token" value="{seen}"' in page
    first.release()
    second = holder.lock("handover")
    assert second.acquire()
    done = client.post(RELEASE, {"name": "handover", "token": seen, "confirm": "yes"}, follow=True)
    assert tokens(redis_nodes, "handover") == [second.token] * 3
    assert "another holder took them after you confirmed" in str(
        next(iter(done.context["messages"]))
    )
    assert not LogEntry.objects.exists()


def test_release_of_a_gone_lock_and_of_nothing(client, lock_releaser, admin_redlock_settings):
    login(client, lock_releaser)
    page = client.get(RELEASE + "?name=ghost")
    assert "None of the selected locks is held any more" in page.content.decode()
    done = client.post(RELEASE, {"name": "ghost", "confirm": "yes"}, follow=True)
    assert "Already free (released or expired): “ghost”." in [
        str(m) for m in done.context["messages"]
    ]
    done = client.post(RELEASE, {"confirm": "yes"}, follow=True)
    assert [str(m) for m in done.context["messages"]] == [
        "No locks were selected, so none were released."
    ]
    assert not LogEntry.objects.exists()


def test_release_of_a_split_leftover(client, lock_releaser, admin_redlock_settings, redis_nodes):
    write_lock(redis_nodes[2], "shard", "lonely")
    login(client, lock_releaser)
    client.post(RELEASE, {"name": "shard", "confirm": "yes"})
    assert tokens(redis_nodes, "shard") == [None] * 3
    assert "on 1 of 3 nodes" in LogEntry.objects.get().change_message


def test_superuser_can_release(admin_client, holder, redis_nodes):
    assert holder.lock("su").acquire()
    admin_client.post(RELEASE, {"name": "su", "confirm": "yes"})
    assert tokens(redis_nodes, "su") == [None] * 3


# -- CSRF -------------------------------------------------------------------------------------


def test_release_post_needs_the_csrf_token(lock_releaser, holder, redis_nodes):
    lock = holder.lock("csrf:1")
    assert lock.acquire()
    client = login(Client(enforce_csrf_checks=True), lock_releaser)
    assert client.post(RELEASE, {"name": "csrf:1", "confirm": "yes"}).status_code == 403
    assert client.post(RELEASE, {"name": "csrf:1"}).status_code == 403
    assert tokens(redis_nodes, "csrf:1") == [lock.token] * 3
    # The confirmation form carries the token; posting it works.
    page = client.get(RELEASE + "?name=csrf:1").content.decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    response = client.post(
        RELEASE, {"name": "csrf:1", "confirm": "yes", "csrfmiddlewaretoken": csrf}
    )
    assert response.status_code == 302
    assert tokens(redis_nodes, "csrf:1") == [None] * 3


def test_list_form_carries_the_csrf_token(lock_releaser, holder):
    assert holder.lock("csrf:2").acquire()
    client = login(Client(enforce_csrf_checks=True), lock_releaser)
    html = client.get(LIST).content.decode()
    form = html[html.index('<form id="changelist-form"') :]
    assert 'name="csrfmiddlewaretoken"' in form[: form.index("</form>")]


# -- escaping ---------------------------------------------------------------------------------


def test_html_in_keys_and_metadata_is_escaped(client, lock_releaser, holder):
    evil_meta = {
        "user": '<img src=x onerror="alert(2)">',
        "view": "</td><script>alert(3)</script>",
        "<b>key</b>": "x",
    }
    lock = holder.lock(XSS, meta=evil_meta)
    assert lock.acquire()
    login(client, lock_releaser)
    pages = {
        "list": client.get(LIST),
        "search": client.get(LIST + "?q=" + quote("<script>")),
        "detail": client.get(DETAIL + "?name=" + quote(XSS)),
        "confirm": client.get(RELEASE + "?name=" + quote(XSS)),
    }
    for label, response in pages.items():
        assert response.status_code == 200, label
        html = response.content.decode()
        assert XSS not in html, label
        assert "<script>alert(3)</script>" not in html, label
        assert "<img src=x" not in html, label
        assert "<b>key</b>" not in html, label
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, label
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in pages["list"].content.decode()
    assert "&lt;b&gt;key&lt;/b&gt;" in pages["detail"].content.decode()
    assert row_keys(pages["search"]) == [XSS]
    # The detail link carries the key URL-encoded.
    assert f'href="{DETAIL}?name={quote(XSS, safe="")}"' in pages["list"].content.decode()
    # Release it through the admin: the success message is escaped too.
    done = client.post(RELEASE, {"name": XSS, "confirm": "yes"}, follow=True)
    html = done.content.decode()
    assert XSS not in html and "Force-released 1 lock: “&lt;script&gt;" in html


# -- misconfiguration ---------------------------------------------------------------------------


def test_unusable_settings_show_an_error_not_a_500(client, lock_releaser, settings):
    settings.REDLOCK = {"NODES": []}
    login(client, lock_releaser)
    for url in (LIST, NODES, DETAIL + "?name=x"):
        response = client.get(url)
        assert response.status_code in (200, 404), url
        assert "The REDLOCK setting could not be used" in response.content.decode(), url
    done = client.post(RELEASE, {"name": "x", "confirm": "yes"}, follow=True)
    assert "could not be used" in str(next(iter(done.context["messages"])))


# -- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 ms"),
        (0.0423, "42 ms"),
        (0.9, "900 ms"),
        (1, "1.0 s"),
        (4.24, "4.2 s"),
        (42.9, "42 s"),
        (192, "3 min 12 s"),
        (7500, "2 h 5 min"),
        (277200, "3 d 5 h"),
        (-3, "0 ms"),
        (None, ""),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_holder_summary_reads_decorator_and_task_keys():
    h = holder_summary(
        {
            "host": "web1",
            "pid": 7,
            "thread": "T",
            "view": "v",
            "method": "GET",
            "path": "/x/",
            "user": "bob",
            "task": "t.sync",
            "task_id": "abc",
            "worker": "celery@w1",
        }
    )
    assert h == {
        "host": "web1",
        "pid": 7,
        "thread": "T",
        "task_id": "abc",
        "task": "t.sync",
        "worker": "celery@w1",
        "view": "v",
        "request": "GET /x/",
        "function": None,
        "user": "bob",
    }
