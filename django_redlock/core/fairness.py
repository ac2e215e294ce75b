"""Fair queueing and waking waiters by name, as policies of :mod:`.algorithm`.

A release wakes one waiter by name (``scripts.RELEASE``): a fair lock's first in line, else
the one that has waited longest. It is alone to contend (but for the releaser, who holds
back, and newcomers), so it asks every node at once; the others sleep on and ask again when
their pause ends (at most a third of ``fair_heartbeat``), so a woken waiter that died before
taking the lock costs the rest at most that.

:class:`FairLine` (``fair=True``) draws a place in the name's line before the first attempt
(``entering``); each attempt runs the fair acquire script with it, which grants only the
first in line. :class:`NamedWaiters` (any other lock) joins the name's waiters once the
caller waits for release notices (``waiting``), with each attempt on the same connection,
under the id the client keeps for the name (its channel stays subscribed between acquires).
Either leaves when the operation ends; a winner leaves with the next command to each node
(the algorithm hands ``left`` to :attr:`.nodes.Node.later`).
"""

from __future__ import annotations

from . import clock
from .algorithm import Cluster, Contender, Finally, Policy, Send, Steps, to_every_node
from .nodes import as_eval

__all__ = ["FairLine", "NamedWaiters"]


class FairLine(Policy):
    """A fair lock's place in line; ``client`` is the Redlock.

    The place is named after the id the client keeps for the name (``waiter.suffix``), so a
    release tells its waiter on that id's channel, which stays subscribed from one acquire
    to the next as a plain lock's does (:class:`NamedWaiters`): on a hot key, a new channel
    per place cost every acquisition a ``SUBSCRIBE`` and an ``UNSUBSCRIBE`` on every node
    and a wait for the confirmations. The suffix keeps places apart: a place left late (its
    leave still on the wire) is never taken for the next one. ``by_name=False`` (a
    semaphore's waiters, which listen on the primitive's channel): a place of its own."""

    flag = "fair"

    def __init__(self, client: Cluster, by_name: bool = True) -> None:
        self.client = client
        self.by_name = by_name

    def entering(self, who: Contender) -> Steps[None]:
        keys, name = self.client.keys, who.handle.name
        waiter = self.client.waiter_id(name) if self.by_name else None
        who.line = keys.line((yield Send(to_every_node(keys.ticket_command(name)))), waiter)
        who.waiter = waiter or who.line[0]
        command = keys.leave_line_command(name, who.line[0])
        who.leave, who.left = Finally(Send(to_every_node(command))), as_eval(command)
        yield who.leave


class NamedWaiters(Policy):
    """A waiter of any other lock, woken by name; ``client`` is the Redlock."""

    def __init__(self, client: Cluster) -> None:
        self.client = client

    def waiting(self, who: Contender) -> Steps[None] | None:
        return None if who.line is not None else self._join(who)

    def _join(self, who: Contender) -> Steps[None]:
        keys, name = self.client.keys, who.handle.name
        who.waiter = self.client.waiter_id(name)
        who.join = keys.join_waiters(name, who.waiter, int(clock.wall() * 1000))
        who.left = keys.leave_waiters(name, who.waiter)
        who.leave = Finally(Send(to_every_node(who.left)))
        yield who.leave
