"""The fault scenarios. Each runs on its own real nodes with many client processes and returns
a :class:`~tests.faults.harness.ScenarioResult`; ``SCENARIOS`` lists them in table order.

Every scenario is a function ``(profile) -> ScenarioResult``; the profile scales rounds and
durations (quick: bounded for CI; soak: ten times longer). What each one must show is asserted
in ``tests/test_faults.py``; the numbers go to the table in ``docs/faults.rst``.

Recovery is the longest time from a *mark* to the next successful acquire by any client: the mark
is the heal for faults that stop the lock (majority down, late
replies, restart guard), the injection for faults the cluster rides through (minority faults),
and the death or freeze of the holder for holder faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django_redlock.core import scripts
from django_redlock.core.commands import lock_fields, lock_value

from .harness import _CTX, PREFIX, Harness, Profile, ScenarioResult, WorkerSpec
from .history import HistoryWriter
from .oracle import OracleClient

__all__ = ["SCENARIOS", "ScenarioSkipped", "run"]

#: Client settings shared by the scenarios: a 100 ms node timeout keeps a loaded 2-core CI box
#: from turning scheduling hiccups into node failures.
BASE: dict[str, Any] = {"node_timeout": 0.1, "retry_delay": 0.05}
CLIENTS = 6


def _holds_between(h: Harness, start: float, end: float) -> int:
    return sum(1 for x in h.holds() if start <= x.acquired_at <= end)


# --------------------------------------------------------------------------- scenarios


def contention(p: Profile) -> ScenarioResult:
    """Six processes, one lock name, no faults: the baseline."""
    with Harness(3) as h:
        h.warm_up(**BASE)
        h.start_clients(CLIENTS, WorkerSpec(h.urls, BASE, ttl=1.0))
        h.begin()
        h.sleep(p.seconds(3.0))
        h.stop_clients()
        return h.result("contention", "Contention only")


def _minority(p: Profile, how: str) -> ScenarioResult:
    """Five nodes; two at a time are killed (then started again, empty) or paused (then
    resumed) while six processes contend. A quorum of three keeps granting."""
    kw = {**BASE, "ttl": 1.0, "max_ttl": 1.5}
    with Harness(5) as h:
        h.warm_up(**kw)
        h.start_clients(CLIENTS, WorkerSpec(h.urls, kw, ttl=1.0, hold=(0.005, 0.05)))
        h.begin()
        h.sleep(0.3)
        during = 0
        for _ in range(p.rounds(2)):
            down = random.sample(range(5), 2)
            h.pump(2.0, until=lambda e: e[0] == "holding")  # hit a cluster with a holder
            t0 = time.monotonic()
            for i in down:
                if how == "kill":
                    h.cluster[i].kill()
                elif how == "pause":
                    h.cluster[i].pause()
                else:  # restart empty, within the holder's TTL
                    h.cluster[i].restart(empty=True)
                h.faults += 1
            h.mark(f"{how} {down}", t0)
            h.sleep(1.0)
            during += _holds_between(h, t0, time.monotonic())
            for i in down:
                if how == "kill":
                    h.cluster[i].start()
                elif how == "pause":
                    h.cluster[i].resume()
            # A node that came back empty sits out max_ttl (restart guard): wait it out so the
            # next round's two faults leave a quorum.
            h.sleep(1.7 if how != "pause" else 0.5)
        h.stop_clients()
        verb = {"kill": "killed", "pause": "paused (SIGSTOP)", "restart": "restarted empty"}[how]
        return h.result(
            f"minority_{how}", f"Minority (2 of 5) {verb}", acquired_during_fault=during
        )


def minority_killed(p: Profile) -> ScenarioResult:
    return _minority(p, "kill")


def minority_paused(p: Profile) -> ScenarioResult:
    return _minority(p, "pause")


def minority_restarted(p: Profile) -> ScenarioResult:
    return _minority(p, "restart")


def majority_down(p: Profile) -> ScenarioResult:
    """Two of three nodes killed: every acquire must fail closed with QuorumError, and once
    the attempts stop nothing may be left on the survivor. The killed nodes come back empty,
    sit out the restart guard (max_ttl), then the lock works again."""
    kw = {**BASE, "ttl": 1.0, "max_ttl": 1.5}
    left: list[dict[str, str]] = []
    granted = 0
    with Harness(3) as h:
        h.warm_up(**kw)
        h.start_clients(CLIENTS, WorkerSpec(h.urls, kw, ttl=1.0, mode="poll", hold=(0.005, 0.05)))
        h.begin()
        h.sleep(0.5)
        for _ in range(p.rounds(1)):
            h.cluster[0].kill()
            h.cluster[1].kill()
            h.faults += 2
            killed = time.monotonic()
            h.sleep(1.0)
            h.idle.set()  # stop attempting; let in-flight attempts and holds finish
            h.sleep(0.5)
            granted += _holds_between(h, killed + 0.2, time.monotonic())
            left.extend(h.lock_keys([2]))
            h.cluster[0].start()
            h.cluster[1].start()
            h.mark("majority restarted")
            h.idle.clear()
            h.sleep(2.5)
        h.stop_clients()
        return h.result(
            "majority_down",
            "Majority (2 of 3) killed: fail closed",
            granted_while_down=granted,
            left_on_survivor=sum(len(k) for k in left),
        )


def holder_killed(p: Profile) -> ScenarioResult:
    """SIGKILL the process holding the (auto-renewed) lock: the others get it once its lease
    runs out, no earlier."""
    kw = {**BASE, "ttl": 1.0}
    killed_holding = 0
    with Harness(3) as h:
        h.warm_up(**kw)
        spec = WorkerSpec(h.urls, kw, ttl=1.0, auto_renew=True, hold=(0.3, 0.6))
        h.start_clients(CLIENTS, spec)
        h.begin()
        for _ in range(p.rounds(2)):
            ev = h.pump(5.0, until=lambda e: e[0] == "holding" and e[1] not in h.done)
            if ev is None:
                break
            h.kill_client(ev[1])
            h.faults += 1
            h.mark(f"killed {ev[1]}", subject=ev[1])
            h.start_clients(1, spec)  # a replacement, so the soak never runs out of clients
            h.sleep(1.5)
        h.stop_clients()
        for hold in h.holds():
            if hold.process in {m[2] for m in h.marks} and hold.released_at is None:
                killed_holding += 1
        return h.result(
            "holder_killed", "Holder SIGKILLed while holding", killed_while_holding=killed_holding
        )


def holder_paused(p: Profile) -> ScenarioResult:
    """A holder checks its validity, is frozen (SIGSTOP) past its TTL before writing, and is
    resumed after another process took the lock and wrote: its write must be rejected by the
    fence, it must see the lock lost, and release must refuse."""
    kw = {**BASE, "ttl": 1.0}
    rounds = p.rounds(2)
    with Harness(3) as h:
        h.warm_up(**kw)
        spec = WorkerSpec(h.urls, kw, ttl=1.0, auto_renew=True, hold=(0.005, 0.05))
        (victim,) = h.start_clients(1, spec, victim=rounds)
        h.start_clients(CLIENTS - 1, spec)
        h.begin()
        for _ in range(rounds):
            if h.pump(20.0, until=lambda e: e[0] == "checked") is None:
                break
            os.kill(h.pid(victim), signal.SIGSTOP)
            h.send(victim, "go")  # read when it wakes up
            paused = time.monotonic()
            h.faults += 1
            h.mark(f"paused {victim}", paused, subject=victim)
            # Another process takes the lock (after the lease ran out) and writes.
            h.pump(10.0, until=lambda e: e[0] == "wrote" and e[1] != victim and e[4])
            os.kill(h.pid(victim), signal.SIGCONT)
            h.pump(10.0, until=lambda e: e[0] == "wrote" and e[1] == victim)
        h.stop_clients()
        return h.result("holder_paused", "Holder paused (SIGSTOP) past its TTL, resumed")


def replies_delayed(p: Profile) -> ScenarioResult:
    """Every reply is held back 0.8 s by a proxy (node_timeout 0.9 s, ttl 1 s, drift 0.2): the
    quorum answers in time for the node timeout but after the lock's validity is gone. No
    lock may be granted; then the delay is lifted and the lock works again."""
    kw = {**BASE, "node_timeout": 0.9, "drift_factor": 0.2, "ttl": 1.0, "retry_count": 0}
    with Harness(3, proxies=True) as h:
        h.warm_up(**kw)
        for proxy in h.proxies:
            proxy.delay = 0.8
        h.start_clients(CLIENTS, WorkerSpec(h.urls, kw, ttl=1.0, mode="poll"))
        h.begin()
        h.sleep(p.seconds(2.5))
        h.faults = 1  # one delay window
        healed = time.monotonic()
        for proxy in h.proxies:
            proxy.delay = 0.0
        h.mark("delay lifted", healed)
        h.sleep(1.5)
        h.stop_clients()
        granted = sum(1 for x in h.holds() if x.acquired_at < healed)
        return h.result(
            "replies_delayed",
            "Replies delayed past the TTL during acquire",
            granted_while_delayed=granted,
        )


def _restart_inside_ttl(p: Profile, guard: bool) -> ScenarioResult:
    """The Redlock paper's restart hazard. Node 2 is down when H takes the lock, so H holds
    nodes 0 and 1 only. Node 2 comes back (empty), then node 1 crashes and comes back empty,
    all inside H's TTL: nodes 1 and 2 now know nothing of H. Without the restart guard another
    client gets nodes 1 and 2 while H still holds: an overlap the checker must find. With it,
    nodes 1 and 2 sit out max_ttl and the lock fails closed until H's lease has run out."""
    kw = {**BASE, "ttl": 3.0, "max_ttl": 3.0, "restart_guard": guard}
    with Harness(3) as h:
        h.warm_up(**kw)
        h.start_clients(
            CLIENTS,
            WorkerSpec(h.urls, kw, ttl=3.0, mode="poll", hold=(2.0, 2.0), acquire_timeout=5.0),
        )
        h.begin()
        for _ in range(p.rounds(1)):
            h.cluster[2].kill()
            h.faults += 1
            ev = h.pump(10.0, until=lambda e: e[0] == "holding")
            if ev is None:
                break
            h.cluster[2].start()
            # Marked before the restart: a client may get the lock the moment node 1 answers,
            # before restart() has returned.
            h.mark("node 1 restarted empty", subject=ev[1])
            h.cluster[1].restart(empty=True)
            h.faults += 1
            h.sleep(4.0)
        h.stop_clients()
        name = "restart_guard" if guard else "restart_no_guard"
        title = (
            "Node restarted empty inside the TTL, restart guard on"
            if guard
            else "Node restarted empty inside the TTL, guard OFF (checker must catch it)"
        )
        return h.result(name, title)


