"""The restart guard as a policy of :mod:`.algorithm`: a node that may have lost leases (a
new server process, a flushed or failed-over node) sits out until no lease it could have held
is left, which the acquire script judges on the node (docs/guarantees, "Restart guard").

It plugs into two points of an attempt. ``replied``: a node whose marker is not the one this
connection saw vote answered :data:`MARKER_CHANGED` to the plain ``SET``, so the nodes that
answered get the full script in a second round, which judges the guard for every node at one
moment. ``refused``: a brand-new cluster (every node fresh, started together) is trusted and
tried again at once; one that another client is trusting right now, or one whose fresh nodes
wait on a node that answered late, after a node timeout.
"""

from __future__ import annotations

from typing import Any

from . import clock
from .algorithm import Cluster, Contender, Pause, Policy, Send, Steps
from .listing import FRESH_START_SPREAD, started_together
from .nodes import Failure

__all__ = ["MARKER_CHANGED", "RestartGuard"]

#: The answer of a node whose restart-guard marker is not the one this connection saw vote:
#: it gets the full acquire script (:meth:`.commands.AcquireRequest.recheck`).
MARKER_CHANGED = Failure("marker", "the node's restart-guard marker changed")

#: How many times one attempt waits a node timeout for a brand-new cluster that another
#: client is trusting right now.
SETTLE_TRIES = 3


