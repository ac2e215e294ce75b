"""A user-space TCP proxy that delays traffic and emulates what packet loss does to a TCP stream.

Why not drop packets: on loopback, with no ``tc netem`` in the kernel, a user-space proxy sees
a byte stream, not segments. Bytes it "dropped" would simply be gone (TCP never retransmits
what the proxy already acknowledged), which is data corruption, not loss. What loss really
does to a TCP connection is make the data arrive *late*, in order, after the sender's
retransmission timer fires. That is what this proxy reproduces.

The model, per connection and per direction (client -> node, node -> client):

* **Chunks stand for segments.** Each ``recv()`` on the incoming side (up to 64 KiB; on
  loopback the MSS is about 64 KiB, so one request or one reply is one segment) is one
  chunk.
* **Delay.** Every chunk is forwarded ``delay`` seconds after it arrived (one-way latency).
* **Loss = a retransmission timeout.** With probability ``loss`` a chunk is "lost": it is held
  back for one RTO more, first :data:`RTO_MIN` (200 ms, Linux's minimum RTO, which is what a
  sub-millisecond path gets). The retransmission itself is lost with the same probability,
  and each further loss doubles the RTO (exponential backoff, capped at :data:`RTO_MAX`).
  Fast retransmit does not rescue request/reply traffic: it needs three duplicate ACKs, so
  more segments in flight behind the lost one, and with a single segment in flight Linux's
  tail-loss probe waits 2 x SRTT + 200 ms, i.e. an RTO as well.
* **In order, head-of-line blocking.** A chunk is never forwarded before the chunk in front of
  it in the same direction: a late chunk holds up everything sent after it on that
  connection (the receiver's TCP buffers out-of-order data until the hole is filled). The
  other direction, and other connections, are not held up.
* **Not modelled:** connection setup (SYN loss would cost 1 s; the clients under test keep
  their connections), congestion-window shrinking after a loss (it matters for bulk
  transfers, not for one-segment requests), and the sender's own timers (a client's socket
  timeout still fires when the proxy holds a reply back: that is the point).

So ``loss=0.15`` means: each request, and independently each reply, is 200 ms late (or
600 ms, 1.4 s... on repeated loss) with probability 0.15, so about 28 % of round trips pay at
least one RTO.

Two ways to run it:

* :class:`LossyProxy` in the current process (an asyncio loop on a thread of its own), for
  small tests;
* :class:`ProxyProcess`, one child process holding a proxy per upstream, steered over its
  stdin (``set LOSS DELAY``); it exits when its stdin closes, so it never outlives the
  process that started it. The bench uses this one: the proxy then competes for CPU like a
  network hop, not for the measured client's interpreter lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RTO_MAX", "RTO_MIN", "LinkStats", "LossyProxy", "ProxyProcess", "late_by"]

#: Linux's minimum retransmission timeout (TCP_RTO_MIN), what a sub-millisecond path gets.
RTO_MIN = 0.2
#: Linux's cap on the backed-off retransmission timeout (TCP_RTO_MAX).
RTO_MAX = 120.0
#: Chunk size read from a socket at once.
CHUNK = 65536


def check_link(loss: float, delay: float) -> tuple[float, float]:
    """Validate a link setting: loss in [0, 1), delay >= 0 seconds."""
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise TypeError(f"loss must be a number in [0, 1), got {loss!r}")
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        raise TypeError(f"delay must be a number of seconds >= 0, got {delay!r}")
    if not 0 <= loss < 1:
        raise ValueError(f"loss must be in [0, 1) (1 would never deliver), got {loss!r}")
    if not 0 <= delay < 60:
        raise ValueError(f"delay must be >= 0 and < 60 seconds, got {delay!r}")
    return float(loss), float(delay)


def late_by(rng: random.Random, loss: float) -> tuple[float, int]:
    """(seconds a chunk is held back for lost transmissions, how many were lost)."""
    extra, rto, lost = 0.0, RTO_MIN, 0
    while rng.random() < loss:
        extra += rto
        rto = min(rto * 2, RTO_MAX)
        lost += 1
    return extra, lost


@dataclass
class LinkStats:
    """What the proxy did so far (all connections, both directions)."""

    chunks: int = 0  #: chunks forwarded
    lost: int = 0  #: transmissions counted as lost (each cost one RTO)
    held_back: int = 0  #: chunks that were late because of a loss (theirs or one in front)
    connections: int = 0  #: connections accepted


class LossyProxy:
    """Proxies to ``upstream`` on a free loopback port, with ``loss`` and ``delay`` (settable at
    any time; they apply to chunks that arrive from then on)."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        loss: float = 0.0,
        delay: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.upstream = upstream
        self.loss, self.delay = check_link(loss, delay)
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        #: Client requests to hold back whatever the loss (see :meth:`hold`).
        self._holds: list[tuple[bytes, float]] = []
        self._holds_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if not self.port:
            raise RuntimeError(f"lossy proxy to {upstream} did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set_link(self, loss: float, delay: float) -> None:
        self.loss, self.delay = check_link(loss, delay)

    def hold(self, match: bytes, count: int, seconds: float) -> None:
        """Hold back the next ``count`` chunks from the client that contain ``match`` by
        ``seconds`` more (each on its own connection, say, a command and its copies): a test
        decides which requests are lost, where :meth:`set_link`'s loss draws them."""
        with self._holds_lock:
            self._holds.extend([(match, seconds)] * count)

    def _held(self, data: bytes) -> float:
        """How long :meth:`hold` holds ``data`` back (0 when it asked for nothing of it)."""
        with self._holds_lock:
            for i, (match, seconds) in enumerate(self._holds):
                if match in data:
                    del self._holds[i]
                    return seconds
        return 0.0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            node_r, node_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers.update((client_w, node_w))
        for r, w, upstream in ((client_r, node_w, True), (node_r, client_w, False)):
            task = asyncio.ensure_future(self._direction(r, w, upstream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _direction(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool
    ) -> None:
        """Read chunks as they come and forward each at its delivery time, in order
        (``upstream``: from the client to the node)."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.ensure_future(self._deliver(queue, writer))
        self._tasks.add(sender)
        sender.add_done_callback(self._tasks.discard)
        free_at = 0.0  # when the chunk in front of the next one is delivered
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                now = time.monotonic()
                extra, lost = late_by(self._rng, self.loss)
                held = self._held(data) if upstream and self._holds else 0.0
                if held:
                    extra, lost = extra + held, lost + 1
                at = now + self.delay + extra
                # Late because of its own loss, or held behind a late chunk in front of it.
                self.stats.held_back += lost > 0 or free_at > at
                self.stats.lost += lost
                free_at = max(at, free_at)
                queue.put_nowait((free_at, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(Exception):
                await sender

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter
    ) -> None:
        try:
            while (item := await queue.get()) is not None:
                at, data = item
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                self.stats.chunks += 1
                await writer.drain()
        except OSError:
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProxyProcess:
    """One child process with a :class:`LossyProxy` per upstream (``host:port``).

    ``urls`` are the proxies' ``redis://`` URLs, in the order of ``upstreams``.
    :meth:`set_link` changes loss and delay on every proxy; :meth:`stats` reads the counters.
    Closing the child's stdin (:meth:`close`, or this process dying) ends it.
    """

    def __init__(
        self,
        upstreams: Sequence[tuple[str, int]],
        *,
        loss: float = 0.0,
        delay: float = 0.0,
        seed: int | None = None,
    ) -> None:
        check_link(loss, delay)
        args = [sys.executable, os.path.abspath(__file__), "--loss", str(loss), "--delay"]
        args += [str(delay), "--seed", str(seed if seed is not None else random.randrange(2**31))]
        args += [f"{host}:{port}" for host, port in upstreams]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().split()
        if len(line) != len(upstreams):
            self.close()
            raise RuntimeError(f"proxy process did not start (said {line!r})")
        self.ports = [int(p) for p in line]

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}/0" for port in self.ports]

    def _ask(self, line: str) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        return self._proc.stdout.readline().strip()

    def set_link(self, loss: float, delay: float = 0.0) -> None:
        loss, delay = check_link(loss, delay)
        answer = self._ask(f"set {loss} {delay}")
        if answer != "ok":
            raise RuntimeError(f"proxy process refused the setting: {answer!r}")

    def stats(self) -> LinkStats:
        chunks, lost, held_back, connections = (int(x) for x in self._ask("stats").split())
        return LinkStats(chunks, lost, held_back, connections)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(argv: Sequence[str]) -> int:
    """The child of :class:`ProxyProcess`: print the ports, then obey stdin until EOF."""
    import argparse

    parser = argparse.ArgumentParser(description="lossy TCP proxies, steered over stdin")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("upstreams", nargs="+", help="host:port")
    args = parser.parse_args(argv)
    proxies = []
    for i, spec in enumerate(args.upstreams):
        host, _, port = spec.rpartition(":")
        seed = None if args.seed is None else args.seed + i
        proxies.append(LossyProxy((host, int(port)), loss=args.loss, delay=args.delay, seed=seed))
    print(" ".join(str(p.port) for p in proxies), flush=True)
    for line in sys.stdin:
        words = line.split()
        try:
            if words[:1] == ["set"] and len(words) == 3:
                for p in proxies:
                    p.set_link(float(words[1]), float(words[2]))
                print("ok", flush=True)
            elif words == ["stats"]:
                total = LinkStats()
                for p in proxies:
                    total.chunks += p.stats.chunks
                    total.lost += p.stats.lost
                    total.held_back += p.stats.held_back
                    total.connections += p.stats.connections
                print(total.chunks, total.lost, total.held_back, total.connections, flush=True)
            else:
                print(f"error unknown command {line.strip()!r}", flush=True)
        except (TypeError, ValueError) as exc:
            print(f"error {exc}", flush=True)
    for p in proxies:
        p.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
