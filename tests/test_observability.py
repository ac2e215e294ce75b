"""Observability against real nodes: Prometheus metrics (django_redlock.metrics), the
readiness and liveness views (django_redlock.urls), OpenTelemetry spans (django_redlock.tracing)
with the SDK's in-memory exporter, and the E013 check.

Metrics are installed on a registry of the test's own (never prometheus_client's default one)
and uninstalled after it. Faults are real: nodes are killed and restarted with the helpers of
django_redlock.testing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.checks import run_checks
from django.test import Client

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")

from prometheus_client import CollectorRegistry

from django_redlock import (
    LockLost,
    LockNotOwned,
    get_redlock,
)
from django_redlock import metrics as redlock_metrics
from django_redlock.labels import OTHER, LockLabels
from django_redlock.probes import probes
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def registry():
    """Metrics installed on a fresh registry (health gauges cached for 10 ms)."""
    registry = CollectorRegistry()
    settings = redlock_metrics.metrics_settings({"HEALTH_CACHE": 0.01})
    redlock_metrics.install(settings, registry)
    probes.forget()
    yield registry
    redlock_metrics.uninstall()
    probes.forget()


def value(registry, name, **labels):
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def other_owner(name, ttl=10.0, **kwargs):
    lock = get_redlock().lock(name, ttl, owner="someone-else", **kwargs)
    assert lock.acquire(blocking=False)
    return lock


# =============================================================== counters and histograms


@pytest.mark.usefixtures("redlock_settings")
class TestLockCounters:
    def test_acquire_contend_release(self, registry):
        rl = get_redlock()
        lock = rl.lock("order:42", 10.0)
        assert lock.acquire(blocking=False)
        assert value(registry, "redlock_acquired_total", lock="order") == 1
        assert (
            value(registry, "redlock_acquire_seconds_count", lock="order", outcome="acquired") == 1
        )
        rival = rl.lock("order:42", 10.0, owner="rival")
        assert not rival.acquire(blocking=False)
        assert value(registry, "redlock_contended_total", lock="order") == 1
        assert (
            value(registry, "redlock_acquire_seconds_count", lock="order", outcome="contended") == 1
        )
        lock.release()
        assert value(registry, "redlock_released_total", lock="order") == 1
        assert value(registry, "redlock_hold_seconds_count", lock="order", end="released") == 1
        assert value(registry, "redlock_hold_seconds_sum", lock="order", end="released") > 0
        # another name with the same prefix: the same series, never one per order
        with rl.lock("order:43", 10.0):
            pass
        assert value(registry, "redlock_acquired_total", lock="order") == 2
        exposition = registry_text(registry)
        assert 'lock="order"' in exposition and "order:42" not in exposition

    def test_force_release_and_loss(self, registry):
        rl = get_redlock()
        lock = rl.lock("report:7", 10.0, auto_renew=True)
        assert lock.acquire(blocking=False)
        assert rl.force_release("report:7") == 3
        assert value(registry, "redlock_force_released_total", lock="report") == 1
        # the holder learns it at its next check (or renewal): the loss is counted once
        assert not lock.check()
        wait_until(lambda: value(registry, "redlock_lost_total", lock="report") == 1)
        assert value(registry, "redlock_hold_seconds_count", lock="report", end="lost") == 1
        with pytest.raises((LockLost, LockNotOwned)):  # it was not ours any more
            lock.release()
        assert value(registry, "redlock_lost_total", lock="report") == 1

    def test_label_function_and_cardinality_cap(self, settings, redlock_settings):
        registry = CollectorRegistry()
        labels = LockLabels(lambda name: name.replace(":", "-"), limit=2)
        redlock_metrics.install(redlock_metrics.MetricsSettings(labels=labels), registry)
        try:
            for n in range(4):
                with get_redlock().lock(f"job:{n}", 10.0):
                    pass
            assert value(registry, "redlock_acquired_total", lock="job-0") == 1
            assert value(registry, "redlock_acquired_total", lock="job-1") == 1
            assert value(registry, "redlock_acquired_total", lock=OTHER) == 2
        finally:
            redlock_metrics.uninstall()

    def test_the_metrics_view(self, registry):
        with get_redlock().lock("ping:1", 10.0):
            pass
        response = Client().get("/redlock/metrics/")
        assert response.status_code == 200
        assert response["Content-Type"].startswith("text/plain")
        assert b'redlock_acquired_total{lock="ping"} 1.0' in response.content
        assert b"redlock_node_up{" in response.content

    def test_the_metrics_view_is_404_while_metrics_are_off(self):
        redlock_metrics.uninstall()
        assert Client().get("/redlock/metrics/").status_code == 404


def registry_text(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


# =============================================================== node gauges and stuck locks


def test_health_gauges_follow_a_killed_node(settings, redis_cluster_factory, registry):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.5}
    with get_redlock().lock("first", 10.0):  # in use: the survivors vote, not a new cluster
        pass
    names = [h.node for h in get_redlock().health()]

    def gauges():
        registry_text(registry)  # a scrape
        return (
            [value(registry, "redlock_node_up", service="default", node=n) for n in names],
            value(registry, "redlock_quorum_available", service="default"),
        )

    assert gauges() == ([1.0, 1.0, 1.0], 1.0)
    assert value(registry, "redlock_health_probe_success", service="default") == 1
    assert all(
        value(registry, "redlock_node_voting", service="default", node=n) == 1 for n in names
    )
    cluster[1].kill()
    wait_until(lambda: gauges() == ([1.0, 0.0, 1.0], 1.0), timeout=15)
    cluster[2].kill()
    wait_until(lambda: gauges() == ([1.0, 0.0, 0.0], 0.0), timeout=15)
    assert value(registry, "redlock_node_voting", service="default", node=names[2]) == 0


def test_stuck_locks_gauge(settings, redlock_settings, registry):
    settings.REDLOCK = {**redlock_settings, "STUCK_AFTER": 0.5}
    other_owner("old-job:1")
    other_owner("fresh-job:1")
    # held longer than STUCK_AFTER: flagged "old"; read at scrape time (cached 10 ms)

    def stuck_old():
        registry_text(registry)
        return value(registry, "redlock_stuck_locks", service="default", reason="old")

    wait_until(lambda: stuck_old() == 2, timeout=10)
    assert value(registry, "redlock_live_locks", service="default") == 2
    assert value(registry, "redlock_stuck_locks", service="default", reason="split") == 0


# =============================================================== readiness and liveness


def ready():
    response = Client().get("/redlock/ready/")
    return response.status_code, json.loads(response.content)


def test_readiness_503_with_a_quorum_down_and_200_after_heal(
    settings, redis_cluster_factory, fresh_readiness
):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.5}
    with get_redlock().lock("first", 10.0):  # arms the restart guard's markers
        pass
    status, body = ready()
    assert status == 200 and body["status"] == "ready"
    assert body["quorum"] == 2 and body["voting"] == 3
    assert [n["status"] for n in body["nodes"]] == ["voting"] * 3
    assert all(n["latency_ms"] is not None and n["version"] for n in body["nodes"])

    cluster[0].kill()
    status, body = ready()
    assert status == 200 and body["voting"] == 2  # one node down: locks still work
    assert body["nodes"][0]["status"] == "down" and body["nodes"][0]["error"]

    cluster[1].kill()
    status, body = ready()
    assert status == 503 and body["status"] == "unavailable"
    assert [n["status"] for n in body["nodes"]] == ["down", "down", "voting"]
    assert Client().get("/redlock/ready/")["Retry-After"] == "1"

    # Back, but empty (no persistence): the restart guard keeps them from voting, and
    # readiness counts that.
    cluster[0].start()
    cluster[1].start()
    wait_until(lambda: ready()[1]["nodes"][1]["status"] == "guarded", timeout=15)
    status, body = ready()
    assert status == 503 and [n["status"] for n in body["nodes"]] == [
        "guarded",
        "guarded",
        "voting",
    ]
    assert body["nodes"][0]["guarded_for"] > 0
    # The operator vouches for them (manage.py redlock trust): ready again.
    get_redlock().trust_cluster()
    wait_until(lambda: ready()[0] == 200, timeout=15)
    assert ready()[1]["voting"] == 3


def test_readiness_is_cached_and_bounded(settings, redlock_settings):
    probes.forget()
    started = time.monotonic()
    first = Client().get("/redlock/ready/")
    second = Client().get("/redlock/ready/")
    assert first.status_code == second.status_code == 200
    assert json.loads(first.content) == json.loads(second.content)
    assert time.monotonic() - started < probes.timeout * 2
    assert first["Cache-Control"].startswith("max-age=0")
    assert Client().get("/redlock/ready/?using=nope").status_code == 404
    assert Client().post("/redlock/ready/").status_code == 405


def test_a_frozen_node_does_not_make_the_pod_unready(
    settings, redis_cluster_factory, fresh_readiness
):
    """One node frozen (SIGSTOP): the probe waits for it at most probes.timeout, and the two
    others still form a quorum, so the pod stays ready."""
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.5}
    with get_redlock().lock("first", 10.0):
        pass
    assert ready()[0] == 200
    with cluster[2].paused():
        started = time.monotonic()
        status, body = ready()
        elapsed = time.monotonic() - started
        assert status == 200 and body["voting"] == 2
        assert body["nodes"][2]["status"] == "down"
        assert elapsed < probes.timeout + 3  # bounded (generously: a busy machine is slow)


def test_a_scrape_with_frozen_nodes_waits_at_most_the_probe_timeout(
    settings, redis_cluster_factory, registry
):
    """Two of five nodes frozen: the scrape's health probe and its lock listing each wait
    for them (a listing timeout), at once and within one probes.timeout, not one after the
    other."""
    cluster = redis_cluster_factory(5)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.5}
    with get_redlock().lock("first", 10.0):
        pass
    assert Client().get("/redlock/metrics/").status_code == 200
    with cluster[0].paused(), cluster[1].paused():
        probes.forget()  # the gauges are cached for 10 ms: this scrape probes again
        started = time.monotonic()
        response = Client().get("/redlock/metrics/")
        elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert elapsed < probes.timeout + 0.4, elapsed
    down = f'redlock_node_up{{node="{cluster.urls[0]}",service="default"}} 0.0'
    assert down in response.content.decode()


def test_readiness_redacts_node_passwords(settings, fresh_readiness):
    from django_redlock.testing import RedisNode

    with RedisNode(password="s3cret-node-pw") as node:
        assert "s3cret-node-pw" in node.url
        settings.REDLOCK = {"NODES": [node.url], "TTL": 10.0}
        response = Client().get("/redlock/ready/")
        assert response.status_code == 200
        assert b"s3cret-node-pw" not in response.content
        # the same password as a URL query parameter (redis-py reads it there too)
        settings.REDLOCK = {
            "NODES": [f"redis://127.0.0.1:{node.port}/0?password=s3cret-node-pw"],
            "TTL": 10.0,
        }
        response = Client().get("/redlock/ready/")
    assert response.status_code == 200
    assert b"s3cret-node-pw" not in response.content


def test_liveness_never_asks_the_nodes(settings, redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls}
    for node in cluster:
        node.kill()  # every node gone: the pod is still alive
    response = Client().get("/redlock/live/")
    assert response.status_code == 200 and json.loads(response.content) == {"status": "alive"}


# =============================================================== the E013 check


@pytest.mark.parametrize(
    ("metrics", "needle"),
    [
        ("yes", "must be True, False or a dict"),
        ({"LABELS": str}, "unknown options LABELS"),
        ({"LABEL": "no.such.module.label"}, "does not import"),
        ({"LABEL": 42}, "must be a callable"),
        ({"MAX_LABELS": 0}, "MAX_LABELS"),
        ({"HEALTH_CACHE": float("nan")}, "HEALTH_CACHE"),
    ],
)
def test_a_broken_metrics_setting_is_E013(settings, redlock_settings, metrics, needle):
    settings.REDLOCK = {**redlock_settings, "METRICS": metrics}
    errors = [m for m in run_checks(tags=["django_redlock"]) if m.id == "django_redlock.E013"]
    assert len(errors) == 1 and needle in errors[0].msg, errors
    # the locks still work: a metrics setting never stops them
    with get_redlock().lock("still-works", 10.0):
        pass


def test_metrics_settings_are_known_names(settings, redlock_settings):
    settings.REDLOCK = {
        **redlock_settings,
        "METRICS": {"LABEL": "django_redlock.labels.default_label"},
        "TRACING": False,
    }
    ids = {m.id for m in run_checks(tags=["django_redlock"])}
    assert "django_redlock.E013" not in ids and "django_redlock.W003" not in ids


# =============================================================== Celery skips and lock retries


@pytest.mark.celery
@pytest.mark.timeout(180)
def test_celery_skips_and_lock_retries_are_counted(
    celery_thread_worker, redlock_settings, registry
):
    from celery.result import AsyncResult

    from testproject import tasks
    from tests.celery_support import Run
    from tests.celery_support import wait_until as wait_celery

    run = Run()
    held = other_owner("demo:metrics-skip")
    skipped = tasks.critical_skip.delay("metrics-skip", run.id)
    # A skipped task ends SUCCESS with no result, so that groups and chords complete.
    wait_celery(lambda: skipped.state == "SUCCESS", what="state SUCCESS (skipped)")
    assert skipped.result is None
    held.release()
    assert (
        value(
            registry, "redlock_celery_skipped_total", lock="demo", task="testproject.critical_skip"
        )
        == 1
    )

    held = other_owner("demo:metrics-retry")
    retried = tasks.critical.delay("metrics-retry", run.id)
    wait_celery(
        lambda: (
            value(
                registry,
                "redlock_celery_lock_retries_total",
                lock="demo",
                task="testproject.critical",
            )
            >= 1
        ),
        what="a lock retry",
    )
    held.release()
    assert AsyncResult(retried.id).get(timeout=60)["task_id"] == retried.id


# =============================================================== OpenTelemetry spans


@pytest.fixture
def spans():
    """A Tracing on a TracerProvider of the test's own, exporting to memory."""
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from django_redlock.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(LockLabels(), tracer_provider=provider)
    tracing.connect()
    yield provider, exporter
    tracing.disconnect()
    provider.shutdown()


