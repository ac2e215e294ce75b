"""The example project's Celery app: Redis broker and result backend on an embedded node.

Run a worker with::

    REDLOCK_NODES=redis://127.0.0.1:7001/0,... REDLOCK_CELERY_BROKER=redis://127.0.0.1:7001/0 \\
        celery -A testproject.celery_app worker -P prefork -c 2

Environment (read here, so the Django settings file stays Celery-free):

``REDLOCK_CELERY_BROKER``
    broker URL (default: the first of ``REDLOCK_NODES``, else ``redis://127.0.0.1:6379/0``).
    The result backend and the example tasks' recorder use databases 1 and 2 of that server
    (of ``REDLOCK_CELERY_RESULTS`` when the broker is not Redis).
``REDLOCK_CELERY_RESULTS``
    a Redis URL for the result backend (db 1) and the recorder (db 2) with a RabbitMQ broker.
``REDLOCK_CELERY_INSTALL``
    ``0`` leaves out ``install(app)`` (default ``1``).
``REDLOCK_CELERY_VISIBILITY``
    the Redis transport's ``visibility_timeout`` in seconds (default 3600): how long an
    unacknowledged message (``acks_late`` task of a worker that died) waits before another
    worker gets it again.

Django settings named ``CELERY_*`` are read too (``config_from_object`` with the ``CELERY``
namespace, the usual Django + Celery layout), and the env values above win.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from celery import Celery

from django_redlock.celery import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")


def with_db(url: str, db: int) -> str:
    """``url`` pointing at Redis database ``db`` (``redis://host:port/N`` or ``unix://...?db=N``)."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or "db=" in parts.query:
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"] + [("db", str(db))]
        return f"{url.partition('?')[0]}?{urlencode(query)}"
    return urlunsplit(parts._replace(path=f"/{db}"))


def broker_url() -> str:
    url = os.environ.get("REDLOCK_CELERY_BROKER")
    if url:
        return url
    nodes = [u for u in os.environ.get("REDLOCK_NODES", "").split(",") if u]
    return nodes[0] if nodes else "redis://127.0.0.1:6379/0"


def configure(
    app: Celery,
    broker: str,
    visibility_timeout: float | None = None,
    results: str | None = None,
) -> None:
    """Point ``app`` at ``broker`` (tests call this again with their embedded node); results
    and records go to the Redis server ``results`` (default: the broker)."""
    visibility = visibility_timeout or float(os.environ.get("REDLOCK_CELERY_VISIBILITY", 3600))
    results = results or os.environ.get("REDLOCK_CELERY_RESULTS") or broker
    app.conf.update(
        broker_url=broker,
        result_backend=with_db(results, 1),
        redlock_recorder_url=with_db(results, 2),
        broker_transport_options={
            "visibility_timeout": visibility,
            # Look for messages of dead workers every second rather than every 100 s, so a
            # low visibility_timeout takes effect promptly.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_extended=True,
        # One message per pool slot: a prefetched task waits in this worker, not in the queue.
        worker_prefetch_multiplier=1,
        # Keep the host's logging (pytest's caplog) instead of replacing the root handlers.
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )


app = Celery("testproject", include=["testproject.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
configure(app, broker_url())
# LockedTask's worker side (revokes, time limits, stopped pool processes). The suite turns it
# off (REDLOCK_CELERY_INSTALL=0) to show what a worker without it logs.
if os.environ.get("REDLOCK_CELERY_INSTALL", "1") != "0":
    install(app)
