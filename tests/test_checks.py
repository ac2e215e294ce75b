"""System checks: override_settings + django.core.checks.run_checks(), asserting fixed ids."""

from __future__ import annotations

import re
import time

import pytest
import redis
from django.core.checks import Tags, run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_redlock import Redlock
from django_redlock.conf import get_redlock

A, B, C = "redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", "redis://10.0.0.3:6379/0"
GOOD = {"NODES": [A, B, C]}

REDIS_CACHE = {
    "BACKEND": "django.core.cache.backends.redis.RedisCache",
    "LOCATION": "redis://10.0.0.9:6379/1",
}
DJANGO_REDIS = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://10.0.0.8:6379/2"}
LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
CACHES = {"default": LOCMEM, "locks": REDIS_CACHE, "dredis": DJANGO_REDIS, "local": LOCMEM}


def messages(redlock, *, deploy=False, **more):
    with override_settings(REDLOCK=redlock, **more):
        return [
            m
            for m in run_checks(include_deployment_checks=deploy)
            if m.id and m.id.startswith("django_redlock.")
        ]


def ids(redlock, **kwargs):
    return sorted(m.id for m in messages(redlock, **kwargs))


def test_valid_setting_is_silent():
    assert ids(GOOD) == []
    assert ids({**GOOD, "TTL": 5, "NODE_TIMEOUT": 0.02, "KEY_PREFIX": "app-locks"}) == []
    # the largest database number Redis's 32-bit "databases" setting allows
    assert ids({"NODES": [A, B, "redis://10.0.0.3:6379/2147483647"]}) == []


def test_regular_checks_do_no_io():
    start = time.monotonic()
    # 10.0.0.x is unroutable here: a connect attempt would take seconds
    assert ids(GOOD) == []
    assert time.monotonic() - start < 2


def test_missing_setting(settings):
    del settings.REDLOCK
    found = [m for m in run_checks() if m.id == "django_redlock.E002"]
    assert len(found) == 1 and "NODES" in found[0].hint


@pytest.mark.parametrize(
    "value, expected",
    [
        ("redis://x", ["django_redlock.E001"]),
        ({}, ["django_redlock.E002"]),
        ({"NODES": []}, ["django_redlock.E002"]),
        ({"NODES": A}, ["django_redlock.E003"]),
    ],
)
def test_shape(value, expected):
    assert ids(value) == expected


