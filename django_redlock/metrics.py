"""Prometheus metrics of the locks, registered when ``REDLOCK["METRICS"]`` is on.

Off by default (explicit is better): ``REDLOCK["METRICS"] = True``, or a dict with
``LABEL`` (callable or dotted path: lock name -> label; default the part before the first
``:``), ``MAX_LABELS`` (default 100) and ``HEALTH_CACHE`` (seconds, default 5). It needs
``prometheus_client`` (the ``metrics`` extra), which is never imported while metrics are off.
``AppConfig.ready()`` calls :func:`install_from_settings`; the series go to
``prometheus_client``'s default registry, so an existing ``/metrics`` endpoint shows them
(``django_redlock.urls`` has one too). The series are listed in docs/monitoring.rst.

Counters and histograms are fed by the package's signals (lock events of the shared lock
services, and ``LockedTask``'s skips and lock retries); node and stuck-lock gauges are read
at scrape time by a collector, from probes that are cached for ``HEALTH_CACHE`` seconds and
bounded (:mod:`django_redlock.probes`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .backends.registry import aliases
from .conf import get_config
from .core import STUCK_REASONS, LockNotAcquired, check_positive
from .labels import DEFAULT_MAX_LABELS, LockLabels, label_function
from .probes import probes

__all__ = [
    "DEFAULT_HEALTH_CACHE",
    "MetricsSettings",
    "RedlockMetrics",
    "install",
    "install_from_settings",
    "installed",
    "metrics_settings",
    "uninstall",
]

logger = logging.getLogger("django_redlock")

#: Seconds the node health and stuck-lock gauges reuse one probe.
DEFAULT_HEALTH_CACHE = 5.0
_OPTIONS = ("LABEL", "MAX_LABELS", "HEALTH_CACHE")

ACQUIRE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


@dataclass(frozen=True)
class MetricsSettings:
    """``REDLOCK["METRICS"]``, judged."""

    labels: LockLabels
    health_cache: float = DEFAULT_HEALTH_CACHE


def metrics_settings(value: Any) -> MetricsSettings | None:
    """``REDLOCK["METRICS"]`` judged: None when off (False, None); a ValueError, TypeError or
    ImportError naming the problem (the ``django_redlock.E013`` check shows it)."""
    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, Mapping):
        raise TypeError(
            f"REDLOCK['METRICS'] must be True, False or a dict of {', '.join(_OPTIONS)}, "
            f"got {value!r}"
        )
    options: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
    unknown = sorted(str(k) for k in options if k not in _OPTIONS)
    if unknown:
        raise ValueError(
            f"REDLOCK['METRICS'] has unknown options {', '.join(unknown)} "
            f"(known: {', '.join(_OPTIONS)})"
        )
    limit = options.get("MAX_LABELS", DEFAULT_MAX_LABELS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"REDLOCK['METRICS']['MAX_LABELS'] must be an int >= 1, got {limit!r}")
    cache = check_positive(
        "REDLOCK['METRICS']['HEALTH_CACHE']",
        options.get("HEALTH_CACHE", DEFAULT_HEALTH_CACHE),
        maximum=math.inf,
    )
    labels = LockLabels(label_function(options.get("LABEL")), limit)
    if importlib.util.find_spec("prometheus_client") is None:
        raise ImportError(
            "REDLOCK['METRICS'] is on but prometheus_client is not installed: "
            "pip install 'django-redlock[metrics]'"
        )
    return MetricsSettings(labels=labels, health_cache=cache)


class RedlockMetrics:
    """The metric objects on one registry, and the receivers that feed them."""

    def __init__(self, settings: MetricsSettings, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        self.settings = settings
        self.registry = REGISTRY if registry is None else registry
        self.label = settings.labels
        #: Every metric registered here, for disconnect() to unregister.
        self._metrics: list[Any] = []

        def add(kind: Any, name: str, doc: str, *labels: str, **options: Any) -> Any:
            metric = kind(name, doc, ["lock", *labels], registry=self.registry, **options)
            self._metrics.append(metric)
            return metric

        self.acquire_seconds = add(
            Histogram,
            "redlock_acquire_seconds",
            "Time spent acquiring a lock, waiting included, by outcome (acquired, contended).",
            "outcome",
            buckets=ACQUIRE_BUCKETS,
        )
        self.hold_seconds = add(
            Histogram,
            "redlock_hold_seconds",
            "How long locks were held, by how the hold ended (released, lost).",
            "end",
            buckets=HOLD_BUCKETS,
        )
        self.acquired = add(Counter, "redlock_acquired", "Locks acquired.")
        self.contended = add(
            Counter,
            "redlock_contended",
            "Acquisitions that did not get the lock (held by another, or too few nodes).",
        )
        self.released = add(Counter, "redlock_released", "Locks released.")
        self.lost = add(
            Counter,
            "redlock_lost",
            "Held locks lost (lease ran out, renewal failed, force-released).",
        )
        self.force_released = add(
            Counter, "redlock_force_released", "Locks an operator force-released."
        )
        self.celery_skipped = add(
            Counter,
            "redlock_celery_skipped",
            "LockedTask runs skipped because the lock was held (on_locked='skip').",
            "task",
        )
        self.celery_lock_retries = add(
            Counter,
            "redlock_celery_lock_retries",
            "LockedTask runs re-scheduled because the lock was held (on_locked='retry').",
            "task",
        )
        self.collector = NodeCollector(settings.health_cache)
        self.registry.register(self.collector)
        self._connected: list[tuple[Any, Any]] = []

    # -- receivers -----------------------------------------------------------------------------

    def _counting(
        self, counter: Any, histogram: Any = None, end: str = "", seconds: str = ""
    ) -> Callable[..., None]:
        """A receiver of a lock signal: ``counter`` +1 for the lock, and when the signal
        gives a duration (its ``seconds`` argument), one observation of ``histogram``
        labelled ``end``."""

        def receive(*, name: str, **kwargs: Any) -> None:
            lock = self.label(name)
            counter.labels(lock).inc()
            duration = kwargs.get(seconds)
            if histogram is not None and duration is not None:
                histogram.labels(lock, end).observe(duration)

        return receive

    def _task_skipped(self, sender: Any = None, *, lock_name: str = "", **_: Any) -> None:
        self.celery_skipped.labels(self.label(lock_name), _task_name(sender)).inc()

    def _task_retry(self, sender: Any = None, *, reason: Any = None, **_: Any) -> None:
        # Celery's task_retry, for every retry: count those LockedTask made for a busy lock.
        exc = getattr(reason, "exc", reason)
        if isinstance(exc, LockNotAcquired):
            self.celery_lock_retries.labels(self.label(exc.name or ""), _task_name(sender)).inc()

    def connect(self) -> None:
        from . import signals

        waits, holds = self.acquire_seconds, self.hold_seconds
        pairs: list[tuple[Any, Any]] = [
            (signals.lock_acquired, self._counting(self.acquired, waits, "acquired", "waited")),
            (signals.lock_contended, self._counting(self.contended, waits, "contended", "waited")),
            (signals.lock_released, self._counting(self.released, holds, "released", "held")),
            (signals.lock_lost, self._counting(self.lost, holds, "lost", "held")),
            (signals.lock_force_released, self._counting(self.force_released)),
        ]
        if importlib.util.find_spec("celery") is not None:
            # Only with Celery installed (LockedTask's own module imports it).
            from celery.signals import task_retry

            from .celery import task_skipped

            pairs += [(task_skipped, self._task_skipped), (task_retry, self._task_retry)]
        for signal, receiver in pairs:
            signal.connect(receiver, weak=False)
        self._connected = pairs

    def disconnect(self) -> None:
        for signal, receiver in self._connected:
            signal.disconnect(receiver)
        self._connected = []
        self.registry.unregister(self.collector)
        for metric in self._metrics:
            self.registry.unregister(metric)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _task_name(task: Any) -> str:
    return str(getattr(task, "name", None) or "unknown")


#: The collector's gauges: key -> (name, help, labels after "service").
_GAUGES = {
    "probe": (
        "redlock_health_probe_success",
        "1 when the nodes of the lock service could be probed in time.",
    ),
    "up": ("redlock_node_up", "1 when the node answers the health probe.", "node"),
    "voting": (
        "redlock_node_voting",
        "1 when the node answers and may vote (not held back by the restart guard).",
        "node",
    ),
    "guarded": (
        "redlock_node_guarded_seconds",
        "Seconds before the restart guard lets the node vote (0: it votes).",
        "node",
    ),
    "latency": ("redlock_node_latency_seconds", "PING round trip to the node.", "node"),
    "quorum": (
        "redlock_quorum_available",
        "1 when a quorum of the nodes answers and may vote: locks can be taken.",
    ),
    "live": ("redlock_live_locks", "Live locks on the nodes."),
    "stuck": (
        "redlock_stuck_locks",
        "Live locks that look stuck, by reason (old, split, stale, dead; see the admin page).",
        "reason",
    ),
}


class NodeCollector:
    """Gauges read at scrape time: per lock service and node, reachability, voting (the restart
    guard counted), guard time left and PING latency; whether a quorum votes; live and stuck
    locks by reason. Each service's probe is cached for ``health_cache`` seconds."""

    def __init__(self, health_cache: float) -> None:
        self.health_cache = health_cache

    def _families(self) -> dict[str, Any]:
        from prometheus_client.core import GaugeMetricFamily

        return {
            key: GaugeMetricFamily(name, doc, labels=["service", *labels])
            for key, (name, doc, *labels) in _GAUGES.items()
        }

    def describe(self) -> Iterator[Any]:
        """The families without samples: registering must not probe the nodes."""
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        families = self._families()
        stuck_after = get_config().get("STUCK_AFTER")
        # Every probe of the scrape runs at once and is waited for until one deadline: a
        # frozen node costs the scrape one probes.timeout, not one per probe.
        services = aliases()
        for service in services:
            probes.start(service, max_age=self.health_cache)
        deadline = time.monotonic() + probes.timeout
        for service in services:
            seen = probes.nodes(service, max_age=self.health_cache, deadline=deadline)
            families["probe"].add_metric([service], 0.0 if seen.error else 1.0)
            if seen.error:
                continue
            for h in seen.health:
                families["up"].add_metric([service, h.node], float(h.reachable))
                families["voting"].add_metric([service, h.node], float(h.voting))
                if h.reachable:
                    families["guarded"].add_metric([service, h.node], h.guarded_for or 0.0)
                if h.latency is not None:
                    families["latency"].add_metric([service, h.node], h.latency)
            families["quorum"].add_metric([service], 1.0 if seen.ready else 0.0)
            locks = probes.live_locks(service, max_age=self.health_cache, deadline=deadline)
            if locks is None:
                continue
            families["live"].add_metric([service], float(len(locks)))
            counts = dict.fromkeys((code for code, _, _ in STUCK_REASONS), 0)
            now = time.time()
            pids: dict[int, bool] = {}
            for info in locks:
                for code in info.stuck_reasons(stuck_after, now=now, pid_cache=pids):
                    counts[code] += 1
            for code, count in counts.items():
                families["stuck"].add_metric([service, code], float(count))
        yield from families.values()


