"""The fenced resource: a tiny TCP server in a process of its own.

Clients send fenced writes; the oracle accepts a write only when its fence is larger than the
last one it accepted for that resource (Kleppmann's fencing check, done at write time by the
storage, not by the writer), and rejects stale ones. It also notes whether a rejected writer's
hold was still valid by the writer's own account when the write arrived: a rejection of a write
made *inside* a valid hold means a later holder got a lock while this one was still valid (an
overlap seen from the storage side), where a rejection after the validity ended is the fence
doing its job against a paused holder.

Protocol: one JSON object per line, one reply line per request.

* ``{"op": "write", "key", "fence", "proc", "token", "vend"}`` ->
  ``{"ok": true}`` or ``{"ok": false, "last": <accepted fence>}``
* ``{"op": "stats"}`` -> ``{"accepted", "rejected", "rejected_in_valid_hold", "rejections"}``
* ``{"op": "reset"}`` -> ``{"ok": true}``
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import socketserver
import threading
import time
from typing import Any

__all__ = ["Oracle", "OracleClient"]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.last: dict[str, int] = {}
        self.accepted = 0
        self.rejections: list[dict[str, Any]] = []

    def write(self, req: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        key, fence = req["key"], int(req["fence"])
        with self.lock:
            last = self.last.get(key)
            if last is None or fence > last:
                self.last[key] = fence
                self.accepted += 1
                return {"ok": True}
            self.rejections.append(
                {
                    "key": key,
                    "fence": fence,
                    "last": last,
                    "proc": req.get("proc"),
                    "token": req.get("token"),
                    "at": now,
                    "in_valid_hold": req.get("vend") is not None and now < req["vend"],
                }
            )
            return {"ok": False, "last": last}

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "accepted": self.accepted,
                "rejected": len(self.rejections),
                "rejected_in_valid_hold": sum(1 for r in self.rejections if r["in_valid_hold"]),
                "rejections": list(self.rejections),
            }


def _serve(sock: socket.socket) -> None:
    state = _State()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                req = json.loads(line)
                op = req.get("op")
                if op == "write":
                    reply = state.write(req)
                elif op == "stats":
                    reply = state.stats()
                elif op == "reset":
                    with state.lock:
                        state.reset()
                    reply = {"ok": True}
                else:
                    reply = {"error": f"unknown op {op!r}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

        def server_bind(self) -> None:  # the listening socket was made by the parent
            pass

        def server_activate(self) -> None:
            pass

    server = Server(("127.0.0.1", 0), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.serve_forever(poll_interval=0.2)


class Oracle:
    """The oracle process. The listening socket is bound in the parent, so its address is known
    before the process starts and no client can connect too early."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.address: tuple[str, int] = self._sock.getsockname()
        ctx = multiprocessing.get_context("fork")
        self._proc = ctx.Process(
            target=_serve, args=(self._sock,), name="fault-oracle", daemon=True
        )
        self._proc.start()
        self._sock.close()  # the child has its own copy
        self._client: OracleClient | None = None

    @property
    def client(self) -> OracleClient:
        if self._client is None:
            self._client = OracleClient(self.address)
        return self._client

    def stats(self) -> dict[str, Any]:
        return self.client.call({"op": "stats"})

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(5)
        if self._proc.is_alive():  # pragma: no cover
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> Oracle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class OracleClient:
    """One connection to the oracle (open one per client process)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._sock = socket.create_connection(address, timeout=10)
        self._file = self._sock.makefile("rb")

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise ConnectionError("the oracle closed the connection")
        return json.loads(line)

    def write(
        self, key: str, fence: int, *, proc: str, token: str, vend: float | None = None
    ) -> bool:
        """A fenced write; True when the oracle accepted it."""
        return bool(
            self.call(
                {
                    "op": "write",
                    "key": key,
                    "fence": fence,
                    "proc": proc,
                    "token": token,
                    "vend": vend,
                }
            )["ok"]
        )

    def close(self) -> None:
        self._file.close()
        self._sock.close()
