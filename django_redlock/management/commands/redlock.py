"""``manage.py redlock list|release|check|trust``: inspect and manage the live locks.

Exit codes (documented in docs/usage.rst, "Management command"):

==  ==============================================================================
0   success (``check``: every node reachable and voting)
1   ``release``: no such lock / no node had it / nothing matches ``--pattern``;
    ``check``: degraded (a node is unreachable or held back by the restart guard, but a
    quorum is fine; or a node may evict keys, W006)
2   ``check``: fewer than a quorum of nodes reachable (or allowed to vote by the restart
    guard): no lock can be taken now; ``list``: fewer than a quorum answered (nothing is
    listed, the silent nodes are named); any action: the ``REDLOCK`` setting is broken (the
    message gives the system check's id); also usage errors (argparse, an unknown
    ``--using`` alias: the message lists the known ones)
3   ``release`` without ``--force`` refused to take a live lock from its holder, or
    ``release --pattern`` without ``--yes``
==  ==============================================================================

Every release is logged (logger ``django_redlock.audit``, level WARNING) with the lock, the
holder's metadata and the operator's OS user.
"""

from __future__ import annotations

import getpass
import json
import logging
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_redlock.admin_views import build_rows, clock_spread, describe_holder
from django_redlock.backends.registry import get_locks
from django_redlock.checks import eviction_warnings, node_eviction_policies
from django_redlock.conf import get_config
from django_redlock.core import TrustRefused
from django_redlock.keys import printable

audit = logging.getLogger("django_redlock.audit")

OK, NOT_FOUND, DEGRADED, QUORUM_LOST, BROKEN_SETTING, USAGE, REFUSED = 0, 1, 1, 2, 2, 2, 3


def _seconds(value: float | None) -> str:
    """``"850ms"``, ``"4.2s"``, ``"1.5m"``, ``"2.0h"``: under a second in milliseconds, so a
    short wait never reads as ``0.0s``."""
    if value is None:
        return "-"
    if value < 1:
        return f"{max(value, 0.0) * 1000:.0f}ms"
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _holder(meta: dict[str, Any]) -> str:
    """Who holds a lock, in one line (as written: print it through :func:`printable`)."""
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


#: The LockInfo fields ``redlock list --json`` gives as they are.
_LIST_FIELDS = (
    "name token meta age ttl nodes total_nodes quorum fence renewals split semaphore permit "
    "reader_of"
)


