"""docs/configuration.rst's settings table against the code: every documented default is the
one the package uses, and a setting left out reaches the shared Redlock with that default."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from django_redlock import QuorumError, Redlock
from django_redlock.conf import get_redlock
from django_redlock.setting import DEFAULTS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.rst"
URLS = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


def documented_defaults() -> dict[str, object]:
    """``{name: default}`` from the page's "Settings" list-table (rows of ``* - ``NAME```` then
    ``- ``DEFAULT````)."""
    text = (
        PAGE.read_text().split("\nSettings\n--------\n", 1)[1].split("\nThe shared Redlock", 1)[0]
    )
    rows = re.findall(r"^   \* - ``([A-Z_]+)``\n     - ``(.+?)``$", text, re.M)
    return {name: ast.literal_eval(value) for name, value in rows}


def test_the_table_lists_every_setting_with_its_default():
    table = documented_defaults()
    # BACKENDS has a section of its own ("Backends", below the table).
    assert set(table) == set(DEFAULTS) - {"BACKENDS"}
    for name, value in table.items():
        assert DEFAULTS[name] == value, name


def test_settings_left_out_reach_the_shared_redlock_as_documented(settings):
    settings.REDLOCK = {"NODES": URLS}
    rl = get_redlock()
    assert (
        rl.key_prefix,
        rl.ttl,
        rl.node_timeout,
        rl.retry_count,
        rl.retry_delay,
        rl.drift_factor,
        rl.restart_guard,
        rl.trust_fresh_cluster,
        rl.reentrant,
        rl.fair_heartbeat,
        rl.meta,
    ) == ("redlock", 30.0, 0.05, 3, 0.2, 0.01, True, True, True, 3.0, {})
    # MAX_TTL None: the larger of TTL and 60 s.
    assert rl.max_ttl == 60.0
    settings.REDLOCK = {"NODES": URLS, "TTL": 90.0}
    assert get_redlock().max_ttl == 90.0


def test_a_redlock_built_by_hand_has_the_same_defaults_but_does_not_reenter():
    rl = Redlock(URLS)
    try:
        assert (rl.key_prefix, rl.ttl, rl.node_timeout, rl.retry_count) == (
            "redlock",
            30.0,
            0.05,
            3,
        )
        assert (rl.retry_delay, rl.drift_factor, rl.max_ttl) == (0.2, 0.01, 60.0)
        assert rl.reentrant is False
    finally:
        rl.close()


@pytest.mark.parametrize(
    "backend",
    ["django.core.cache.backends.redis.RedisCache", "django_redis.cache.RedisCache"],
)
def test_a_cache_with_several_locations_locks_on_its_primary(
    settings, redis_cluster_factory, backend
):
    cluster = redis_cluster_factory(4)
    primary, replica = cluster.urls[0], cluster.urls[3]
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": backend, "LOCATION": [primary, replica]},
    }
    settings.REDLOCK = {"NODES": ["cache:locks", cluster.urls[1], cluster.urls[2]]}
    rl = get_redlock()
    assert rl.nodes[0].name == primary
    with rl.lock("several"):
        assert cluster[0].client().exists("redlock:lock:several")
        assert not cluster[3].client().exists("redlock:lock:several")


def test_lock_commands_wait_node_timeout_whatever_socket_timeout_says(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    nodes = [
        {"URL": url, "OPTIONS": {"socket_timeout": 30, "socket_connect_timeout": 30}}
        for url in cluster.urls
    ]
    rl = Redlock(nodes, node_timeout=0.2)
    try:
        with rl.lock("warm"):  # connections open: the frozen nodes accept and never answer
            pass
        cluster[0].pause()
        cluster[1].pause()
        try:
            start = time.monotonic()
            with pytest.raises(QuorumError):
                with rl.lock("frozen", timeout=0):
                    pass
            took = time.monotonic() - start
        finally:
            cluster[0].resume()
            cluster[1].resume()
        assert took < 5, took  # socket_timeout would be 30 s
    finally:
        rl.close()


DB = {"BACKEND": "django_redlock.backends.database.DatabaseLocks", "OPTIONS": {"using": "default"}}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("reentrant", [None, False])
def test_a_backends_service_takes_reentrant_and_meta_from_the_setting(settings, reentrant):
    from django_redlock import get_locks

    settings.REDLOCK = {
        "NODES": URLS,
        "BACKENDS": {"db": DB},
        "META": {"service": "web"},
        **({} if reentrant is None else {"REENTRANT": reentrant}),
    }
    locks = get_locks("db")
    outer = locks.lock("conf:reentry", ttl=10)
    assert outer.acquire(blocking=False)
    try:
        assert locks.lock_info("conf:reentry").meta["service"] == "web"
        inner = locks.lock("conf:reentry", ttl=10)
        again = inner.acquire(blocking=False)
        assert again is (reentrant is None)  # REENTRANT defaults to True
        if again:
            inner.release()
            assert locks.locked("conf:reentry")  # the outer hold stands
    finally:
        outer.release()
    assert not locks.locked("conf:reentry")


@pytest.mark.parametrize("auto_renew", [None, True])
def test_auto_renew_is_the_default_of_locked(settings, redis_nodes, auto_renew):
    from django_redlock import locked
    from django_redlock.decorators import current_lock

    settings.REDLOCK = {
        "NODES": list(redis_nodes.urls),
        **({} if auto_renew is None else {"AUTO_RENEW": auto_renew}),
    }

    @locked("conf:renew")
    def job():
        return current_lock().auto_renew

    assert job() is bool(auto_renew)
