"""docs/monitoring.rst's node gauges that tests/test_observability.py leaves out, on real
nodes: a node whose data was flushed answers (``redlock_node_up`` 1) but sits out its restart
guard (``redlock_node_voting`` 0, ``redlock_node_guarded_seconds`` counting down from at most
``MAX_TTL``), while the quorum stays available; ``redlock_node_latency_seconds`` is the PING
round trip of each node that answers, and every series has the documented type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")

from django.test import Client
from prometheus_client import CollectorRegistry, generate_latest

from django_redlock import get_redlock
from django_redlock import metrics as redlock_metrics
from django_redlock.probes import probes


@pytest.fixture
def registry():
    registry = CollectorRegistry()
    redlock_metrics.install(redlock_metrics.metrics_settings({"HEALTH_CACHE": 0.01}), registry)
    probes.forget()
    yield registry
    redlock_metrics.uninstall()
    probes.forget()


def scrape(registry, name, node):
    probes.forget()
    generate_latest(registry)
    return registry.get_sample_value(name, {"service": "default", "node": node})


def test_a_guarded_node_is_up_not_voting_with_its_guard_time(
    settings, redis_cluster_factory, registry
):
    cluster = redis_cluster_factory(3)
    settings.REDLOCK = {"NODES": cluster.urls, "TTL": 10.0, "MAX_TTL": 30.0, "NODE_TIMEOUT": 0.5}
    rl = get_redlock()
    with rl.lock("mon:first", 10.0):  # in use: no longer a brand-new cluster
        pass
    names = [h.node for h in rl.health()]
    for name in names:
        assert scrape(registry, "redlock_node_guarded_seconds", name) == 0
        assert 0 < scrape(registry, "redlock_node_latency_seconds", name) < 3
    cluster[0].client().flushall()
    with rl.lock("mon:arm", 10.0):  # the acquire sees the lost marker and arms the guard
        pass
    assert scrape(registry, "redlock_node_up", names[0]) == 1
    assert scrape(registry, "redlock_node_voting", names[0]) == 0
    assert 0 < scrape(registry, "redlock_node_guarded_seconds", names[0]) <= 30.0
    assert scrape(registry, "redlock_node_guarded_seconds", names[1]) == 0
    probes.forget()
    generate_latest(registry)
    assert registry.get_sample_value("redlock_quorum_available", {"service": "default"}) == 1


def test_every_series_has_its_documented_type(settings, redlock_settings, registry):
    with get_redlock().lock("mon:types", 5.0):
        pass
    probes.forget()
    types = {family.name: family.type for family in registry.collect()}
    # The page's "Series" table: name and type of each row (a counter's family drops _total).
    page = (Path(__file__).resolve().parent.parent / "docs" / "monitoring.rst").read_text()
    rows = re.findall(r"^   \* - ``(redlock_\w+)``\n     - (\w+)$", page, re.M)
    documented = {name.removesuffix("_total"): kind for name, kind in rows}
    assert len(documented) == 17
    assert {name: types.get(name) for name in documented} == documented


def documented_ready_body() -> dict:
    page = (Path(__file__).resolve().parent.parent / "docs" / "monitoring.rst").read_text()
    block = page.split("Kubernetes probes", 1)[1].split(".. code-block:: json", 1)[1]
    text = block.split("\n\n", 2)[1]
    return json.loads(text)


def test_the_readiness_body_has_the_documented_fields(settings, redlock_settings, fresh_readiness):
    documented = documented_ready_body()
    response = Client().get("/redlock/ready/")
    assert response.status_code == 200
    body = json.loads(response.content)
    assert set(body) == set(documented)
    assert body["status"] == "ready" and body["using"] == "default" and body["quorum"] == 2
    assert all(set(node) == set(documented["nodes"][0]) for node in body["nodes"])


@pytest.mark.django_db(transaction=True)
def test_readiness_asks_another_backends_service_by_alias(
    settings, redlock_settings, fresh_readiness
):
    settings.REDLOCK = {
        **redlock_settings,
        "BACKENDS": {
            "db": {
                "BACKEND": "django_redlock.backends.database.DatabaseLocks",
                "OPTIONS": {"using": "default"},
            }
        },
    }
    response = Client().get("/redlock/ready/", {"using": "db"})
    assert response.status_code == 200
    body = json.loads(response.content)
    assert body["using"] == "db" and len(body["nodes"]) == 1
