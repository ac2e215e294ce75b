"""Node health read off the request path: concurrent, bounded and cached, for the readiness
view and the Prometheus collector.

``Redlock.health()`` probes the nodes one after another, so a frozen node costs its whole
listing timeout before the next one is asked. The asyncio client probes them all at once. So
the probes here run the shared ``AsyncRedlock`` (or a backend's async twin) on one event loop
of their own, in a daemon thread: its connections persist between probes, every caller (sync
view, async view, a scrape) waits at most :attr:`HealthProbes.timeout`, and concurrent callers
share one probe in flight. A fork (a preloading server's workers) gets a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from .backends.registry import get_async_locks
from .core import LockInfo, NodeHealth

__all__ = ["HealthProbes", "NodesSeen", "probes"]


@dataclass(frozen=True)
class NodesSeen:
    """One probe's answer: every node's health (empty when the probe itself failed), the
    service's quorum, and when it was taken (``time.monotonic()``)."""

    health: list[NodeHealth]
    quorum: int
    taken_at: float
    error: str | None = None

    @property
    def voting(self) -> int:
        return sum(1 for h in self.health if h.voting)

    @property
    def ready(self) -> bool:
        """A quorum of the nodes answers and may vote (the restart guard counted)."""
        return self.error is None and self.voting >= self.quorum


class _Loop:
    """An event loop running in a daemon thread of this process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="django-redlock-probes", daemon=True
        )
        self.thread.start()

    def submit(self, make: Callable[[], Awaitable[Any]]) -> concurrent.futures.Future[Any]:
        async def run() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)


class HealthProbes:
    """Cached, single-flight node health per lock service alias."""

    #: Longest wait for a probe, seconds. The asyncio client bounds each node's probe by its
    #: listing timeout (2 s) and asks every node at once; this is the outer bound.
    timeout = 3.0

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._loop: _Loop | None = None
        #: (what, alias) -> (time.monotonic() of the answer, the answer)
        self._seen: dict[tuple[str, str], tuple[float, Any]] = {}
        self._pending: dict[tuple[str, str], concurrent.futures.Future[Any]] = {}

    def _running_loop(self) -> _Loop:
        loop = self._loop
        if loop is None or loop.pid != os.getpid() or not loop.thread.is_alive():
            # First use, or a forked child: the parent's thread does not exist here.
            loop = self._loop = _Loop()
            self._pending.clear()
        return loop

    def _cached_or_pending(
        self, key: tuple[str, str], max_age: float, make: Callable[[], Awaitable[Any]]
    ) -> tuple[bool, Any]:
        """``(True, answer)`` when the cached answer is younger than ``max_age``, else
        ``(False, future)`` of the probe in flight (started when there is none)."""
        with self._mutex:
            seen = self._seen.get(key)
            if seen is not None and time.monotonic() - seen[0] < max_age:
                return True, seen[1]
            future = self._pending.get(key)
            if future is None or future.done():
                future = self._pending[key] = self._running_loop().submit(make)
            return False, future

    def _store(self, key: tuple[str, str], value: Any) -> Any:
        with self._mutex:
            self._seen[key] = (time.monotonic(), value)
        return value

    def _probed(
        self,
        key: tuple[str, str],
        max_age: float,
        make: Callable[[], Awaitable[Any]],
        failed: Callable[[BaseException], Any],
        deadline: float | None = None,
    ) -> Any:
        """The cached answer when younger than ``max_age``, else the probe's (waited for at
        most :attr:`timeout`, or until ``deadline`` (``time.monotonic()``); ``failed(exc)``
        stands for an answer that did not come)."""
        cached, found = self._cached_or_pending(key, max_age, make)
        if cached:
            return found
        wait = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            value = found.result(wait)
        except Exception as exc:
            value = failed(exc)
        return self._store(key, value)

    # -- node health ---------------------------------------------------------------------------

    def nodes(
        self, alias: str = "default", *, max_age: float = 1.0, deadline: float | None = None
    ) -> NodesSeen:
        """Every node of lock service ``alias``, at most ``max_age`` seconds old (waited for
        until ``deadline``, a ``time.monotonic()`` value, when given)."""
        return self._probed(
            ("nodes", alias), max_age, lambda: _probe_nodes(alias), self._failed, deadline
        )

    def start(self, alias: str, *, max_age: float) -> None:
        """Start the probes of :meth:`nodes` and :meth:`live_locks` that are not cached, so
        they run at once: a caller that reads both then waits for the slower one only (a
        scrape, with frozen nodes, waits one listing timeout rather than two)."""
        self._cached_or_pending(("nodes", alias), max_age, lambda: _probe_nodes(alias))
        self._cached_or_pending(("locks", alias), max_age, lambda: _listing(alias))

    async def anodes(self, alias: str = "default", *, max_age: float = 1.0) -> NodesSeen:
        """:meth:`nodes` for async code (the wait does not block the caller's loop)."""
        key = ("nodes", alias)
        cached, found = self._cached_or_pending(key, max_age, lambda: _probe_nodes(alias))
        if cached:
            return found
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(found), self.timeout)
        except Exception as exc:
            value = self._failed(exc)
        return self._store(key, value)

    def _failed(self, exc: BaseException) -> NodesSeen:
        if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
            error = f"no answer from the health probe in time (at most {self.timeout:g} s)"
        else:
            error = str(exc) or type(exc).__name__
        return NodesSeen(health=[], quorum=0, taken_at=time.monotonic(), error=error)

    # -- live locks ----------------------------------------------------------------------------

    def live_locks(
        self, alias: str = "default", *, max_age: float = 5.0, deadline: float | None = None
    ) -> list[LockInfo] | None:
        """Every live lock of ``alias``, at most ``max_age`` seconds old; None when the nodes
        could not be listed in time (until ``deadline`` when given)."""
        return self._probed(
            ("locks", alias), max_age, lambda: _listing(alias), lambda exc: None, deadline
        )

    def forget(self) -> None:
        """Drop every cached answer (the settings changed)."""
        with self._mutex:
            self._seen.clear()


async def _listing(alias: str) -> list[LockInfo]:
    return list(await get_async_locks(alias).live_locks("*"))


async def _probe_nodes(alias: str) -> NodesSeen:
    locks = get_async_locks(alias)
    health = await locks.health()
    quorum = getattr(locks, "quorum", len(health) // 2 + 1)
    return NodesSeen(health=list(health), quorum=quorum, taken_at=time.monotonic())


#: The process's probes (the readiness view and the metrics collector share them).
probes = HealthProbes()


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("REDLOCK", "CACHES", "DATABASES"):
        probes.forget()
