"""What a semaphore permit costs next to the mutex and next to the Redis semaphores on PyPI.

    python bench/semaphore.py                 # 3 nodes, full size (about 90 s)
    python bench/semaphore.py --quick         # about 40 s
    python bench/semaphore.py --only ours     # no peer (nothing installed)

One process, ``--nodes`` local ``redis-server`` nodes started here. Ours runs on every node (a
quorum per permit); each peer runs on the first node, which is all it can use.

The peers, found on PyPI and called through their documented API (nothing patched). They are
installed as the lock peers are (``bench/peers.py``, :func:`load_isolated`: ``pip install
--no-deps --target ~/.cache/django-redlock-bench/peers/<dist>``, never into the environment);
redis-limiters needs pydantic, which the ``bench`` extra brings. ``--no-install`` skips a peer
that is not there yet.

``py-redis-semaphore``  ``redis_semaphore.Semaphore``: a sorted set of holders scored by expiry
                        (one script), a heartbeat thread per holder, waiters woken by a list
``redis-limiters``      ``redis_limiters.SyncSemaphore``: a list of N tokens, ``BLPOP`` to take
                        one, ``LPUSH`` to give it back; context manager only (always blocks)
``concurrency-limit``   ``concurrency_limit.limit``: a hash of holders, ``HSET`` then ``HLEN``
                        in a transaction, back off and poll (100 ms) when over; context manager

Part 1, uncontended: one thread, acquire + release of a free permit, in ``--rounds``
interleaved rounds so a burst of foreign load touches every row a little. Ours and
py-redis-semaphore use a non-blocking acquire, the context-manager peers their blocking one
(the permit is free, so it returns at once). p50, p99, rate (cycles/s, one thread) and the
ratio to our mutex's p50. Rows of ours: ``mutex`` (``rl.lock``), ``permit, free``
(``rl.semaphore(name, 8)``, nothing else held), ``permit, 7 of 8 held`` (7 held by another
client: the first slot tried is taken 7 times in 8, then the slots are read and a free one
taken), ``read lock``, ``write lock``; and ``ZSET by hand (1)``, the Redisson-style single-node
script with nothing around it (the floor of one round trip and one script).

Part 2, contended: ``--threads`` threads (8) share one semaphore of ``--limit`` permits (3),
each looping blocking acquire, a hold of ``--hold-ms`` (1 ms of sleep: the "work"), release,
for ``--seconds`` per round, rows interleaved over ``--rounds``. Ours also as a mutex (N = 1)
for the cost per permit. Reported: cycles/s, cycles/s per permit, failed acquires, and the
largest number of holders at once. Every thread notes the time after its acquire returned
and before it calls release (``time.monotonic``, one process): the noted intervals lie inside
the true holds, so more than N of them overlapping is a proven overshoot, never an artefact.

Part 3, past the lease: ``--limit`` holders hold for 3 leases of ``--lease`` seconds (2), each
library renewing where it can (ours ``auto_renew=True``, py-redis-semaphore its heartbeat; the
other two have no renewal), and one more caller comes after 1.5 and after 3 leases of quiet.
It must be refused; "holders told" is what each holder's library says at the end.

Nothing here is a test; the numbers are this machine's (a shared 2-core box: compare rows of
one run, not runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import redis  # noqa: E402

from bench import peers  # noqa: E402
from django_redlock import Redlock  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402

LIMIT = 8  #: permits of the uncontended semaphore
TTL = 10.0  #: every library's lease, seconds
WAIT = 10.0  #: bound of every blocking acquire, seconds

#: label -> (PyPI distribution, top-level module)
PEERS: dict[str, tuple[str, str]] = {
    "py-redis-semaphore": ("py-redis-semaphore", "redis_semaphore"),
    "redis-limiters": ("redis-limiters", "redis_limiters"),
    "concurrency-limit": ("concurrency-limit", "concurrency_limit"),
}

# A single-node semaphore as Redisson's RPermitExpirableSemaphore keeps it: permits in a sorted
# set scored by their expiry. KEYS[1] the set; ARGV[1] permit id, ARGV[2] ttl ms, ARGV[3] limit.
# Returns 1 when taken, 0 when every permit is held.
_ZSET_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class Holder(Protocol):
    """One caller's (one thread's) way into a semaphore."""

    def acquire(self, blocking: bool) -> bool: ...

    def release(self) -> None: ...

    def holds(self) -> bool | None:
        """Whether the library still tells this holder it holds (None: it has no way to)."""
        ...


@dataclass(frozen=True)
class Terms:
    """The lease and the bound of a blocking acquire, seconds; ``renew``: keep the lease."""

    ttl: float = TTL
    wait: float = WAIT
    renew: bool = False


USUAL = Terms()

#: (semaphore name, limit, terms) -> a new holder
Factory = Callable[[str, int, Terms], Holder]


class _Ours:
    def __init__(
        self, rl: Redlock, name: str, limit: int, terms: Terms = USUAL, mutex: bool = False
    ) -> None:
        self.rl, self.name, self.limit, self.terms, self.mutex = rl, name, limit, terms, mutex
        self.handle: Any = None

    def acquire(self, blocking: bool) -> bool:
        ttl, renew = self.terms.ttl, self.terms.renew
        if self.mutex:
            self.handle = self.rl.lock(self.name, ttl, auto_renew=renew)
        else:
            self.handle = self.rl.semaphore(self.name, self.limit, ttl, auto_renew=renew)
        wait = self.terms.wait if blocking else None
        return bool(self.handle.acquire(blocking=blocking, timeout=wait))

    def release(self) -> None:
        self.handle.release()

    def holds(self) -> bool | None:
        return bool(self.handle.held)


class _Managed:
    """A peer that only offers a context manager: entering is the acquire."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.make = make
        self.stack = contextlib.ExitStack()

    def acquire(self, blocking: bool) -> bool:
        self.stack.enter_context(self.make())
        return True

    def release(self) -> None:
        self.stack.close()

    def holds(self) -> bool | None:
        return None