@pytest.mark.parametrize(
    "node, text",
    [
        ("http://10.0.0.4:6379", "must start with redis://"),
        ("redis://", "names no host"),
        ("redis://10.0.0.4:99999/0", "invalid port"),
        ("redis://10.0.0.4:0/0", "invalid port"),
        ("rediss://10.0.0.4:65536/0", "invalid port"),
        ("redis+sentinel://10.0.0.9:26379,10.0.0.8:0/mymaster/0", "invalid Sentinel port '0'"),
        ("redis+sentinel://10.0.0.9:\u0663/mymaster/0", "invalid Sentinel port"),
        ("redis://10.0.0.4:6379/zero", "invalid database number"),
        ({"url": "redis://10.0.0.4"}, "needs 'URL'"),
        ({"URL": "redis://10.0.0.4", "OPTIONS": "password"}, "OPTIONS must be a dict"),
        # a falsy non-dict is not "no options"
        ({"URL": "redis://10.0.0.4", "OPTIONS": []}, "OPTIONS must be a dict, got []"),
        ({"URL": "redis://10.0.0.4", "OPTIONS": None}, "OPTIONS must be a dict, got None"),
        ({"URL": "redis://10.0.0.4", "OPTIONS": 0}, "OPTIONS must be a dict, got 0"),
        # SELECT takes 0 .. databases-1, a 32-bit setting
        ("redis://10.0.0.4:6379/99999999999", "database number 99999999999"),
        ("redis://10.0.0.4:6379/" + "1" * 23, "database number " + "1" * 23),
        ("redis://10.0.0.4:6379/2147483648", "database number 2147483648"),
        ("redis://10.0.0.4:6379/0?db=-5", "database number -5"),
        ("unix:///tmp/redis.sock?db=-5", "database number -5"),
        ("redis+sentinel://10.0.0.9:26379/mymaster/2147483648", "database number 2147483648"),
        ({"URL": "redis://10.0.0.4", "OPTIONS": {"pasword": "x"}}, "pasword"),
        (42, "a node must be a URL string"),
        # a connection that would not be what the URL says: refused, never plain text
        (
            {"URL": "rediss://10.0.0.4", "OPTIONS": {"connection_class": redis.Connection}},
            "'connection_class' redis.connection.Connection cannot be honoured with a rediss://",
        ),
        ({"URL": "rediss://10.0.0.4", "OPTIONS": {"ssl": False}}, '"ssl": False'),
        ({"URL": "redis://10.0.0.4", "OPTIONS": {"ssl": "yes"}}, "'ssl' must be True or False"),
        (
            {
                "URL": "redis+sentinel://10.0.0.9:26379/mymaster/0",
                "OPTIONS": {"ssl_ca_certs": "/x"},
            },
            '"ssl": True',
        ),
        (
            {
                "URL": "redis+sentinel://10.0.0.9:26379/mymaster/0",
                "OPTIONS": {"sentinel_kwargs": {"bogus": 1}},
            },
            "'redis+sentinel://10.0.0.9:26379/mymaster/0' OPTIONS sentinel_kwargs 'bogus'",
        ),
        # options in the URL's query are checked as OPTIONS are, never dropped
        ("redis://10.0.0.4:6379/0?ssl=true", "rediss://"),
        ("redis://10.0.0.4:6379/0?ssl_cert_reqs=none", "rediss://"),
        ("redis://10.0.0.4:6379/0?socket_timout=1", "socket_timout"),
        ("redis://10.0.0.4:6379/0?protocol=3", "protocol"),
        ("redis://10.0.0.4:6379/0?max_connections=0", "max_connections"),
        ({"URL": "redis://10.0.0.4", "OPTIONS": {"max_connections": "4"}}, "max_connections"),
        ("redis://10.0.0.4:6379/0?socket_timeout=-1", "socket_timeout"),
        ("redis://10.0.0.4:6379/0?socket_timeout=soon", "socket_timeout"),
        ("unix:///tmp/redis.sock?socket_timout=1", "socket_timout"),
        ("redis+sentinel://10.0.0.9:26379/mymaster/0?socket_timout=1", "socket_timout"),
        ("redis+sentinel://10.0.0.9:26379/mymaster/0?ssl=true", "ssl"),
        ("redis+sentinel://10.0.0.9:26379", "names no service"),
        ("ftp://10.0.0.4:6379/0", "redis+sentinel://"),
        ("rediss://10.0.0.4:6380/0?ssl_cert_reqs=bogus", "ssl_cert_reqs 'bogus'"),
        ({"URL": "rediss://10.0.0.4", "OPTIONS": {"ssl_cert_reqs": "bogus"}}, "ssl_cert_reqs"),
        *(
            (
                {
                    "URL": "redis+sentinel://10.0.0.9:26379/mymaster/0",
                    "OPTIONS": {"sentinel_kwargs": {name: bad}},
                },
                f"sentinel_kwargs {name}",
            )
            for name, bad in (
                ("socket_timeout", "x"),
                ("socket_timeout", -1),
                ("socket_connect_timeout", float("nan")),
            )
        ),
    ],
)
def test_malformed_node(node, text):
    found = messages({"NODES": [A, B, node]})
    assert [m.id for m in found] == ["django_redlock.E004"]
    assert "REDLOCK['NODES'][2]" in found[0].msg and text in found[0].msg
    assert found[0].hint


