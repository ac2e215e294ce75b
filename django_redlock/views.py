"""Probe views for Kubernetes (include ``django_redlock.urls``): readiness asks the lock
nodes, liveness never does.

``ready`` answers 200 when a quorum of the nodes answers and may vote (a node in its restart
guard does not count), 503 otherwise, with a JSON body per node. It is cheap: the nodes are
probed all at once off the request path (:mod:`django_redlock.probes`), the answer is cached
for :data:`READY_CACHE` seconds and a probe waits at most ``probes.timeout`` seconds, so a
frozen node costs a probe no more than that, and does not make a ready pod unready while a
quorum of the others answers. ``?using=ALIAS`` asks another ``REDLOCK["BACKENDS"]`` service.

``live`` answers 200 without touching Redis: a lock outage must not get the pods restarted.
"""

from __future__ import annotations

import math
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.utils.cache import add_never_cache_headers

from .backends.registry import aliases
from .core import NodeHealth
from .probes import NodesSeen, probes

__all__ = ["READY_CACHE", "live", "metrics", "ready"]

_SAFE = ("GET", "HEAD")

#: Seconds a readiness answer is reused (probes of many replicas arrive together).
READY_CACHE = 1.0


def _node(h: NodeHealth) -> dict[str, Any]:
    guarded = h.guarded_for if h.guarded_for and math.isfinite(h.guarded_for) else None
    # A Sentinel group's current master, when the node is one.
    master = {"master": h.master} if getattr(h, "master", None) else {}
    return {
        "node": h.node,
        **master,
        "status": h.status,
        "reachable": h.reachable,
        "latency_ms": round(h.latency * 1000, 3) if h.latency is not None else None,
        "guarded_for": round(guarded, 3) if guarded else None,
        "server": h.server,
        "version": h.version,
        "error": h.error,
    }


def readiness_body(seen: NodesSeen, using: str) -> dict[str, Any]:
    return {
        "status": "ready" if seen.ready else "unavailable",
        "using": using,
        "quorum": seen.quorum,
        "voting": seen.voting,
        "nodes": [_node(h) for h in seen.health],
        **({"error": seen.error} if seen.error else {}),
    }


async def ready(request: HttpRequest) -> HttpResponse:
    """200 when locks can be taken (a quorum of nodes reachable and voting), else 503."""
    # Django's never_cache/require_safe take async views only from Django 5.0 on.
    if request.method not in _SAFE:
        return HttpResponseNotAllowed(_SAFE)
    using = request.GET.get("using", "default")
    if using not in aliases():
        return JsonResponse(
            {"error": f"no lock service named {using!r}", "known": aliases()}, status=404
        )
    seen = await probes.anodes(using, max_age=READY_CACHE)
    response = JsonResponse(readiness_body(seen, using), status=200 if seen.ready else 503)
    if not seen.ready:
        response["Retry-After"] = "1"
    add_never_cache_headers(response)
    return response


def live(request: HttpRequest) -> HttpResponse:
    """200 always: the process serves requests (the lock nodes are not asked)."""
    if request.method not in _SAFE:
        return HttpResponseNotAllowed(_SAFE)
    response = JsonResponse({"status": "alive"})
    add_never_cache_headers(response)
    return response


def metrics(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition of the registry ``REDLOCK["METRICS"]`` registered on (404
    while metrics are off)."""
    from . import metrics as redlock_metrics

    installed = redlock_metrics.installed()
    if installed is None:
        raise Http404("REDLOCK['METRICS'] is off")
    if request.method not in _SAFE:
        return HttpResponseNotAllowed(_SAFE)
    body, content_type = installed.exposition()
    response = HttpResponse(body, content_type=content_type)
    add_never_cache_headers(response)
    return response
