"""Bad input, fuzzed with Hypothesis, against real nodes.

Whatever a caller passes as a lock name, a key template value, a TTL, a timeout, holder
metadata or a Redlock setting, the answer is either a working lock or a clear ``TypeError`` /
``ValueError`` that names the parameter, raised before anything reaches a node. After every
example the nodes are scanned: no ``fuzz:lock:*`` key may be left (never a half-taken lock).
The watchdog thread renews a lock through the whole run and must still be renewing it at the end.

The regression tests at the end pin inputs that broke these rules once (huge finite durations
included: they are refused up front, so the strategies draw them too).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from django_redlock import LockNotOwned, QuorumError, Redlock
from django_redlock.testing import RedisCluster

PREFIX = "fuzz"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster(3) as c:
        yield c


@pytest.fixture(scope="module")
def rl(cluster, watchdog):  # the watchdog lock is taken before any fuzzing
    r = Redlock(cluster.urls, key_prefix=PREFIX, ttl=5.0)
    yield r
    r.close()


@pytest.fixture(scope="module")
def watchdog(cluster):
    """A lock auto-renewed by the watchdog thread for the whole module (its own Redlock)."""
    # 3 s lease: a failing Hypothesis example's report can hold the GIL for ~0.25 s at a time,
    # which a sub-second lease would (rightly) not survive.
    r = Redlock(cluster.urls, key_prefix="fuzzdog", ttl=3.0)
    lost: list[Any] = []
    r.listeners.append(lambda e: lost.append((time.monotonic(), e)) if e.kind == "lost" else None)
    r.lost_events = lost  # type: ignore[attr-defined]
    lock = r.lock("watchdog", auto_renew=True)
    assert lock.acquire(blocking=False)
    yield r, lock
    with contextlib.suppress(LockNotOwned):
        lock.release()
    r.close()


@pytest.fixture(scope="module")
def clients(cluster):
    cs = [node.client(socket_timeout=5) for node in cluster]
    yield cs
    for c in cs:
        c.close()


def leftovers(clients) -> list[list[bytes]]:
    return [list(c.scan_iter(match=f"{PREFIX}:lock:*")) for c in clients]


def assert_clear(exc: BaseException, *labels: str) -> None:
    """A TypeError/ValueError (never a UnicodeError or OverflowError dressed as one) whose
    message names one of ``labels``."""
    assert isinstance(exc, (TypeError, ValueError)), f"{type(exc).__name__}: {exc}"
    assert not isinstance(exc, UnicodeError), f"{type(exc).__name__}: {exc}"
    message = str(exc)
    assert any(label in message for label in labels), (labels, message)


def outcome(fn, *labels: str) -> Any:
    """``fn()``'s value, or None after checking it raised a clear error."""
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        assert_clear(exc, *labels)
        return None


# --------------------------------------------------------------------------- strategies

SPECIAL = "*?[]{}\\:% \t\n\r\x00\x7f\u200b\u00e9\U0001f512"
#: Text with lone surrogates: a valid str that cannot be encoded as UTF-8.
surrogates = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from("ab:")
    ),
    min_size=1,
    max_size=6,
).filter(lambda t: any(0xD800 <= ord(c) <= 0xDFFF for c in t))
huge_ints = st.integers(min_value=10**308, max_value=10**400) | st.integers(
    min_value=-(10**400), max_value=-(10**308)
)
names = st.one_of(
    st.text(max_size=40),
    surrogates,
    st.text(alphabet=SPECIAL, max_size=20),
    st.text(min_size=505, max_size=520),  # around the 512-character limit
    st.just("x" * 100_000),
    st.binary(max_size=20),
    st.integers(-(10**30), 10**30),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.lists(st.text(max_size=3), max_size=3),
    st.tuples(st.integers()),
)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=120.0),
    st.integers(-(10**6), 10**6),
    huge_ints,
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.fractions(),
    st.complex_numbers(max_magnitude=10),
    st.just([]),
)
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
metas = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=8), json_like, max_size=4),
    st.dictionaries(st.text(max_size=4), st.builds(object), max_size=2),  # not JSON: str()-ed
    st.text(max_size=5),
    st.integers(),
    st.lists(st.integers(), max_size=2),
)


# --------------------------------------------------------------------------- names


