"""The scripted tour: each step prints what it shows and returns whether the product behaved
as promised (the demo exits 1 otherwise)."""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import signal
import threading
import time
from collections.abc import Sequence

from ..core import LockNotAcquired, QuorumError, Redlock
from ..testing import RedisCluster
from .resources import Resources
from .web import Reply, WebServer, fetch

__all__ = ["TOUR_PREFIX", "fencing", "locked_view", "mutual_exclusion", "node_failures", "title"]

# Processes are frozen with SIGSTOP, so the tour is POSIX-only and forks its children.
_CTX = multiprocessing.get_context("fork")  # the same as Resources.child's

#: Key prefix of the tour's locks. Restart-guard markers are per prefix, so the tour's node
#: crash does not keep the example project's locks (prefix "redlock") waiting afterwards.
TOUR_PREFIX = "tour"

_WORKERS, _ROUNDS = 4, 50
_COUNTER = "demo-counter"  # a plain key, outside the lock key space


def title(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 70 - len(text)))


# --------------------------------------------------------------------------- mutual exclusion


def _bump(urls: Sequence[str], use_lock: bool, rounds: int) -> None:
    """Read-modify-write a shared counter: correct only under the lock."""
    redlock = Redlock(urls, key_prefix=TOUR_PREFIX, ttl=5)
    client = redlock.nodes[0].client
    for _ in range(rounds):
        lock = redlock.lock("counter") if use_lock else None
        if lock is not None and not lock.acquire(timeout=10):
            continue  # the count comes out short and the step fails
        value = int(client.get(_COUNTER) or 0)
        time.sleep(0.0005)  # widen the race window the lock closes
        client.set(_COUNTER, value + 1)
        if lock is not None:
            lock.release()


def mutual_exclusion(cluster: RedisCluster, resources: Resources) -> bool:
    total = _WORKERS * _ROUNDS
    title(f"Mutual exclusion: {_WORKERS} processes x {_ROUNDS} read-modify-write cycles")
    client = cluster.nodes[0].client()
    counts = {}
    for use_lock in (False, True):
        label = "with the lock   " if use_lock else "without the lock"
        print(f"  {label}: running ...")
        client.delete(_COUNTER)
        started = time.perf_counter()
        workers = [resources.child(_bump, cluster.urls, use_lock, _ROUNDS) for _ in range(_WORKERS)]
        for worker in workers:
            worker.join()
        counts[use_lock] = int(client.get(_COUNTER) or 0)
        lost = "" if counts[use_lock] == total else f", {total - counts[use_lock]} updates lost"
        print(
            f"  {label}: counter = {counts[use_lock]} of {total}{lost} "
            f"({time.perf_counter() - started:.2f}s)"
        )
    return counts[True] == total


# --------------------------------------------------------------------------- node failures


def node_failures(cluster: RedisCluster, resources: Resources) -> bool:
    n = len(cluster)
    quorum = n // 2 + 1
    spare = n - quorum
    can_fail = f"{spare} may fail" if spare else "none may fail"
    title(f"Node failures: {n} node{'s' if n > 1 else ''}, quorum {quorum}: {can_fail}")
    redlock = Redlock(cluster.urls, key_prefix=TOUR_PREFIX, ttl=5, node_timeout=0.05, max_ttl=5)
    ok = True
    frozen = cluster.nodes[n - spare :]
    for node in frozen:
        node.pause()
    if frozen:
        started = time.perf_counter()
        try:
            with redlock.lock("failover") as lock:
                print(
                    f"  {len(frozen)} of {n} nodes frozen (SIGSTOP): acquired in "
                    f"{(time.perf_counter() - started) * 1000:.1f} ms, "
                    f"validity {lock.validity:.2f}s"
                )
        except LockNotAcquired as exc:
            print(f"  {len(frozen)} of {n} nodes frozen (SIGSTOP): refused (bug!) -> {exc}")
            ok = False
    victim_index = n - spare - 1
    victim = cluster.nodes[victim_index]
    victim.kill()
    down = len(frozen) + 1
    try:
        granted = redlock.lock("failover").acquire(blocking=False)
        print(f"  {down} of {n} nodes down: {'GRANTED (bug!)' if granted else 'refused'}")
    except QuorumError as exc:
        granted = False
        print(f"  {down} of {n} nodes down: refused, as it must be -> {exc}")
    ok = ok and not granted
    for node in frozen:
        node.resume()
    resources.restart_node(victim)
    guard = redlock.health()[victim_index].guarded_for or 0.0
    print("  the crashed node restarted empty: it forgot every lock it held")
    healthy = n - 1
    if n == 1:
        print(
            "  no other node remembers a lock, so it counts as a brand-new cluster and is "
            "trusted at once: one node cannot survive a crash, use 3 or 5"
        )
    elif healthy >= quorum:
        print(f"  the restart guard keeps it out of the quorum for {guard:.1f}s")
    else:
        print(
            f"  the restart guard keeps it out of the quorum for {guard:.1f}s, and the other "
            f"{healthy} node{'s are' if healthy > 1 else ' is'} short of the quorum: waiting"
        )
    what = f"locks work on the {healthy} other nodes" if healthy >= quorum else "locks work"
    ok = _acquire_with_progress(redlock, what, guard + 3.0) and ok
    return ok