def restart_no_guard(p: Profile) -> ScenarioResult:
    return _restart_inside_ttl(p, guard=False)


def restart_guard(p: Profile) -> ScenarioResult:
    return _restart_inside_ttl(p, guard=True)


_DEL_IF_TOKEN = """
if string.match(redis.call('GET', KEYS[1]) or '', '^(%S+) ') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def key_deleted(p: Profile) -> ScenarioResult:
    """An operator (or eviction, or a failover to a replica that missed the write) deletes the
    lock key on node 0 while auto-renewed holders hold it: the holder keeps nodes 1 and 2, a
    quorum, so nobody else may get the lock.

    Only holds that have the key on all three nodes are hit. Under contention many holds get
    only two nodes (the losers of a race hold the third for a moment, and the winner never
    comes back for it); deleting one key of such a *bare-quorum* hold loses the lock, which
    ``key_deleted_bare`` shows. Those holds are counted here (``bare_holds_skipped``), not hit:
    hitting them would also chain overlaps (every later hold would be bare as well).
    """
    kw = {**BASE, "ttl": 0.9}
    deleted: set[str] = set()
    bare: set[str] = set()
    with Harness(3) as h:
        h.warm_up(**kw)
        h.start_clients(CLIENTS, WorkerSpec(h.urls, kw, ttl=0.9, auto_renew=True, hold=(0.05, 0.3)))
        h.begin()
        key = f"{PREFIX}:lock:fault:shared"
        clients = [node.client(socket_timeout=5) for node in h.cluster]
        try:
            delete = clients[0].register_script(_DEL_IF_TOKEN)
            deadline = time.monotonic() + p.seconds(3.0)
            while time.monotonic() < deadline:
                values = [c.get(key) for c in clients]
                tokens = [lock_fields(v)["token"].encode() if v else None for v in values]
                token = tokens[1]
                holder = token is not None and token == tokens[2]
                if holder and tokens[0] == token and token.decode() not in deleted:
                    if delete(keys=[key], args=[token]):
                        h.faults += 1
                        deleted.add(token.decode())
                elif holder and tokens[0] != token:
                    bare.add(token.decode())
                h.sleep(0.01)
        finally:
            for c in clients:
                c.close()
        h.stop_clients()
        holds = {x.token for x in h.holds()}
        return h.result(
            "key_deleted",
            "Lock key deleted early on one node (holder on all 3)",
            spare_deletions=len(deleted & holds),
            bare_holds_skipped=len(bare & holds - deleted),
        )


def key_deleted_bare(p: Profile) -> ScenarioResult:
    """The directed form of the bare-quorum case: node 2 holds a competitor's token (a racing
    attempt that has not cleaned up yet) when H acquires, so H gets nodes 0 and 1 only. The
    competitor's key then goes (its cleanup) and H's key on node 0 is deleted (one node loses
    one key). Another client gets nodes 0 and 2 while H's lease is still valid: an overlap. H's
    watchdog notices at its next renewal (the lock is reported lost)."""
    kw = {**BASE, "ttl": 2.0}
    key = f"{PREFIX}:lock:fault:shared"
    with Harness(3) as h:
        h.warm_up(**kw)
        h.start_clients(
            CLIENTS, WorkerSpec(h.urls, kw, ttl=2.0, auto_renew=True, mode="poll", hold=(1.5, 1.5))
        )
        with h.cluster[2].client(socket_timeout=5) as c:
            c.set(key, lock_value("COMPETITOR", ttl_ms=10_000), px=10_000)
        h.begin()
        for _ in range(p.rounds(1)):
            ev = h.pump(10.0, until=lambda e: e[0] == "holding")
            if ev is None:
                break
            h.mark("key deleted on node 0", subject=ev[1])
            with h.cluster[2].client(socket_timeout=5) as c:
                c.delete(key)  # the competitor's cleanup
            with h.cluster[0].client(socket_timeout=5) as c:
                h.faults += c.eval(_DEL_IF_TOKEN, 1, key, ev[3])
            h.sleep(2.0)
            with h.cluster[2].client(socket_timeout=5) as c:  # set up the next round
                c.set(key, lock_value("COMPETITOR", ttl_ms=10_000), px=10_000)
        h.stop_clients()
        return h.result(
            "key_deleted_bare", "Key deleted on one node of a bare-quorum (2 of 3) hold"
        )


def clock_jump(p: Profile) -> ScenarioResult:
    """Each client's wall clock (time.time) jumps by +-1 h every 0.1-0.3 s; validity is
    measured on the monotonic clock, so it must stay in (0, ttl] and renewal must go on."""
    kw = {**BASE, "ttl": 1.0}
    with Harness(3) as h:
        h.warm_up(**kw)
        h.start_clients(
            CLIENTS,
            WorkerSpec(h.urls, kw, ttl=1.0, auto_renew=True, hold=(0.005, 0.5), clock_jump=True),
        )
        h.begin()
        h.sleep(p.seconds(3.0))
        h.stop_clients()
        res = h.result("clock_jump", "Client wall clock jumped by +-1 hour")
        res.faults = res.stats["clock_jumps"]
        return res


def _fork_child(
    i: int, rl: Any, parent_name: str, history: str, oracle: tuple[str, int], out: Any
) -> None:
    """One forked child, using the Redlock object it inherited from the parent."""
    import traceback

    from django_redlock import LockNotOwned

    report: dict[str, Any] = {"i": i, "pid": os.getpid()}
    try:
        hist = HistoryWriter(history, f"f{i}")
        writer = OracleClient(oracle)
        # The parent's lock is not ours: a forked child holds none of its parent's locks.
        report["parent_lock_refused"] = not rl.lock(parent_name).acquire(blocking=False)
        # A lock of its own, renewed by the child's own watchdog past its 1 s TTL.
        own = rl.lock(f"fork:{i}", ttl=1.0, auto_renew=True)
        if not own.acquire(timeout=30):
            raise AssertionError("own lock not acquired")
        t_own = time.monotonic()
        report["own_token"] = own.token
        hist.acquired(own.name, own.token, own.fence, t_own, t_own + own.validity)
        # One name shared by all children: mutual exclusion among 100 forks.
        shared = rl.lock("fork:shared", ttl=2.0, fencing=True)
        if not shared.acquire(timeout=120):
            raise AssertionError("shared lock not acquired within 120 s")
        t = time.monotonic()
        report["shared_token"] = shared.token
        hist.acquired(shared.name, shared.token, shared.fence, t, t + shared.validity)
        time.sleep(0.005)
        report["shared_write_ok"] = writer.write(
            shared.name,
            shared.fence or 0,
            proc=f"f{i}",
            token=shared.token or "",
            vend=t + shared.validity,
        )
        hist.releasing(shared.token or "", time.monotonic())
        try:
            shared.release()
            hist.outcome(report["shared_token"], "ok")
        except LockNotOwned:
            hist.outcome(report["shared_token"], "not-owned")
        time.sleep(max(t_own + 1.5 - time.monotonic(), 0.0))
        report["own_held"] = own.held
        report["own_check"] = own.check()
        info = rl.lock_info(own.name)
        report["renewals"] = info.renewals if info is not None else -1
        now = time.monotonic()
        hist.releasing(own.token, now, now + own.validity)
        own.release()
        hist.outcome(report["own_token"], "ok")
    except BaseException:
        report["error"] = traceback.format_exc()
    out.put(report)


def forks(p: Profile) -> ScenarioResult:
    """A parent holding an auto-renewed lock forks 100 children that use the Redlock object
    they inherited: each must get its own connections and token, renew its own lock from its
    own watchdog thread, never hold the parent's lock, and the 100 must exclude each other on
    a shared name. The parent's lock stays held and renewed throughout."""
    from django_redlock import LockNotOwned, Redlock

    children, batches = 100, min(p.scale, 5)  # soak: batches of 100, one after another
    # 0.3 s node timeout: 100 processes connecting at once on two cores is the point here,
    # not a test of connect latency.
    kw = {**BASE, "ttl": 1.0, "node_timeout": 0.3}
    with Harness(3) as h:
        h.warm_up(**kw)
        rl = Redlock(h.urls, **kw)
        # 5 s lease: 100 forks on two cores starve a 1 s lease's watchdog (it is then, rightly,
        # reported lost), which is not what this scenario is about.
        parent_lock = rl.lock("fork:parent", ttl=5.0, auto_renew=True)
        assert parent_lock.acquire(blocking=False), "parent could not take its lock"
        out = _CTX.SimpleQueue()
        h.begin()
        reports: list[dict[str, Any]] = []
        for batch in range(batches):
            procs = []
            for i in range(batch * children, (batch + 1) * children):
                proc = _CTX.Process(
                    target=_fork_child,
                    daemon=True,
                    args=(
                        i,
                        rl,
                        parent_lock.name,
                        str(h.dir / f"f{i}.jsonl"),
                        h.oracle.address,
                        out,
                    ),
                )
                proc.start()
                procs.append(proc)
            deadline = time.monotonic() + 240
            while len(reports) < (batch + 1) * children and time.monotonic() < deadline:
                reports.append(out.get())
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        children *= batches
        tokens = [r.get(k) for r in reports for k in ("own_token", "shared_token")]
        tokens.append(parent_lock.token)
        parent_ok = parent_lock.held and parent_lock.check()
        parent_info = rl.lock_info(parent_lock.name)
        parent_lost = parent_lock.lost
        with contextlib.suppress(LockNotOwned):
            parent_lock.release()
        rl.close()
        res = h.result(
            "forks",
            "100 forked children (inherited Redlock object)"
            + (f", {batches} batches" if batches > 1 else ""),
            children_reported=len(reports),
            child_errors=[r["error"] for r in reports if "error" in r][:3],
            unique_tokens=len({t for t in tokens if t}),
            expected_tokens=2 * children + 1,
            parent_lock_refused=sum(1 for r in reports if r.get("parent_lock_refused")),
            renewed_children=sum(1 for r in reports if r.get("renewals", 0) >= 1),
            held_after_ttl=sum(1 for r in reports if r.get("own_held") and r.get("own_check")),
            parent_still_held=parent_ok,
            parent_lost=parent_lost,
            parent_renewals=parent_info.renewals if parent_info is not None else -1,
        )
        res.clients = children
        res.stats["forks"] = children
        return res


