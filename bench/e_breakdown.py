"""Where a hold's time goes in scenario e (bench/load.py): the same load, instrumented.

    PYTHONPATH=$PWD python bench/e_breakdown.py [--loss 0.15] [--seconds 6]

Per hold (one acquire + release of a contended key by one thread), the time in: the local
queue, acquire attempts (and undos), refused attempts and why, waits for release notices,
pauses, the release; plus the connections opened, hedged copies sent, and the budget the
fan-outs waited; and the key's own time, from a holder calling release to the next holder's
acquire returning, by the path the next holder took. ``--copies`` / ``--delete-copies`` set
:data:`~django_redlock.core.hedging.MAX_COPIES` / ``MAX_DELETE_COPIES`` for a comparison.
Instrumented by wrapping the client's internals in this process only (they are private: this
script follows them, nothing else depends on it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.load import TTL, Tally, count_overlaps, lossy_cluster  # noqa: E402
from django_redlock.core import algorithm, fanout, nodes, redlock, waiting  # noqa: E402
from django_redlock.core.nodes import TIMED_OUT, Failure  # noqa: E402
from django_redlock.core.redlock import Redlock  # noqa: E402

local = threading.local()
totals: Counter[str] = Counter()  # summed seconds / counts over every hold
reasons: Counter[str] = Counter()
budgets: Counter[str] = Counter()
rel_unanswered: Counter[int] = Counter()
samples: dict[str, list[float]] = defaultdict(list)
paths: list[tuple[str, float, float, str]] = []
#: Tokens by what they were: an attempt's (thread), a lease held, being released, released.
attempt_of: dict[str, int] = {}
holding: set[str] = set()
releasing_tok: dict[str, float] = {}
released_tok: dict[str, float] = {}
held_by: Counter[str] = Counter()
direct: list[Any] = []  # redis clients straight to the nodes, around the proxy
held_pttls: list[int] = []


def sample(key: str, value: float) -> None:
    with lock:
        samples[key].append(value)


lock = threading.Lock()
holds_done = 0


def rec() -> Counter[str]:
    r = getattr(local, "rec", None)
    if r is None:
        r = local.rec = Counter()
    return r


def add(key: str, value: float = 1.0) -> None:
    rec()[key] += value


class Timed:
    """A proxy for an operation's steps: the time from each yield to the next send is the
    driver's time on that step."""

    def __init__(self, steps: Any, client: Any) -> None:
        self.steps, self.client = steps, client
        self.step: Any = None
        self.t = 0.0

    def send(self, reply: Any) -> Any:
        now = time.monotonic()
        if self.step is not None:
            self.account(self.step, now - self.t, reply)
        self.step = self.steps.send(reply)
        self.t = time.monotonic()
        return self.step

    def account(self, step: Any, took: float, reply: Any) -> None:
        if isinstance(step, algorithm.Send):
            enough = step.enough
            name = getattr(enough, "__name__", "")
            if name == "granted_by_quorum":
                kind = "acquire"
                add("attempts")
                late = sum(1 for r in reply if r is TIMED_OUT)
                add("attempt_nodes_timed_out", late)
            elif name == "_any_answers":
                kind = "undo"
            else:
                kind = "send_other:" + name
            add(f"t_{kind}", took)
            add(f"n_{kind}")
            if kind == "acquire":
                ok = sum(1 for r in reply if r.__class__ is list and r[0] == 0) >= 2
                sample("attempt_ok" if ok else "attempt_refused", took)
                name, token = step.undo_if_cancelled
                me = threading.get_ident()
                with lock:
                    attempt_of[token] = me
                if not ok and direct:
                    for i, r in enumerate(reply):
                        if r.__class__ is list and r[0] == 1:
                            held_by[classify(direct[i].get(f"e:lock:{name}"), me)] += 1
        elif isinstance(step, algorithm.Wait):
            add("t_wait_notice", took)
            add("n_wait_notice")
            add("wait_budget", step.seconds)
            add("wait_woken" if reply else "wait_timed_out")
        elif isinstance(step, algorithm.Pause):
            add("t_pause", took)
            add("n_pause")
        elif isinstance(step, algorithm.Listen):
            add("t_listen", took)
            add("n_listen")
        else:
            add(f"t_{type(step).__name__}", took)


