"""Credentials, ACLs, TLS and key-prefix isolation, on real redis-server processes.

* ACL users and ``requirepass``: the right credentials lock; a wrong password, a missing one,
  or a user whose key pattern does not cover the lock keys make ``acquire`` raise
  :class:`QuorumError` naming ``auth`` for every node, without leaking the password.
* TLS: nodes listening on ``rediss://`` with certificates generated here (a private CA, a
  server certificate for 127.0.0.1, optionally client certificates); CA verification on. A
  client that trusts another CA is refused with a clear certificate error.
* Prefixes: two Redlocks with different ``key_prefix`` on the same nodes do not see each
  other's locks.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
from pathlib import Path

import pytest

from django_redlock import AsyncRedlock, QuorumError, Redlock
from django_redlock.testing import RedisCluster, RedisNode, tls_redis_server_binary

PASSWORD = "s3cr3t-Pa55"
NODE_TIMEOUT = 0.2  # ACL/TLS handshakes on a loaded machine


def _cluster(n: int = 3, **kwargs) -> RedisCluster:
    return RedisCluster(n, **kwargs)


def _urls(cluster: RedisCluster, userinfo: str) -> list[str]:
    return [f"redis://{userinfo}@127.0.0.1:{node.port}/0" for node in cluster]


def _cycle(rl: Redlock, name: str = "secure") -> None:
    lock = rl.lock(name)
    assert lock.acquire(blocking=False) is True
    try:
        assert lock.check() and rl.locked(name)
        assert [i.name for i in rl.live_locks()] == [name]
    finally:
        lock.release()
    assert not rl.locked(name)


def _auth_refused(rl: Redlock, cluster: RedisCluster, *secrets: str) -> QuorumError:
    lock = rl.lock("secure")
    with pytest.raises(QuorumError) as info:
        lock.acquire(blocking=False)
    err = info.value
    assert len(err.failures) == len(cluster), err.failures
    for why in err.failures.values():
        assert why.startswith("auth"), err.failures
    text = str(err)
    assert "auth" in text and "could answer" in text, text
    for secret in secrets:  # credentials never appear in errors (URLs are redacted)
        assert secret not in text, text
    assert not lock.held
    return err


# --------------------------------------------------------------------------- ACL users


ACL_LOCKER = ["--user", "locker", "on", f">{PASSWORD}", "~redlock:*", "&*", "+@all"]
ACL_OTHER = ["--user", "other", "on", f">{PASSWORD}", "~elsewhere:*", "&*", "+@all"]
ACL_NOEVAL = [
    *["--user", "noeval", "on", f">{PASSWORD}", "~redlock:*", "&*", "+@all"],
    *["-eval", "-evalsha"],
]


@pytest.fixture(scope="module")
def acl_cluster():
    with _cluster(3, extra_args=[*ACL_LOCKER, *ACL_OTHER, *ACL_NOEVAL]) as cluster:
        yield cluster


def test_acl_user_with_the_right_password_locks(acl_cluster) -> None:
    rl = Redlock(_urls(acl_cluster, f"locker:{PASSWORD}"), node_timeout=NODE_TIMEOUT)
    try:
        _cycle(rl)
        # The node names used in errors, logs and the admin never carry the credentials.
        assert all(PASSWORD not in n.name and "locker" not in n.name for n in rl.nodes)
        assert all(h.reachable for h in rl.health())
    finally:
        rl.close()


def test_acl_user_with_a_wrong_password_is_refused_on_every_node(acl_cluster) -> None:
    rl = Redlock(_urls(acl_cluster, "locker:not-the-password"), node_timeout=NODE_TIMEOUT)
    try:
        err = _auth_refused(rl, acl_cluster, "not-the-password")
        assert any("WRONGPASS" in why or "invalid" in why for why in err.failures.values())
    finally:
        rl.close()


def test_unknown_acl_user_is_refused(acl_cluster) -> None:
    rl = Redlock(_urls(acl_cluster, f"nobody:{PASSWORD}"), node_timeout=NODE_TIMEOUT)
    try:
        _auth_refused(rl, acl_cluster, PASSWORD)
    finally:
        rl.close()


def test_acl_user_restricted_to_other_keys_gets_noperm(acl_cluster) -> None:
    """Authenticated, but the lock keys (redlock:*) are outside the user's key pattern: the
    script is refused with NOPERM, reported as auth, and nothing is written."""
    rl = Redlock(_urls(acl_cluster, f"other:{PASSWORD}"), node_timeout=NODE_TIMEOUT)
    try:
        err = _auth_refused(rl, acl_cluster, PASSWORD)
        assert all("NOPERM" in why for why in err.failures.values()), err.failures
    finally:
        rl.close()
    for node in acl_cluster:
        with node.client(username="locker", password=PASSWORD, socket_timeout=5) as c:
            assert c.keys("redlock:lock:*") == []


@pytest.mark.parametrize(("user", "refused"), [("noeval", "EVAL"), ("other", "redlock:lock:*")])
def test_health_names_a_node_whose_user_cannot_run_the_lock_scripts(
    acl_cluster, user: str, refused: str
) -> None:
    """A user that may not run EVAL/EVALSHA, or not on the lock keys, never votes: health()
    calls its nodes down and says why, sync and async alike."""
    rl = Redlock(_urls(acl_cluster, f"{user}:{PASSWORD}"), node_timeout=NODE_TIMEOUT)
    try:
        health = rl.health()
    finally:
        rl.close()
    assert [h.status for h in health] == ["down"] * 3
    assert all("NOPERM" in h.error and refused in h.error for h in health), health

    async def probe() -> list:
        arl = AsyncRedlock(_urls(acl_cluster, f"{user}:{PASSWORD}"), node_timeout=NODE_TIMEOUT)
        try:
            return await arl.health()
        finally:
            await arl.close()

    health = asyncio.run(probe())
    assert [h.status for h in health] == ["down"] * 3
    assert all("NOPERM" in h.error and refused in h.error for h in health), health


def test_acl_user_restricted_to_the_prefix_works_with_a_matching_prefix(acl_cluster) -> None:
    """A user limited to ``elsewhere:*`` locks fine once the Redlock uses that prefix."""
    rl = Redlock(
        _urls(acl_cluster, f"other:{PASSWORD}"), key_prefix="elsewhere", node_timeout=NODE_TIMEOUT
    )
    try:
        _cycle(rl)
    finally:
        rl.close()


# --------------------------------------------------------------------------- requirepass


@pytest.fixture(scope="module")
def password_cluster():
    with _cluster(3, password=PASSWORD) as cluster:
        yield cluster


def test_requirepass_with_the_password_locks(password_cluster) -> None:
    rl = Redlock(list(password_cluster.urls), node_timeout=NODE_TIMEOUT)
    try:
        _cycle(rl)
    finally:
        rl.close()


def test_requirepass_with_a_wrong_password(password_cluster) -> None:
    rl = Redlock(_urls(password_cluster, ":wrong-one"), node_timeout=NODE_TIMEOUT)
    try:
        _auth_refused(rl, password_cluster, "wrong-one")
    finally:
        rl.close()


def test_requirepass_without_a_password(password_cluster) -> None:
    rl = Redlock(
        [f"redis://127.0.0.1:{n.port}/0" for n in password_cluster], node_timeout=NODE_TIMEOUT
    )
    try:
        err = _auth_refused(rl, password_cluster)
        assert all("Authentication required" in why for why in err.failures.values()), err.failures
    finally:
        rl.close()


def test_password_in_options_instead_of_the_url(password_cluster) -> None:
    nodes = [
        {"URL": f"redis://127.0.0.1:{n.port}/0", "OPTIONS": {"password": PASSWORD}}
        for n in password_cluster
    ]
    rl = Redlock(nodes, node_timeout=NODE_TIMEOUT)
    try:
        _cycle(rl)
    finally:
        rl.close()


def test_a_password_in_the_url_query_locks_and_is_never_shown(password_cluster) -> None:
    from django_redlock.core import redact

    urls = [f"redis://127.0.0.1:{n.port}/0?password={PASSWORD}" for n in password_cluster]
    rl = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        _cycle(rl)
        assert all(PASSWORD not in repr(h) for h in rl.health())
        assert PASSWORD not in repr(rl)
    finally:
        rl.close()
    wrong = [f"redis://127.0.0.1:{n.port}/0?password=wrong-one" for n in password_cluster]
    rl = Redlock(wrong, node_timeout=NODE_TIMEOUT)
    try:
        _auth_refused(rl, password_cluster, "wrong-one")
        assert all("wrong-one" not in repr(h) for h in rl.health())
    finally:
        rl.close()
    shown = redact(f"redis://127.0.0.1:6379/0?ssl_password=key-pw&password={PASSWORD}&db=2")
    assert PASSWORD not in shown and "key-pw" not in shown and "db=2" in shown, shown


@pytest.mark.parametrize(
    "url",
    [
        f"redis://127.0.0.1:6379/0?pasword={PASSWORD}",
        f"redis://127.0.0.1:6379/0?PASSWORD={PASSWORD}",
        f"redis+sentinel://127.0.0.1:26379/mymaster/0?pasword={PASSWORD}",
    ],
)
def test_a_mistyped_password_option_is_refused_without_showing_it(settings, url) -> None:
    # The refusal names the option; the value, whatever its name, is never printed.
    from django_redlock.checks import check_settings

    with pytest.raises(ValueError) as refused:
        Redlock([url])
    assert "PASSWORD" in str(refused.value).upper().replace("PASWORD", "PASSWORD")
    assert PASSWORD not in str(refused.value)
    settings.REDLOCK = {"NODES": [url, "redis://10.0.0.2:6379/0", "redis://10.0.0.3:6379/0"]}
    found = check_settings(None)
    assert [m.id for m in found] == ["django_redlock.E004"]
    assert all(PASSWORD not in f"{m.msg} {m.hint}" for m in found)


# --------------------------------------------------------------------------- TLS


def _tls_binary() -> str:
    """A redis-server built with TLS: ``$REDLOCK_TLS_REDIS_SERVER``, else the first on PATH
    (``.ci/run`` installs Debian's when there is none; the wheels' servers have no TLS)."""
    binary = tls_redis_server_binary()
    if binary is None:
        pytest.skip(
            "no redis-server built with TLS on PATH (install e.g. Debian's redis-server, or "
            "set REDLOCK_TLS_REDIS_SERVER)"
        )
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pki:
    """A private CA plus certificates it signs, written as PEM files into ``directory``."""

    def __init__(self, directory: Path, name: str = "Test CA") -> None:
        x509 = pytest.importorskip("cryptography.x509")
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ser, self._ec, self._oid = (
            x509,
            hashes,
            serialization,
            ec,
            NameOID,
        )
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            # Key identifiers: Python 3.13's default context verifies with X509_STRICT, which
            # refuses certificates without an Authority Key Identifier.
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_file = self._write("ca.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    def _write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def issue(
        self,
        name: str,
        *,
        server: bool,
        names: list[str] | None = None,
        password: str | None = None,
    ) -> tuple[str, str]:
        """(cert file, key file) for ``name``. A server certificate covers 127.0.0.1 and
        localhost, or only the DNS ``names`` given; ``password`` encrypts the key file."""
        x509, oid = self._x509, self._oid
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [
                        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
                        if server
                        else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
                    ]
                ),
                critical=False,
            )
        )
        if server:
            alt: list[x509.GeneralName] = (
                [x509.DNSName(n) for n in names]
                if names
                else [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            )
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(self.key, self._hashes.SHA256())
        enc = self._ser.Encoding.PEM
        encryption = (
            self._ser.BestAvailableEncryption(password.encode())
            if password
            else self._ser.NoEncryption()
        )
        key_pem = key.private_bytes(enc, self._ser.PrivateFormat.PKCS8, encryption)
        return (
            self._write(f"{name}.crt", cert.public_bytes(enc)),
            self._write(f"{name}.key", key_pem),
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module", params=["server-auth", "mutual-tls"])
def tls_nodes(request, pki):
    """Three TLS nodes: ``(nodes, tls ports, client options)``. The plain port stays open for
    the harness's readiness probe; the lock client only uses the TLS port."""
    binary = _tls_binary()
    cert, key = pki.issue("redis-server", server=True)
    mutual = request.param == "mutual-tls"
    nodes, ports = [], []
    try:
        for _ in range(3):
            port = _free_port()
            nodes.append(
                RedisNode(
                    binary=binary,
                    extra_args=[
                        "--tls-port",
                        str(port),
                        "--tls-cert-file",
                        cert,
                        "--tls-key-file",
                        key,
                        "--tls-ca-cert-file",
                        pki.ca_file,
                        "--tls-auth-clients",
                        "yes" if mutual else "no",
                    ],
                )
            )
            ports.append(port)
        options = {"ssl_ca_certs": pki.ca_file, "ssl_cert_reqs": "required"}
        if mutual:
            client_cert, client_key = pki.issue("redlock-client", server=False)
            options.update(ssl_certfile=client_cert, ssl_keyfile=client_key)
        yield nodes, ports, options
    finally:
        for node in nodes:
            node.stop()