def _reset_directed(h: Harness, kw: dict[str, Any]) -> dict[str, Any]:
    """Two directed acquires whose acquire script runs on a node while the reply is lost (the
    connection is reset), on pooled connections (the common path: the client re-sends once
    on a fresh connection and finds the key its first send created):

    * A: resets on nodes 0 and 1, a foreign token on node 2. The lock *is* ours on nodes 0
      and 1 (a quorum): success is correct if and only if our token is there; release must
      then remove it from both and leave the foreign one.
    * B: reset on node 0, foreign tokens on nodes 1 and 2. Only node 0 is ours: no success,
      and the cleanup must remove our token from node 0 and nothing else.
    """
    from django_redlock import QuorumError, Redlock

    rl = Redlock(h.urls, **{**kw, "retry_count": 0})
    out: dict[str, Any] = {}
    own_left = 0
    foreign_intact = True
    try:
        warm = rl.lock("fault:reset-warm")  # pooled connections: the common, reused path
        assert warm.acquire(blocking=False)
        warm.release()
        for case, reset, foreign in (("a", (0, 1), (2,)), ("b", (0,), (1, 2))):
            name = f"fault:reset-{case}"
            key = f"{PREFIX}:lock:{name}"
            for i in foreign:
                with h.cluster[i].client(socket_timeout=5) as c:
                    c.set(key, lock_value("FOREIGN", ttl_ms=5000), px=5000)
            for i in reset:
                h.proxies[i].armed = 1
            lock = rl.lock(name, ttl=5.0)
            try:
                outcome: object = lock.acquire(blocking=False)
            except QuorumError as exc:
                outcome = f"QuorumError: {exc}"
            out[f"directed_{case}_resets"] = all(h.proxies[i].armed == 0 for i in reset)
            tokens = [keys.get(key) for keys in h.lock_keys()]
            if outcome is True:
                # A true success: our token on a quorum.
                ours = sum(1 for t in tokens if t == lock.token)
                out[f"directed_{case}_true_success"] = ours >= rl.quorum
                lock.release()
                tokens = [keys.get(key) for keys in h.lock_keys()]
            out[f"directed_{case}_acquire"] = outcome
            own_left += sum(1 for t in tokens if t not in (None, "FOREIGN"))
            foreign_intact &= all(tokens[i] == "FOREIGN" for i in foreign)
        out["directed_own_token_left"] = own_left
        out["directed_foreign_intact"] = foreign_intact
        return out
    finally:
        rl.close()


