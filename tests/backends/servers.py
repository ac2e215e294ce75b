"""Real ZooKeeper and etcd servers for the backend tests, started from the Debian packages
(``zookeeper``, ``etcd-server``) on free loopback ports with a temporary data directory.

Without the package the fixture skips with the reason (a failure under REDLOCK_REQUIRE_ALL=1,
see tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ZOOKEEPER_JARS = "/usr/share/java"
ZOOKEEPER_CLASSPATH = [
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
    "netty-handler.jar",
    "netty-common.jar",
    "netty-buffer.jar",
    "netty-transport.jar",
    "netty-resolver.jar",
    "netty-codec.jar",
    "netty-transport-native-epoll.jar",
    "netty-transport-native-unix-common.jar",
    "metrics-core.jar",
    "snappy-java.jar",
]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    address: str
    data_dir: str

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@contextlib.contextmanager
def frozen(server: Server, timeout: float = 30.0) -> Iterator[Server]:
    """The server stopped (SIGSTOP: connections stay open, nothing is answered) until the
    block ends. Entered once every thread of it has stopped: a signal takes effect
    asynchronously, and a thread still running on another core would answer the request the
    block sends first."""
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"pid {pid} did not stop within {timeout} s")
            time.sleep(0.001)
        yield server
    finally:
        os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        with contextlib.suppress(OSError), open(stat, "rb") as fh:
            states.append(fh.read().rpartition(b")")[2].split()[0])
    return not states or all(state in (b"T", b"t") for state in states)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(server: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", server.port), 0.5),
        ):
            return
        time.sleep(0.1)
    raise RuntimeError(f"server did not listen on {server.port} within {timeout} s")


@contextlib.contextmanager
def _serving(command: list[str], port: int, address: str, data: str) -> Iterator[Server]:
    """Run ``command`` until the block ends; the data directory goes with it."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(process, port, address, data)
    try:
        _wait_for_port(server)
        yield server
    finally:
        server.kill()
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def zookeeper() -> Iterator[Server]:
    """A standalone ZooKeeper with tickTime 500 ms (sessions of 1 to 10 s allowed)."""
    java = shutil.which("java")
    jar = os.path.join(ZOOKEEPER_JARS, "zookeeper.jar")
    if java is None or not os.path.exists(jar):
        pytest.skip("ZooKeeper is not installed (Debian package 'zookeeper': java + zookeeper.jar)")
    classpath = [os.path.join(ZOOKEEPER_JARS, j) for j in ZOOKEEPER_CLASSPATH]
    classpath = [p for p in classpath if glob.glob(p)]
    data = tempfile.mkdtemp(prefix="redlock-zk-")
    port = free_port()
    command = [
        java,
        "-Dzookeeper.admin.enableServer=false",
        "-Dzookeeper.4lw.commands.whitelist=srvr,ruok",
        "-Xmx256m",
        "-cp",
        ":".join(classpath),
        "org.apache.zookeeper.server.ZooKeeperServerMain",
        str(port),
        data,
        "500",
    ]
    with _serving(command, port, f"127.0.0.1:{port}", data) as server:
        _wait_for_session(server)
        yield server


def _wait_for_session(server: Server, timeout: float = 60.0) -> None:
    """Until a client gets a session: a listening port is not yet a server that answers in a
    client's connect timeout (the JVM's warm-up on a busy host took longer than 5 s)."""
    from kazoo.client import KazooClient

    client = KazooClient(server.address, timeout=10.0)
    try:
        client.start(timeout)
        client.get_children("/")
    finally:
        client.stop()
        client.close()


@contextlib.contextmanager
def etcd() -> Iterator[Server]:
    """A single-member etcd (v3 API, JSON gateway on the client URL)."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (Debian package 'etcd-server')")
    data = tempfile.mkdtemp(prefix="redlock-etcd-")
    port, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    command = [
        binary,
        "--name",
        "redlock-test",
        "--data-dir",
        data,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"redlock-test={peer_url}",
        "--log-level",
        "error",
    ]
    with _serving(command, port, client_url, data) as server:
        _wait_for_leader(server)
        yield server


def _wait_for_leader(server: Server, timeout: float = 60.0) -> None:
    """Until the member has elected itself leader: before that, requests that need
    consensus (a lease grant) wait for the election, so the first lock of a test would take
    longer than its ttl."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            request = urllib.request.Request(
                f"{server.address}/v3/maintenance/status", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(request, timeout=2) as response:
                status = json.loads(response.read())
            if int(status.get("leader", 0)):
                return
        time.sleep(0.05)
    raise RuntimeError(f"etcd at {server.address} elected no leader within {timeout} s")