@pytest.mark.usefixtures("redlock_settings")
def test_spans_of_acquire_and_hold_in_the_callers_trace(spans):
    provider, exporter = spans
    rl = get_redlock()
    with provider.get_tracer("test").start_as_current_span("request") as request_span:
        with rl.lock("invoice:42", 10.0, fencing=True) as lock:
            fence = lock.fence
            assert not rl.lock("invoice:42", 10.0, owner="rival").acquire(blocking=False)
    finished = {
        (s.name, s.attributes.get("redlock.outcome")): s for s in exporter.get_finished_spans()
    }
    assert set(finished) >= {
        ("redlock.acquire", "acquired"),
        ("redlock.acquire", "contended"),
        ("redlock.hold", "released"),
        ("request", None),
    }
    request_id = request_span.get_span_context().span_id
    for key in [("redlock.acquire", "acquired"), ("redlock.hold", "released")]:
        span = finished[key]
        assert span.parent is not None and span.parent.span_id == request_id
        assert span.attributes["redlock.lock"] == "invoice"  # the label, never the full name
        assert "invoice:42" not in str(dict(span.attributes))
    acquire = finished[("redlock.acquire", "acquired")]
    hold = finished[("redlock.hold", "released")]
    assert acquire.end_time - acquire.start_time == pytest.approx(
        acquire.attributes["redlock.wait_seconds"] * 1e9, abs=2e6
    )
    assert hold.attributes["redlock.fence"] == fence
    assert acquire.start_time <= hold.start_time + 2e6 and hold.start_time <= hold.end_time