def conn_reset(p: Profile) -> ScenarioResult:
    """Proxies in front of the nodes reset the connection right after forwarding an acquire
    (the script ran, its reply is lost) on 20% of acquires. No acquire may report success
    without our token on a quorum (checked with lock.check() at once), and no overlap."""
    kw = {**BASE, "ttl": 1.0}
    # The acquire goes out as the full script or, on a connection that saw its node vote, as
    # a plain SET NX PX: either one is reset.
    markers = (scripts.ACQUIRE.sha.encode(), b"$2\r\nNX\r\n$2\r\nPX\r\n")
    with Harness(3, proxies=True, markers=markers) as h:
        h.warm_up(**kw)
        for proxy in h.proxies:
            proxy.armed, proxy.probability = None, 0.2
        h.start_clients(CLIENTS, WorkerSpec(h.urls, kw, ttl=1.0, check_after_acquire=True))
        h.begin()
        h.sleep(p.seconds(3.0))
        # On a busy machine the clients may have started late: go on until a few resets
        # happened (at most 30 s more), so the scenario always tests what it names.
        give_up = time.monotonic() + 30.0
        while sum(proxy.resets for proxy in h.proxies) < 3 and time.monotonic() < give_up:
            h.sleep(0.25)
        for proxy in h.proxies:
            proxy.armed, proxy.probability = 0, 0.0
        h.stop_clients()
        h.faults = sum(proxy.resets for proxy in h.proxies)
        ghosts = sum(len(keys) for keys in h.lock_keys())
        directed = _reset_directed(h, kw)
        h.faults += 2
        res = h.result(
            "conn_reset",
            "Connection reset after the acquire was sent",
            leftover_keys_after_run=ghosts,
            **directed,
        )
        res.checks["false_success"] = res.stats["false_success"]
        return res