@pytest.mark.parametrize(
    ("node", "text"),
    [
        ({"URL": "redis://10.0.0.4", "OPTIONS": {"max_connections": 4}}, "max_connections"),
        ("redis://10.0.0.4:6379/0?max_connections=4", "max_connections"),
        ({"URL": "rediss://10.0.0.4", "OPTIONS": {"ssl_validate_ocsp": True}}, "no OCSP"),
    ],
)
def test_a_node_only_the_async_client_refuses_is_W007_and_E004_when_it_is_built(node, text):
    """docs/configuration.rst: options AsyncRedlock cannot honour are refused by it as E004.
    ``check`` passed them silently, and ``get_async_redlock()`` raised E008: every async view
    answered 500. Now ``check`` warns (a project with no async code is fine: the sync client
    takes them), and the async client's refusal names E004."""
    found = messages({"NODES": [A, B, node]})
    assert [m.id for m in found] == ["django_redlock.W007"], found
    assert "REDLOCK['NODES'][2]" in found[0].msg and text in found[0].msg
    assert "a TLS option needs a rediss:// URL" not in found[0].msg
    with override_settings(REDLOCK={"NODES": [A, B, node]}):
        from django_redlock.conf import get_async_redlock

        assert get_redlock() is not None
        with pytest.raises(ImproperlyConfigured, match=r"django_redlock\.E004: .*NODES'\]\[2\]"):
            get_async_redlock()


@pytest.mark.parametrize(
    "node",
    [
        "http://10.0.0.4:6379",
        {"url": "redis://10.0.0.4"},
        42,
        "cache:nope",
        "cache:local",
    ],
)
def test_what_the_checks_reject_get_redlock_rejects(node):
    with override_settings(REDLOCK={"NODES": [A, B, node]}, CACHES=CACHES):
        found = [m for m in run_checks(tags=["django_redlock"]) if m.is_serious()]
        with pytest.raises(ImproperlyConfigured) as caught:
            get_redlock()
    # The same id and message as the check, for servers that never run the checks.
    assert str(caught.value).startswith(f"{found[0].id}: {found[0].msg}")


@pytest.mark.parametrize(
    "redlock, text",
    [
        ({"NODES": "r"}, "django_redlock.E003"),
        ({"NODES": [A, B, C], "RETRY_COUNT": 5000}, "RETRY_COUNT"),
        ({"NODES": [A, B, C], "TTL": float("nan")}, "TTL"),
        ({"NODES": [A, B, C], "LOCKED_TASK": {"lock_wait": float("nan")}}, "lock_wait"),
    ],
)
def test_misconfigured_redlock_raises_improperly_configured_at_first_use(redlock, text):
    with override_settings(REDLOCK=redlock):
        (error,) = [m for m in run_checks(tags=["django_redlock"]) if m.is_serious()]
        with pytest.raises(ImproperlyConfigured, match=re.escape(f"{error.id}: {error.msg}")):
            get_redlock()
    assert text in f"{error.id} {error.msg}"


def test_checks_refuse_what_the_constructor_refuses():
    """RETRY_COUNT=5000 used to pass `manage.py check` and fail at first use."""
    from django_redlock import Redlock

    with pytest.raises(ValueError) as caught:
        Redlock([A], retry_count=5000)
    found = messages({**GOOD, "RETRY_COUNT": 5000})
    assert [m.id for m in found] == ["django_redlock.E008"]
    assert "REDLOCK['RETRY_COUNT']" in found[0].msg and str(caught.value) in found[0].msg


@pytest.mark.parametrize(
    "options, text",
    [
        ("wait", "must be a dict"),
        ({"lock_waits": 3}, "unknown options: lock_waits"),
        ({"lock_key": "x"}, "a task sets itself, never a project default: lock_key."),
        ({"lock_limit": 3, "lock_using": "db"}, "never a project default: lock_limit, lock_using"),
        ({"lock_redlock": "x", "lock_wiat": 1}, "unknown options: lock_wiat; options a task"),
        ({"lock_wait": float("nan")}, "lock_wait must be"),
        ({"lock_retry_jitter": float("nan")}, "lock_retry_jitter must be"),
        ({"lock_ttl": -1}, "lock_ttl must be"),
        ({"on_locked": "later"}, "on_locked must be one of"),
        ({"lock_dedupe": "sometimes"}, "lock_dedupe must be"),
        ({"lock_renew": "yes"}, "lock_renew must be True or False"),
        ({"lock_max_retries": 1.5}, "lock_max_retries must be an int"),
        # the shared Redlock refuses a lease longer than MAX_TTL (60 s by default) at every run
        ({"lock_ttl": 100}, "lock_ttl 100 exceeds max_ttl 60"),
    ],
)
def test_locked_task_defaults_are_checked(options, text):
    found = messages({**GOOD, "LOCKED_TASK": options})
    assert [m.id for m in found] == ["django_redlock.E012"]
    assert text in found[0].msg


