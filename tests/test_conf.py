"""conf.py: the REDLOCK setting -> one shared, lazily built Redlock, reset on setting_changed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.test import override_settings

import django_redlock
from django_redlock import Redlock, get_redlock
from django_redlock.conf import DEFAULTS, get_config, resolve_node

REPO = Path(__file__).resolve().parent.parent


def test_lazy_names_on_the_package():
    assert django_redlock.get_redlock is get_redlock
    assert callable(django_redlock.locked)


def test_config_merges_defaults_and_keeps_unknown_names(settings):
    settings.REDLOCK = {"NODES": ["redis://127.0.0.1:1/0"], "TTL": 5, "TYPO": 1}
    config = get_config()
    assert config["TTL"] == 5 and config["TYPO"] == 1
    assert config["NODE_TIMEOUT"] == DEFAULTS["NODE_TIMEOUT"]


def test_settings_reach_the_redlock(settings):
    settings.REDLOCK = {
        "NODES": ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"],
        "KEY_PREFIX": "app",
        "TTL": 12.0,
        "NODE_TIMEOUT": 0.02,
        "RETRY_COUNT": 5,
        "RETRY_DELAY": 0.1,
        "DRIFT_FACTOR": 0.02,
        "MAX_TTL": 120.0,
        "REENTRANT": False,
        "META": {"service": "web"},
    }
    rl = get_redlock()
    assert isinstance(rl, Redlock)
    assert (
        rl.key_prefix,
        rl.ttl,
        rl.node_timeout,
        rl.retry_count,
        rl.retry_delay,
        rl.drift_factor,
        rl.max_ttl,
        rl.reentrant,
        rl.meta,
    ) == ("app", 12.0, 0.02, 5, 0.1, 0.02, 120.0, False, {"service": "web"})
    assert rl.quorum == 2


def test_building_does_no_io(settings):
    # nothing listens on these ports: building must not try to connect
    settings.REDLOCK = {"NODES": ["redis://127.0.0.1:1/0"]}
    assert get_redlock().nodes[0].name == "redis://127.0.0.1:1/0"


def test_import_and_setup_do_no_io():
    """django.setup() (AppConfig.ready) with unreachable nodes: no connection attempted."""
    code = (
        "import socket, django\n"
        "def refuse(*a, **k): raise AssertionError('connected at import/ready')\n"
        "socket.create_connection = refuse\n"
        "socket.socket.connect = refuse\n"
        "django.setup()\n"
        "import django_redlock.decorators, django_redlock.checks\n"
        "from django.core.management import call_command\n"
        "call_command('check')\n"
        "from django_redlock import get_redlock; get_redlock()\n"
        "print('ok')\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "REDLOCK_NODES": "redis://10.255.255.1:6379,redis://10.255.255.2:6379,"
        "redis://10.255.255.3:6379",
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_one_instance_shared_by_threads(redlock_settings):
    from django_redlock.conf import reset

    reset()
    barrier = threading.Barrier(8)
    seen = []

    def grab():
        barrier.wait(30)
        seen.append(id(get_redlock()))

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 8 and len(set(seen)) == 1


def test_override_settings_rebuilds(redlock_settings, redis_nodes5):
    first = get_redlock()
    assert get_redlock() is first and len(first.nodes) == 3
    with override_settings(REDLOCK={"NODES": redis_nodes5.urls}):
        inside = get_redlock()
        assert inside is not first and len(inside.nodes) == 5
        with inside.lock("k"):
            assert get_redlock().locked("k")
    after = get_redlock()
    assert after is not inside and len(after.nodes) == 3
    assert not after.locked("k")  # a different cluster


def test_caches_change_rebuilds(redlock_settings):
    first = get_redlock()
    with override_settings(
        CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    ):
        assert get_redlock() is not first


@pytest.mark.parametrize(
    "backend",
    [
        "django.core.cache.backends.redis.RedisCache",
        "django_redis.cache.RedisCache",
    ],
)
def test_cache_alias_nodes_lock_for_real(settings, redis_nodes, backend):
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        **{
            f"n{i}": {"BACKEND": backend, "LOCATION": url} for i, url in enumerate(redis_nodes.urls)
        },
    }
    settings.REDLOCK = {"NODES": ["cache:n0", "cache:n1", redis_nodes.urls[2]]}
    rl = get_redlock()
    assert [n.name for n in rl.nodes] == redis_nodes.urls
    with rl.lock("via-cache"):
        for node in redis_nodes:
            assert node.client().exists("redlock:lock:via-cache")


def test_cache_alias_errors(settings):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    with pytest.raises(ValueError, match="names no cache"):
        resolve_node("cache:missing")
    with pytest.raises(ValueError, match="is not a Redis cache"):
        resolve_node("cache:default")


def test_node_options_with_password(settings, redis_cluster_factory):
    cluster = redis_cluster_factory(3, password="s3cret")
    settings.REDLOCK = {
        "NODES": [
            {"URL": f"redis://127.0.0.1:{n.port}/0", "OPTIONS": {"password": "s3cret"}}
            for n in cluster
        ]
    }
    with get_redlock().lock("auth") as lock:
        assert lock.held


def test_unix_socket_nodes(settings, redis_cluster_factory):
    cluster = redis_cluster_factory(3, unix_socket=True)
    settings.REDLOCK = {"NODES": cluster.urls}
    with get_redlock().lock("unix") as lock:
        assert lock.held


def test_async_twin_is_shared_and_reset(redlock_settings, redis_nodes5):
    import asyncio

    from django_redlock import get_async_redlock
    from django_redlock.core.asyncio import AsyncRedlock

    first = get_async_redlock()
    assert isinstance(first, AsyncRedlock) and get_async_redlock() is first
    with override_settings(REDLOCK={"NODES": redis_nodes5.urls}):
        inside = get_async_redlock()
        assert inside is not first and len(inside.nodes) == 5
    assert get_async_redlock() is not inside

    async def take():
        async with get_async_redlock().lock("async-conf") as lock:
            return lock.held, get_redlock().locked("async-conf")

    # one instance serves several event loops (each asyncio.run is a new loop)
    assert asyncio.run(take()) == (True, True)
    assert asyncio.run(take()) == (True, True)