class _PyRedisSemaphore:
    def __init__(self, mod: Any, client: redis.Redis, name: str, limit: int, terms: Terms) -> None:
        # Its heartbeat always runs (every lock_timeout / 3): ``renew`` changes nothing here.
        config = mod.SemaphoreConfig(
            name=name, limit=limit, lock_timeout=terms.ttl, acquire_timeout=terms.wait
        )
        self.sem = mod.Semaphore(client, config)

    def acquire(self, blocking: bool) -> bool:
        return bool(self.sem.acquire(blocking=blocking).success)

    def release(self) -> None:
        self.sem.release()

    def holds(self) -> bool | None:
        return bool(self.sem.is_acquired)


class _ZsetByHand:
    def __init__(self, script: Any, name: str, limit: int, client: redis.Redis) -> None:
        self.script, self.name, self.limit, self.client = script, name, limit, client
        self.token = ""

    def acquire(self, blocking: bool) -> bool:
        self.token = uuid.uuid4().hex
        return self.script(keys=[self.name], args=[self.token, int(TTL * 1000), self.limit]) == 1

    def release(self) -> None:
        self.client.zrem(self.name, self.token)

    def holds(self) -> bool | None:
        return None


def peer_factory(label: str, url: str) -> Factory:
    """The holder factory of one PyPI peer on the node at ``url`` (ImportError: not there)."""
    dist, module = PEERS[label]
    # The module's own name: these packages import themselves by absolute name.
    mod = peers.load_isolated(dist, module, module)
    client = redis.Redis.from_url(url)
    if label == "py-redis-semaphore":
        return lambda name, limit, terms: _PyRedisSemaphore(mod, client, name, limit, terms)
    if label == "redis-limiters":

        def limiters(name: str, limit: int, terms: Terms) -> Holder:
            # No renewal: ``expiry`` (whole seconds) is the list's, pushed back by each use.
            sem = mod.SyncSemaphore(
                name=name,
                capacity=limit,
                expiry=max(1, round(terms.ttl)),
                max_sleep=terms.wait,
                connection=client,
            )
            return _Managed(lambda: sem)

        return limiters
    # Its host/port fields hand redis-py's Connection a ``path`` keyword that redis-py 8
    # refuses (TypeError); its documented connection_pool field goes around that.
    config = mod.RedisConfiguration(connection_pool=redis.ConnectionPool.from_url(url))

    def concurrency(name: str, limit: int, terms: Terms) -> Holder:
        # No renewal: ``limit_expire`` (whole seconds) is the hash's, pushed back by each entry.
        cfg = mod.LimitConfiguration(
            key=name,
            limit=limit,
            limit_timeout=int(terms.wait),
            limit_expire=max(1, round(terms.ttl)),
        )
        return _Managed(lambda: mod.limit(config, cfg))

    return concurrency


