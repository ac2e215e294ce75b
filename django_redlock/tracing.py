"""OpenTelemetry spans of lock acquisition and holds, where ``opentelemetry-api`` is installed.

``AppConfig.ready()`` connects receivers to the lock signals (unless ``REDLOCK["TRACING"]`` is
False); without ``opentelemetry-api`` nothing is imported or connected, and without an SDK
configured the API's tracer records nothing. Two spans per lock, in the trace of the code
that took it (the request's or the task's span is their parent):

``redlock.acquire``
    From the start of the acquisition to its outcome, waiting included; attributes
    ``redlock.lock`` (the lock's label, e.g. ``order`` for ``order:42``: never the full name),
    ``redlock.outcome`` (``acquired`` or ``contended``), ``redlock.wait_seconds``.
``redlock.hold``
    From the acquisition to the release (or the loss: ``redlock.outcome`` = ``lost`` and an
    error status); ``redlock.lock``, ``redlock.hold_seconds``, ``redlock.fence`` when fenced.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from typing import Any

from . import metrics
from .conf import get_config
from .labels import LockLabels

__all__ = ["TRACER_NAME", "Tracing", "install_from_settings"]

#: The instrumentation scope of the spans.
TRACER_NAME = "django_redlock"


class Tracing:
    """Receivers turning lock signals into spans."""

    def __init__(self, labels: LockLabels, tracer_provider: Any = None) -> None:
        from opentelemetry import trace

        self._trace = trace
        self.label = labels
        #: None: the global provider, looked up at each span (one set up later is used).
        self.tracer_provider = tracer_provider
        self._connected: list[tuple[Any, Any]] = []

    def _span(
        self, name: str, seconds: float | None, attributes: dict[str, Any], failed: bool = False
    ) -> None:
        # The event comes when the acquisition or hold is over: the span is recorded with the
        # start it had, in the trace of the code that took the lock (the current context).
        end = time.time_ns()
        start = end - int(max(seconds or 0.0, 0.0) * 1e9)
        tracer = self._trace.get_tracer(TRACER_NAME, tracer_provider=self.tracer_provider)
        span = tracer.start_span(name, start_time=start, attributes=attributes)
        if failed:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, "lock lost"))
        span.end(end_time=end)

    def _acquire(self, outcome: str, *, name: str, waited: float | None = None, **_: Any) -> None:
        self._span(
            "redlock.acquire",
            waited,
            {
                "redlock.lock": self.label(name),
                "redlock.outcome": outcome,
                "redlock.wait_seconds": float(waited or 0.0),
            },
        )

    def _hold(
        self,
        outcome: str,
        *,
        name: str,
        held: float | None = None,
        fence: int | None = None,
        **_: Any,
    ) -> None:
        attributes: dict[str, Any] = {
            "redlock.lock": self.label(name),
            "redlock.outcome": outcome,
            "redlock.hold_seconds": float(held or 0.0),
        }
        if fence is not None:
            attributes["redlock.fence"] = fence
        self._span("redlock.hold", held, attributes, failed=outcome == "lost")

    def connect(self) -> None:
        from . import signals

        self._connected = [
            (signals.lock_acquired, functools.partial(self._acquire, "acquired")),
            (signals.lock_contended, functools.partial(self._acquire, "contended")),
            (signals.lock_released, functools.partial(self._hold, "released")),
            (signals.lock_lost, functools.partial(self._hold, "lost")),
        ]
        for signal, receiver in self._connected:
            signal.connect(receiver, weak=False)

    def disconnect(self) -> None:
        for signal, receiver in self._connected:
            signal.disconnect(receiver)
        self._connected = []


_installed: Tracing | None = None


def install_from_settings() -> Tracing | None:
    """``AppConfig.ready()``: connect when ``opentelemetry-api`` is installed and
    ``REDLOCK["TRACING"]`` is not False. The label of a lock is the metrics' one."""
    global _installed
    config = get_config()
    if config.get("TRACING") is False or importlib.util.find_spec("opentelemetry") is None:
        return None
    if _installed is None:
        counted = metrics.installed()
        try:
            # The metrics' own labeller when they are on: one count of distinct labels, one
            # warning past MAX_LABELS.
            labels = (
                counted.label
                if counted is not None
                else LockLabels.from_settings(config.get("METRICS"))
            )
        except (TypeError, ValueError):
            labels = LockLabels()  # METRICS is broken: E013 says so; spans keep the default
        _installed = Tracing(labels)
        _installed.connect()
    return _installed