def _strict_json(meta: dict) -> bool:
    """What the nodes can store: JSON without NaN or infinities (other values as str())."""
    try:
        json.dumps(meta, default=str, allow_nan=False)
    except ValueError:
        return False
    return True


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@FUZZ
@given(name=names, auto_renew=st.booleans(), meta=metas)
def test_any_lock_name(rl, clients, name, auto_renew, meta) -> None:
    lock = outcome(lambda: rl.lock(name, auto_renew=auto_renew, meta=meta), "lock name", "meta")
    if lock is not None:
        assert isinstance(name, str) and 0 < len(name) <= 512 and _utf8(name)
        assert lock.acquire(blocking=False) is True, repr(name)
        try:
            assert lock.held and rl.locked(name)
            info = rl.lock_info(name)
            assert info is not None and info.name == name and info.token == lock.token
        finally:
            lock.release()
        assert not rl.locked(name)
    else:
        assert not (
            isinstance(name, str)
            and 0 < len(name) <= 512
            and _utf8(name)
            and (meta is None or (isinstance(meta, dict) and _strict_json(meta)))
        )
    assert leftovers(clients) == [[], [], []]


# --------------------------------------------------------------------------- TTLs and timeouts


@FUZZ
@given(ttl=numbers)
def test_any_ttl(rl, clients, ttl) -> None:
    lock = outcome(lambda: rl.lock("ttl", ttl=ttl, auto_renew=True), "ttl")
    if lock is not None:
        value = rl.ttl if ttl is None else float(ttl)
        assert rl.node_timeout < value <= rl.max_ttl
        got = lock.acquire(blocking=False)  # a lease barely above node_timeout may not make it
        if got:
            assert 0 < lock.validity <= value
            lock.release()
    assert leftovers(clients) == [[], [], []]


@FUZZ
@given(ttl=numbers)
def test_any_extend_ttl(rl, clients, ttl) -> None:
    lock = rl.lock("extend", ttl=5.0)
    assert lock.acquire(blocking=False)
    try:
        try:
            result = lock.extend(ttl)
        except (TypeError, ValueError) as exc:
            assert_clear(exc, "ttl")
            # A refused extension leaves the lock as it was.
            assert lock.held and lock.check()
        else:
            assert isinstance(result, bool)
            if result:
                assert 0 < lock.validity <= (lock.ttl if ttl is None else float(ttl))
    finally:
        with contextlib.suppress(LockNotOwned):  # a short extension may have run out
            lock.release()
    assert leftovers(clients) == [[], [], []]


@FUZZ
@given(timeout=numbers, blocking=st.one_of(st.booleans(), st.none()))
def test_any_timeout(rl, clients, timeout, blocking) -> None:
    lock = rl.lock("timeout")
    got = outcome(lambda: lock.acquire(blocking=blocking, timeout=timeout), "timeout")
    if got is not None:
        assert got is True  # the lock is free: any valid timeout gets it at once
        lock.release()
    assert leftovers(clients) == [[], [], []]


# --------------------------------------------------------------------------- settings

setting_values = {
    "ttl": numbers,
    "node_timeout": st.one_of(
        numbers.filter(lambda v: not (isinstance(v, (int, float)) and 0 < v < 0.05)), st.just(0.1)
    ),
    "retry_count": st.one_of(st.integers(-3, 10), numbers),
    "retry_delay": numbers,
    "drift_factor": st.one_of(numbers, st.floats(0, 0.6)),
    "max_ttl": numbers,
    "fair_heartbeat": numbers,
    "key_prefix": st.one_of(
        st.text(alphabet="ab:*? {}", max_size=6),
        st.text(max_size=8),
        surrogates,
        st.none(),
        st.integers(),
        st.binary(max_size=4),
    ),
    "meta": metas,
    "restart_guard": st.one_of(st.booleans(), st.none(), st.integers()),
}


@FUZZ
@given(kwargs=st.fixed_dictionaries({}, optional=setting_values))
def test_any_redlock_settings(cluster, kwargs) -> None:
    labels = [*kwargs, "max_ttl", "node_timeout", "ttl"]
    r = outcome(lambda: Redlock(cluster.urls, **kwargs), *labels)
    if r is None:
        return
    prefix = r.key_prefix
    try:
        lock = r.lock("settings")
        try:
            got = lock.acquire(blocking=False)
        except QuorumError:  # a legal but hopeless node_timeout; still nothing may be left
            got = False
        if got:
            lock.release()
        for node in cluster:
            with node.client(socket_timeout=5) as c:
                assert list(c.scan_iter(match=f"{prefix}:lock:*")) == []
    finally:
        r.close()


