"""A semaphore's permits on the admin page and in ``manage.py redlock list``: each permit is a
row with its holder and time left, and one can be released (the others stay)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from django_redlock import LockLost

pytestmark = pytest.mark.django_db

LIST = "/admin/django_redlock/lock/"
DETAIL = LIST + "detail/"
RELEASE = LIST + "release/"


def test_permits_listed_and_one_released_from_the_admin(client: Client, lock_releaser, holder):
    permits = [holder.semaphore("export:7", 3, owner=i, meta={"user": f"u{i}"}) for i in range(2)]
    assert all(p.acquire(blocking=False) for p in permits)
    client.force_login(lock_releaser)
    html = client.get(LIST).content.decode()
    for p in permits:
        assert f"export:7#permit:{p.permit}" in html
        assert f"permit {p.permit} of semaphore export:7" in html
    detail = client.get(DETAIL, {"name": f"export:7#permit:{permits[0].permit}"}).content.decode()
    assert "Semaphore" in detail and "u0" in detail
    name = f"export:7#permit:{permits[0].permit}"
    done = client.post(
        RELEASE, {"name": [name], "confirm": "yes", "token": [permits[0].token]}, follow=True
    )
    assert done.status_code == 200
    names = [i.name for i in holder.live_locks("export:7*")]
    assert names == [f"export:7#permit:{permits[1].permit}"]
    assert permits[0].check() is False  # the nodes say it is gone: marked lost
    assert not permits[0].held
    with pytest.raises(LockLost):
        permits[0].release()
    permits[1].release()


def test_manage_list_shows_permits(admin_redlock_settings, holder):
    sem = holder.semaphore("job:1", 2, owner="x")
    assert sem.acquire(blocking=False)
    out = StringIO()
    call_command("redlock", "list", "--json", stdout=out)
    (item,) = json.loads(out.getvalue())
    assert item["name"] == f"job:1#permit:{sem.permit}"
    assert item["semaphore"] == "job:1" and item["permit"] == sem.permit
    assert 0 < item["ttl"] <= 30 and item["meta"]["pid"]
    sem.release()


def test_readers_listed_one_per_reader_and_one_released(client: Client, lock_releaser, holder):
    readers = [holder.read_lock("doc:9", owner=i, meta={"user": f"r{i}"}) for i in range(2)]
    assert all(r.acquire(blocking=False) for r in readers)
    infos = {i.name: i for i in holder.live_locks("doc:*")}
    assert set(infos) == {f"doc:9#read:{r.token}" for r in readers}
    first = infos[f"doc:9#read:{readers[0].token}"]
    assert first.reader_of == "doc:9" and first.meta["user"] == "r0"
    assert first.nodes == 3 and not first.split and 0 < first.ttl <= 30
    client.force_login(lock_releaser)
    html = client.get(LIST).content.decode()
    assert html.count("reader of doc:9") == 2
    done = client.post(
        RELEASE, {"name": [first.name], "confirm": "yes", "token": [first.token]}, follow=True
    )
    assert done.status_code == 200
    assert [i.name for i in holder.live_locks("doc:*")] == [f"doc:9#read:{readers[1].token}"]
    assert readers[0].check() is False
    # One reader left: a writer still waits; with both gone it gets in.
    assert holder.write_lock("doc:9", owner="w").acquire(blocking=False) is False
    assert holder.force_release(f"doc:9#read:{readers[1].token}") == 3
    writer = holder.write_lock("doc:9", owner="w2")
    assert writer.acquire(blocking=False)
    writer.release()