class ScenarioSkipped(Exception):
    """The scenario cannot run here (the reason is the message)."""


def celery_worker_killed(p: Profile) -> ScenarioResult:
    """A Celery worker SIGKILLed mid-task (needs django_redlock.celery.LockedTask)."""
    import django_redlock

    if not (Path(django_redlock.__file__).parent / "celery.py").exists():
        raise ScenarioSkipped("LockedTask not available")
    from .celery_scenario import run_celery_scenario

    return run_celery_scenario(p)


# --------------------------------------------------------------------------- registry

SCENARIOS: dict[str, Callable[[Profile], ScenarioResult]] = {
    "contention": contention,
    "minority_kill": minority_killed,
    "minority_pause": minority_paused,
    "minority_restart": minority_restarted,
    "majority_down": majority_down,
    "holder_killed": holder_killed,
    "holder_paused": holder_paused,
    "replies_delayed": replies_delayed,
    "restart_no_guard": restart_no_guard,
    "restart_guard": restart_guard,
    "key_deleted": key_deleted,
    "key_deleted_bare": key_deleted_bare,
    "clock_jump": clock_jump,
    "forks": forks,
    "conn_reset": conn_reset,
    "celery_killed": celery_worker_killed,
}


def run(name: str, profile: Profile | None = None) -> ScenarioResult:
    return SCENARIOS[name](profile or Profile.quick())
