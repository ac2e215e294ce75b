"""Added network latency for the bench: ``tc netem`` in a private network namespace when the
kernel has it, else a small delaying TCP proxy.

netem: :func:`netem_available` checks that a throw-away namespace can get a ``netem`` qdisc on
its loopback; :func:`run_in_netns` then runs a command inside such a namespace (its ``lo``
delays every packet by X ms, so each request and each reply waits X ms: RTT = 2X). The command
starts its own nodes there, so nothing outside the namespace is slowed down.

Proxy: one asyncio process listens on a loopback port per node and forwards to the node,
holding each chunk for X ms in each direction (RTT = 2X plus the proxy's own cost). It runs as
a separate process so it never competes with the measured client for the GIL. The bench
measures the real RTT through it (PING) and reports it next to the results.

Standalone: ``python bench/latency.py --delay-ms 1 --target 127.0.0.1:6379`` prints the
listening ports as one JSON line and forwards until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence

# -- tc netem in a network namespace ---------------------------------------------------------


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)


def netem_available() -> tuple[bool, str]:
    """(usable, why not). Needs root, iproute2 (``ip``, ``tc``) and the kernel's netem."""
    if os.geteuid() != 0:
        return False, "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return False, "iproute2 (ip, tc) not installed"
    ns = f"rlbench-probe-{uuid.uuid4().hex[:8]}"
    made = _run(["ip", "netns", "add", ns])
    if made.returncode != 0:
        return False, f"ip netns add: {made.stderr.strip()}"
    try:
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        q = _run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
            ]
        )
        if q.returncode != 0:
            return False, f"network namespaces work, tc netem does not: {q.stderr.strip()}"
        return True, ""
    finally:
        _run(["ip", "netns", "del", ns])


def run_in_netns(argv: Sequence[str], delay_ms: float, timeout: float) -> int:
    """Run ``argv`` in a fresh namespace whose loopback delays each packet by ``delay_ms``."""
    ns = f"rlbench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = _run(["ip", "netns", "add", ns])
    if made.returncode != 0:
        raise RuntimeError(f"ip netns add: {made.stderr.strip()}")
    try:
        for cmd in (
            ["ip", "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", f"{delay_ms}ms"],
        ):
            r = _run(["ip", "netns", "exec", ns, *cmd])
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        return subprocess.run(["ip", "netns", "exec", ns, *argv], timeout=timeout).returncode
    finally:
        _run(["ip", "netns", "del", ns])


# -- the delaying proxy ----------------------------------------------------------------------


class _Side(asyncio.Protocol):
    """One end of a proxied connection: what it receives is written to ``peer`` ``delay``
    seconds later (a timer per chunk, so order is kept and nothing waits in a task)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # received before the other end was connected
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.early.append(data)
            return
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + self.delay, self.peer.write, data)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + self.delay, peer.transport.close)


async def _serve(targets: list[tuple[str, int]], delay: float, host: str) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for t_host, t_port in targets:

        def client_side(t_host: str = t_host, t_port: int = t_port) -> _Side:
            side = _Side(delay)

            async def connect() -> None:
                try:
                    _, up = await loop.create_connection(lambda: _Side(delay), t_host, t_port)
                except OSError:
                    if side.transport is not None:
                        side.transport.close()
                    return
                up.peer, side.peer = side, up
                for chunk in side.early:
                    side.data_received(chunk)
                side.early.clear()

            side.connecting = loop.create_task(connect())  # keep a reference until it ran
            return side

        servers.append(await loop.create_server(client_side, host, 0))
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps({"ports": ports}), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


class DelayProxy:
    """A proxy process in front of ``targets`` adding ``delay_ms`` each way; ``ports`` in order."""

    def __init__(
        self, targets: Sequence[tuple[str, int]], delay_ms: float, host: str = "127.0.0.1"
    ) -> None:
        args = [
            sys.executable,
            os.path.abspath(__file__),
            "--delay-ms",
            str(delay_ms),
            "--host",
            host,
        ]
        for h, p in targets:
            args += ["--target", f"{h}:{p}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.close()
            raise RuntimeError("the delaying proxy did not start")
        self.ports: list[int] = json.loads(line)["ports"]
        self.host = host

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, required=True, help="delay per direction")
    p.add_argument("--target", action="append", required=True, help="host:port, repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    a = p.parse_args(argv)
    targets = [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in a.target]
    asyncio.run(_serve(targets, a.delay_ms / 1000, a.host))


if __name__ == "__main__":
    main()
