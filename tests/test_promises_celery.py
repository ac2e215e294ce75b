"""docs/celery.rst's promises that tests/test_celery*.py leave out, run eagerly (``apply``)
against the real lock nodes: the default lease of 30 s whatever ``REDLOCK["TTL"]`` says, the
holder metadata's fields and its 200-character argument summary, and ``"raise"``'s
``retry_after`` (the holder's remaining lease)."""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("celery")

from django_redlock import LockNotAcquired
from django_redlock.celery import LockedTask
from django_redlock.conf import get_redlock
from testproject.celery_app import app


@app.task(base=LockedTask, bind=True, lock_key="promises:{name}", name="promises.seen")
def seen(self, name, payload=""):
    info = get_redlock().lock_info(self.lock.name)
    return {"ttl": info.ttl, "meta": dict(info.meta), "held": self.lock.held}


def test_the_default_lease_is_30_seconds_whatever_the_setting_says(redlock_settings):
    assert redlock_settings["TTL"] == 10.0
    out = seen.apply(("ttl",), throw=True).get()
    assert out["held"] and 25.0 < out["ttl"] <= 30.0
    assert not get_redlock().locked("promises:ttl")


def test_holder_metadata_has_the_documented_fields_and_a_short_argument_summary(
    redlock_settings,
):
    out = seen.apply(("meta",), {"payload": "x" * 5000}, throw=True).get()
    meta = out["meta"]
    for field in ("task_id", "task", "worker", "args", "attempt", "on_locked"):
        assert field in meta, field
    for field in ("host", "pid", "thread", "acquired_at"):
        assert field in meta, field
    assert meta["task"] == "promises.seen" and meta["on_locked"] == "retry"
    assert meta["args"].startswith("'meta', payload='xxx") and len(meta["args"]) <= 200


def test_raise_names_the_holder_and_retry_after_is_its_remaining_lease(redlock_settings):
    holder = get_redlock().lock("promises:busy", ttl=20.0)
    assert holder.acquire(blocking=False)
    try:
        with pytest.raises(LockNotAcquired) as caught:
            seen.apply(("busy",), throw=True, on_locked="raise")
    finally:
        holder.release()
    assert 10.0 < caught.value.retry_after <= 20.0
    # A plain holder (no task) is named by its process and host.
    assert f"held by pid {os.getpid()} on {socket.gethostname()}" in str(caught.value)