def peer_version(label: str) -> str:
    return peers._version(PEERS[label][0])


# -- the history check -------------------------------------------------------------------------


def max_holders(intervals: Iterable[tuple[float, float]]) -> tuple[int, int]:
    """The most intervals open at one instant, and how many entries found >= that many open.

    An exit and an entry at the same instant are taken as exit first: a tie is no proof of
    overlap. Returns ``(most, entries that raised the count to most)``.
    """
    events: list[tuple[float, int]] = []
    for t_in, t_out in intervals:
        events.append((t_in, 1))
        events.append((t_out, -1))
    events.sort()  # (t, -1) sorts before (t, +1)
    open_now = most = 0
    for _, delta in events:
        open_now += delta
        most = max(most, open_now)
    at_most = 0
    open_now = 0
    for _, delta in events:
        open_now += delta
        if delta == 1 and open_now == most:
            at_most += 1
    return most, at_most


# -- part 1: uncontended -----------------------------------------------------------------------


@dataclass
class Cycles:
    name: str
    samples: list[float] = field(default_factory=list)

    def p(self, q: float) -> float:
        got = sorted(self.samples)
        return got[max(0, int(len(got) * q) - 1)]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def rate(self) -> float:
        return len(self.samples) / sum(self.samples)


def uncontended_rows(
    rl: Redlock, other: Redlock, single: redis.Redis, peer_rows: dict[str, Factory], nodes: int
) -> dict[str, Callable[[], None]]:
    # Held through another client: this one cannot skip the taken slots by its own records.
    held = [other.semaphore("bench:crowded", LIMIT, 30.0, owner=f"o{i}") for i in range(LIMIT - 1)]
    for hold in held:
        assert hold.acquire(blocking=False)
    zset = single.register_script(_ZSET_ACQUIRE)

    def cycle(holder: Holder, blocking: bool = False) -> Callable[[], None]:
        def run() -> None:
            assert holder.acquire(blocking)
            holder.release()

        return run

    def read() -> None:
        hold = rl.read_lock("bench:rw", 10.0)
        assert hold.acquire(blocking=False)
        hold.release()

    def write() -> None:
        hold = rl.write_lock("bench:rw", 10.0)
        assert hold.acquire(blocking=False)
        hold.release()

    table = {
        f"ours: mutex ({nodes})": cycle(_Ours(rl, "bench:mutex", 1, mutex=True)),
        f"ours: permit, free ({nodes})": cycle(_Ours(rl, "bench:free", LIMIT)),
        f"ours: permit, {LIMIT - 1} of {LIMIT} held ({nodes})": cycle(
            _Ours(rl, "bench:crowded", LIMIT)
        ),
        f"ours: read lock ({nodes})": read,
        f"ours: write lock ({nodes})": write,
    }
    for label, factory in peer_rows.items():
        holder = factory(f"bench:u:{label}", LIMIT, USUAL)
        table[f"{label} (1)"] = cycle(holder, blocking=label != "py-redis-semaphore")
    table["ZSET by hand (1)"] = cycle(_ZsetByHand(zset, "bench:zset", LIMIT, single))
    return table


def run_uncontended(table: dict[str, Callable[[], None]], rounds: int, cycles: int) -> list[Cycles]:
    out = {name: Cycles(name) for name in table}
    for run in table.values():  # warm connections and script caches
        for _ in range(20):
            run()
    for _ in range(rounds):
        for name, run in table.items():
            for _ in range(cycles):
                t0 = time.perf_counter()
                run()
                out[name].samples.append(time.perf_counter() - t0)
    return list(out.values())


# -- part 2: contended -------------------------------------------------------------------------


@dataclass
class Contended:
    name: str
    limit: int
    intervals: list[tuple[float, float]] = field(default_factory=list)
    seconds: float = 0.0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    per_thread: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.intervals) / self.seconds if self.seconds else 0.0


