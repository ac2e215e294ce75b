"""TLS options on every connection the package opens, against real TLS redis-server processes.

redis-py's meaning of each option is the contract: a server whose certificate names another
host is refused by default (lock connections, ``health()`` and ``live_locks()`` alike, sync and
async) and accepted with ``ssl_check_hostname=False``; ``ssl_min_version``, ``ssl_ciphers``,
``ssl_ca_data``, ``ssl_ca_path``, client certificates and ``ssl_password`` each change what
connects; an option the package cannot honour is refused when the nodes are configured.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest
from test_security import Pki, _free_port, _tls_binary

from django_redlock import QuorumError, Redlock
from django_redlock.core.asyncio import AsyncRedlock
from django_redlock.testing import RedisNode

NODE_TIMEOUT = 2.0  # TLS handshakes on a loaded machine (a refusal comes at once)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("tls-pki"))


def _tls_node(pki: Pki, cert: tuple[str, str], *extra: str) -> tuple[RedisNode, int]:
    port = _free_port()
    node = RedisNode(
        binary=_tls_binary(),
        extra_args=[
            "--tls-port",
            str(port),
            "--tls-cert-file",
            cert[0],
            "--tls-key-file",
            cert[1],
            "--tls-ca-cert-file",
            pki.ca_file,
            *extra,
        ],
    )
    return node, port


@pytest.fixture(scope="module")
def wrong_host(pki):
    """Three TLS nodes on 127.0.0.1 whose certificate (from a trusted CA) names another host."""
    cert = pki.issue("elsewhere", server=True, names=["db.elsewhere.example"])
    started = []
    try:
        for _ in range(3):
            started.append(_tls_node(pki, cert, "--tls-auth-clients", "no"))
        yield [port for _, port in started]
    finally:
        for node, _ in started:
            node.stop()


@pytest.fixture(scope="module")
def tls12(pki):
    """One TLS node that speaks TLS 1.2 only, with one cipher suite."""
    node, port = _tls_node(
        pki,
        pki.issue("tls12", server=True),
        "--tls-auth-clients",
        "no",
        "--tls-protocols",
        "TLSv1.2",
        "--tls-ciphers",
        "ECDHE-ECDSA-AES128-GCM-SHA256",
    )
    try:
        yield port
    finally:
        node.stop()


@pytest.fixture(scope="module")
def mutual(pki):
    """One TLS node that requires a client certificate from the CA."""
    node, port = _tls_node(pki, pki.issue("mutual", server=True), "--tls-auth-clients", "yes")
    try:
        yield port
    finally:
        node.stop()


def _specs(ports: list[int], **options) -> list[dict]:
    return [{"URL": f"rediss://127.0.0.1:{p}/0", "OPTIONS": dict(options)} for p in ports]


def _works(specs: list[dict]) -> None:
    """A full lock cycle, ``live_locks`` and ``health`` succeed, sync and async."""
    rl = Redlock(specs, node_timeout=NODE_TIMEOUT, ttl=30.0)
    try:
        lock = rl.lock("tls")
        assert lock.acquire(blocking=False) is True
        assert [i.name for i in rl.live_locks()] == ["tls"]
        lock.release()
        assert all(h.reachable for h in rl.health())
    finally:
        rl.close()

    async def main() -> None:
        arl = AsyncRedlock(specs, node_timeout=NODE_TIMEOUT)
        try:
            lock = arl.lock("tls-async")
            assert await lock.acquire(blocking=False) is True
            assert [i.name for i in await arl.live_locks()] == ["tls-async"]
            await lock.release()
            health = await arl.health()
            assert all(h.reachable for h in health), health
        finally:
            await arl.close()

    asyncio.run(main())


def _refused(specs: list[dict], *why: str) -> None:
    """Every connection is refused, sync and async: acquire fails on every node (the reason
    names one of ``why``), ``health`` reports every node unreachable, and ``live_locks``
    reads nothing from them (a lock held there is not listed)."""

    def named(failures: dict[str, str]) -> None:
        assert len(failures) == len(specs), failures
        for reason in failures.values():
            assert any(w.lower() in reason.lower() for w in why), failures

    rl = Redlock(specs, node_timeout=NODE_TIMEOUT)
    try:
        with pytest.raises(QuorumError) as info:
            rl.lock("tls").acquire(blocking=False)
        named(info.value.failures)
        assert not any(h.reachable for h in rl.health())
        assert list(rl.live_locks()) == []
    finally:
        rl.close()

    async def main() -> None:
        arl = AsyncRedlock(specs, node_timeout=NODE_TIMEOUT)
        try:
            with pytest.raises(QuorumError) as info:
                await arl.lock("tls-async").acquire(blocking=False)
            named(info.value.failures)
            assert not any(h.reachable for h in await arl.health())
            assert await arl.live_locks() == []
        finally:
            await arl.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- hostname


def test_a_certificate_for_another_host_is_refused_by_default(wrong_host, pki) -> None:
    holder = Redlock(
        _specs(wrong_host, ssl_ca_certs=pki.ca_file, ssl_check_hostname=False),
        node_timeout=NODE_TIMEOUT,
    )
    try:
        held = holder.lock("held-elsewhere", ttl=30)
        assert held.acquire(blocking=False)
        try:
            _refused(_specs(wrong_host, ssl_ca_certs=pki.ca_file), "match")
        finally:
            held.release()
    finally:
        holder.close()


def test_a_certificate_for_another_host_is_refused_with_cert_reqs_required(wrong_host, pki) -> None:
    _refused(_specs(wrong_host, ssl_ca_certs=pki.ca_file, ssl_cert_reqs="required"), "match")


def test_ssl_check_hostname_false_accepts_it(wrong_host, pki) -> None:
    _works(_specs(wrong_host, ssl_ca_certs=pki.ca_file, ssl_check_hostname=False))


def test_ssl_check_hostname_in_the_url_is_read_as_redis_py_reads_it(wrong_host, pki) -> None:
    urls = [
        f"rediss://127.0.0.1:{p}/0?ssl_check_hostname=false&ssl_ca_certs={pki.ca_file}"
        for p in wrong_host
    ]
    _works([{"URL": u, "OPTIONS": {}} for u in urls])
    refused = [f"rediss://127.0.0.1:{p}/0?ssl_ca_certs={pki.ca_file}" for p in wrong_host]
    _refused([{"URL": u, "OPTIONS": {}} for u in refused], "match")


# --------------------------------------------------------------------------- versions, ciphers


def test_ssl_min_version_is_honoured(tls12, pki) -> None:
    _works(_specs([tls12], ssl_ca_certs=pki.ca_file))
    _refused(
        _specs([tls12], ssl_ca_certs=pki.ca_file, ssl_min_version=ssl.TLSVersion.TLSv1_3),
        "version",
        "protocol",
        "alert",
    )


def test_ssl_ciphers_is_honoured(tls12, pki) -> None:
    _works(_specs([tls12], ssl_ca_certs=pki.ca_file, ssl_ciphers="ECDHE-ECDSA-AES128-GCM-SHA256"))
    _refused(
        _specs(
            [tls12],
            ssl_ca_certs=pki.ca_file,
            ssl_ciphers="ECDHE-ECDSA-AES256-GCM-SHA384",
            ssl_min_version=ssl.TLSVersion.TLSv1_2,
        ),
        "handshake",
        "cipher",
        "alert",
    )


# --------------------------------------------------------------------------- trust anchors


def test_ssl_ca_data_is_honoured(mutual, pki, tmp_path) -> None:
    cert, key = pki.issue("client-ca-data", server=False)
    ca_pem = Path(pki.ca_file).read_text()
    _works(_specs([mutual], ssl_ca_data=ca_pem, ssl_certfile=cert, ssl_keyfile=key))
    other = Path(Pki(tmp_path, "Other CA").ca_file).read_text()
    _refused(
        _specs([mutual], ssl_ca_data=other, ssl_certfile=cert, ssl_keyfile=key),
        "certificate verify failed",
    )


def test_ssl_ca_path_is_honoured(mutual, pki, tmp_path) -> None:
    cert, key = pki.issue("client-ca-path", server=False)
    # No CA at all: the system store does not know the test CA.
    _refused(_specs([mutual], ssl_certfile=cert, ssl_keyfile=key), "certificate verify failed")
    ca_dir = tmp_path / "cas"
    ca_dir.mkdir()
    digest = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", pki.ca_file],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (ca_dir / f"{digest}.0").write_text(Path(pki.ca_file).read_text())
    _works(_specs([mutual], ssl_ca_path=str(ca_dir), ssl_certfile=cert, ssl_keyfile=key))


# --------------------------------------------------------------------------- client certificates


def test_client_certificate_is_sent(mutual, pki) -> None:
    cert, key = pki.issue("client-plain", server=False)
    _works(_specs([mutual], ssl_ca_certs=pki.ca_file, ssl_certfile=cert, ssl_keyfile=key))
    # Without one, the server ends the handshake (TLS 1.3: at the first read).
    _refused(
        _specs([mutual], ssl_ca_certs=pki.ca_file), "certificate", "alert", "closed", "reset", "EOF"
    )


def test_ssl_password_unlocks_an_encrypted_client_key(mutual, pki) -> None:
    cert, key = pki.issue("client-encrypted", server=False, password="k3y-pa55")
    options = {"ssl_ca_certs": pki.ca_file, "ssl_certfile": cert, "ssl_keyfile": key}
    _works(_specs([mutual], ssl_password="k3y-pa55", **options))
    _refused(_specs([mutual], ssl_password="wrong", **options), "decrypt", "password", "PEM")


# --------------------------------------------------------------------------- refused options


@pytest.mark.parametrize(
    ("option", "value"),
    [("protocol", 3), ("not_an_option", 1)],
)
def test_an_option_the_lock_connections_cannot_honour_is_refused(option, value) -> None:
    spec = {"URL": "rediss://127.0.0.1:6399/0", "OPTIONS": {option: value}}
    with pytest.raises(ValueError, match=option):
        Redlock([spec])
    with pytest.raises(ValueError, match=option):
        AsyncRedlock([spec])


def test_ocsp_is_refused_for_the_asyncio_client() -> None:
    """redis-py's asyncio connections have no OCSP validation: asking for it is an error
    there, not a silently unchecked certificate."""
    spec = {"URL": "rediss://127.0.0.1:6399/0", "OPTIONS": {"ssl_validate_ocsp": True}}
    with pytest.raises(ValueError, match="ssl_validate_ocsp"):
        AsyncRedlock([spec])


def test_a_client_lends_its_tls_options(wrong_host, pki) -> None:
    """A node given as a ``redis.Redis`` keeps every TLS option of its pool (not only the
    credentials): the hostname check stays on."""
    import redis

    clients = [
        redis.Redis(host="127.0.0.1", port=p, ssl=True, ssl_ca_certs=pki.ca_file)
        for p in wrong_host
    ]
    rl = Redlock(clients, node_timeout=NODE_TIMEOUT)
    try:
        with pytest.raises(QuorumError) as info:
            rl.lock("tls").acquire(blocking=False)
        assert all("match" in why for why in info.value.failures.values()), info.value
    finally:
        rl.close()
        for client in clients:
            client.close()


class _OwnTLS(__import__("redis").connection.SSLConnection):
    """A project's own TLS connection class (a subclass keeps TLS)."""