def classify(raw: bytes | None, me: int) -> str:
    """Whose key a refused attempt found, read straight from the node just after."""
    if raw is None:
        return "gone when read"
    token = raw.split(b" ", 1)[0].decode()
    with lock:
        if token in holding:
            return "a holder's (held)"
        if token in releasing_tok:
            return "a lease being released"
        if token in released_tok:
            return "a lease already released"
        owner = attempt_of.get(token)
    if owner is None:
        return "unknown token"
    return "own earlier attempt" if owner == me else "another thread's attempt"


def patch() -> None:
    drive = redlock.Redlock._drive

    def _drive(self: Any, steps: Any) -> Any:
        return drive(self, Timed(steps, self))

    redlock.Redlock._drive = _drive  # type: ignore[method-assign]

    enter = waiting.LocalQueue.enter

    def _enter(self: Any, deadline: Any) -> bool:
        t = time.monotonic()
        try:
            return enter(self, deadline)
        finally:
            add("t_local_queue", time.monotonic() - t)

    waiting.LocalQueue.enter = _enter  # type: ignore[method-assign]

    release = redlock.Redlock._release

    def _release(self: Any, lease: Any) -> None:
        t = time.monotonic()
        local.releasing = True
        with lock:
            holding.discard(lease.token)
            releasing_tok[lease.token] = t
        try:
            release(self, lease)
        finally:
            with lock:
                releasing_tok.pop(lease.token, None)
                released_tok[lease.token] = time.monotonic()
            local.releasing = False
            add("t_release", time.monotonic() - t)
            sample("release", time.monotonic() - t)

    redlock.Redlock._release = _release  # type: ignore[method-assign]

    everywhere = redlock.Redlock._release_everywhere

    def _everywhere(self: Any, *a: Any, **k: Any) -> Any:
        replies = everywhere(self, *a, **k)
        out = sum(1 for r in replies if r is TIMED_OUT)
        with lock:
            rel_unanswered[out] += 1
        return replies

    redlock.Redlock._release_everywhere = _everywhere  # type: ignore[method-assign]

    refusal = algorithm.Algorithm.refusal

    def _refusal(self: Any, replies: Any, at: float = 0.0) -> Any:
        r = refusal(self, replies, at)
        why = []
        for reply in replies:
            if isinstance(reply, Failure):
                why.append("timeout" if reply is TIMED_OUT else f"fail:{reply.reason}")
            elif reply[0] == 1:
                why.append("held")
                with lock:
                    held_pttls.append(int(reply[1]))
            elif reply[0] == 0:
                why.append("granted")
            else:
                why.append(f"status{reply[0]}")
        key = ",".join(sorted(why)) + (" (late)" if r.late else "")
        with lock:
            reasons[key] += 1
        add("refusals")
        return r

    algorithm.Algorithm.refusal = _refusal  # type: ignore[method-assign]

    send_copy = fanout._send_copy

    def _send_copy(node: Any, op: Any, now: float) -> Any:
        out = send_copy(node, op, now)
        add("hedges_sent" if out is not None else "hedges_no_spare")
        return out

    fanout._send_copy = _send_copy

    hedge = fanout._hedge

    def _hedge(
        nodes_: Any,
        op: Any,
        waiting_: Any,
        poller: Any,
        copies: Any,
        answered: Any,
        now: float,
        every: float,
    ) -> Any:
        late = sorted({e[0] for e in waiting_.values()} - answered)
        out = hedge(nodes_, op, waiting_, poller, copies, answered, now, every)
        log = getattr(local, "hedge_log", None)
        if log is not None:
            log.append(
                (
                    round((now - local.fan_start) * 1000, 1),
                    late,
                    dict(copies),
                    None if out is None else round((out - now) * 1000, 1),
                )
            )
        return out

    fanout._hedge = _hedge
    examples: list[Any] = []
    globals()["examples"] = examples

    plain = fanout.fan_out

    def _fan_out(nodes_: Any, op: Any, timeout: float, then: Any = None) -> None:
        t = local.fan_start = time.monotonic()
        local.hedge_log = []
        try:
            plain(nodes_, op, timeout, then)
        finally:
            took = time.monotonic() - t
            log = local.hedge_log
            tag = "rel" if getattr(local, "releasing", False) else "fan"
            sample(f"{tag}_all", took)
            if log:
                sample(f"{tag}_first_copy_at", log[0][0] / 1000)
                sample(f"{tag}_hedged_took", took)
            else:
                sample(f"{tag}_unhedged_took", took)
            with lock:
                budgets[f"{timeout * 1000:.0f}ms"] += 1
            if took >= timeout * 0.95:
                add("fanouts_to_budget")
                log = local.hedge_log
                last = log[-1][2] if log else {}
                out_nodes = [i for i, r in enumerate(op.replies) if r is TIMED_OUT]
                never = [i for i in out_nodes if last.get(i, 1) == 1]
                kind = (
                    "no copy at all"
                    if never
                    else (
                        "all copies out"
                        if all(last.get(i, 1) >= 3 for i in out_nodes)
                        else "some copies"
                    )
                )
                with lock:
                    budgets[
                        f"why:{'rel' if getattr(local, 'releasing', False) else 'acq'}:{kind}"
                    ] += 1
                    if len(examples) < 4:
                        examples.append(
                            (
                                getattr(local, "releasing", False),
                                [r if r.__class__ is int else str(r)[:20] for r in op.replies],
                                local.hedge_log,
                                [
                                    round(n.detector.quick * 1000, 2) if n.detector.quick else None
                                    for n in nodes_
                                ],
                                [n.detector.misses for n in nodes_],
                            )
                        )
                    budgets[
                        f"to_budget:{'rel' if getattr(local, 'releasing', False) else 'acq'}:{timeout * 1000:.0f}ms"
                    ] += 1
            add("fanouts")

    fanout.fan_out = _fan_out

    wire_init = nodes.Wire.__init__

    def _wire_init(self: Any, *a: Any, **k: Any) -> None:
        wire_init(self, *a, **k)
        with lock:
            totals["connections_opened"] += 1

    nodes.Wire.__init__ = _wire_init  # type: ignore[method-assign]