class Command(BaseCommand):
    help = "List, release and check the distributed locks (REDLOCK nodes)."
    #: No system checks first: `redlock check` must run (and report) when nodes are down.
    requires_system_checks = ()

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--using",
            default="default",
            help='lock service: a REDLOCK["BACKENDS"] alias (default: the Redlock over NODES)',
        )
        sub = parser.add_subparsers(
            dest="action", required=True, metavar="{list,release,check,trust}"
        )
        p_list = sub.add_parser("list", help="live locks across the nodes")
        p_list.add_argument("--pattern", default="*", help="glob on lock names (default *)")
        p_rel = sub.add_parser(
            "release",
            help="remove a lock (needs --force while it is held) or every lock matching "
            "--pattern (needs --yes)",
        )
        p_rel.add_argument("key", nargs="?", help="lock name, as `redlock list` shows it")
        p_rel.add_argument(
            "--force",
            action="store_true",
            help="remove it whoever holds it; the holder loses its lock",
        )
        p_rel.add_argument("--pattern", help="glob on lock names: release every match")
        p_rel.add_argument(
            "--yes", action="store_true", help="with --pattern: release without asking"
        )
        p_check = sub.add_parser("check", help="per-node health, restart guard and clocks")
        for p in (p_list, p_check):
            p.add_argument(
                "--json", action="store_true", dest="as_json", help="machine-readable output"
            )
        p_trust = sub.add_parser(
            "trust", help="let every reachable node vote now (asserts that no lock is held)"
        )
        p_trust.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    def do_trust(self, *, yes: bool = False, **_: Any) -> None:
        """Arm the restart-guard markers as trusted (Redlock.trust_cluster): for a new cluster
        with a node down, which otherwise waits max_ttl because no node can vouch that
        nothing was held. Exit 3 when refused (a lock is held, or not confirmed)."""
        redlock = self.redlock
        if not hasattr(redlock, "trust_cluster"):
            raise CommandError(
                "'trust' is for a Redlock over Redis nodes (the restart guard); "
                f"{type(redlock).__name__} has no restart guard.",
                returncode=USAGE,
            )
        if not redlock.restart_guard:
            raise CommandError(
                "'trust' lets guarded nodes vote, and this service has no restart guard "
                "(RESTART_GUARD is False: every reachable node votes already); nothing changed.",
                returncode=USAGE,
            )
        if not yes:
            try:
                answer = input(
                    f"Let every reachable node of {len(redlock.nodes)} vote at once? Only safe "
                    "when no lock is held anywhere (the command checks the reachable nodes). "
                    "[y/N] "
                )
            except EOFError:  # no terminal (a script, stdin closed): nobody said yes
                self.stdout.write("")
                raise CommandError(
                    "Not confirmed (no answer on standard input; pass --yes in scripts); "
                    "nothing changed.",
                    returncode=REFUSED,
                ) from None
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("Not confirmed; nothing changed.", returncode=REFUSED)
        try:
            armed = redlock.trust_cluster()
        except TrustRefused as exc:
            raise CommandError(str(exc), returncode=REFUSED) from None
        self.stdout.write(
            self.style.SUCCESS(f"Trusted {armed} of {len(redlock.nodes)} node(s); they vote now.")
        )

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:  # the lock service this command works on (the one place it is picked)
            self.redlock = get_locks(options["using"])
        except ImproperlyConfigured as exc:  # its message starts with the check id
            raise CommandError(
                f"The REDLOCK setting is broken, no lock can be taken: {exc}",
                returncode=BROKEN_SETTING,
            ) from None
        except (ValueError, TypeError, ImportError) as exc:  # unknown alias, bad BACKENDS entry
            raise CommandError(f"--using {options['using']!r}: {exc}", returncode=USAGE) from None
        getattr(self, f"do_{action}")(**options)

    # -- list ------------------------------------------------------------------------------

    def _answering(self, action: str) -> None:
        """Refuse to report when fewer than a quorum of nodes answer (an empty listing would
        read as "no locks" when nobody was asked); name the silent ones otherwise."""
        health = self.redlock.health()
        down = [h for h in health if not h.reachable]
        answered = len(health) - len(down)
        quorum = self.redlock.quorum
        if answered < quorum:
            raise CommandError(
                f"Only {answered} of {len(health)} node(s) answered, fewer than the quorum of "
                f"{quorum}: cannot {action}. Not answering: {_nodes_down(down)}.",
                returncode=QUORUM_LOST,
            )
        if down:
            self.stderr.write(
                self.style.WARNING(
                    f"Not answering ({answered} of {len(health)} did, quorum {quorum}): "
                    f"{_nodes_down(down)}; locks held only there are not shown."
                )
            )

    def do_list(self, *, pattern: str, as_json: bool = False, **_: Any) -> None:
        redlock = self.redlock
        self._answering("list the live locks")
        # The admin page's rows: the same "stuck" reasons (held too long, split, not
        # renewing, holder gone), judged by the same code.
        rows = build_rows(redlock.live_locks(pattern), get_config().get("STUCK_AFTER"))
        if as_json:
            listed = [
                {
                    **{field: getattr(r.info, field) for field in _LIST_FIELDS.split()},
                    "acquired_at": r.info.acquired_at and r.info.acquired_at.isoformat(),
                    "stuck": r.stuck,
                    "flags": r.reason_labels,
                }
                for r in rows
            ]
            self.stdout.write(_dumps(listed))
        elif not rows:
            self.stdout.write(f"No live locks matching {pattern!r}.")
        else:
            table = [("NAME", "HOLDER", "AGE", "TTL", "NODES", "FENCE", "STUCK")]
            for r in rows:
                i, flags = r.info, ", ".join(r.reason_labels)
                age, ttl, nodes = _seconds(i.age), _seconds(i.ttl), f"{i.nodes}/{i.total_nodes}"
                table.append((i.name, _holder(i.meta), age, ttl, nodes, str(i.fence or "-"), flags))
            self._table(table)
            self.stdout.write(f"{len(rows)} lock(s).")

    # -- release ---------------------------------------------------------------------------

    def do_release(
        self,
        *,
        key: str | None = None,
        force: bool = False,
        pattern: str | None = None,
        yes: bool = False,
        **_: Any,
    ) -> None:
        if (key is None) == (pattern is None):
            raise CommandError("Give a lock name or --pattern (one of them).", returncode=USAGE)
        redlock = self.redlock
        if pattern is not None:
            self._release_matching(redlock, pattern, yes=yes)
            return
        assert key is not None
        info = redlock.lock_info(key)
        if not force:
            if info is None:
                raise CommandError(f"No lock named {key!r} is held.", returncode=NOT_FOUND)
            raise CommandError(
                f"{key!r} is held by {printable(_holder(info.meta))} (token {info.token[:8]}..., "
                f"{_seconds(info.ttl)} of lease left, on {info.nodes}/{info.total_nodes} "
                "nodes). Releasing it takes the lock from a holder that may still be working; "
                "it would learn so only at its next renewal or release. Rerun with --force "
                "to do it anyway.",
                returncode=REFUSED,
            )
        removed = redlock.force_release(key)
        total = len(redlock.nodes)
        if removed == 0:
            raise CommandError(
                f"No node had a lock named {key!r}; nothing released.", returncode=NOT_FOUND
            )
        self._audit(key, removed, total, info)
        self.stdout.write(self.style.SUCCESS(f"Released {key!r} on {removed} of {total} node(s)."))

    def _release_matching(self, redlock: Any, pattern: str, *, yes: bool) -> None:
        """Every live lock matching ``pattern``, listed first; released (each one only from
        the holder listed) with ``--yes``."""
        locks = list(redlock.live_locks(pattern))
        if not locks:
            raise CommandError(f"No live lock matches {pattern!r}.", returncode=NOT_FOUND)
        self.stdout.write(f"{len(locks)} lock(s) match {pattern!r}:")
        for info in locks:
            self.stdout.write(
                printable(f"  {info.name}  ({_holder(info.meta)}, {_seconds(info.age)} old)")
            )
        if not yes:
            raise CommandError(
                f"Not released: rerun with --yes to release these {len(locks)} lock(s) from "
                "their holders.",
                returncode=REFUSED,
            )
        total = len(redlock.nodes)
        released = 0
        for info in locks:
            # The token compare on the nodes leaves a holder that took the lock since alone.
            removed = redlock.force_release(info.name, token=info.token)
            if removed:
                released += 1
                self._audit(info.name, removed, total, info)
            else:
                self.stdout.write(
                    f"  {printable(info.name)}: not released (freed or taken by another since)"
                )
        self.stdout.write(self.style.SUCCESS(f"Released {released} of {len(locks)} lock(s)."))

    @staticmethod
    def _audit(name: str, removed: int, total: int, info: Any) -> None:
        audit.warning(
            "manage.py redlock release by %s: released lock '%s' on %s of %s nodes; holder: %s",
            printable(_operator()),
            printable(name),
            removed,
            total,
            describe_holder(info) if info is not None else "unknown",  # repr: escaped
        )

    # -- check -----------------------------------------------------------------------------

    def do_check(self, *, as_json: bool = False, **_: Any) -> None:
        health, quorum = self.redlock.health(), self.redlock.quorum
        reachable = [h for h in health if h.reachable]
        # The core judges each node with the whole cluster in view (as the admin page shows
        # it): a brand-new cluster's nodes vote, trusted at the first acquire.
        voting = [h for h in health if h.voting]
        spread = clock_spread(health) or 0.0
        # The same W006 warnings as `manage.py check --deploy`.
        eviction = eviction_warnings(node_eviction_policies())
        if len(reachable) < quorum or len(voting) < quorum:
            status, code, style = "CRITICAL", QUORUM_LOST, self.style.ERROR
        elif len(voting) < len(health) or eviction:
            status, code, style = "DEGRADED", DEGRADED, self.style.WARNING
        else:
            status, code, style = "OK", OK, self.style.SUCCESS
        summary = (
            f"{status}: {len(reachable)}/{len(health)} nodes reachable, "
            f"{len(voting)} voting, quorum {quorum}, clock spread {spread * 1000:.1f} ms"
        )
        down = [h for h in health if not h.reachable]
        guarded = [h for h in reachable if not h.voting]
        if down:
            summary += f"; not answering: {_nodes_down(down)}"
        if guarded:
            summary += "; not voting (restart guard): " + ", ".join(
                f"{h.node} ({_seconds(h.guarded_for)} left)" for h in guarded
            )
        if as_json:
            report = {
                "status": status.lower(),
                "quorum": quorum,
                "reachable": len(reachable),
                "voting": len(voting),
                "clock_spread": spread,
                "fresh_cluster": any(h.voting and h.fresh for h in health),
                "nodes": [h.__dict__ for h in health],
                "warnings": [{"id": m.id, "msg": m.msg} for m in eviction],
            }
            self.stdout.write(_dumps(report))
        else:
            header = (
                "NODE",
                "REACHABLE",
                "LATENCY",
                "VERSION",
                "UPTIME",
                "GUARD",
                "CLOCK",
                "LOCKS",
            )
            self._table([header, *map(_check_row, health)])
            for message in eviction:
                self.stdout.write(self.style.WARNING(f"{message.id}: {message.msg}"))
            self.stdout.write(style(summary))
        if code != OK:
            raise CommandError(summary, returncode=code)

    # -- output ----------------------------------------------------------------------------

    def _table(self, rows: Sequence[Sequence[str]]) -> None:
        # A holder's metadata may be a client's (a view's path): no control character of
        # it reaches the operator's terminal.
        rows = [[printable(cell) for cell in row] for row in rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            self.stdout.write(
                "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            )


def _check_row(h: Any) -> tuple[str, ...]:
    """One node's line of ``redlock check``."""
    if not h.reachable:
        return (_node_label(h), "no", "-", "-", "-", "-", "-", h.error or "")
    if h.voting:
        guard = "fresh (trusted at first lock)" if h.fresh else "ready"
    else:
        guard = f"guarded {_seconds(h.guarded_for)}"
        if h.armed is False:  # shows all of max_ttl until something arms it
            guard += ", counts down from the next lock"
    latency = f"{(h.latency or 0) * 1000:.2f}ms"
    clock = f"{h.clock_offset * 1000:+.1f}ms" if h.clock_offset is not None else "-"
    locks = str(h.lock_keys if h.lock_keys is not None else "-")
    return (
        _node_label(h),
        "yes",
        latency,
        h.software or "?",
        _seconds(h.uptime),
        guard,
        clock,
        locks,
    )


def _node_label(health: Any) -> str:
    """A node as the table shows it: a Sentinel group with its current master."""
    master = getattr(health, "master", None)
    return f"{health.node} (master {master})" if master else health.node


def _nodes_down(health: Sequence[Any]) -> str:
    """``"redis://a:6379/0 (Connection refused), ..."``: each silent node and why."""
    return ", ".join(f"{h.node} ({h.error or 'no answer'})" for h in health)


def _operator() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (containers without a passwd entry)
        return "unknown user"


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, default=str, sort_keys=True)
