"""The Redlock algorithm as redis.io's distributed-locks page reads it, sans-I/O.

An operation is a generator of steps (:class:`Send`, :class:`Pause`, ...) that a driver runs:
:mod:`.redlock` over threads and sockets, :mod:`.asyncio` over an event loop, the simulator
(``tests/simulation``) over virtual time. Nothing here reads a clock or draws a random
number: a driver stamps each :class:`Send` with its monotonic time before and after
(``started``, ``ended``), and jitter comes from the ``source`` the client hands in.

Read :meth:`Algorithm.attempt` and :meth:`Algorithm.contend` against the spec:

1. the same random token to every node at once, each bounded by ``node_timeout``;
2. a quorum (N/2+1) granted it and validity = ttl - elapsed - drift is left: the lock is ours;
3. otherwise undo it everywhere (also where no answer came: the SET may have landed late);
4. retry after a random delay (jitter keeps contenders from retrying in lock step).

The rules the spec leaves out are :class:`Policy` objects, each in a file of its own, that
plug into the named points of those two methods: the restart guard (:mod:`.guard`), fencing
(:mod:`.fencing`), fair queueing and waking waiters by name (:mod:`.fairness`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from .errors import QuorumError
from .events import Listener, LockEvent, emit
from .lock import Lease, LockBase
from .nodes import (
    BEHIND_LATE,
    NOT_CONNECTED,
    NOT_SENT,
    TIMED_OUT,
    Failure,
    Node,
    Pipelined,
    reached,
)

__all__ = [
    "Algorithm",
    "AnyBuilder",
    "Cluster",
    "Contender",
    "Finally",
    "Listen",
    "Pause",
    "Policy",
    "Refusal",
    "Send",
    "SendBatch",
    "Steps",
    "Wait",
    "keep_unreached",
    "to_each_node",
    "to_every_node",
]

_T = TypeVar("_T")

#: Builds one node's command from the connection it goes out on (sync or async): the
#: arguments, or the command already encoded.
AnyBuilder = Callable[[Node, Any], Sequence[Any] | bytes | Pipelined]


class Send:
    """A step: send a command to every node at once (the driver's fan-out) and resume with
    the replies in node order. ``enough(replies)`` may end the wait before every node
    answered (see :class:`.fanout.FanOut`); the driver then lists in ``left`` the connections
    that still owe a reply. ``late`` builds the undo for a node that does not answer in time;
    ``undo_if_cancelled`` is the ``(name, token)`` whose keys a driver releases when the
    caller is cancelled (asyncio, in the background) or interrupted (sync) while this step is
    on the wire. ``idempotent``: the command may run twice (a release, an undo); ``behind``:
    connections that still owe the reply of a command this one ends, for it to go out behind
    (both: see :class:`.fanout.FanOut`). The driver sets ``started`` and ``ended``, its
    monotonic time just before the first byte goes out and once the wait is over."""

    __slots__ = (
        "args",
        "behind",
        "build",
        "ended",
        "enough",
        "hedge",
        "idempotent",
        "late",
        "left",
        "started",
        "timeout",
        "undo_if_cancelled",
    )

    def __init__(
        self,
        build: AnyBuilder,
        late: Callable[[], bytes] | None = None,
        undo_if_cancelled: tuple[str, str] | None = None,
        timeout: float | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        idempotent: bool = False,
        behind: Mapping[int, Any] | None = None,
    ) -> None:
        self.build = build
        self.behind = behind
        self.late = late
        self.undo_if_cancelled = undo_if_cancelled
        self.timeout = timeout  #: None: the node timeout
        self.enough = enough
        self.idempotent = idempotent
        self.left: dict[int, Any] = {}
        #: Builds the copy of the command a node late to answer gets on a second connection
        #: (the sync driver's hedged request: see :func:`.fanout.fan_out`); None: the command
        #: itself if ``idempotent``, else no copy.
        self.hedge: AnyBuilder | None = None
        self.started = self.ended = 0.0
        #: The arguments of either driver's fan-out, in its order (the two take the same).
        self.args = (build, timeout, late, enough, self.left, behind, idempotent)


def to_every_node(command: list[Any] | bytes) -> AnyBuilder:
    """A builder sending the same command to every node."""
    return lambda node, wire: command


def to_each_node(commands: dict[int, list[Any]]) -> AnyBuilder:
    """A builder sending each node its own command (keyed by ``id(node)``)."""
    return lambda node, wire: commands[id(node)]


class Pause:
    """A step: wait ``seconds``, then resume (with None)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class SendBatch:
    """A step: pipeline ``commands`` to every node at once (one write per node); resume with
    each node's replies in command order, or its :class:`~.nodes.Failure`. ``leases`` are the
    leases the commands renew: the driver keeps their release from running meanwhile, and a
    lease released before the batch went out gets a harmless ``PING`` instead. The replies
    are worth waiting for until ``until`` (monotonic: the last of the leases' validity), not
    beyond a quorum's answer and its straggler's grace; the driver records in ``answered``
    when each node's replies were all in (None where they were not)."""

    __slots__ = ("answered", "commands", "leases", "until")

    def __init__(self, commands: list[list[Any]], leases: list[Lease]) -> None:
        self.commands = commands
        self.leases = leases
        self.until = max((lease.valid_until for lease in leases), default=0.0)
        self.answered: list[float | None] = []


class Listen:
    """A step: subscribe to release channel ``channel`` until the operation ends; resume with
    the notice to wait on (the driver's :class:`~.waiting.ReleaseNotice`)."""

    __slots__ = ("channel",)

    def __init__(self, channel: str) -> None:
        self.channel = channel


class Wait:
    """A step: wait on ``notice`` (from :class:`Listen`) for a release, at most ``seconds``."""

    __slots__ = ("notice", "seconds")

    def __init__(self, notice: Any, seconds: float) -> None:
        self.notice = notice
        self.seconds = seconds


class Finally:
    """A step: when the operation ends, however it ends, send ``send`` (cleanup that must go
    out even when the caller is interrupted, e.g. leaving a fair lock's line)."""

    __slots__ = ("cancelled", "send")

    def __init__(self, send: Send) -> None:
        self.send = send
        #: Set by the operation once the cleanup is no longer needed (or was handed to
        #: :attr:`.nodes.Node.later`): the driver then sends nothing.
        self.cancelled = False


#: The I/O-free steps of an operation: they yield what to do and receive its outcome; the
#: return value is the operation's result. ``Redlock`` and ``AsyncRedlock`` each drive them.
Steps = Generator[Send | SendBatch | Pause | Listen | Wait | Finally, Any, _T]


class Refusal:
    """Why one attempt did not produce a lock."""

    def __init__(
        self,
        failures: dict[str, str],
        answered: int,
        retry_after: float | None,
        late: bool = False,
        at: float = 0.0,
        readers: int | None = None,
    ) -> None:
        self.failures = failures
        self.answered = answered  #: nodes that gave a verdict (granted or held)
        self.retry_after = retry_after
        #: Read/write locks: when every node that said "held" said why, the most readers one
        #: counted in a writer's way (0: a reader held back by a waiting writer), else None.
        self.readers = readers
        #: Refused for lateness: some node's answer did not come in time (a lossy link holds a
        #: reply up for TCP's retransmission) or every connection to it still owed one, no
        #: node is guarded or queued for, and the nodes that said "held" are too few to keep
        #: a quorum away.
        self.late = late
        self.at = at  #: the driver's monotonic time when the attempt ended


class Request(Protocol):
    """One attempt's token and commands (the client's :class:`.commands.AcquireRequest`)."""

    token: str
    meta: Any
    #: The copy a node late to answer gets on a second connection, None for no copy.
    hedge: AnyBuilder | None

    def build(self, node: Node, wire: Any) -> Any: ...

    def undo(self) -> bytes: ...


class Contender:
    """One caller's acquire of one lock: what the algorithm and the policies share. The
    policies fill in the fair line's place (``line``), the waiter id, the command that joins
    the name's waiters with each attempt (``join``), and the cleanup that leaves either once
    the operation ends (``leave``, and ``left``: the same command, encoded for any
    connection). A policy whose steps send sets ``now`` from its send's ``ended``."""

    __slots__ = ("handle", "join", "leave", "left", "line", "now", "owner", "rounds", "waiter")

    def __init__(
        self, handle: LockBase, owner: Hashable, line: tuple[str, int] | None = None
    ) -> None:
        self.handle = handle
        self.owner = owner
        self.line = line
        self.waiter = ""
        self.join: bytes | None = None
        self.leave: Finally | None = None
        self.left = b""
        #: The driver's monotonic time as of the caller's last step (a policy that sends
        #: sets it from its :attr:`Send.ended`).
        self.now = 0.0
        #: What the policies did so far in the current attempt (reset by each attempt).
        self.rounds: dict[Policy, Any] | None = None


class Policy:
    """A rule the spec leaves out, plugged into named points of :class:`Algorithm`. A point
    a policy does not override is never called. Each returns None (nothing to do) or the
    steps to run there, whose result may change the outcome:

    - ``entering(who)``: before the first attempt of a contending caller (a fair lock's
      place in line); may set ``who.line``, ``who.leave``, ``who.left``.
    - ``waiting(who)``: once the caller waits for release notices, before its next attempt
      (joining the name's waiters); may set ``who.join``, ``who.leave``, ``who.left``.
    - ``replied(who, request, replies)``: no quorum granted; the steps' result replaces the
      replies (the restart guard's second round).
    - ``granted(who, request, lease, replies)``: a quorum granted with validity left; the
      steps' result (a bool) says whether the lease stands (fencing's write-back).
    - ``refused(who, replies, spread)``: the attempt failed and was undone; the steps'
      result (a bool) asks for another attempt at once (trusting a brand-new cluster).
    - ``explain(reply, replies)``: why a node that did not vote sits out (status 2), for the
      refusal (``replies``: every node's, as the reason may lie in the whole cluster).
    """

    #: The handle flag that switches the policy on (``"fair"``, ``"fencing"``), None: always.
    flag: str | None = None

    def entering(self, who: Contender) -> Steps[None] | None:
        return None

    def waiting(self, who: Contender) -> Steps[None] | None:
        return None

    def replied(self, who: Contender, request: Any, replies: list[Any]) -> Steps[Any] | None:
        return None

    def granted(
        self, who: Contender, request: Any, lease: Lease, replies: list[Any]
    ) -> Steps[bool] | None:
        return None

    def refused(self, who: Contender, replies: list[Any], spread: float) -> Steps[bool] | None:
        return None

    def explain(self, reply: list[Any], replies: list[Any]) -> str | None:
        return None


class Cluster(Protocol):
    """What the algorithm and its policies read of their client (at each use: a test may
    change them)."""

    nodes: list[Node]
    quorum: int
    node_timeout: float
    max_ttl: float
    restart_guard: bool
    trust_fresh_cluster: bool
    retry_delay: float
    fair_heartbeat: float
    listeners: list[Listener]
    keys: Any

    @property
    def leases(self) -> Table: ...

    def waiter_id(self, name: str) -> str:
        """The id a blocked acquire of ``name`` waits to be woken under."""


class Table(Protocol):
    """The client's lease table, as the algorithm uses it (:class:`.leases.LeaseTable`)."""

    #: The drift allowance of a lease of ``ttl`` seconds is ``ttl * drift_factor +
    #: drift_floor`` (the spec's clock drift term).
    drift_factor: float
    drift_floor: float

    def won(self, handle: LockBase, lease: Lease, start: float) -> Lease:
        """Enter a lease just won (asked for at ``start``) in the table."""


class Source(Protocol):
    """Where jitter comes from (the client's :mod:`.clock`; the simulator's seeded one)."""

    def uniform(self, a: float, b: float) -> float: ...


_POINTS = ("entering", "waiting", "replied", "granted", "refused", "explain")

#: Builds one attempt's request: ``(handle, line, join)`` (see :class:`Contender`).
MakeRequest = Callable[[LockBase, "tuple[str, int] | None", "bytes | None"], Request]


class Algorithm:
    """Redlock's acquire over ``client``'s nodes, with ``policies`` plugged in; ``request``
    builds an attempt's request, ``source`` draws the jitter."""

    def __init__(
        self,
        client: Cluster,
        policies: Sequence[Policy],
        request: MakeRequest,
        source: Source,
    ) -> None:
        self.client = client
        self.request = request
        self.source = source
        #: Per point, the policies that override it (no empty hook is called).
        self.points: dict[str, list[Policy]] = {
            point: [p for p in policies if getattr(type(p), point) is not getattr(Policy, point)]
            for point in _POINTS
        }
        # The same, for each combination of the handle flags that switch policies on: a
        # handle's points are one lookup.
        flags = sorted({p.flag for p in policies if p.flag is not None})
        self._flags: Callable[[LockBase], Any] = (
            operator.attrgetter(*flags) if flags else lambda handle: ()
        )
        self._table: dict[Any, dict[str, list[Policy]]] = {}
        for values in itertools.product((False, True), repeat=len(flags)):
            on = {flag for flag, value in zip(flags, values, strict=True) if value}
            key = values[0] if len(flags) == 1 else values
            self._table[key] = {
                point: [p for p in some if p.flag is None or p.flag in on]
                for point, some in self.points.items()
            }

    # -- the spec ------------------------------------------------------------------------------

    def attempt(self, who: Contender, make: MakeRequest | None = None) -> Steps[Lease | Refusal]:
        """One acquire attempt (steps 1 to 3 of the spec). ``make`` builds each attempt's
        request in place of the client's (a read or write hold's script: :mod:`.permits`)."""
        client, handle = self.client, who.handle
        points = self._table[self._flags(handle)]
        make = make or self.request
        who.rounds = None
        while True:
            request = make(handle, who.line, who.join)
            cancel = (handle.name, request.token)
            # 1. The same token to every node at once; the wait ends once a quorum granted.
            send = Send(request.build, request.undo, cancel, None, self.granted_by_quorum)
            send.hedge = request.hedge
            replies = yield send
            start = send.started
            now = who.now = send.ended
            granted = [r for r in replies if r.__class__ is list and r[0] == 0]
            unsure = False
            if len(granted) < client.quorum:
                # What this round set stays set until it is undone, whatever a policy's second
                # look then reports of the node (sitting out).
                unsure = _may_have_set(replies)
                for policy in points["replied"]:
                    more = policy.replied(who, request, replies)
                    if more is not None:
                        replies = yield from more
                        now = who.now
                        granted = [r for r in replies if r.__class__ is list and r[0] == 0]
            # 2. Ours if a quorum granted it and validity = ttl - elapsed - drift is left
            # (measured after the replies came in: node-redlock returned locks with none).
            drift = handle.ttl * client.leases.drift_factor + client.leases.drift_floor
            valid_until = start + handle.ttl - drift
            if len(granted) >= client.quorum and now < valid_until:
                lease = Lease(
                    name=handle.name,
                    token=request.token,
                    ttl=handle.ttl,
                    owner=who.owner,
                    valid_until=valid_until,
                    fence=max(int(r[1]) for r in granted) if handle.fencing else None,
                    acquired=start,
                    last_renewal=now,
                    meta=request.meta,
                    auto_renew=handle.auto_renew,
                    renew_until=None if handle.renew_for is None else start + handle.renew_for,
                )
                stands = True
                for policy in points["granted"]:
                    more = policy.granted(who, request, lease, replies)
                    if more is not None and not (yield from more):
                        stands = False
                        break
                if stands:
                    # The release goes out behind the acquire where it is still on its way.
                    lease.behind = send.left
                    return lease
            # 3. Undo it everywhere, also where no answer came in time.
            if unsure or _may_have_set(replies):
                undo = client.keys.release_command(handle.name, request.token)
                # Behind the acquire where it is still on its way, as a release goes; kept
                # for a node it could not reach, as a release is. Its answers change nothing
                # once a majority has them: a slower node gets it behind whatever it still
                # owes, and nobody waits for it there.
                undoing = Send(
                    to_every_node(undo),
                    None,
                    cancel,
                    enough=_any_answers,
                    idempotent=True,
                    behind=send.left,
                )
                undone = yield undoing
                who.now = undoing.ended
                keep_unreached(client.nodes, undo, undone)
            again = False
            for policy in points["refused"]:
                more = policy.refused(who, replies, now - start)
                if more is not None and (yield from more):
                    again = True
                    break
            if not again:
                return self.refusal(replies, who.now)

    def contend(
        self,
        who: Contender,
        blocking: bool,
        deadline: float | None,
        retries: int | None,
        start: float,
        first: Refusal | None = None,
        listen_first: bool = False,
    ) -> Steps[Lease | None]:
        """Attempts until the lock is ours or the time is up (step 4 of the spec: retry with
        jitter). After the first refusal, subscribe to this waiter's own release channel and
        try again at once (a release between the attempt and the subscription would otherwise
        go unnoticed); then wait for a release notice, the holder's lease end or a random
        retry delay (:meth:`pause_for`). ``first`` is the refusal of an attempt already made.
        ``listen_first``: this process just released the name and woke a waiter, who is
        taking it now: the first attempt is made waiting already (subscribed and joined), as
        it would be refused. The lease won is entered in the client's lease table (asked for
        at ``start``); once out of time, the refusal is reported (:meth:`give_up`)."""
        handle = who.handle
        points = self._table[self._flags(handle)]
        attempts = 0
        notice = None
        for policy in points["entering"]:
            more = policy.entering(who)
            if more is not None:
                yield from more
        while True:
            if notice is None and (listen_first or (blocking and attempts)):
                for policy in points["waiting"]:
                    more = policy.waiting(who)
                    if more is not None:
                        yield from more
                notice = yield Listen(self.client.keys.waiter_channel(handle.name, who.waiter))
            if first is None:
                outcome = yield from self.attempt(who)
            else:
                outcome, first = first, None
            if isinstance(outcome, Lease):
                if who.leave is not None:
                    # The nodes that granted a fair lock took its waiter out of the line; the
                    # others (and every node, for the waiters of another lock) get the leave
                    # with the next command that reaches them, the release at the latest,
                    # which it goes out before: no round trip between a waiter's grant and
                    # its caller, and no release wakes it after.
                    who.leave.cancelled = True
                    for node in self.client.nodes:
                        node.later.append(who.left)
                return self.client.leases.won(handle, outcome, start)
            attempts += 1
            now = outcome.at
            if self.out_of_time(blocking, attempts, retries, deadline, now, outcome.late):
                self.give_up(handle, outcome, now - start)
                return None
            if notice is not None:
                pause = self.pause_for(handle, outcome, retries, deadline, now, True)
                yield Wait(notice, pause)
            elif not blocking:
                yield Pause(self.pause_for(handle, outcome, retries, deadline, now))

    # -- judging replies -----------------------------------------------------------------------

    def granted_by_quorum(self, replies: list[Any]) -> bool:
        """An acquire's wait ends once a quorum granted it: the lock is ours whatever the
        slower nodes answer (validity is measured from before the first send)."""
        # A list, not a generator: this runs on every acquire (one call, not one per reply).
        granted = [r for r in replies if r.__class__ is list and r[0] == 0]
        return len(granted) >= self.client.quorum

    def refusal(self, replies: list[Any], at: float = 0.0) -> Refusal:
        """Why the nodes refused, and when the lock frees up if they said."""
        failures: dict[str, str] = {}
        held_pttls: list[int] = []
        readers: list[int] = []
        answered = 0
        timed_out = contended = False
        for node, reply in zip(self.client.nodes, replies, strict=True):
            if isinstance(reply, Failure):
                failures[node.name] = str(reply)
                timed_out = timed_out or reply is TIMED_OUT or reply == BEHIND_LATE
            elif reply[0] == 1:
                answered += 1
                held_pttls.append(max(int(reply[1]), 0))
                if len(reply) > 4:  # a read/write lock's: readers in a writer's way
                    readers.append(int(reply[4]))
                    failures[node.name] = (
                        f"held by {readers[-1]} readers" if readers[-1] else "a writer waits"
                    )
                else:
                    failures[node.name] = "held"
            elif reply[0] == 2:
                failures[node.name] = next(
                    (why for p in self.points["explain"] if (why := p.explain(reply, replies))),
                    "sits out",
                )
                contended = True
            elif reply[0] == 3:
                answered += 1
                failures[node.name] = "queued behind an earlier waiter"
                contended = True
            else:
                answered += 1
        retry_after = None
        free = len(self.client.nodes) - len(held_pttls)
        still_needed = self.client.quorum - free
        if held_pttls and 0 < still_needed <= len(held_pttls):
            # The lock frees up once enough leases have run out to leave a quorum free.
            retry_after = sorted(held_pttls)[still_needed - 1] / 1000
        # Held on too few nodes to keep a quorum from us: a copy that outlived its holder's
        # release because it landed late, or a late node's; no split vote to break up.
        contended = contended or still_needed > 0
        said = max(readers) if readers and len(readers) == len(held_pttls) else None
        return Refusal(failures, answered, retry_after, timed_out and not contended, at, said)

    # -- retrying ------------------------------------------------------------------------------

    def deadline(self, start: float, timeout: float | None, retries: int | None) -> float | None:
        """When a blocking acquire gives up: ``timeout`` seconds from now, never for ``None``
        or ``inf`` (unless ``retries`` bounds it: once that many retries could have run)."""
        client = self.client
        if timeout is None and retries is not None:
            return start + (retries + 1) * max(client.retry_delay, client.node_timeout)
        return None if timeout is None or math.isinf(timeout) else start + timeout

    def out_of_time(
        self,
        blocking: bool,
        attempts: int,
        retries: int | None,
        deadline: float | None,
        now: float,
        late: bool = False,
    ) -> bool:
        if not blocking:
            # A caller that will not wait for a holder gets one more attempt when the first
            # was refused for lateness alone (``late``): nobody holds the lock, a node's
            # answer was held up (a busy host, a retransmitted packet), which is no verdict.
            # It goes out on other connections, a late one being set aside.
            return not (late and attempts == 1 and retries != 0)
        if retries is not None and attempts > retries:
            return True
        return deadline is not None and now >= deadline

    def pause_for(
        self,
        handle: LockBase,
        refusal: Refusal,
        retries: int | None,
        deadline: float | None,
        now: float,
        by_name: bool = False,
    ) -> float:
        """How long to wait before the next attempt if no release notice comes first: until
        the holder's lease runs out when the nodes told us, else a random retry delay. With
        ``retries`` (the spec's retry loop) never longer than ``retry_delay``. The jitter keeps
        contenders from retrying in lock step. ``by_name``: a release wakes this waiter
        alone, on its own channel (see :meth:`contend`)."""
        client, uniform = self.client, self.source.uniform
        jitter = uniform(0, client.retry_delay / 2)
        if refusal.late:
            # The next attempt goes out on other connections (a late one is set aside until
            # it answered), so it is not held up behind the late reply; a little jitter keeps
            # this process's own threads apart.
            delay = uniform(0, min(client.node_timeout, client.retry_delay / 2))
        elif refusal.retry_after is not None:
            delay = refusal.retry_after + min(jitter, 0.002)
        else:
            delay = client.retry_delay / 2 + jitter
        if retries is not None:
            delay = min(delay, client.retry_delay / 2 + jitter)
        if handle.fair or by_name:
            # A waiter refreshes its place on every attempt (a fair line drops a waiter whose
            # heartbeat ran out), and one woken by name only asks again if the waiter a
            # release woke took nothing.
            delay = min(delay, client.fair_heartbeat / 3)
        if deadline is not None:
            delay = min(delay, deadline - now)
        return max(delay, 0.0)

    def give_up(self, handle: LockBase, refusal: Refusal, waited: float) -> None:
        """Report a failed acquire; raise when the cluster could not even give a verdict."""
        client = self.client
        handle.retry_after = refusal.retry_after
        emit(
            client.listeners,
            LockEvent(
                "contended",
                handle.name,
                meta=handle.meta,
                waited=waited,
                retry_after=refusal.retry_after,
                reason=", ".join(f"{n}: {why}" for n, why in refusal.failures.items()),
            ),
        )
        if refusal.answered < client.quorum:
            raise QuorumError(
                f"lock {handle.name!r}: only {refusal.answered} of {len(client.nodes)} nodes "
                f"could answer, {client.quorum} needed",
                handle.name,
                failures=refusal.failures,
                retry_after=refusal.retry_after,
            )


def keep_unreached(nodes: list[Node], command: bytes, replies: list[Any]) -> None:
    """A release that could not reach a node goes out with the next operation that reaches
    it (:attr:`.nodes.Node.later`)."""
    # Most releases have an answer from every node: told in one test, not a loop (this runs
    # on every release).
    if Failure not in map(type, replies):
        return
    for node, reply in zip(nodes, replies, strict=True):
        if reply.__class__ is Failure and not reached(reply):
            node.later.append(command)


def _may_have_set(replies: list[Any]) -> bool:
    """Whether an acquire's replies leave our key possibly set on a node: a grant, or no
    clear answer (a failure: the command may have run; not where it never went out, as to
    a node whose connection was still opening)."""
    return any(
        (r.__class__ is list and r[0] == 0)
        or (isinstance(r, Failure) and r is not NOT_CONNECTED and r is not NOT_SENT)
        for r in replies
    )


def _any_answers(replies: list[Any]) -> bool:
    """An ``enough`` for a command whose answers nobody reads: a majority's (asked only
    once a majority answered)."""
    return True