def test_locked_task_lock_ttl_is_judged_against_the_configured_max_ttl():
    assert ids({**GOOD, "MAX_TTL": 120, "LOCKED_TASK": {"lock_ttl": 100}}) == []
    found = messages({**GOOD, "MAX_TTL": 90, "LOCKED_TASK": {"lock_ttl": 100}})
    assert [m.id for m in found] == ["django_redlock.E012"] and "max_ttl 90" in found[0].msg


def test_locked_task_defaults_accept_every_option():
    options = {
        "lock_ttl": 60,
        "on_locked": "wait",
        "lock_wait": 5,
        "lock_renew": False,
        "lock_retry_counts": True,
        "lock_max_retries": 3,
        "lock_retry_delay": 0.5,
        "lock_retry_jitter": 0,
        "lock_dedupe": "drop",
        "lock_dedupe_ttl": 100,
    }
    assert ids({**GOOD, "LOCKED_TASK": options}) == []


def test_node_options_are_accepted():
    node = {
        "URL": "rediss://10.0.0.4:6380/0",
        "OPTIONS": {
            "password": "s3cret",
            "username": "app",
            "ssl_cert_reqs": "none",
            "socket_connect_timeout": 1,
        },
    }
    assert ids({"NODES": [A, B, node]}) == []


def test_unix_nodes():
    assert ids({"NODES": ["unix:///run/redis/a.sock?db=0", "unix:///run/redis/b.sock", C]}) == []


def test_unknown_cache_alias():
    found = messages({"NODES": [A, B, "cache:nope"]}, CACHES=CACHES)
    assert [m.id for m in found] == ["django_redlock.E005"]
    assert "'locks'" in found[0].hint


def test_non_redis_cache():
    found = messages({"NODES": [A, B, "cache:local"]}, CACHES=CACHES)
    assert [m.id for m in found] == ["django_redlock.E006"]
    assert "LocMemCache" in found[0].msg


def test_redis_caches_are_accepted():
    assert ids({"NODES": [A, "cache:locks", "cache:dredis"]}, CACHES=CACHES) == []


def test_duplicate_nodes():
    found = messages({"NODES": ["redis://LOCALHOST:6379/0", B, "redis://127.0.0.1"]})
    assert [m.id for m in found] == ["django_redlock.E007"]
    assert "[0] and [2]" in found[0].msg


@pytest.mark.parametrize(
    "spelt", ["/run/redis//redis.sock", "/run/redis/./redis.sock", "/run/redis/sub/../redis.sock"]
)
def test_one_socket_spelt_two_ways_is_one_server(spelt):
    """The same socket file is one server however its path is written (the constructor and
    the check read one rule)."""
    nodes = ["unix:///run/redis/redis.sock?db=0", f"unix://{spelt}?db=1", C]
    found = messages({"NODES": nodes})
    assert [m.id for m in found] == ["django_redlock.E007"]
    with pytest.raises(ValueError, match="same Redis server"):
        Redlock(nodes)


def test_cache_node_duplicating_a_url():
    assert ids({"NODES": [A, "cache:locks", "redis://10.0.0.9:6379/1"]}, CACHES=CACHES) == [
        "django_redlock.E007"
    ]


def test_duplicate_password_hidden():
    found = messages({"NODES": ["redis://:pw@10.0.0.1:6379", "redis://:pw@10.0.0.1:6379", C]})
    assert "pw" not in found[0].msg


@pytest.mark.parametrize("n", [2, 4])
def test_even_number_of_nodes(n):
    nodes = [f"redis://10.0.0.{i}:6379" for i in range(1, n + 1)]
    found = messages({"NODES": nodes})
    assert [m.id for m in found] == ["django_redlock.W001"]
    assert f"Use {n - 1} or {n + 1} nodes" in found[0].hint


