"""Background reconnection to nodes that stopped answering.

A node whose connection attempt timed out (frozen, or its packets dropped) would make every
operation wait ``node_timeout`` to try again, so the slowest node would set the pace after
all. Instead, operations count it as failed at once, and one thread per process tries to
reconnect to it, every :data:`RETRY_EVERY` seconds at most, until it answers; the connection
it makes goes into the node's pool, carrying what could not reach the node meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Protocol

__all__ = ["RETRY_EVERY", "Reconnectable", "Reconnector", "reconnector"]

#: Shortest time between two attempts to reconnect to one node.
RETRY_EVERY = 0.1


class Reconnectable(Protocol):
    """What the reconnector asks of a node (:class:`~.nodes.Node`); named here so this
    module does not import the one that imports it."""

    def reconnect(self) -> bool:
        """One attempt; True once the node is back."""
        ...


class Reconnector:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._nodes: dict[int, Reconnectable] = {}
        self._thread: threading.Thread | None = None

    def watch(self, node: Reconnectable) -> None:
        with self._cond:
            self._nodes[id(node)] = node
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redlock-reconnector", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def forget(self, node: Reconnectable) -> None:
        """Stop trying (the node's client is closed)."""
        with self._cond:
            self._nodes.pop(id(node), None)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._nodes:
                    self._thread = None
                    return
                nodes = list(self._nodes.items())
            started = time.monotonic()
            for key, node in nodes:
                if node.reconnect():
                    with self._cond:
                        if self._nodes.get(key) is node:
                            del self._nodes[key]
            with self._cond:
                pause = started + RETRY_EVERY - time.monotonic()
                if self._nodes and pause > 0:
                    self._cond.wait(pause)

    def _after_fork(self) -> None:
        # The child has no thread; its nodes start over (see Node.unreachable).
        self.__init__()  # type: ignore[misc]


reconnector = Reconnector()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=reconnector._after_fork)