def _tls_specs(ports: list[int], options: dict) -> list[dict]:
    return [{"URL": f"rediss://127.0.0.1:{p}/0", "OPTIONS": dict(options)} for p in ports]


def test_tls_nodes_lock_and_release(tls_nodes) -> None:
    nodes, ports, options = tls_nodes
    rl = Redlock(_tls_specs(ports, options), node_timeout=NODE_TIMEOUT)
    try:
        _cycle(rl, "over-tls")
        fenced = rl.lock("over-tls-fenced", fencing=True, auto_renew=True, ttl=1.0)
        assert fenced.acquire(blocking=False) and fenced.fence
        assert fenced.extend() is True
        fenced.release()
        assert all(h.reachable for h in rl.health())
    finally:
        rl.close()
    assert all(node.running for node in nodes)


def test_tls_with_an_untrusted_ca_is_refused_clearly(tls_nodes, tmp_path) -> None:
    _, ports, options = tls_nodes
    other = Pki(tmp_path, "Some Other CA")
    rl = Redlock(
        _tls_specs(ports, {**options, "ssl_ca_certs": other.ca_file}), node_timeout=NODE_TIMEOUT
    )
    try:
        with pytest.raises(QuorumError) as info:
            rl.lock("over-tls").acquire(blocking=False)
        assert len(info.value.failures) == 3
        assert "certificate verify failed" in str(info.value), str(info.value)
    finally:
        rl.close()


