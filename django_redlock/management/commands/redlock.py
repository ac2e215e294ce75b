"""``manage.py redlock list|release|check``: inspect and manage the live locks.

Exit codes (documented in docs/usage.rst, "Management command"):

==  ==============================================================================
0   success (``check``: every node reachable and voting)
1   ``release``: no such lock / no node had it; ``check``: degraded (a node is
    unreachable or held back by the restart guard, but a quorum is fine)
2   ``check``: fewer than a quorum of nodes reachable (or allowed to vote by the restart
    guard): no lock can be taken now; also argparse usage errors
3   ``release`` without ``--force`` refused to take a live lock from its holder
==  ==============================================================================
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_redlock.conf import get_config, get_redlock

OK, NOT_FOUND, DEGRADED, QUORUM_LOST, REFUSED = 0, 1, 1, 2, 3


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _holder(meta: dict[str, Any]) -> str:
    what = meta.get("view") or meta.get("task") or meta.get("function") or meta.get("code") or ""
    where = f"{meta.get('host', '?')}:{meta.get('pid', '?')}"
    parts = [where]
    if meta.get("method") and meta.get("path"):
        parts.append(f"{meta['method']} {meta['path']}")
    elif what:
        parts.append(str(what))
    if meta.get("user") is not None:
        parts.append(f"user {meta['user']}")
    return " ".join(parts)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class Command(BaseCommand):
    help = "List, release and check the distributed locks (REDLOCK nodes)."
    #: No system checks first: `redlock check` must run (and report) when nodes are down.
    requires_system_checks = ()

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="{list,release,check}")
        p_list = sub.add_parser("list", help="live locks across the nodes")
        p_list.add_argument("--pattern", default="*", help="glob on lock names (default *)")
        p_list.add_argument("--json", action="store_true", dest="as_json",
                            help="machine-readable output")
        p_rel = sub.add_parser("release", help="remove a lock (needs --force while it is held)")
        p_rel.add_argument("key", help="lock name, as `redlock list` shows it")
        p_rel.add_argument("--force", action="store_true",
                           help="remove it whoever holds it; the holder loses its lock")
        p_check = sub.add_parser("check", help="per-node health, restart guard and clocks")
        p_check.add_argument("--json", action="store_true", dest="as_json",
                             help="machine-readable output")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        getattr(self, f"do_{action}")(**options)

    # -- list ------------------------------------------------------------------------------

    def do_list(self, *, pattern: str, as_json: bool = False, **_: Any) -> None:
        redlock = get_redlock()
        stuck_after = float(get_config().get("STUCK_AFTER") or 0)
        locks = list(redlock.live_locks(pattern))
        if as_json:
            self.stdout.write(_dumps([
                {
                    "name": i.name, "token": i.token, "meta": i.meta,
                    "acquired_at": _iso(i.acquired_at), "age": i.age, "ttl": i.ttl,
                    "nodes": i.nodes, "total_nodes": i.total_nodes, "quorum": i.quorum,
                    "fence": i.fence, "renewals": i.renewals, "split": i.split,
                    "stuck": bool(stuck_after and (i.age or 0) > stuck_after),
                }
                for i in locks
            ]))
            return
        if not locks:
            self.stdout.write(f"No live locks matching {pattern!r}.")
            return
        rows = [("NAME", "HOLDER", "AGE", "TTL", "NODES", "FENCE", "FLAGS")]
        for i in locks:
            flags = []
            if i.split:
                flags.append("split")
            if stuck_after and (i.age or 0) > stuck_after:
                flags.append("stuck")
            rows.append((i.name, _holder(i.meta), _seconds(i.age), _seconds(i.ttl),
                         f"{i.nodes}/{i.total_nodes}", str(i.fence or "-"), ",".join(flags)))
        self._table(rows)
        self.stdout.write(f"{len(locks)} lock(s).")

    # -- release ---------------------------------------------------------------------------

    def do_release(self, *, key: str, force: bool = False, **_: Any) -> None:
        redlock = get_redlock()
        if not force:
            info = redlock.lock_info(key)
            if info is None:
                raise CommandError(f"No lock named {key!r} is held.", returncode=NOT_FOUND)
            raise CommandError(
                f"{key!r} is held by {_holder(info.meta)} (token {info.token[:8]}..., "
                f"{_seconds(info.ttl)} of lease left, on {info.nodes}/{info.total_nodes} "
                "nodes). Releasing it takes the lock from a holder that may still be working; "
                "it would learn so only at its next renewal or release. Rerun with --force "
                "to do it anyway.",
                returncode=REFUSED,
            )
        removed = redlock.force_release(key)
        total = len(redlock.nodes)
        if removed == 0:
            raise CommandError(f"No node had a lock named {key!r}; nothing released.",
                               returncode=NOT_FOUND)
        self.stdout.write(self.style.SUCCESS(
            f"Released {key!r} on {removed} of {total} node(s)."
        ))

    # -- check -----------------------------------------------------------------------------

    def do_check(self, *, as_json: bool = False, **_: Any) -> None:
        redlock = get_redlock()
        health = redlock.health()
        quorum = redlock.quorum
        reachable = [h for h in health if h.reachable]
        fresh = {h.node for h in health if h.reachable and h.guarded_for and h.fresh}
        # A brand-new cluster (no node ever held a lock under this prefix) is guarded until
        # the first acquire, which trusts every node at once (TRUST_FRESH_CLUSTER).
        trusted_at_first_lock = (
            redlock.restart_guard and redlock.trust_fresh_cluster
            and len(fresh) == len(health)
        )
        voting = [h for h in reachable if not h.guarded_for or trusted_at_first_lock]
        offsets = [h.clock_offset for h in reachable if h.clock_offset is not None]
        spread = (max(offsets) - min(offsets)) if len(offsets) > 1 else 0.0
        if len(reachable) < quorum or len(voting) < quorum:
            status, code = "CRITICAL", QUORUM_LOST
        elif len(voting) < len(health):
            status, code = "DEGRADED", DEGRADED
        else:
            status, code = "OK", OK
        summary = (f"{status}: {len(reachable)}/{len(health)} nodes reachable, "
                   f"{len(voting)} voting, quorum {quorum}, clock spread {spread * 1000:.1f} ms")
        if as_json:
            self.stdout.write(_dumps({
                "status": status.lower(), "quorum": quorum, "reachable": len(reachable),
                "voting": len(voting), "clock_spread": spread,
                "fresh_cluster": trusted_at_first_lock,
                "nodes": [h.__dict__ for h in health],
            }))
        else:
            rows = [("NODE", "REACHABLE", "LATENCY", "VERSION", "UPTIME", "GUARD", "CLOCK",
                     "LOCKS")]
            for h in health:
                if not h.reachable:
                    rows.append((h.node, "no", "-", "-", "-", "-", "-", h.error or ""))
                    continue
                if not h.guarded_for:
                    guard = "ready"
                elif trusted_at_first_lock:
                    guard = "fresh (trusted at first lock)"
                else:
                    guard = f"guarded {_seconds(h.guarded_for)}"
                clock = f"{h.clock_offset * 1000:+.1f}ms" if h.clock_offset is not None else "-"
                rows.append((h.node, "yes", f"{(h.latency or 0) * 1000:.2f}ms",
                             h.version or "?", _seconds(h.uptime), guard, clock,
                             str(h.lock_keys if h.lock_keys is not None else "-")))
            self._table(rows)
            style = self.style.SUCCESS if code == OK else (
                self.style.WARNING if code == DEGRADED else self.style.ERROR)
            self.stdout.write(style(summary))
        if code != OK:
            raise CommandError(summary, returncode=code)

    # -- output ----------------------------------------------------------------------------

    def _table(self, rows: Sequence[Sequence[str]]) -> None:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            self.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                              .rstrip())


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, default=str, sort_keys=True)