@pytest.mark.parametrize(
    ("url", "options", "error", "said"),
    [
        # A plain class on a rediss:// URL would reach the node in plain text.
        (
            "rediss://127.0.0.1:6399/0",
            {"connection_class": "Connection"},
            ValueError,
            ["'connection_class'", "redis.connection.Connection", "rediss://", "plain text"],
        ),
        (
            "redis://127.0.0.1:6399/0",
            {"ssl": True, "connection_class": "Connection"},
            ValueError,
            ["'connection_class'", "redis.connection.Connection", '"ssl": True'],
        ),
        (
            "unix:///tmp/redlock-none.sock",
            {"connection_class": "Connection"},
            ValueError,
            ["'connection_class'", "redis.connection.Connection", "unix://"],
        ),
        (
            "rediss://127.0.0.1:6399/0",
            {"ssl": False},
            ValueError,
            ['"ssl": False', "rediss://", "redis://"],
        ),
        ("redis://127.0.0.1:6399/0", {"ssl": "yes"}, TypeError, ["'ssl'", "'yes'"]),
        ("unix:///tmp/redlock-none.sock", {"ssl": True}, ValueError, ['"ssl": True', "unix://"]),
        # The hint fits the URL: a rediss:// URL's plain class, a group's "ssl": True.
        (
            "rediss://127.0.0.1:6399/0",
            {"connection_class": "Connection", "ssl_ca_certs": "/x"},
            ValueError,
            ["'connection_class'", "plain text"],
        ),
        (
            "redis+sentinel://127.0.0.1:26399/svc/0",
            {"ssl_ca_certs": "/x"},
            ValueError,
            ["'ssl_ca_certs'", '"ssl": True'],
        ),
        (
            "redis://127.0.0.1:6399/0",
            {"ssl_ca_certs": "/x"},
            ValueError,
            ["'ssl_ca_certs'", "rediss://"],
        ),
    ],
)
def test_a_connection_that_would_not_be_what_the_url_says_is_refused(
    url, options, error, said
) -> None:
    """README: rediss:// is TLS, hostname verified, and an option the package cannot honour
    is refused, never ignored. A plain connection class on a rediss:// node spoke plain text
    while health() showed rediss://; ``ssl: False`` there was ignored."""
    import redis

    if options.get("connection_class") == "Connection":
        options = {**options, "connection_class": redis.Connection}
    spec = {"URL": url, "OPTIONS": options}
    for client in (Redlock, AsyncRedlock):
        with pytest.raises(error) as info:
            client([spec])
        for text in said:
            assert text in str(info.value), (client, info.value)
        assert "needs a rediss:// URL" not in str(info.value) or not url.startswith("rediss")


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("rediss://127.0.0.1:6399/0", {"connection_class": _OwnTLS}),
        ("rediss://127.0.0.1:6399/0", {"ssl": True}),
        ("redis://127.0.0.1:6399/0", {"ssl": True, "connection_class": _OwnTLS}),
        ("redis://127.0.0.1:6399/0", {"ssl": False}),
        ("redis+sentinel://127.0.0.1:26399/svc/0", {"ssl": True, "ssl_ca_certs": "/x"}),
    ],
)
def test_tls_options_that_agree_with_the_url_are_taken(url, options) -> None:
    rl = Redlock([{"URL": url, "OPTIONS": options}])
    rl.close()


def test_a_tls_subclass_on_a_rediss_node_still_checks_the_hostname(wrong_host, pki) -> None:
    _refused(_specs(wrong_host, ssl_ca_certs=pki.ca_file, connection_class=_OwnTLS), "match")