def test_plain_text_client_on_a_tls_port_fails_closed(tls_nodes) -> None:
    _, ports, _ = tls_nodes
    rl = Redlock([f"redis://127.0.0.1:{p}/0" for p in ports], node_timeout=NODE_TIMEOUT)
    try:
        with pytest.raises(QuorumError):
            rl.lock("plain").acquire(blocking=False)
    finally:
        rl.close()


# --------------------------------------------------------------------------- key prefixes


@pytest.fixture
def two_prefixes(redis_nodes):
    a = Redlock(list(redis_nodes.urls), key_prefix="app1")
    b = Redlock(list(redis_nodes.urls), key_prefix="app2")
    yield a, b
    a.close()
    b.close()


def test_key_prefixes_isolate_locks(two_prefixes) -> None:
    a, b = two_prefixes
    la, lb = a.lock("shared-name"), b.lock("shared-name")
    assert la.acquire(blocking=False) and lb.acquire(blocking=False)  # independent
    try:
        assert [i.name for i in a.live_locks()] == ["shared-name"]
        assert [i.token for i in a.live_locks()] == [la.token]
        assert [i.token for i in b.live_locks()] == [lb.token]
        only_a = a.lock("only-a")
        assert only_a.acquire(blocking=False)
        assert a.locked("only-a") and not b.locked("only-a")
        assert b.lock_info("only-a") is None
        assert [i.name for i in b.live_locks()] == ["shared-name"]
        # An operator's force-release under one prefix never touches the other.
        assert b.force_release("only-a") == 0
        assert only_a.check()
        only_a.release()
    finally:
        la.release()
        lb.release()
    assert list(a.live_locks()) == [] and list(b.live_locks()) == []


def test_nested_key_prefixes_are_refused(redis_nodes) -> None:
    """Regression: prefix 'iso:lock' used to share the key space of prefix 'iso' (lock 'x' of
    one and lock 'lock:x' of the other were the same key 'iso:lock:lock:x', and the marker
    'iso:lock:node' looked like a held lock 'node' of 'iso'). A ':' in a prefix is refused."""
    with pytest.raises(ValueError, match="key_prefix"):
        Redlock(list(redis_nodes.urls), key_prefix="iso:lock")
    outer = Redlock(list(redis_nodes.urls), key_prefix="iso")
    try:
        mine = outer.lock("lock:x")
        assert mine.acquire(blocking=False)
        assert [i.name for i in outer.live_locks()] == ["lock:x"]
        mine.release()
    finally:
        outer.close()