def test_single_node_is_a_deploy_warning():
    assert ids({"NODES": [A]}) == []
    found = messages(
        {"NODES": [A]},
        deploy=True,
    )
    # deploy also pings; 10.0.0.1 does not answer, so E011 joins W004
    assert "django_redlock.W004" in [m.id for m in found]
    with override_settings(REDLOCK={"NODES": [A]}):
        security = [m.id for m in run_checks(tags=[Tags.security], include_deployment_checks=True)]
    assert "django_redlock.W004" in security


@pytest.mark.parametrize(
    "values, text",
    [
        ({"TTL": "ten"}, "TTL"),
        ({"TTL": -1}, "TTL"),
        ({"TTL": float("nan")}, "TTL"),
        ({"NODE_TIMEOUT": 0}, "NODE_TIMEOUT"),
        ({"RETRY_DELAY": -0.1}, "RETRY_DELAY"),
        ({"RETRY_COUNT": 1.5}, "RETRY_COUNT"),
        ({"RETRY_COUNT": True}, "RETRY_COUNT"),
        ({"DRIFT_FACTOR": 0.6}, "DRIFT_FACTOR"),
        ({"MAX_TTL": 0}, "MAX_TTL"),
        ({"STUCK_AFTER": "soon"}, "STUCK_AFTER"),
        ({"KEY_PREFIX": "locks*"}, "KEY_PREFIX"),
        ({"KEY_PREFIX": ""}, "KEY_PREFIX"),
        ({"META": ["x"]}, "META"),
        ({"REENTRANT": "yes"}, "REENTRANT"),
    ],
)
def test_invalid_values(values, text):
    found = messages({**GOOD, **values})
    assert [m.id for m in found] == ["django_redlock.E008"]
    assert text in found[0].msg


def test_node_timeout_not_smaller_than_ttl():
    assert ids({**GOOD, "TTL": 1, "NODE_TIMEOUT": 1}) == ["django_redlock.E009"]
    assert ids({**GOOD, "TTL": 100, "MAX_TTL": 60}) == ["django_redlock.E009"]


def test_node_timeout_not_much_smaller_than_ttl():
    found = messages({**GOOD, "TTL": 10, "NODE_TIMEOUT": 2})
    assert [m.id for m in found] == ["django_redlock.W002"]
    assert ids({**GOOD, "TTL": 10, "NODE_TIMEOUT": 0.5}) == []


def test_unknown_setting_names():
    found = messages({**GOOD, "TTLL": 5, "node_timeout": 0.1, "FROBNICATE": 1})
    by_msg = {m.msg.split("'")[1]: m for m in found}
    assert {m.id for m in found} == {"django_redlock.W003"}
    assert by_msg["TTLL"].hint == "Did you mean 'TTL'?"
    assert by_msg["node_timeout"].hint == "Did you mean 'NODE_TIMEOUT'?"
    assert by_msg["FROBNICATE"].hint.startswith("Known settings: ")


def test_locked_response():
    assert ids({**GOOD, "LOCKED_RESPONSE": "testproject.views.busy_response"}) == []
    assert ids({**GOOD, "LOCKED_RESPONSE": "testproject.views.nothing"}) == ["django_redlock.E010"]
    assert ids({**GOOD, "LOCKED_RESPONSE": "testproject.settings.DEBUG"}) == ["django_redlock.E010"]
    assert ids({**GOOD, "LOCKED_RESPONSE": 42}) == ["django_redlock.E010"]


def test_every_message_has_a_hint_or_explains_itself():
    cases = [
        {"NODES": []},
        {"NODES": A},
        {"NODES": [A, A, "http://x"]},
        {**GOOD, "TTL": -1},
        {**GOOD, "TTLL": 1},
        {"NODES": [A, B]},
    ]
    for case in cases:
        for m in messages(case):
            assert m.msg.endswith((".", ")")) or m.hint, m


# ---------------------------------------------------------------- deploy: pinging real nodes


def test_deploy_all_nodes_reachable(redis_nodes):
    assert ids({"NODES": redis_nodes.urls}, deploy=True) == []