def loop(rl: Redlock, key: str, deadline: float, tally: Tally) -> None:
    global holds_done
    from bench.load import Hold

    clock = time.monotonic
    while clock() < deadline:
        local.rec = Counter()
        t0 = clock()
        lk = rl.lock(key, ttl=TTL)
        ok = lk.acquire(blocking=True, timeout=10.0)
        t1 = clock()
        if not ok:
            continue
        with lock:
            holding.add(lk.token)
        lk.release()
        t2 = clock()
        tally.hold(Hold(key, t1, t1, t2))
        r = rec()
        path = (
            ("queued " if r["t_local_queue"] > 0.0005 else "")
            + ("notice " if r["n_wait_notice"] else "")
            + f"{int(r['attempts'])} attempts"
        )
        with lock:
            paths.append((key, t0, t1, path))
        r["t_hold_total"] += t2 - t0
        r["t_acquire_total"] += t1 - t0
        with lock:
            totals.update(r)
            holds_done += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", type=float, default=0.15)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--copies", type=int, default=None)
    parser.add_argument("--delete-copies", type=int, default=None)
    parser.add_argument("--examples", action="store_true")
    args = parser.parse_args()
    if args.copies is not None:
        from django_redlock.core import hedging

        hedging.MAX_COPIES = args.copies
    if args.delete_copies is not None:
        from django_redlock.core import hedging

        hedging.MAX_DELETE_COPIES = args.delete_copies
    patch()
    with lossy_cluster("e") as (cluster, px):
        import redis

        direct.extend(redis.Redis(host=n.host, port=n.port) for n in cluster)
        px.set_link(args.loss, 0.0)
        before = px.stats()
        totals.clear()
        rl = Redlock(px.urls, key_prefix="e")
        tally = Tally()
        deadline = time.monotonic() + args.seconds
        t0 = time.perf_counter()
        ts = [
            threading.Thread(target=loop, args=(rl, f"k{i % args.keys}", deadline, tally))
            for i in range(args.threads)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.perf_counter() - t0
        rl.close()
        after = px.stats()
    n = holds_done
    print(
        f"loss {args.loss:.0%}: {n} holds in {elapsed:.1f} s = {n / elapsed:.0f} holds/s, "
        f"overlaps {count_overlaps(tally.holds)}, load {os.getloadavg()[0]:.1f}, "
        f"chunks {after.chunks - before.chunks} lost {after.lost - before.lost}"
    )
    print("per hold (ms for t_*, counts otherwise):")
    for k in sorted(totals):
        v = totals[k] / max(n, 1)
        print(f"  {k:32s} {v * 1000 if k.startswith('t_') else v:10.3f}")
    print("refusals (every node's answer):")
    for k, v in reasons.most_common(12):
        print(f"  {v:6d}  {k}")
    print("release fan-outs by nodes still out at the end:", dict(sorted(rel_unanswered.items())))
    print("fan-out budgets:", dict(budgets.most_common(16)))
    for k, v in sorted(samples.items()):
        v.sort()

        def q(f: float, v: list[float] = v) -> float:
            return v[min(len(v) - 1, int(f * len(v)))] * 1000

        print(
            f"  {k:16s} n={len(v):5d} p10={q(0.1):6.1f} p50={q(0.5):6.1f} p80={q(0.8):6.1f} p90={q(0.9):6.1f} p99={q(0.99):6.1f} ms"
        )
    for e in globals().get("examples", []) if args.examples else []:
        print("  budget-long fan-out:", e)
    by_key: dict[str, list[Any]] = defaultdict(list)
    for h in tally.holds:
        by_key[h.key].append(h)
    gaps, rels = [], []
    for group in by_key.values():
        group.sort(key=lambda h: h.acquired)
        for a, b in itertools.pairwise(group):
            gaps.append(b.acquired - a.released)
        rels += [h.released - h.acquired for h in group]
    if gaps:
        print(
            f"per key: handoff gap (prev release returned -> next acquire returned) mean {sum(gaps) / len(gaps) * 1000:.1f} ms, "
            f"release mean {sum(rels) / len(rels) * 1000:.1f} ms; negative gaps {sum(1 for g in gaps if g < 0)}"
        )
        gaps.sort()
        print(
            "  gap p10/p50/p90/p99 ms:",
            [round(gaps[int(f * len(gaps))] * 1000, 1) for f in (0.1, 0.5, 0.9, 0.99)],
        )
    # The key's own cycle: from a holder calling release to the next holder's acquire
    # returning, by the path the next holder took.
    by_path: dict[str, list[float]] = defaultdict(list)
    releasing = {k: sorted(h.releasing for h in tally.holds if h.key == k) for k in by_key}
    for key, _t0, t1, path in paths:
        before = [t for t in releasing[key] if t < t1]
        if before:
            by_path[path].append(t1 - before[-1])
    total = sum(len(v) for v in by_path.values())
    print("key handoff (release called -> next acquire returned), by the next holder's path:")
    for path, v in sorted(by_path.items(), key=lambda kv: -sum(kv[1])):
        v.sort()
        print(
            f"  {path:28s} {len(v) / total:5.0%} mean {sum(v) / len(v) * 1000:6.1f} ms "
            f"p50 {v[len(v) // 2] * 1000:6.1f} share of key time {sum(v) / sum(map(sum, by_path.values())):5.0%}"
        )
    print("whose key a refused attempt found held (read from the node right after):")
    for k, v in held_by.most_common():
        print(f"  {v:6d}  {k}")
    held_pttls.sort()
    if held_pttls:
        print(
            "held pttls: n",
            len(held_pttls),
            "min",
            held_pttls[0],
            "p50",
            held_pttls[len(held_pttls) // 2],
            "max",
            held_pttls[-1],
        )


if __name__ == "__main__":
    main()