@pytest.mark.usefixtures("redlock_settings")
def test_a_waiting_acquire_spans_the_wait_and_a_lost_hold_is_an_error(spans):
    _, exporter = spans
    rl = get_redlock()
    other_owner("export:7", ttl=1.0)  # never released: its lease runs out
    lock = rl.lock("export:7", 10.0)
    assert lock.acquire(timeout=30)
    rl.force_release("export:7")
    assert not lock.check()
    with pytest.raises((LockLost, LockNotOwned)):
        lock.release()
    by_kind = {}
    for span in exporter.get_finished_spans():
        by_kind.setdefault((span.name, span.attributes.get("redlock.outcome")), []).append(span)
    # the other owner's acquisition, then ours, which waited for its lease to end
    assert len(by_kind[("redlock.acquire", "acquired")]) == 2
    acquire = by_kind[("redlock.acquire", "acquired")][-1]
    assert acquire.attributes["redlock.wait_seconds"] >= 0.5  # waited for the lease to end
    assert (acquire.end_time - acquire.start_time) / 1e9 >= 0.5
    (lost,) = by_kind[("redlock.hold", "lost")]
    from opentelemetry.trace import StatusCode

    assert lost.status.status_code is StatusCode.ERROR
    assert lost.attributes["redlock.lock"] == "export"