def contend(
    factory: Factory,
    name: str,
    limit: int,
    threads: int,
    seconds: float,
    hold: float,
    row: Contended,
) -> None:
    """``threads`` threads loop acquire / hold / release on one semaphore for ``seconds``."""
    holders = [factory(name, limit, USUAL) for _ in range(threads)]
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def worker(holder: Holder) -> None:
        mine: list[tuple[float, float]] = []
        failed, errors = 0, []
        start.wait()
        while time.monotonic() < deadline[0]:
            try:
                got = holder.acquire(True)
            except Exception as exc:
                failed += 1
                errors.append(f"acquire: {type(exc).__name__}: {exc}")
                continue
            if not got:
                failed += 1
                continue
            t_in = time.monotonic()
            time.sleep(hold)
            t_out = time.monotonic()
            try:
                holder.release()
            except Exception as exc:
                errors.append(f"release: {type(exc).__name__}: {exc}")
            mine.append((t_in, t_out))
        with lock:
            row.intervals.extend(mine)
            row.failed += failed
            row.errors.extend(errors)
            row.per_thread.append(len(mine))

    workers = [threading.Thread(target=worker, args=(h,), daemon=True) for h in holders]
    for w in workers:
        w.start()
    t0 = time.monotonic()
    deadline[0] = t0 + seconds
    start.wait()
    for w in workers:
        w.join(seconds + 2 * WAIT + 5)
        assert not w.is_alive(), f"{row.name}: a thread is stuck"
    row.seconds += time.monotonic() - t0


def run_contended(
    factories: dict[str, tuple[Factory, int]],
    rounds: int,
    threads: int,
    seconds: float,
    hold: float,
) -> list[Contended]:
    rows = {name: Contended(name, limit) for name, (_, limit) in factories.items()}
    for r in range(rounds):
        for name, (factory, limit) in factories.items():
            # A fresh semaphore per round: no round inherits another's state.
            key = f"bench:c:{name.split()[0]}:{limit}:{r}"
            contend(factory, key, limit, threads, seconds, hold, rows[name])
    return list(rows.values())


# -- part 3: a hold past the lease ------------------------------------------------------------


@dataclass
class PastLease:
    name: str
    limit: int
    probes: int = 0
    admitted: int = 0  #: probes let in while ``limit`` holders held
    told: list[bool | None] = field(default_factory=list)  #: each holder's ``holds()`` at the end
    errors: list[str] = field(default_factory=list)


def past_lease(factory: Factory, name: str, limit: int, lease: float, row: PastLease) -> None:
    """``limit`` holders hold for 3 leases, with the library's renewal where it has one; one
    caller comes after 1.5 leases of quiet and again after 3, and must be refused."""
    terms = Terms(ttl=lease, wait=0.2, renew=True)
    holders = [factory(name, limit, terms) for _ in range(limit)]
    for h in holders:
        assert h.acquire(True), f"{row.name}: a free permit was refused"
    t0 = time.monotonic()
    for at in (1.5 * lease, 3.0 * lease):
        # The quiet is the point: no event to wait for, the leases run on the servers' clocks.
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        probe = factory(name, limit, terms)
        row.probes += 1
        try:
            got = probe.acquire(False)
        except Exception as exc:  # the context-manager peers refuse by raising
            got = False
            if "Exceeded" not in type(exc).__name__:
                row.errors.append(f"{type(exc).__name__}: {exc}")
        if got:
            row.admitted += 1
            probe.release()
    row.told = [h.holds() for h in holders]
    for h in holders:
        try:
            h.release()
        except Exception as exc:
            row.errors.append(f"release: {type(exc).__name__}: {exc}")


