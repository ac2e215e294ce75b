"""docs/celery.rst's promises that tests/test_celery*.py leave out, run eagerly (``apply``)
against the real lock nodes: the default lease of 30 s whatever ``REDLOCK["TTL"]`` says, the
holder metadata's fields and its 200-character argument summary, and ``"raise"``'s
``retry_after`` (the holder's remaining lease)."""

from __future__ import annotations

import logging
import os
import socket

import pytest

pytest.importorskip("celery")

from django_redlock import LockNotAcquired
from django_redlock.celery import LockedTask
from django_redlock.conf import get_redlock
from testproject.celery_app import app
from tests.celery_support import UNREAD_QUEUE, drop_queue, queued_messages

# The app is configured (broker and result backend on the embedded node) before any task of
# it runs, even eagerly: a run before that would fix the app's backend to its defaults for
# the rest of the session, and the worker of a later test module would never see a result.
pytestmark = pytest.mark.usefixtures("celery_test_app")


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


@app.task(base=LockedTask, bind=True, lock_key="promises:dd:{name}", name="promises.dedupe")
def dedupe(self, name):
    return name


def test_lockedtask_acknowledges_late_and_rejects_on_worker_lost_by_default():
    assert seen.acks_late is True and seen.reject_on_worker_lost is True

    @app.task(base=LockedTask, bind=True, acks_late=False, name="promises.early")
    def early(self):
        return None

    assert early.acks_late is False and early.reject_on_worker_lost is True


def test_dedupe_raise_gives_the_seconds_the_marker_has_left(
    redlock_settings, celery_test_app, celery_broker_node
):
    try:
        first = dedupe.apply_async(("r",), queue=UNREAD_QUEUE, lock_dedupe="raise")
        with pytest.raises(LockNotAcquired) as caught:
            dedupe.apply_async(("r",), queue=UNREAD_QUEUE, lock_dedupe="raise")
        # lock_dedupe_ttl (3600 s) is capped by MAX_TTL, 60 s by default.
        assert 50.0 < caught.value.retry_after <= 60.0
        assert first.id in str(caught.value)
        assert queued_messages(celery_broker_node.url) == 1
    finally:
        drop_queue(celery_broker_node.url)


def test_dedupe_with_the_lock_nodes_down_still_sends_the_task(
    settings, redis_cluster_factory, celery_test_app, celery_broker_node
):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0}
    for node in cluster:
        node.kill()
    try:
        for _ in range(2):
            dedupe.apply_async(("down",), queue=UNREAD_QUEUE, lock_dedupe="merge")
        assert queued_messages(celery_broker_node.url) == 2
    finally:
        drop_queue(celery_broker_node.url)


@app.task(base=LockedTask, bind=True, lock_key="promises:lost", name="promises.loses")
def loses(self):
    get_redlock().force_release("promises:lost")  # an operator, mid-run
    return "finished"


def test_a_task_that_lost_its_lock_finishes_and_the_release_logs_an_error(redlock_settings, caplog):
    from django_redlock.signals import lock_lost

    lost = []

    def record(sender, name, **kwargs):
        lost.append(name)

    lock_lost.connect(record)
    try:
        with caplog.at_level(logging.WARNING, logger="django_redlock.celery"):
            assert loses.apply(throw=True).get() == "finished"
    finally:
        lock_lost.disconnect(record)
    assert lost == ["promises:lost"]
    (record_,) = [r for r in caplog.records if r.name == "django_redlock.celery"]
    assert record_.levelno == logging.ERROR
    assert "promises.loses" in record_.getMessage()
    assert "finished without holding lock promises:lost" in record_.getMessage()


def test_a_merged_duplicate_is_logged_at_info_and_a_dropped_one_at_warning(
    redlock_settings, celery_test_app, celery_broker_node, caplog
):
    try:
        with caplog.at_level(logging.INFO, logger="django_redlock.celery"):
            first = dedupe.apply_async(("log",), queue=UNREAD_QUEUE, lock_dedupe="merge")
            merged = dedupe.apply_async(("log",), queue=UNREAD_QUEUE, lock_dedupe="merge")
            dropped = dedupe.apply_async(("log",), queue=UNREAD_QUEUE, lock_dedupe="drop")
        assert merged.id == first.id and dropped.state == "REJECTED"
        assert queued_messages(celery_broker_node.url) == 1
    finally:
        drop_queue(celery_broker_node.url)
    levels = [r.levelno for r in caplog.records if r.name == "django_redlock.celery"]
    assert levels == [logging.INFO, logging.WARNING], caplog.records


def test_a_queued_or_scheduled_task_holds_nothing(redlock_settings, celery_broker_node):
    try:
        seen.apply_async(("queued",), queue=UNREAD_QUEUE)
        seen.apply_async(("scheduled",), queue=UNREAD_QUEUE, countdown=60)
        assert queued_messages(celery_broker_node.url) >= 1
        assert list(get_redlock().live_locks("promises:*")) == []
    finally:
        drop_queue(celery_broker_node.url)
