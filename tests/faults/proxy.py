"""A TCP proxy in front of one Redis node, with two faults a paused process cannot produce.

* ``delay``: every reply from the node is held back this many seconds before it is forwarded
  (a slow network / an overloaded node whose replies still arrive, late).
* ``held``: requests from the clients are kept in the proxy, not forwarded, until it is
  cleared (a connection cut, or a node that stopped reading, after what came before ran);
  :meth:`drop_all` while held drops them with their connections. :meth:`hold_open` holds
  the connections open now only, :meth:`let_through` ends every hold.
* ``reset``: a request containing one of ``markers`` (e.g. the SHA of the acquire script) is
  forwarded to the node, the node's reply is read and thrown away, and the client's
  connection is reset (RST). The command *did* run on the node; the client never learns its outcome. This is the
  "connection reset after the SET was sent" fault: the client must not count that node as
  granted, and its cleanup must remove its own token only.

The proxy runs in threads of the process that made it (the controller, not a client), one
thread per connection. ``armed`` is how many resets are still to inject (``None``: use
``probability`` on every matching request).
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import struct
import threading
import time

__all__ = ["Proxy"]


class Proxy:
    def __init__(self, upstream: tuple[str, int], *, markers: tuple[bytes, ...] = ()) -> None:
        self.upstream = upstream
        self.markers = markers
        self.delay = 0.0
        self.held = False
        self._held_clients: set[socket.socket] = set()
        self.armed: int | None = 0
        self.probability = 0.0
        self.resets = 0  #: resets injected so far
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _should_reset(self, data: bytes) -> bool:
        if not any(marker in data for marker in self.markers):
            return False
        with self._lock:
            if self.armed is None:
                hit = random.random() < self.probability
            elif self.armed > 0:
                self.armed -= 1
                hit = True
            else:
                hit = False
            if hit:
                self.resets += 1
            return hit

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        """Both directions of one connection in one thread (request/reply traffic), so a
        reset closes sockets no other thread is blocked on: the RST goes out at once."""
        reset_pending = False
        kept = b""
        try:
            while True:
                if kept and not self._holds(client):
                    server.sendall(kept)
                    kept = b""
                # While requests are kept, look again now and then for the hold to end.
                readable, _, _ = select.select([client, server], [], [], 0.01 if kept else None)
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        break
                    if kept or self._holds(client):
                        kept += data
                        continue
                    if self._should_reset(data):
                        reset_pending = True
                    server.sendall(data)
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        break
                    if reset_pending and not data.startswith(b"-NOSCRIPT"):
                        # The command ran on the node; its reply is dropped and the
                        # client's connection reset.
                        _reset(client)
                        break
                    if self.delay:
                        time.sleep(self.delay)
                    client.sendall(data)
        except (OSError, ValueError):
            pass
        for sock in (client, server):
            with self._lock:
                self._conns.discard(sock)
            _reset(sock)

    def _holds(self, client: socket.socket) -> bool:
        return self.held or client in self._held_clients

    def hold_open(self) -> None:
        """Hold the requests of the connections open now (new ones go through)."""
        with self._lock:
            self._held_clients = set(self._conns)

    def let_through(self) -> None:
        self.held = False
        self._held_clients = set()

    def drop_all(self) -> None:
        """End every open connection (as a node restart would): shutdown wakes the pump
        thread, which then closes both sockets."""
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread
        with contextlib.suppress(OSError):
            self._listener.close()
        self.drop_all()


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN (SO_LINGER on, timeout 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