class RestartGuard(Policy):
    """The guard's judgements on the client's side; ``client`` is the Redlock."""

    def __init__(self, client: Cluster) -> None:
        self.client = client

    def replied(self, who: Contender, request: Any, replies: list[Any]) -> Steps[Any] | None:
        if not any(r is MARKER_CHANGED for r in replies):
            return None
        return self._recheck(who, request, replies)

    def _recheck(self, who: Contender, request: Any, replies: list[Any]) -> Steps[list[Any]]:
        answered = {
            i for i, r in enumerate(replies) if r is MARKER_CHANGED or not isinstance(r, Failure)
        }
        recheck = request.recheck([self.client.nodes[i] for i in answered])
        send = Send(recheck, request.undo, (who.handle.name, request.token))
        again = yield send
        who.now = send.ended
        return [again[i] if i in answered else r for i, r in enumerate(replies)]

    def refused(self, who: Contender, replies: list[Any], spread: float) -> Steps[bool] | None:
        if not (self.client.restart_guard and self.client.trust_fresh_cluster):
            return None
        return self._again(who, replies, spread)

    def _again(self, who: Contender, replies: list[Any], spread: float) -> Steps[bool]:
        # What this attempt did so far: trusted the cluster once, settled how many times, and
        # when its first round started (this round's start, as near as the steps know it).
        if who.rounds is None:
            who.rounds = {}
        trusted, settle, first = who.rounds.get(self, (False, SETTLE_TRIES, who.now - spread))
        # The markers this attempt armed, over all of its rounds, were armed since its first
        # round started: a node answering late had its marker armed a round after the others.
        if not trusted and self.all_fresh(replies, who.now - first):
            trusted = True
            who.rounds[self] = (trusted, settle, first)
            # Each node's marker as this attempt saw it fresh: only that one is trusted.
            trusting = Send(self.trust_builder(replies))
            trust = yield trusting
            who.now = trusting.ended
            if any(r == 1 for r in trust):  # a node it could not trust stays guarded
                who.rounds[self] = (trusted, 0, first)
                return True
        if settle and (self.settling(replies, spread) or self.unheard(replies)):
            # Another client is trusting this brand-new cluster right now, or a node's
            # answer that would let it be trusted came late (a busy host).
            who.rounds[self] = (trusted, settle - 1, first)
            yield Pause(self.client.node_timeout)
            return True
        return False

    def explain(self, reply: list[Any], replies: list[Any]) -> str:
        """Why a node in its restart guard does not vote, and what an operator can do."""
        seconds = f"{int(reply[1]) / 1000:.1f}s"
        if reply[2] == 1:
            why = self._why_new_is_guarded(replies) or (
                "a node did not answer in time, so whether every node is new is not known "
                "and no node can vouch that nothing was held"
                if self.unheard(replies)
                else "not every node is new, so no node can vouch that nothing was held"
            )
            return (
                f"guarded for {seconds}: it has no lock data (new, flushed or restarted empty) "
                f"and {why}; if no lock is held, `manage.py redlock trust` "
                "(Redlock.trust_cluster()) lets it vote now"
            )
        return (
            f"guarded for {seconds}: a new server process (restart or failover) may have lost "
            "leases"
        )

    def _why_new_is_guarded(self, replies: list[Any]) -> str | None:
        """When every node answered guarded for a missing marker (a cluster that looks
        brand-new) and was not trusted as one: why not (None when some node is not new)."""
        if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
            return None
        client = self.client
        if not (client.restart_guard and client.trust_fresh_cluster):
            return "every node has no lock data, but trust_fresh_cluster is off"
        started = [r[5] for r in replies if len(r) > 5]
        if len(started) == len(replies) and not started_together(
            started, clock.wall(), client.max_ttl
        ):
            return (
                "every node has no lock data, but their servers started more than "
                f"{FRESH_START_SPREAD:g}s apart (FRESH_START_SPREAD, from INFO's uptime), so "
                "they may have lost their data apart and none can vouch for another"
            )
        return (
            "every node has no lock data, but their markers were armed apart, so they may have "
            "lost their data apart and none can vouch for another"
        )

    def trust_builder(self, replies: list[Any]) -> Any:
        """TRUST for each node, naming the marker this attempt saw fresh there (a node
        flushed and armed again since has another marker and is not trusted)."""
        keys = self.client.keys
        seen = {id(node): r[4] for node, r in zip(self.client.nodes, replies, strict=True)}
        return lambda node, wire: keys.trust_command(wire.run_id, seen[id(node)])

    def all_fresh(self, replies: list[Any], spread: float) -> bool:
        """A brand-new cluster: every node is in its guard for a missing marker, all the
        markers were armed by one attempt (within a node timeout of each other), and the
        servers started together (:data:`.listing.FRESH_START_SPREAD`): none of the nodes has
        ever held a lock under this prefix, or all lost their data at once.

        There is no lease to protect, so the caller trusts them all at once instead of idling
        for max_ttl (docs/guarantees). A node that is fresh while another votes is never
        trusted this way: it may have forgotten a lease the others still count on. Nor are
        nodes that lost their data apart: one came back into a running cluster while a lease
        may have been taken on the others since, which they then lost in turn. ``spread``
        is how long this attempt's rounds took so far: the nodes measured their markers'
        ages at moments at most that far apart, and the markers it armed were armed in it."""
        if not all(isinstance(r, list) and r[0] == 2 and r[2] == 1 for r in replies):
            return False
        armed_ages: list[int] = [r[3] for r in replies]
        if max(armed_ages) - min(armed_ages) > (self.client.node_timeout + spread) * 1000 + 1:
            return False
        # A node that lost its data and was not reached again before the others lost theirs
        # is armed with them, but its server restarted earlier. (Servers that all started
        # more than a lease ago lost nothing to a restart that a lease could outlive.)
        return started_together([r[5] for r in replies], clock.wall(), self.client.max_ttl)

    @staticmethod
    def unheard(replies: list[Any]) -> bool:
        """Every node that answered is new, and the others' answers did not come in time:
        whether the cluster is brand-new hangs on answers a busy host or a lost packet made
        late, which another attempt may well get."""
        late = [r for r in replies if isinstance(r, Failure) and r.reason == "timeout"]
        fresh = [r for r in replies if isinstance(r, list) and r[0] == 2 and r[2] == 1]
        return bool(late) and bool(fresh) and len(late) + len(fresh) == len(replies)

    def settling(self, replies: list[Any], spread: float) -> bool:
        """A brand-new cluster that another client is trusting right now: the nodes still
        guarded have no marker of their own (fresh) written *before* the others were trusted,
        so they belong to the same brand-new cluster and the trust round just has not reached
        them yet. Worth another try after a node timeout. A node that restarted empty in a
        running cluster wrote its marker after its peers were trusted (or they never were),
        and is refused at once. ``spread`` is how long the fan-out took: the nodes measured
        their ages at moments at most that far apart."""
        guarded = [r for r in replies if isinstance(r, list) and r[0] == 2]
        others = [r for r in replies if isinstance(r, list) and r[0] != 2]
        if not guarded or not others or len(guarded) + len(others) != len(replies):
            return False
        trusted_ages = [r[2] if len(r) > 2 else -1 for r in others]
        if min(trusted_ages) < 0:
            return False
        slack = spread * 1000 + 1
        return all(r[2] == 1 and r[3] + slack >= max(trusted_ages) for r in guarded)
