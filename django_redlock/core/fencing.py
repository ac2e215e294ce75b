"""Fencing as a policy of :mod:`.algorithm`: a lock taken with ``fencing=True`` gets a number
that only grows (each node's counter, incremented by the acquire script). The nodes that
granted may disagree (one missed an earlier grant), so the highest is the fence, written back
to a quorum holding our token before the lease counts (``granted`` point): the next holder
then draws a higher one from any quorum.
"""

from __future__ import annotations

from typing import Any

from .algorithm import Cluster, Contender, Policy, Send, Steps, to_every_node
from .lock import Lease

__all__ = ["Fencing"]


class Fencing(Policy):
    """The fence write-back; ``client`` is the Redlock."""

    flag = "fencing"

    def __init__(self, client: Cluster) -> None:
        self.client = client

    def granted(
        self, who: Contender, request: Any, lease: Lease, replies: list[Any]
    ) -> Steps[bool] | None:
        return self._write_back(who, lease) if lease.fence is not None else None

    def _write_back(self, who: Contender, lease: Lease) -> Steps[bool]:
        assert lease.fence is not None
        command = self.client.keys.fence_command(lease.name, lease.token, lease.fence)
        send = Send(to_every_node(command), None, (lease.name, lease.token), None, self.synced)
        synced = yield send
        who.now = send.ended
        return self.synced(synced) and send.ended < lease.valid_until

    def synced(self, replies: list[Any]) -> bool:
        """A fence written back to a quorum holding our token."""
        return sum(1 for r in replies if r == 1) >= self.client.quorum