def test_the_max_labels_warning_is_logged_once_with_metrics_and_tracing_on(redis_nodes, tmp_path):
    """docs/monitoring.rst: past MAX_LABELS new labels count as ``other`` and a warning is
    logged once. Tracing kept a labeller of its own, which warned a second time."""
    pytest.importorskip("opentelemetry")
    pytest.importorskip("prometheus_client")
    (tmp_path / "labelled_settings.py").write_text(
        "from testproject.settings import *\nREDLOCK = {**REDLOCK, 'METRICS': {'MAX_LABELS': 3}}\n"
    )
    script = (
        "import django; django.setup()\n"
        "from django_redlock import get_redlock\n"
        "rl = get_redlock()\n"
        "for i in range(10):\n"
        "    lock = rl.lock(f'kind{i}:1', ttl=5)\n"
        "    assert lock.acquire(blocking=False)\n"
        "    lock.release()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
            "DJANGO_SETTINGS_MODULE": "labelled_settings",
            "REDLOCK_NODES": ",".join(redis_nodes.urls),
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("distinct lock labels") == 1, done.stderr


def test_tracing_follows_the_setting(settings, redlock_settings):
    pytest.importorskip("opentelemetry")
    from django_redlock import tracing

    assert tracing.install_from_settings() is not None  # installed at startup, kept
    settings.REDLOCK = {**redlock_settings, "TRACING": False}
    assert tracing.install_from_settings() is None