def test_deploy_one_node_down(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    cluster[2].kill()
    found = messages({"NODES": cluster.urls}, deploy=True)
    assert [m.id for m in found] == ["django_redlock.W005"]
    assert "1 of 3" in found[0].msg and cluster[2].url in found[0].msg


def test_deploy_quorum_down(redis_cluster_factory):
    cluster = redis_cluster_factory(3)
    cluster[0].kill()
    cluster[1].kill()
    found = messages({"NODES": cluster.urls}, deploy=True)
    assert [m.id for m in found] == ["django_redlock.E011"]
    assert "Only 1 of 3" in found[0].msg


def test_deploy_ping_uses_credentials(redis_cluster_factory):
    cluster = redis_cluster_factory(3, password="s3cret")
    nodes = [
        {"URL": f"redis://127.0.0.1:{n.port}/0", "OPTIONS": {"password": "s3cret"}} for n in cluster
    ]
    assert ids({"NODES": nodes}, deploy=True) == []
    wrong = [
        {"URL": f"redis://127.0.0.1:{n.port}/0", "OPTIONS": {"password": "nope"}} for n in cluster
    ]
    assert ids({"NODES": wrong}, deploy=True) == ["django_redlock.E011"]


ACL_PASSWORD = "acl-Pa55"
ACL_USERS = [
    # may do everything the locks do
    *["--user", "locker", "on", f">{ACL_PASSWORD}", "~redlock:*", "&*", "+@all"],
    # may not run the lock scripts
    *["--user", "noeval", "on", f">{ACL_PASSWORD}", "~redlock:*", "&*", "+@all", "-eval"],
    *["--user", "noevalsha", "on", f">{ACL_PASSWORD}", "~redlock:*", "&*", "+@all", "-evalsha"],
    # may run them, but not read INFO (the health probe's, and the guard's, view of the node)
    *["--user", "noinfo", "on", f">{ACL_PASSWORD}", "~redlock:*", "&*", "+@all", "-info"],
]


def _as(user, cluster):
    return [f"redis://{user}:{ACL_PASSWORD}@127.0.0.1:{n.port}/0" for n in cluster]


def test_deploy_check_reports_nodes_whose_user_may_not_run_the_lock_scripts(
    redis_cluster_factory,
):
    """PING alone passed a cluster on which no lock can ever be taken: the deploy check runs
    the health probe (health() and `manage.py redlock check` report the same)."""
    cluster = redis_cluster_factory(3, extra_args=ACL_USERS)
    assert ids({"NODES": _as("locker", cluster)}, deploy=True) == []
    for user, said in (
        ("noeval", "may not run the lock scripts"),
        ("noevalsha", "may not run the lock scripts"),
        ("noinfo", "info"),
    ):
        found = messages({"NODES": _as(user, cluster)}, deploy=True)
        assert [m.id for m in found] == ["django_redlock.E011"], (user, found)
        assert "Only 0 of 3" in found[0].msg and said in found[0].msg.lower(), found[0].msg
        assert ACL_PASSWORD not in found[0].msg
    # One node's user only: locks still work on the other two, one failure from stopping.
    nodes = _as("locker", cluster)
    nodes[1] = _as("noeval", cluster)[1]
    found = messages({"NODES": nodes}, deploy=True)
    assert [m.id for m in found] == ["django_redlock.W005"]
    assert "[1]" in found[0].msg and "may not run the lock scripts" in found[0].msg
    # Only with --deploy: the regular checks never talk to the nodes.
    assert ids({"NODES": _as("noeval", cluster)}) == []


@pytest.mark.usefixtures("db")
def test_deploy_check_warns_about_evicting_nodes(redis_nodes):
    nodes = list(redis_nodes.urls)
    assert "django_redlock.W006" not in ids({"NODES": nodes}, deploy=True)
    node = redis_nodes[2]
    node.client().config_set("maxmemory-policy", "allkeys-lru")
    try:
        found = messages({"NODES": nodes}, deploy=True)
    finally:
        node.client().config_set("maxmemory-policy", "noeviction")
    (warning,) = [m for m in found if m.id == "django_redlock.W006"]
    assert "REDLOCK node [2]" in warning.msg and "'allkeys-lru'" in warning.msg
    assert "noeviction" in warning.hint
    assert "django_redlock.W006" not in ids({"NODES": nodes})  # only with --deploy