_installed: RedlockMetrics | None = None
_install_lock = threading.Lock()


def install(settings: MetricsSettings, registry: Any = None) -> RedlockMetrics:
    """Register the metrics on ``registry`` (prometheus_client's default one) and connect
    their receivers; what was installed before is uninstalled first."""
    global _installed
    with _install_lock:
        _uninstall()
        metrics = RedlockMetrics(settings, registry)
        metrics.connect()
        _installed = metrics
        return metrics


def uninstall() -> None:
    """Disconnect and unregister what :func:`install` registered."""
    with _install_lock:
        _uninstall()


def _uninstall() -> None:
    global _installed
    if _installed is not None:
        _installed.disconnect()
        _installed = None


def installed() -> RedlockMetrics | None:
    """The installed metrics, or None while ``REDLOCK["METRICS"]`` is off."""
    return _installed


def install_from_settings() -> RedlockMetrics | None:
    """``AppConfig.ready()``: install when ``REDLOCK["METRICS"]`` is on. A broken value is
    logged (and reported by the ``django_redlock.E013`` check), never raised at startup."""
    try:
        settings = metrics_settings(get_config().get("METRICS"))
    except (TypeError, ValueError, ImportError) as exc:
        logger.error("django_redlock.E013: metrics are off: %s", exc)
        return None
    if settings is None:
        return None
    if _installed is not None:
        return _installed
    return install(settings)
