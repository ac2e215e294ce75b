"""Historical bugs of this project, switchable back on inside the simulator (``--mutant``).
Each must be found (a violated invariant) within 300 runs of seed 7; the simulator is only as
good as the bugs it finds again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django_redlock.core import scripts
from django_redlock.core.guard import RestartGuard
from django_redlock.core.lock import Lease

from .engine import SimLeaseTable, World

__all__ = ["MUTANTS", "applied"]

#: name -> what the bug was.
MUTANTS: dict[str, str] = {
    "undo_new_connection": "the undo of a timed-out acquire goes out on a new connection, "
    "where it can overtake the acquire still queued on the old one",
    "flushed_votes": "a node that lost its data (flushed, restarted empty, failed over) votes "
    "at once: no restart guard in the acquire script",
    "fresh_kept": "a node whose marker came from another server process (a promoted replica) "
    "is taken for brand-new (fresh), so a cluster of failed-over nodes is trusted at once",
    "fork_releases": "a forked child releases the lock its parent holds",
    "no_drift": "validity = ttl - elapsed, without the clock-drift margin",
    "quorum_half": "quorum N/2 instead of N/2+1",
    "renewal_serial": "renewal sends one lease after another, each waiting a node timeout "
    "for a silent node",
    "fence_skip": "the agreed fence is not written back to the nodes",
    "trust_apart": "a cluster whose nodes lost their data apart (servers started far apart) "
    "is trusted as brand-new",
    "notice_dies": "the release-notice listener dies with a node's connection and a waiter "
    "then waits for a notice that never comes",
}

_GUARD_CHECK = "elseif tonumber(m[2]) + guard > now then"
_FRESH = "m[1] and '0' or '1'"


def _swap(world: World, old: str, new: str) -> None:
    for script in (scripts.ACQUIRE, scripts.FAIR_ACQUIRE):
        assert old in script.body, old
        for node in world.nodes:
            node.body_swap[script.body] = script.body.replace(old, new)


def _all_fresh_apart(self: Any, replies: list[Any], spread: float) -> bool:
    """``RestartGuard.all_fresh`` without the servers' start-time check."""
    if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
        return False
    armed_ages = [r[3] for r in replies]
    return max(armed_ages) - min(armed_ages) <= (self.client.node_timeout + spread) * 1000 + 1


@contextlib.contextmanager
def applied(mutant: str | None, world: World) -> Iterator[None]:
    """``mutant`` switched on for this world (and off again afterwards)."""
    if mutant is not None and mutant not in MUTANTS:
        raise ValueError(f"unknown mutant {mutant!r}; --list-mutants lists them")
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, value: Any) -> None:
        saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, value)

    if mutant == "flushed_votes":
        _swap(world, _GUARD_CHECK, "elseif false then")
    elif mutant == "fresh_kept":
        _swap(world, _FRESH, "'1'")
    elif mutant == "fork_releases":
        patch(Lease, "foreign", property(lambda self: False))
    elif mutant == "no_drift":
        patch(SimLeaseTable, "margin", lambda self, ttl: 0.0)
        # The acquire reads the two terms of the margin (a class property wins over the
        # value the table's constructor stores).
        no_term = property(lambda self: 0.0, lambda self, value: None)
        patch(SimLeaseTable, "drift_factor", no_term)
        patch(SimLeaseTable, "drift_floor", no_term)
    elif mutant == "trust_apart":
        patch(RestartGuard, "all_fresh", _all_fresh_apart)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            if value is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


_MISSING = object()