bad_urls = st.sampled_from(
    [
        "",
        "localhost",
        "http://127.0.0.1:6379",
        "redis://",
        "redis://:6379",
        "redis://host:99999",
        "redis://host:port",
        "redis://[::1",
        "redis://127.0.0.1:6379/x",
        "unix://",
        "rediss://",
        "redis://127.0.0.1:6379/0?socket_timeout=abc",
    ]
)
node_specs = st.one_of(
    bad_urls,
    st.text(max_size=20),
    st.integers(),
    st.none(),
    st.binary(max_size=5),
    st.dictionaries(
        st.sampled_from(["URL", "OPTIONS", "url", "X"]),
        st.one_of(bad_urls, st.integers(), st.none(), st.text(max_size=5)),
        max_size=2,
    ),
)


@FUZZ
@given(
    nodes=st.one_of(
        st.lists(node_specs, max_size=3),
        st.text(max_size=10),
        st.none(),
        st.integers(),
        st.just(()),
    )
)
def test_any_node_list(nodes) -> None:
    r = outcome(lambda: Redlock(nodes), "node", "URL", "nodes")
    if r is not None:  # only well-formed specs get here (no connection is made yet)
        r.close()


# --------------------------------------------------------------------------- key templates


def _decorators():
    return pytest.importorskip("django_redlock.decorators")


templates = st.one_of(
    st.text(alphabet="ab:{}!.[]0 %_x-y", max_size=16),
    st.sampled_from(
        [
            "t:{x}",
            "t:{x}:{y}",
            "{x}{y}",
            "{x}-{y}",
            "{x.real}",
            "{x[0]}",
            "{0}",
            "{}",
            "{x!r}",
            "{x:>5}",
            "{x:{y}}",
            "t:{z}",
            "{",
            "}",
            "{x",
        ]
    ),
)
template_values = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=SPECIAL, max_size=10),
    st.integers(),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.decimals(allow_nan=True),
    st.uuids(),
    st.dates(),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.text(min_size=600, max_size=700),
    st.builds(object),
)


@FUZZ
@given(
    template=st.one_of(templates, st.none(), st.integers()), x=template_values, y=template_values
)
def test_any_key_template(rl, clients, template, x, y) -> None:
    make_key = _decorators().make_key
    key = outcome(lambda: make_key(template, x=x, y=y), "template", "lock key")
    if key is not None:
        assert isinstance(key, str) and 0 < len(key) <= 512, key
        lock = rl.lock(key)
        assert lock.acquire(blocking=False), key
        lock.release()
    assert leftovers(clients) == [[], [], []]


@FUZZ
@given(
    a=st.tuples(st.text(max_size=12), st.text(max_size=12)),
    b=st.tuples(st.text(max_size=12), st.text(max_size=12)),
)
def test_distinct_template_values_give_distinct_keys(a, b) -> None:
    assume(a != b)
    make_key = _decorators().make_key
    assert make_key("t:{x}:{y}", x=a[0], y=a[1]) != make_key("t:{x}:{y}", x=b[0], y=b[1])


# --------------------------------------------------------------------------- regressions and known bad inputs
#
# Fixed (regression tests): ints beyond float range raised OverflowError (validation.py
# _number), retry_count=10**400 was accepted and every acquire raised OverflowError
# (base.py _deadline), lone surrogates failed at the first acquire inside the wire encoder.


@pytest.mark.parametrize(
    "where",
    ["lock ttl", "timeout", "Redlock ttl", "node_timeout", "retry_delay", "max_ttl", "extend"],
)
def test_huge_int_is_a_clear_value_error(rl, cluster, where) -> None:
    """An int beyond float range is a ValueError naming the value (was OverflowError)."""
    huge = 10**400
    with pytest.raises((TypeError, ValueError)) as info:
        if where == "lock ttl":
            rl.lock("huge", ttl=huge)
        elif where == "timeout":
            rl.lock("huge").acquire(timeout=huge)
        elif where == "extend":
            lock = rl.lock("huge")
            assert lock.acquire(blocking=False)
            try:
                lock.extend(huge)
            finally:
                lock.release()
        else:
            key = {"Redlock ttl": "ttl"}.get(where, where)
            Redlock(cluster.urls, **{key: huge})
    assert "10000" in str(info.value)


def test_huge_retry_count(cluster) -> None:
    """retry_count=10**400 is refused up front, or works (was OverflowError at acquire)."""
    try:
        r = Redlock(cluster.urls, key_prefix=PREFIX, retry_count=10**400)
    except ValueError as exc:
        assert "retry_count" in str(exc)
        return
    try:
        lock = r.lock("huge-retry")
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        r.close()


