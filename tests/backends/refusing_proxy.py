"""An HTTP proxy in front of etcd's JSON gateway, on threads of the test's process: it forwards
every request (watch streams as they come), except that a request to a path the test named is
answered by the proxy itself with the status and body the test chose, and never reaches etcd.
That is how etcd's own 5xx answers (``etcdserver: no leader``, a request timed out inside the
cluster) and a load balancer's (a plain-text 502) look to the client.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit


class RefusingProxy:
    """``refuse(path, status, body)`` answers every request to ``path`` that way until
    ``forward(path)``; ``refused[path]`` counts the answers it gave."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self._upstream = (target.hostname or "127.0.0.1", target.port or 2379)
        self._rules: dict[str, tuple[int, str, bytes]] = {}
        self.refused: dict[str, int] = {}
        self._mutex = threading.Lock()
        self._streams: set[http.client.HTTPConnection] = set()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        # Handler threads wait on keep-alive connections and watch streams: close() ends
        # them rather than waiting for every client to hang up.
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.address = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def refuse(self, path: str, status: int, body: str | bytes, content_type: str = "") -> None:
        raw = body.encode() if isinstance(body, str) else body
        kind = content_type or ("application/json" if raw.startswith(b"{") else "text/plain")
        with self._mutex:
            self._rules[path] = (status, kind, raw)

    def forward(self, path: str) -> None:
        with self._mutex:
            self._rules.pop(path, None)

    @contextlib.contextmanager
    def refusing(self, path: str, status: int, body: str | bytes) -> Iterator[None]:
        self.refuse(path, status, body)
        try:
            yield
        finally:
            self.forward(path)

    def _rule(self, path: str) -> tuple[int, str, bytes] | None:
        with self._mutex:
            rule = self._rules.get(path)
            if rule is not None:
                self.refused[path] = self.refused.get(path, 0) + 1
            return rule

    def close(self) -> None:
        self._server.shutdown()
        with self._mutex:
            streams = list(self._streams)
        for upstream in streams:
            # A watch stream's thread is reading from etcd: a shutdown ends its read at once
            # (close() would wait for the reader's buffer lock).
            if upstream.sock is not None:
                with contextlib.suppress(OSError):
                    upstream.sock.shutdown(socket.SHUT_RDWR)
        self._server.server_close()


def _handler(proxy: RefusingProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            rule = proxy._rule(self.path)
            if rule is not None:
                status, kind, raw = rule
                self._answer(status, kind, raw)
                return
            upstream = http.client.HTTPConnection(*proxy._upstream, timeout=None)
            try:
                upstream.request("POST", self.path, body, {"Content-Type": "application/json"})
                response = upstream.getresponse()
                if self.path != "/v3/watch":
                    kind = response.getheader("Content-Type", "application/json")
                    self._answer(response.status, kind, response.read())
                    return
                with proxy._mutex:
                    proxy._streams.add(upstream)
                self._stream(response)
            except (OSError, http.client.HTTPException):
                self.close_connection = True  # the client left, or close() ended the stream
            finally:
                with proxy._mutex:
                    proxy._streams.discard(upstream)
                upstream.close()

        def _answer(self, status: int, kind: str, raw: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _stream(self, response: http.client.HTTPResponse) -> None:
            self.send_response(response.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while line := response.readline():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    return Handler
