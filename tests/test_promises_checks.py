"""docs/checks.rst's promises that tests/test_checks.py leaves out: every E008 value the page
lists, the default named in each E008 hint, and the deployment pings (concurrent, bounded,
skipped while a node is malformed), against real redis-server processes."""

from __future__ import annotations

import time

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from django_redlock.setting import DEFAULTS

A, B, C = "redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", "redis://10.0.0.3:6379/0"
GOOD = {"NODES": [A, B, C]}


def messages(redlock, *, deploy=False):
    with override_settings(REDLOCK=redlock):
        return [
            m
            for m in run_checks(include_deployment_checks=deploy)
            if m.id and m.id.startswith("django_redlock.")
        ]


@pytest.mark.parametrize(
    "name, value",
    [
        ("TTL", float("inf")),
        ("NODE_TIMEOUT", float("inf")),
        ("MAX_TTL", -5),
        ("FAIR_HEARTBEAT", 0),
        ("FAIR_HEARTBEAT", float("nan")),
        ("FAIR_HEARTBEAT", "3"),
        ("STUCK_AFTER", 0),
        ("RETRY_DELAY", -1),
        ("DRIFT_FACTOR", -0.01),
        ("DRIFT_FACTOR", 0.5),
        ("RETRY_COUNT", -1),
        ("KEY_PREFIX", "locks "),
        ("KEY_PREFIX", ":locks"),
        ("KEY_PREFIX", "locks:"),
        ("META", "service=web"),
        ("RESTART_GUARD", "yes"),
        ("TRUST_FRESH_CLUSTER", 1),
        ("REENTRANT", None),
        ("AUTO_RENEW", "no"),
    ],
)
def test_each_value_the_page_lists_is_e008_naming_the_setting(name, value):
    found = messages({**GOOD, name: value})
    assert [m.id for m in found] == ["django_redlock.E008"], found
    assert f"REDLOCK['{name}']" in found[0].msg


@pytest.mark.parametrize(
    "name, value",
    [
        ("TTL", -1),
        ("NODE_TIMEOUT", 0),
        ("FAIR_HEARTBEAT", 0),
        ("STUCK_AFTER", -1),
        ("RETRY_DELAY", -1),
        ("RETRY_COUNT", "3"),
        ("DRIFT_FACTOR", 0.7),
        ("KEY_PREFIX", "a*"),
        ("META", ["x"]),
        ("REENTRANT", "yes"),
        ("RESTART_GUARD", 0),
        ("TRUST_FRESH_CLUSTER", "true"),
        ("AUTO_RENEW", None),
    ],
)
def test_the_e008_hint_gives_the_default(name, value):
    (found,) = messages({**GOOD, name: value})
    assert found.id == "django_redlock.E008"
    assert repr(DEFAULTS[name]) in found.hint, found.hint


def test_max_ttl_and_stuck_after_may_be_none():
    assert messages({**GOOD, "MAX_TTL": None, "STUCK_AFTER": None}) == []


def test_deploy_pings_every_node_at_once_with_a_two_second_timeout(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    for node in cluster:
        node.pause()  # accepts the connection, never answers: each ping waits its full timeout
    try:
        start = time.monotonic()
        found = messages({"NODES": cluster.urls}, deploy=True)
        took = time.monotonic() - start
    finally:
        for node in cluster:
            node.resume()
    assert [m.id for m in found] == ["django_redlock.E011"]
    assert "Only 0 of 3" in found[0].msg
    # One after another, three frozen nodes would take 6 s at least.
    assert 1.9 <= took < 5.5, took


def test_no_ping_while_a_node_is_malformed(redis_cluster_factory):
    cluster = redis_cluster_factory(2)
    cluster[0].kill()
    cluster[1].kill()
    # Two dead nodes and a malformed one: only the malformed entry is reported.
    found = messages({"NODES": [*cluster.urls, "http://10.0.0.4:6379"]}, deploy=True)
    assert [m.id for m in found] == ["django_redlock.E004"]


def test_the_tag_selects_this_apps_deploy_checks_too(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    for node in cluster:
        node.kill()
    with override_settings(REDLOCK={"NODES": cluster.urls}):
        tagged = {m.id for m in run_checks(tags=["django_redlock"], include_deployment_checks=True)}
        regular = {m.id for m in run_checks(tags=["django_redlock"])}
    assert "django_redlock.E011" in tagged and "django_redlock.E011" not in regular


def test_every_table_of_the_checks_page_starts_with_its_header_row():
    """Each ``list-table`` renders its first row as the header: a check's row put above the
    header row became the header (W007 was missing from the warnings where readers look)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "checks.rst").read_text()
    tables = re.findall(r"\.\. list-table::\n(?:   :.*\n)*\n   \* - (.*)\n", page)
    assert tables, "no list-table found on docs/checks.rst"
    assert all(first == "Id" for first in tables), tables