def _acquire_with_progress(redlock: Redlock, what: str, limit: float) -> bool:
    """Take the ``failover`` lock, retrying for up to ``limit`` seconds with a line per second."""
    started = time.perf_counter()
    last_report = started
    while True:
        try:
            lock = redlock.lock("failover")
            granted = lock.acquire(blocking=False)
        except QuorumError:
            granted = False
        now = time.perf_counter()
        if granted:
            lock.release()
            print(f"  {what}: acquired after {now - started:.1f}s")
            return True
        if now - started > limit:
            print(f"  still refused after {limit:.1f}s (bug!)")
            return False
        if now - last_report >= 1.0:
            last_report = now
            print(f"  ... refused for {now - started:.0f}s, still waiting")
        time.sleep(0.2)


# --------------------------------------------------------------------------- fencing


def _paused_holder(
    urls: Sequence[str],
    ready: multiprocessing.synchronize.Event,
    out: multiprocessing.queues.Queue[tuple[int | None, bool]],
) -> None:
    redlock = Redlock(urls, key_prefix=TOUR_PREFIX, ttl=1, restart_guard=False)
    lock = redlock.lock("fenced", fencing=True)
    if not lock.acquire(timeout=10):
        return
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)  # a long GC pause, or a VM migration
    out.put((lock.fence, lock.held))


def fencing(cluster: RedisCluster, resources: Resources) -> bool:
    title("Fencing: a holder paused past its lease writes late")
    ready: multiprocessing.synchronize.Event = _CTX.Event()
    out: multiprocessing.queues.Queue[tuple[int | None, bool]] = _CTX.Queue()
    holder = resources.child(_paused_holder, cluster.urls, ready, out)
    if not ready.wait(15):
        print("  the first holder did not get the lock (bug!)")
        return False
    print("  the holder took the lock (1 s lease) and froze (SIGSTOP) before writing ...")
    redlock = Redlock(cluster.urls, key_prefix=TOUR_PREFIX, ttl=5, restart_guard=False)
    lock = redlock.lock("fenced", fencing=True)
    if not lock.acquire(timeout=10):
        print("  the lease never ran out (bug!)")
        return False
    storage = {"fence": lock.fence, "value": "written by the new holder"}
    print(f"  the lease ran out; a new holder got fence {lock.fence} and wrote")
    assert holder.pid is not None
    os.kill(holder.pid, signal.SIGCONT)
    old_fence, still_held = out.get(timeout=10)
    holder.join()
    accepted = old_fence is None or old_fence > storage["fence"]
    print(
        f"  the old holder wakes up: held={still_held}, tries to write with fence {old_fence}: "
        f"{'ACCEPTED (bug!)' if accepted else 'rejected by the storage'}"
    )
    lock.release()
    return not accepted and not still_held


# --------------------------------------------------------------------------- @locked view


def locked_view(site: WebServer) -> bool:
    """Two concurrent requests to the project's ``order_pay`` view, ``@locked(wait=0)``."""
    from django.core.management import call_command

    from testproject.views import gate

    title("Django: two concurrent requests to one @locked view")
    # The project's locks have their own key prefix, new to nodes one of which crashed a
    # moment ago: nothing vouches that none of its locks was held, so every node would sit
    # out max_ttl (60 s). The project has not started, so none is held: the operator's step.
    out = io.StringIO()
    call_command("redlock", "trust", "--yes", stdout=out)
    print("  the project is new to nodes that just had a crash, and holds no lock yet:")
    print(f"  `manage.py redlock trust --yes`: {out.getvalue().strip()}")
    url = f"{site.url}/orders/42/pay/"
    print(f"  the project runs on {site.url}; GET {url} twice at once")
    hold = gate("demo-tour")
    replies: list[Reply] = []
    # The first request waits inside the view (holding order:42) until the gate opens.
    first = threading.Thread(
        target=lambda: replies.append(fetch(url + "?gate=demo-tour")), daemon=True
    )
    first.start()
    if not hold.wait_arrivals(1, timeout=15):
        print("  the first request never reached the view (bug!)")
        return False
    second = fetch(url)
    hold.open()
    first.join(15)
    if not replies:
        print("  the first request got no answer (bug!)")
        return False
    print(f"  first:  {replies[0].status}, held the lock while the second one came in")
    retry_after = second.headers.get("Retry-After")
    print(f"  second: {second.status}, Retry-After: {retry_after}s, body: {second.body.strip()}")
    return replies[0].status == 200 and second.status == 423 and retry_after is not None