@pytest.mark.parametrize("where", ["name", "key_prefix"])
def test_lone_surrogate_is_refused_up_front(cluster, clients, where) -> None:
    """A name or prefix that cannot be sent as UTF-8 is a ValueError naming it, before any
    node is contacted (was a UnicodeEncodeError from the wire encoder at acquire time)."""
    bad = "lock\ud800"
    try:
        if where == "name":
            r = Redlock(cluster.urls, key_prefix=PREFIX)
            lock = r.lock(bad)
        else:
            r = Redlock(cluster.urls, key_prefix="fuzz\ud800")
            lock = r.lock("x")
    except ValueError as exc:
        assert_clear(exc, "lock name", "key_prefix")
        return
    try:
        try:
            lock.acquire(blocking=False)
        except ValueError as exc:
            assert_clear(exc, "lock name", "key_prefix")
    finally:
        r.close()
        assert leftovers(clients) == [[], [], []]


def test_meta_with_tuple_keys_is_refused_clearly(rl, clients) -> None:
    try:
        lock = rl.lock("meta-keys", meta={(1, 2): "x"})
        lock.acquire(blocking=False)
    except TypeError as exc:
        assert_clear(exc, "meta")
    finally:
        assert leftovers(clients) == [[], [], []]


@pytest.mark.parametrize("name", ["a]b", "a\\b", "[]"])
def test_lock_info_of_names_with_glob_brackets(rl, name) -> None:
    lock = rl.lock(name)
    assert lock.acquire(blocking=False)
    try:
        assert rl.locked(name)
        info = rl.lock_info(name)
        assert info is not None and info.token == lock.token
    finally:
        lock.release()


def test_extend_by_less_than_a_millisecond_never_wedges_the_lock(rl, clients) -> None:
    name = "tiny-extend"
    lock = rl.lock(name)
    assert lock.acquire(blocking=False)
    try:
        try:
            lock.extend(1e-9)
        except ValueError as exc:
            assert_clear(exc, "ttl")
        with contextlib.suppress(LockNotOwned):
            lock.release()
        assert not rl.locked(name)
        assert leftovers(clients) == [[], [], []]
    finally:
        for c in clients:  # the wedged key has no expiry and no token: remove it by hand
            c.delete(f"{PREFIX}:lock:{name}")


@pytest.mark.parametrize(("template", "value"), [("order:{x:05d}", "abc"), ("t:{x:>5}", object())])
def test_key_template_format_spec_errors_name_the_template(template, value) -> None:
    """Regression: format() errors used to escape bare, naming neither template nor field."""
    make_key = _decorators().make_key
    with pytest.raises((TypeError, ValueError)) as info:
        make_key(template, x=value)
    assert_clear(info.value, template)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 1e306},
        {"ttl": 2147485.0, "node_timeout": 2147484.0},
        {"ttl": 9223372038.0, "node_timeout": 9223372037.0},
    ],
    ids=["ttl-1e306", "node_timeout-24d", "node_timeout-292y"],
)
def test_huge_finite_durations_are_refused_or_work(cluster, clients, kwargs) -> None:
    try:
        r = Redlock(cluster.urls, key_prefix=PREFIX, **kwargs)
    except ValueError as exc:
        assert_clear(exc, *kwargs)
        return
    try:
        lock = r.lock("huge-duration")
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        r.close()
        left = leftovers(clients)
        for c in clients:  # whatever was left has a TTL of weeks: remove it by hand
            for key in c.scan_iter(match=f"{PREFIX}:lock:*"):
                c.delete(key)
    assert left == [[], [], []]


# --------------------------------------------------------------------------- the watchdog


def test_zz_renewal_thread_survived_the_fuzz(watchdog) -> None:
    """Runs last in this module: the lock taken before the fuzz tests is still held and still
    being renewed, by a live watchdog thread."""
    r, lock = watchdog
    assert r.lost_events == [], r.lost_events
    before = r.lock_info("watchdog").renewals
    time.sleep(1.2)  # more than ttl/3 of the 3 s lease
    assert lock.held and lock.check() and lock.lost is None
    assert r.lock_info("watchdog").renewals > before
    assert any(t.name == "redlock-renewer" and t.is_alive() for t in threading.enumerate())
    # A fresh auto-renewed lock is renewed too (the thread still takes new work).
    fresh = r.lock("after-fuzz", ttl=0.3, auto_renew=True)
    assert fresh.acquire(blocking=False)
    time.sleep(0.45)
    assert fresh.held and fresh.check()
    assert r.lock_info("after-fuzz").renewals >= 1
    fresh.release()