# -- main --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=500, help="per row and round (part 1)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--limit", type=int, default=3, help="permits (part 2)")
    parser.add_argument("--seconds", type=float, default=2.5, help="per row and round (part 2)")
    parser.add_argument("--hold-ms", type=float, default=1.0)
    parser.add_argument("--lease", type=float, default=2.0, help="part 3's lease, seconds")
    parser.add_argument("--no-lease", action="store_true", help="skip part 3")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 200 cycles, 1.5 s")
    parser.add_argument(
        "--only", default="ours," + ",".join(PEERS), help="ours and/or peers, comma-separated"
    )
    parser.add_argument("--no-install", action="store_true", help="skip peers not yet installed")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.cycles, args.seconds = 2, 200, 1.5
    peers.ALLOW_INSTALL = not args.no_install
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {"ours", *PEERS}
    if unknown:
        parser.error(f"unknown in --only: {', '.join(sorted(unknown))}")

    cluster = RedisCluster(args.nodes)
    try:
        rl, other = Redlock(cluster.urls, ttl=30.0), Redlock(cluster.urls, ttl=30.0)
        single = redis.Redis.from_url(cluster.urls[0])
        peer_rows: dict[str, Factory] = {}
        for label in PEERS:
            if label not in only:
                continue
            try:
                peer_rows[label] = peer_factory(label, cluster.urls[0])
            except ImportError as exc:
                print(f"# {label}: skipped ({exc})")
        versions = ", ".join(f"{label} {peer_version(label)}" for label in peer_rows)
        print(f"# redis-py {redis.__version__}" + (f"; {versions}" if versions else ""))

        table = uncontended_rows(rl, other, single, peer_rows, args.nodes)
        if "ours" not in only:
            table = {k: v for k, v in table.items() if not k.startswith("ours")}
        got = run_uncontended(table, args.rounds, args.cycles)
        base = next((c.p50 for c in got if c.name.startswith("ours: mutex")), None)
        print()
        print(
            f"uncontended: one thread, {args.rounds} rounds x {args.cycles} cycles, "
            f"limit {LIMIT}; ours on {args.nodes} nodes, peers on 1"
        )
        print(f"{'row':<30} {'p50 us':>8} {'p99 us':>8} {'cyc/s':>7} {'x mutex':>8}")
        for c in got:
            ratio = f"{c.p50 / base:>8.2f}" if base else f"{'-':>8}"
            print(
                f"{c.name:<30} {c.p50 * 1e6:>8.0f} {c.p(0.99) * 1e6:>8.0f} {c.rate:>7.0f} {ratio}"
            )

        factories: dict[str, tuple[Factory, int]] = {}
        if "ours" in only:
            factories[f"ours: mutex ({args.nodes})"] = (
                lambda name, limit, terms: _Ours(rl, name, 1, terms, mutex=True),
                1,
            )
            factories[f"ours: semaphore ({args.nodes})"] = (
                lambda name, limit, terms: _Ours(rl, name, limit, terms),
                args.limit,
            )
        for label, factory in peer_rows.items():
            factories[f"{label} (1)"] = (factory, args.limit)
        rows = run_contended(
            factories, args.rounds, args.threads, args.seconds, args.hold_ms / 1000
        )
        print()
        print(
            f"contended: {args.threads} threads, limit {args.limit} (the mutex: 1), hold "
            f"{args.hold_ms:g} ms, {args.rounds} rounds x {args.seconds:g} s"
        )
        print(
            f"{'row':<30} {'cyc/s':>7} {'/permit':>7} {'slowest':>7} {'failed':>6} "
            f"{'max held':>8} {'at max':>6}  verdict"
        )
        for row in rows:
            most, at_most = max_holders(row.intervals)
            verdict = "ok" if most <= row.limit else f"OVERSHOOT: {most} > {row.limit}"
            mean = statistics.mean(row.per_thread) if row.per_thread else 0
            slowest = f"{min(row.per_thread) / mean:.0%}" if mean else "-"
            print(
                f"{row.name:<30} {row.rate:>7.0f} {row.rate / row.limit:>7.0f} {slowest:>7} "
                f"{row.failed:>6} {most:>8} {at_most:>6}  {verdict}"
            )
            if row.errors:
                print(f"    {len(row.errors)} errors, first: {row.errors[0][:160]}")
        if not args.no_lease:
            print()
            print(
                f"past the lease: {args.limit} holders hold 3 leases of {args.lease:g} s "
                "(renewed where the library can); one more caller after 1.5 and 3 leases"
            )
            print(f"{'row':<30} {'admitted':>8}  {'holders told':<24} verdict")
            for name, (factory, limit) in factories.items():
                if limit == 1:
                    continue  # the mutex: the semaphore row says the same
                past = PastLease(name, limit)
                key = f"bench:lease:{name.split()[0]}"
                past_lease(factory, key, limit, args.lease, past)
                told = (
                    "no API"
                    if all(t is None for t in past.told)
                    else f"{sum(bool(t) for t in past.told)} of {limit} still hold"
                )
                verdict = (
                    "ok"
                    if past.admitted == 0
                    else f"OVERSHOOT: {limit + 1} holders ({past.admitted} of {past.probes})"
                )
                print(f"{name:<30} {past.admitted:>8}  {told:<24} {verdict}")
                if past.errors:
                    print(f"    {len(past.errors)} errors, first: {past.errors[0][:160]}")
        rl.close()
        other.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
