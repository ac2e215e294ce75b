"""The sync client's fan-out: one command to every node at once, shared by the threads that
fan out at the same moment.

A fan-out writes the command to every node first and then waits on all sockets at once (poll)
against one deadline. The requests are in flight at the same time, so an operation costs one
round trip to the slowest node that answers (bounded by ``node_timeout``), not the sum over
nodes; an acquire or release that already has its quorum does not wait for the rest. It needs
no thread of its own: no pool is built per call (pottery's cost) and no node waits for the
previous one (redlock-py's).

Rounds. Threads of one process that fan out while another thread's fan-out is on the wire
queue up; once a majority of nodes answered that thread's operation (what it still waits for
is the slower nodes), the queue goes out as the next :class:`Round`, led by its first thread.
A thread alone sends a plain :func:`fan_out` (the uncontended hot path, in one frame), and so
does the main thread always: signal handlers raise there, anywhere, and must not strand the
others. A round carries every queued command to a node in one write on one connection and
reads their replies together, so eight threads each taking their own lock cost the kernel
and the nodes about one fan-out per round instead of eight (each ``send`` and ``recv`` on a
socket is a system call, and with many threads each one also hands the GIL around). Every
thread still gets its answer as soon as its own operation is decided, and an operation that
must wait for a slow node is served by its own thread (the round is handed on from thread to
thread) while the next round goes out on other connections.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import hedging
from .detector import (
    CONNECT_AT_LEAST,
    MAX_STALLS,
    QUICK_GAIN,
    RTTVAR_KEEP,
    SRTT_GAIN,
    STALL_SLACK,
    connect_budget,
)
from .nodes import (
    LATENESS,
    NOT_CONNECTED,
    NOT_SENT,
    NOTHING_LEFT,
    OWED,
    SOCKET_FULL,
    TIMED_OUT,
    Due,
    Failure,
    Incomplete,
    Node,
    Owing,
    Pipelined,
    ReplyError,
    Wakeup,
    Wire,
    WireError,
    as_bytes,
    eval_form,
    leave,
    list_left,
    os_failure,
    pack_many,
    reply_failure,
    reply_wait,
    settled,
)
from .process import ThisProcess

__all__ = ["FanOut", "Round", "Rounds", "Wait", "batch_quorum_in", "batch_wait", "fan_out_batch"]

#: Builds one node's command from the wire it will go out on (it may need the run id): the
#: arguments, the command already encoded (the hot path encodes the shared part once), or
#: several commands with one answer (:class:`~.nodes.Pipelined`).
CommandBuilder = Callable[[Node, Wire], Sequence[Any] | bytes | Pipelined]

#: A bare instance of a class, without its ``__init__``: the hot path sets the fields of its
#: :class:`~.nodes.Due`, :class:`Wait` and :class:`FanOut` itself (a class call that runs an
#: ``__init__`` costs more than all of them).
_bare = object.__new__

#: A :class:`Wait`'s credit when nothing caps it.
_NO_CAP = float("inf")

# What a thread waiting on its fan-out is woken for (FanOut.role).
_DONE, _LEAD, _SERVE = "done", "lead", "serve"


class Wait:
    """One operation's wait for the nodes' replies, on a clock that stops while this process
    does not run: ``remaining(now)`` before each wait; a wait that overran is given back (the
    deadline moves out by the whole wait), at most :data:`~.detector.MAX_STALLS` times and ``cap``
    seconds in all (if given: what the lease's validity allows; an acquire's validity is
    counted from its start, so a longer wait only leaves it less).
    :attr:`stalled` is the time given back. :attr:`excused` tells whether a node that did
    not answer had less than its budget of time in which this process ran since the last
    stall: its miss then says nothing about it (:meth:`.nodes.NodeDetector.missed`)."""

    __slots__ = ("asked", "budget", "clean", "credit", "deadline", "last", "stalled", "stalls")

    def __init__(self, budget: float, now: float, cap: float | None = None) -> None:
        # fan_out() sets these on a bare instance (its hot path): keep the two alike.
        self.budget = budget
        #: Time waited since the last stall, without one.
        self.clean = 0.0
        self.deadline = now + budget
        self.last = now
        self.asked = 0.0
        #: Seconds given back, and how many stalls they came from.
        self.stalled = 0.0
        self.stalls = 0
        self.credit = _NO_CAP if cap is None else cap

    @property
    def excused(self) -> bool:
        """Whether the nodes not heard from had less than their budget since the last stall
        (never, when there was no stall)."""
        return self.stalls > 0 and self.clean < self.budget

    def remaining(self, now: float) -> float:
        """Seconds left to wait (0 once the deadline passed); the next wait is expected to
        return within them. A wait that overran is taken as not having happened at all: the
        nodes on a host where this process did not run may not have run either, so they get
        the time that was left before it again."""
        waited = now - self.last
        # Written out rather than a call to overrun(): this runs on every wait of a fan-out.
        if waited - self.asked > STALL_SLACK and self.credit > 0.0 and self.stalls < MAX_STALLS:
            given = waited if waited < self.credit else self.credit
            self.credit -= given
            self.deadline += given
            self.stalled += given
            self.stalls += 1
            self.clean = 0.0
        elif waited > 0.0:
            self.clean += waited
        left = self.deadline - now
        if left < 0.0:
            left = 0.0
        self.last = now
        self.asked = left
        return left


class FanOut:
    """One operation's command to every node, and its replies in node order.

    A reply is whatever the node returned; a node that failed or did not answer in time
    yields a :class:`~.nodes.Failure`. ``enough(replies)``, asked once a majority of nodes
    answered, may end the wait before every node did (an acquire a quorum granted, a release a
    quorum removed): the others' replies still count as timed out, their connections are listed
    in ``left`` (``node index -> (wire, due)``) and go back to the pool owing them (in a round,
    unless the round gives them up later: a release behind one then finds it gone), and the
    next user of such a connection reads what it owes first (:meth:`~.nodes.Wire.settle`), so
    the slowest node never sets the pace.

    ``behind`` lists connections that owe the reply of a command this one ends (a release
    after an acquire that did not wait for every node). The command goes out behind it on the
    same connection when that is idle, so the node runs them in order; when another thread
    has it, the earlier command is marked unwanted, and whoever reads its reply sends its undo.

    ``late`` builds the undo sent behind the command on a connection given up before it
    answered (:meth:`~.nodes.Node.abandon`), so the undo cannot overtake a command still
    queued there (a frozen node runs both when it wakes up), and the late reply is never read
    as the answer to a later command. ``idempotent``: the command may run twice (a release);
    left owing on a connection that is then cut, it goes out again with the next operation
    that reaches the node (:attr:`~.nodes.Due.again`).
    """

    # Class defaults rather than slots: most stay as they are for most operations, and a new
    # fan-out (two per lock cycle) sets only what it is given.
    #: Nodes it was sent to again after the connection was cut with it out (see
    #: :data:`~.nodes.SENT_TWICE`).
    cut: set[int] | None = None
    #: Nodes where a copy of the command this one ends (an acquire's, for its release or
    #: undo) was still out: whoever reads the copy's reply sends its undo, which may remove
    #: the key before this command gets there (see :func:`_reclaim`).
    undone: set[int] | None = None
    finished = False
    #: ``enough`` ended it before every node answered.
    in_time = False
    #: The last command built and its encoding: most commands are one object for every node,
    #: encoded once.
    last: tuple[Any, bytes] | None = None
    # Sharing a round with other threads: why this op's thread is woken, the lock it sleeps
    # on, the ops it leads when it is woken to lead, the round it serves when woken to serve.
    role = ""
    wake: threading.Lock | None = None
    batch: list[FanOut] | None = None
    round: Round | None = None
    #: Builds a copy of the command for a node that is late to answer, sent on a second
    #: connection (a hedged request: see :func:`fan_out`); None: no copies.
    hedge: CommandBuilder | None = None

    def __init__(
        self,
        nodes: int,
        build: CommandBuilder,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, Owing] | None = None,
        behind: Mapping[int, Owing] | None = None,
        idempotent: bool = False,
    ) -> None:
        # Rounds.fan_out sets these on a bare instance (its hot path): keep the two alike.
        self.build = build
        self.late = late
        self.enough = enough
        self.left = left
        self.behind = behind
        self.idempotent = idempotent
        self.cut = self.undone = None  # read with every reply: see Due on class defaults
        #: Each node's reply; :data:`~.nodes.NOT_SENT` until the command went out to it.
        self.replies: list[Any] = [NOT_SENT] * nodes
        #: Nodes whose answer the operation still waits for.
        self.pending = nodes
        #: ``pending`` once a majority answered: ``enough`` (a quorum granted, or removed the
        #: key) cannot hold before.
        self.majority = nodes - (nodes // 2 + 1)

    def answer(self, index: int, reply: Any) -> bool:
        """A node of a round answered (or failed); whether that decides the operation."""
        self.replies[index] = settled(reply, index, self.cut, self.undone)
        self.pending -= 1
        if not self.pending:
            self.finished = True
        elif (
            self.pending <= self.majority and self.enough is not None and self.enough(self.replies)
        ):
            self.finished = self.in_time = True
        return self.finished


#: One connection of a round: the node it goes to, the connection, and the round's commands
#: on it still to be answered, oldest first (each :class:`~.nodes.Due` names its fan-out).
_Carried = tuple[int, Wire, list[Due]]


def fan_out(
    nodes: Sequence[Node], op: FanOut, timeout: float, then: Callable[[], None] | None = None
) -> None:
    """``op``'s command to every node at once, its replies collected in ``op.replies``: the
    fan-out of a thread that has the nodes to itself (a round of one, with nothing to share,
    in one frame: this is the uncontended lock's hot path).

    A node with no pooled connection gets one opened on a thread of its own
    (:meth:`~.nodes.Node.open_for`), within the connect budget; the command goes out on it
    once it is open, if the operation still waits. The operation waits for such a node
    until the connect budget only while too few other nodes can decide it without it (a
    fresh client on a busy host, whose handshakes all take longer than ``timeout``);
    otherwise it waits for it as for a slow node, within ``timeout`` of the last command
    out, and a node still connecting then is :data:`~.nodes.NOT_CONNECTED`, not a miss (the
    connection's own budget tells whether the node answers). A pooled socket that had gone
    stale (the node closed it while idle) gets one fresh try. ``then`` is called once a
    majority of nodes answered (the queue of other threads goes out: what is left to wait for
    is the slower nodes), or at the end. Interrupted, it gives up the connections it still
    waits on, with the undo of what they carried.
    """
    build, enough, behind, replies = op.build, op.enough, op.behind, op.replies
    #: fd -> (node index, wire, the reply this fan-out waits for on it)
    waiting: dict[int, tuple[int, Wire, Due]] = {}
    poller = select.poll()
    last: Any = None  # most commands are one object for every node: encoded once
    data = b""
    count = 1  # replies it gets (a Pipelined has several)
    now = time.monotonic()
    connect_deadline = now + (timeout if timeout > CONNECT_AT_LEAST else CONNECT_AT_LEAST)
    #: The nodes in ``connecting`` that missed an answer lately: they may be frozen, so
    #: once nothing else is owed they are waited for :data:`SUSPECT_LINGER` of the timeout
    #: at most.
    suspects: set[Node] | None = None
    #: Nodes whose connection is being opened for this fan-out -> their index; and what
    #: wakes the wait when one is open (or failed).
    connecting: dict[Node, int] = {}
    wakeup: Wakeup | None = None
    #: The longest any node's connection opened for this fan-out took (from its start).
    slowest_open = 0.0
    began = now
    stale: list[int] = []
    expired = False
    late, again = op.late, op.idempotent
    pid = ThisProcess.pid
    # This runs on every lock operation: the common case (every node has an idle pooled
    # connection, the command goes out whole in one send) is written out in this frame.
    order: Sequence[int] = range(len(nodes))
    for node in nodes:
        if not node._idle:
            order = _pooled_first(nodes)
            break
    try:
        for index in order:
            node = nodes[index]
            owing = behind.get(index) if behind else None
            if owing is not None and _reclaim(node, owing, op, index):
                wire = owing[0]
            else:
                # Node.checkout's common case: an idle connection that owes nothing, to a
                # server's URL, in a pool with nothing set aside, of this process.
                idle = node._idle
                pooled: Wire | None = None
                if idle and node._pid == pid and not node._draining and node.group is None:
                    try:
                        pooled = idle.pop()
                    except IndexError:  # another thread took it
                        pass
                    else:
                        if pooled.due:
                            idle.append(pooled)
                            pooled = None
                if pooled is not None:
                    wire = pooled
                else:
                    try:
                        if node.max_connections is not None:
                            # Its connections are counted: waiting for room is a wait of
                            # its own, and one opened for nobody would hold a slot.
                            wire = node.checkout(connect_deadline)
                        else:
                            opened = node.checkout_pooled(connect_deadline)
                            if opened is None:
                                if wakeup is None:
                                    wakeup = Wakeup()
                                    poller.register(wakeup.fd, select.POLLIN)
                                node.open_for(wakeup, connect_deadline - now)
                                connecting[node] = index
                                if node.missed_lately():
                                    if suspects is None:
                                        suspects = set()
                                    suspects.add(node)
                                replies[index] = TIMED_OUT  # not heard from yet
                                continue
                            wire = opened
                    except WireError as exc:
                        replies[index] = exc.failure
                        continue
            command: Any = build(node, wire)
            if command is not last:
                last = command
                kind = command.__class__
                if kind is Pipelined:
                    data, count = command.data, command.count
                elif kind is bytes:
                    data, count = command, 1
                else:
                    data, count = as_bytes(command), 1
            try:
                # What could not reach the node before goes out first, in the same write.
                out = node.owe_later(wire) + data if node.later else data
                try:
                    sent = wire.sock.send(out)
                except SOCKET_FULL:
                    sent = 0
                if sent != len(out):
                    wire.write(memoryview(out)[sent:])
            except OSError as exc:
                node.lose(wire)
                if wire.reused and not isinstance(exc, TimeoutError):
                    stale.append(index)
                else:
                    replies[index] = os_failure(exc)
                continue
            # Due(command, late, now, data if again else None, op), written out (see _bare).
            due = _bare(Due)
            due.command = command
            due.op = op
            due.count = count
            due.late = late
            due.sent = now
            due.again = data if again else None
            due.unwanted = due.resent = False
            due.waited = 0.0
            wire.due.append(due)
            replies[index] = TIMED_OUT  # out: it runs on the node when the node gets to it
            waiting[wire.fd] = (index, wire, due)
            poller.register(wire.fd, select.POLLIN)
        for index in stale:
            _resend_one(nodes, index, op, waiting, poller, timeout)
        # Connecting is not the nodes' silence: their time starts once the command is out.
        # Wait(timeout, time.monotonic()), written out on a bare instance (as the Due).
        wait = _bare(Wait)
        wait.budget = timeout
        wait.last = started = time.monotonic()
        wait.deadline = started + timeout
        wait.clean = wait.asked = wait.stalled = 0.0
        wait.stalls = 0
        wait.credit = _NO_CAP
        need = len(nodes) - op.majority  # a majority
        #: Until when the nodes whose command is out get to answer (moved out for a node
        #: whose command went out once its connection was open).
        reply_until = wait.deadline
        if connecting:
            _retime(wait, reply_until, connect_deadline, len(nodes) - len(connecting) < need)
        hedge_at = None
        since = wait.last - hedging.LOSSY_FOR
        if op.hedge is not None and LATENESS.last > since:
            # Copies only while some node's replies come late enough to be lost packets
            # (tested here first, without a call: this runs on every fan-out; mostly no
            # node of the process was late lately).
            for node in nodes:
                if node.late_at > since:
                    hedge_at = hedging.hedge_at(nodes, wait.last, wait.last, timeout)
                    break
        every = 0.0 if hedge_at is None else hedge_at - wait.last
        #: node index -> how many copies of the command it was sent (hedged nodes only).
        copies: dict[int, int] = {}
        #: hedged nodes that answered on one of their connections.
        answered: set[int] = set()
        #: ``enough`` held while some node was still being connected to: the wait goes on
        #: for those connections only (see _linger_until).
        decided = False
        while waiting or connecting:
            if decided and not connecting:
                break
            if suspects and not waiting and suspects.issuperset(connecting):
                # Only nodes that missed an answer lately are left, being connected to (or
                # waited for until one comes back to the pool): they may be frozen.
                until = began + wait.stalled
                until += max(suspect_linger(node, timeout) for node in connecting)
                if until < wait.deadline:
                    wait.deadline = until
            outstanding = len(waiting) if not copies else _outstanding(waiting, answered)
            outstanding += len(connecting)
            if not outstanding:
                # Every node answered; only copies of a command that another connection
                # already answered are owed: they go back to the pool owing them.
                op.in_time = True
                break
            if then is not None and len(nodes) - outstanding >= need:
                handed: Callable[[], None] = then
                then = None
                handed()
            # Past the deadline this still sweeps up replies that have already arrived.
            remaining = wait.remaining(time.monotonic())
            poll_for = remaining
            if hedge_at is not None:
                now = time.monotonic()
                if now >= hedge_at:
                    hedge_at = _hedge(nodes, op, waiting, poller, copies, answered, now, every)
                    if hedge_at is not None:
                        poll_for = min(remaining, max(hedge_at - now, 0.0))
                else:
                    poll_for = min(remaining, hedge_at - now)
            events = poller.poll(poll_for * 1000)
            if not events:
                if wait.remaining(time.monotonic()):
                    continue  # the process did not run meanwhile: the nodes get their time
                expired = not decided
                break
            now = time.monotonic()
            # Every reply that came in is read before deciding: a connection left owing costs
            # the next user a read, and the release a connection of its own.
            for fd, _ in events:
                if wakeup is not None and fd == wakeup.fd:
                    opened_at = _send_opened(
                        nodes, op, wakeup, connecting, waiting, poller, connect_deadline
                    )
                    if opened_at is not None:
                        if opened_at + timeout > reply_until:
                            reply_until = opened_at + timeout
                        if opened_at - began > slowest_open:
                            slowest_open = opened_at - began
                    if not decided:
                        short = len(nodes) - len(connecting) < need
                        _retime(wait, reply_until, connect_deadline, short)
                    continue
                index, wire, due = waiting[fd]
                try:
                    wire.read()
                except Incomplete:
                    if due.reply is OWED:
                        continue  # the rest of the reply is on its way
                except OSError as exc:
                    del waiting[fd]
                    poller.unregister(fd)
                    nodes[index].lose(wire)
                    if index in copies:
                        # Another copy may still answer; if none does, it timed out.
                        if index not in answered and not _waits_on(waiting, index):
                            replies[index] = os_failure(exc)
                    elif wire.reused and remaining > 0:
                        _resend_one(nodes, index, op, waiting, poller, remaining, wire)
                    else:
                        replies[index] = os_failure(exc)
                    continue
                del waiting[fd]
                poller.unregister(fd)
                node = nodes[index]
                # NodeDetector.answered's common case (no misses to forget), and the round
                # trip (a new connection's first one included its handshake: not counted).
                detector = node.detector
                sent_at = due.sent
                if detector.misses or detector.down_since is not None:
                    detector.answered(now, sent_at)
                elif sent_at > detector.heard_at:
                    detector.heard_at = sent_at
                if wire.reused and not due.resent:
                    # NodeDetector.round_trip, written out (not of a script sent again after
                    # NOSCRIPT: Karn's rule, its time spans two round trips).
                    rtt = now - sent_at
                    srtt = detector.srtt
                    if srtt is None:
                        detector.round_trip(rtt)  # the first: nothing to smooth yet
                    else:
                        quick = detector.quick
                        if quick is None or rtt < quick:
                            detector.quick = rtt
                        else:
                            detector.quick = quick + QUICK_GAIN * (rtt - quick)
                        off = rtt - srtt
                        detector.srtt = srtt = srtt + SRTT_GAIN * off
                        # RTT_GAIN is a quarter: four deviations take the new one whole.
                        rttvar4 = RTTVAR_KEEP * detector.rttvar4 + (off if off > 0.0 else -off)
                        detector.rttvar4 = rttvar4
                        detector.rto = srtt + rttvar4
                # Dropped if the server is no longer the master (checkin); closed if the
                # pool holds what the operations use at once already (see Node.wanted).
                idle = node._idle
                if wire.on_replica or node.group is not None:
                    node.checkin(wire)
                elif (
                    len(idle) < node._wanted
                    and node.max_connections is None
                    and now < node._window_ends
                    and node._open - len(idle) - len(node._draining) <= node._peak
                ):
                    # Node._pool's common case (a server's URL, room in the pool, no new
                    # peak of connections in use), written out: it runs for every reply.
                    wire.reused = True
                    wire.idle_since = now
                    idle.append(wire)
                else:
                    node._pool(wire, now)  # checkin()'s common case: a server's URL
                reply = due.reply
                # Asked first: an acquire's reply (a list) compared with 0 is CPython's slow path.
                if (op.cut is not None or op.undone is not None) and reply == 0:
                    reply = settled(reply, index, op.cut, op.undone)
                if index in copies:
                    reply = hedging.first_word(
                        reply,
                        answered=index in answered,
                        prior=replies[index],
                        idempotent=op.idempotent,
                        other_out=_waits_on(waiting, index),
                        nothing_left=NOTHING_LEFT,
                    )
                    if reply is None:
                        continue
                    answered.add(index)
                    if hedging.granted(reply):
                        for other in waiting.values():
                            if other[0] == index:
                                other[2].counted = True
                replies[index] = reply
            # Asked only once a majority answered: no quorum can have granted (or removed)
            # before, and a command whose answers nobody reads would end at its first reply.
            if not decided and enough is not None and (waiting or connecting):
                outstanding = len(waiting) if not copies else _outstanding(waiting, answered)
                if 2 * (outstanding + len(connecting)) < len(nodes) and enough(replies):
                    op.in_time = True
                    linger = _linger_until(connecting, timeout, slowest_open)
                    if linger is None:
                        break
                    decided = True
                    wait.deadline = linger + wait.stalled
    except BaseException:
        for index, wire, _ in waiting.values():
            _put_back(nodes[index], wire, False, False)
        raise
    finally:
        if wakeup is not None:
            # A connection opened after this is pooled for the next operation; none carries
            # this one's command.
            for node in nodes:
                node.stop_waiting(wakeup)
            for index in connecting.values():
                replies[index] = NOT_CONNECTED
            wakeup.close()
        if then is not None:
            then()
    now = time.monotonic()
    for index, wire, due in waiting.values():
        # Without a quorum in time no lease comes of it: a grant counted here is undone
        # like the rest, behind the connection that is given up.
        refused = index in answered and not hedging.granted(replies[index])
        leave(due, counted=due.counted and op.in_time, refused=refused)
        if wire.reused:
            due.waited = now - due.sent  # its reply, read later, measures the node
        overdue = wire.due[0].sent + timeout + wait.stalled <= now
        silent = (expired or overdue) and index not in answered
        kept = _put_back(
            nodes[index], wire, op.in_time and not overdue, silent, silent and wait.excused
        )
        # A counted copy given up (past the node timeout already) carries no undo: what ends
        # the lock must still go behind it (it is read, and found, where it is set aside).
        if kept or due.counted:
            list_left(op.left, index, wire, due)
    if every and op.in_time and op.idempotent and waiting:
        _send_copies(nodes, op, waiting, copies, answered)


#: How many times as long as the other nodes' new connections took a fan-out decided without
#: a node still being connected to waits for it (see :func:`_linger_until`).
LINGER_FACTOR = 10

#: The longest (seconds) such a fan-out waits for it when that is longer than its node
#: timeout: what a frozen node's first contact costs a caller on a busy host (a fresh
#: client there needed more than 0.25 s for three handshakes one after the other).
LINGER_AT_MOST = 0.25


#: The share of the node timeout for which such a fan-out waits for the connection of a node
#: that missed an answer lately (or :data:`SUSPECT_ROUND_TRIPS` of its round trips, if
#: longer): a healthy node's new connection opens within a few milliseconds (0.4 ms at the
#: median, 5 ms at the 99th percentile on a loaded 2-core host), a far one's within two
#: round trips (TCP's, then the handshake's), so one late reply does not leave it out of the
#: next operation, while a frozen near node costs an operation that waits for it a fifth of
#: the node timeout, not all of it.
SUSPECT_LINGER = 0.2
SUSPECT_ROUND_TRIPS = 3


def suspect_linger(node: Node, timeout: float) -> float:
    """How long from its start the connection of a node that missed an answer lately is
    waited for (:data:`SUSPECT_LINGER`)."""
    quick = node.detector.quick
    floor = SUSPECT_LINGER * timeout
    if quick is None or SUSPECT_ROUND_TRIPS * quick < floor:
        return floor
    return SUSPECT_ROUND_TRIPS * quick


def node_linger(node: Node, timeout: float, wait_for: float) -> float:
    """How long from its start a node's connection is waited for by an operation that its
    other nodes decided: ``wait_for`` (:func:`linger_for`), or :func:`suspect_linger` for a
    node that missed an answer lately (both fan-outs' rule)."""
    return suspect_linger(node, timeout) if node.missed_lately() else wait_for


def linger_for(timeout: float, slowest_open: float) -> float:
    """How long from its start a node's connection is waited for by an operation that its
    other nodes decided (see :func:`_linger_until`; the asyncio fan-out's rule too)."""
    wait_for = LINGER_FACTOR * slowest_open
    if wait_for > LINGER_AT_MOST:
        wait_for = LINGER_AT_MOST
    return timeout if wait_for < timeout else wait_for


def _linger_until(
    connecting: Mapping[Node, int], timeout: float, slowest_open: float
) -> float | None:
    """How long a fan-out decided without some nodes still being connected to waits for
    their connections (None: not at all): a healthy node's copy of a fresh client's first
    lock is not lost to its handshake. Each gets ``timeout`` from when its connection began,
    or :data:`LINGER_FACTOR` times as long as the slowest of this fan-out's other new
    connections took (``slowest_open``: on a busy host every handshake runs long, a healthy
    node's too; a frozen node's neighbours answer theirs in a millisecond or two), within
    :data:`LINGER_AT_MOST` (or ``timeout`` if longer). A node whose connection has been
    opening longer than that costs nothing more: the operation that began to connect to it
    waited for it already. One whose connection has just opened (its thread is done, its
    news not yet read) gets ``timeout`` from now: its command goes out once the news is.
    A node that missed an answer lately gets :data:`SUSPECT_LINGER` of that instead."""
    wait_for = linger_for(timeout, slowest_open)
    now = time.monotonic()
    until = None
    for node in connecting:
        since = node.connecting_since()
        if since is not None:
            at = since + node_linger(node, timeout, wait_for)
        else:
            # Its connection has just opened (or failed), and the news is on its way.
            at = now + (suspect_linger(node, timeout) if node.missed_lately() else timeout)
        if until is None or at > until:
            until = at
    if until is None or until <= now:
        return None
    return until


def _retime(wait: Wait, reply_until: float, connect_until: float, short: bool) -> None:
    """Set ``wait``'s deadline: ``reply_until``, or ``connect_until`` if later while ``short``
    (too few nodes have their command out to decide the operation without a node still
    being connected to), plus the time given back for stalls."""
    until = connect_until if short and connect_until > reply_until else reply_until
    wait.deadline = until + wait.stalled


def _send_opened(
    nodes: Sequence[Node],
    op: FanOut,
    wakeup: Wakeup,
    connecting: dict[Node, int],
    waiting: dict[int, tuple[int, Wire, Due]],
    poller: Any,
    deadline: float,
) -> float | None:
    """``op``'s command to each node in ``connecting`` whose connection the threads opening
    them told ``wakeup`` of: out on a pooled connection (that one, or any other), or the
    node's failure; another is opened when another operation took it first. When the last
    command went out (None: none did)."""
    sent_at = None
    for node, failure in wakeup.take().items():
        index = connecting.get(node)
        if index is None:
            continue
        try:
            wire = node.checkout_pooled(deadline)
        except WireError as exc:
            wire, failure = None, exc.failure
        if wire is None:
            if failure is None:
                node.open_for(wakeup, max(deadline - time.monotonic(), 0.005))
            else:
                del connecting[node]
                op.replies[index] = failure
            continue
        del connecting[node]
        now = time.monotonic()
        if _send_watched(node, wire, op, index, waiting, poller, now):
            sent_at = now
    return sent_at


def _send_copies(
    nodes: Sequence[Node],
    op: FanOut,
    waiting: Mapping[int, tuple[int, Wire, Due]],
    copies: Mapping[int, int],
    answered: set[int],
) -> None:
    """A release or an undo that a quorum answered leaves the slower nodes their copy of the
    command on a connection that owes a late reply: the key stays there until that reply's
    retransmission, and a quorum of the other nodes must then grant the next acquire alone.
    Each such node gets one more copy now on an idle connection, if one is there, whose reply
    nobody waits for (read by the connection's next user)."""
    now = time.monotonic()
    for index in {entry[0] for entry in waiting.values()} - answered:
        if copies.get(index, 1) > 1:
            continue  # it has one already
        sent = _send_copy(nodes[index], op, now)
        if sent is not None:
            sent[1].left = True
            nodes[index].checkin(sent[0])


def _send_copy(node: Node, op: FanOut, now: float) -> tuple[Wire, Due] | None:
    """``op``'s hedge sent to ``node`` on an idle connection that owes nothing: the
    connection and the reply it owes, or None when none is idle (or sending failed)."""
    hedge = op.hedge
    assert hedge is not None
    wire = node.spare()
    if wire is None:
        return None
    command = hedge(node, wire)
    try:
        return wire, _send_one(node, wire, op, command, as_bytes(command), now)
    except OSError:
        node.lose(wire)
        return None


def _outstanding(waiting: Mapping[int, tuple[int, Wire, Due]], answered: set[int]) -> int:
    """How many nodes have not answered yet (a hedged node waits on several connections)."""
    return len({entry[0] for entry in waiting.values() if entry[0] not in answered})


def _waits_on(waiting: Mapping[int, tuple[int, Wire, Due]], index: int) -> bool:
    return any(entry[0] == index for entry in waiting.values())


def _hedge(
    nodes: Sequence[Node],
    op: FanOut,
    waiting: dict[int, tuple[int, Wire, Due]],
    poller: Any,
    copies: dict[int, int],
    answered: set[int],
    now: float,
    every: float,
) -> float | None:
    """Send ``op``'s hedge (a copy of its command that the node may run twice: a
    token-checked delete, or the acquire script, which takes our own token as our grant)
    to every node that has not answered yet, on an idle connection that owes nothing (none
    is opened for it). A connection that carries a copy owes its reply like the first: an
    undo or release goes behind each (see :attr:`~.nodes.Due.twins`). Returns when the next
    copies go out (one more each ``every`` seconds, up to :func:`~.hedging.copies_allowed`
    connections), or None."""
    late = {entry[0] for entry in waiting.values()} - answered
    most = hedging.copies_allowed(op.idempotent)
    more = False
    for index in late:
        sent = copies.get(index, 1)
        if sent >= most:
            continue
        copy = _send_copy(nodes[index], op, now)
        if copy is None:
            more = True  # a connection may be back in the pool by the next try
            continue
        wire, due = copy
        copies[index] = sent + 1
        more = more or sent + 1 < most
        waiting[wire.fd] = (index, wire, due)
        poller.register(wire.fd, select.POLLIN)
    return now + every if more else None


def _pooled_first(nodes: Sequence[Node]) -> Sequence[int]:
    """Node indexes, those with an idle pooled connection first: their commands are in flight
    while the others are still being connected to."""
    # The pools' deques read directly: this runs on every fan-out.
    for node in nodes:
        if not node._idle:
            if any(n.max_connections is not None for n in nodes):
                # Connections taken in one order by every thread: one holding some while it
                # waits for a capped node's never blocks one holding that node's.
                return range(len(nodes))
            return sorted(range(len(nodes)), key=lambda i: not nodes[i]._idle)
    return range(len(nodes))


def _send_one(node: Node, wire: Wire, op: FanOut, command: Any, data: bytes, sent: float) -> Due:
    """Send ``op``'s command (``data``, encoded) on ``wire``, behind what could not reach the
    node before; the reply it now owes (raises ``OSError``)."""
    wire.write(node.owe_later(wire) + data if node.later else data)
    due = Due(command, op.late, sent, data if op.idempotent else None, op)
    wire.due.append(due)
    return due


def _resend_one(
    nodes: Sequence[Node],
    index: int,
    op: FanOut,
    waiting: dict[int, tuple[int, Wire, Due]],
    poller: Any,
    timeout: float,
    cut: Wire | None = None,
) -> None:
    """:func:`fan_out`'s one fresh try on a new connection (see :meth:`Round._resend`)."""
    node = nodes[index]
    wire = _fresh(node, index, [op], timeout, cut)
    if isinstance(wire, Failure):
        op.replies[index] = wire
        return
    _send_watched(node, wire, op, index, waiting, poller, time.monotonic())


def _send_watched(
    node: Node,
    wire: Wire,
    op: FanOut,
    index: int,
    waiting: dict[int, tuple[int, Wire, Due]],
    poller: Any,
    now: float,
) -> bool:
    """Send ``op``'s command to ``node`` on ``wire`` outside the fan-out's first round (a
    connection opened meanwhile, one taken anew) and watch it for the reply; False when the
    send failed (the connection is lost and the reply is the failure)."""
    command = op.build(node, wire)
    try:
        due = _send_one(node, wire, op, command, as_bytes(command), now)
    except OSError as exc:
        node.lose(wire)
        op.replies[index] = os_failure(exc)
        return False
    op.replies[index] = TIMED_OUT
    waiting[wire.fd] = (index, wire, due)
    poller.register(wire.fd, select.POLLIN)
    return True


def _reclaim(node: Node, owing: Owing, op: FanOut, index: int) -> bool:
    """Take the connection that owes the reply of a command ``op`` ends (``behind``) out of
    the pool, for ``op``'s command to go out behind it. When another thread has it, mark the
    earlier command unwanted: whoever holds the connection next sends the undo behind it (it
    may have come back before it could see the mark: then it is taken after all)."""
    wire, due = owing
    if op.idempotent and due.twins:
        # The command ends the earlier one (a release, an undo), whose copy on another
        # connection is ended too: the command goes behind that copy as well, or, when
        # another thread has its connection, whoever reads its reply sends the undo behind
        # it (waiting for a reader would leave the key set until its lease ran out if the
        # copy landed late and nobody took that connection). Either may reach the node
        # first, and this command then finds nothing: not a key that was not ours.
        for twin in due.twins:
            _end_twin(node, twin, op)
        op.undone = op.undone or set()
        op.undone.add(index)
    if node.reclaim(wire):
        return True
    due.unwanted = True
    if node.reclaim(wire):
        due.unwanted = False
        return True
    if op.idempotent:
        # Whoever reads the earlier command's reply sends its undo, which may reach the node
        # first, as a copy's may.
        op.undone = op.undone or set()
        op.undone.add(index)
    return False


def _end_twin(node: Node, twin: Due, op: FanOut) -> None:
    """Send ``op``'s command (a release or an undo) behind ``twin``, a copy of the command it
    ends still owed on a connection of its own, if that connection is idle or set aside;
    else mark the copy unwanted (see :func:`_reclaim`)."""
    wire = twin.wire
    if wire is None or twin.reply is not OWED or not node.reclaim(wire):
        twin.unwanted = True
        return
    command = op.build(node, wire)
    try:
        due = _send_one(node, wire, op, command, as_bytes(command), time.monotonic())
    except OSError:
        twin.unwanted = True  # its undo goes out on another connection (Node.lose)
        node.lose(wire)
        return
    due.left = True
    node.checkin(wire)


def _fresh(
    node: Node, index: int, ops: list[FanOut], timeout: float, cut: Wire | None
) -> Wire | Failure:
    """A new connection to node ``index`` for the one fresh try of ``ops``, or why there is
    none. After a connection ``cut`` with idempotent commands out, the same server may have run
    them: their second "nothing to do" then says nothing (:data:`~.nodes.SENT_TWICE`); after a
    restart it did not, or its data is gone with them."""
    try:
        wire = node.connect(timeout)
    except WireError as exc:
        return exc.failure
    if cut is not None and wire.run_id == cut.run_id:
        for op in ops:
            if op.idempotent:
                op.cut = op.cut or set()
                op.cut.add(index)
    return wire


def _put_back(node: Node, wire: Wire, timely: bool, silent: bool, excused: bool = False) -> bool:
    """End a fan-out's use of a connection that still owes replies: back to the pool when
    what it owes is for operations that ended in time (the next user reads it first), else
    given up with the undo of what it carried sent behind it (:meth:`~.nodes.Node.abandon`).
    ``silent``: the node did not answer within the node timeout, a miss (``excused`` when
    this process stalled during the wait: see :mod:`.detector`). Whether it went back."""
    if silent:
        node.went_silent(excused, wire.due[0].sent if wire.due else None)
    if timely:
        for due in wire.due:
            if due.unwanted:
                try:
                    wire.undo_unwanted()
                except OSError:
                    node.lose(wire)
                    return False
                break
        node.checkin(wire)
        return True
    node.abandon(wire)
    return False


class Round:
    """Fan-outs sent together: on each node, one connection carries all their commands in one
    write (a fan-out whose ``behind`` names an idle connection gets that one), and whoever
    serves the round reads the replies for all of them.

    One thread at a time serves it: the first until its own operation is decided, then the
    thread of an operation still waiting (:meth:`serve` hands it on). The last one puts the
    connections back, owing what the nodes have not answered yet, or gives them up.
    """

    def __init__(self, nodes: Sequence[Node], ops: list[FanOut], timeout: float) -> None:
        self.nodes = nodes
        self.ops = ops
        self.timeout = timeout
        #: fd -> a connection that still owes some of the round's replies
        self.carried: dict[int, _Carried] = {}
        self.poller = select.poll()
        self.sent = False
        #: The wait for the replies, once the commands are out.
        self.wait = Wait(timeout, 0.0)
        #: Called once the first operation heard from a majority (see :meth:`serve`).
        self.then: Callable[[], None] | None = None
        #: The deadline passed with fan-outs still waiting (the nodes not heard are silent).
        self.expired = False
        #: The nodes for which some fan-out names the connection it must go out on
        #: (``behind``).
        self.claimed: set[int] = set()
        for op in ops:
            if op.behind:
                self.claimed.update(op.behind)

    def serve(self, me: FanOut, then: Callable[[], None] | None = None) -> None:
        """Send the round (the first time), then read replies for every fan-out of it until
        ``me`` is decided, waking the others' threads as theirs are; call ``then`` (the
        leader hands the queue over); hand the round on to the thread of a fan-out still
        waiting, or end it. On an error (an interrupt in this thread) every fan-out of the
        round ends with what it has, so no other thread waits for it."""
        self.then = then
        try:
            if not self.sent:
                self._send_all()
            self._read_until(me)
        except BaseException:
            self._end_all()
            self._close()
            raise
        finally:
            self._next_round()
        for op in self.ops:
            if not op.finished:
                op.round = self
                _wake(op, _SERVE)
                return
        self._close()

    # -- sending --------------------------------------------------------------------------------

    def _send_all(self) -> None:
        self.sent = True
        nodes = self.nodes
        now = time.monotonic()
        # For all the connecting together; not the nodes' silence (see .detector).
        connect_deadline = now + connect_budget(self.timeout)
        # One fresh try for a pooled socket that had gone stale (the node closed it while idle).
        stale: list[tuple[int, list[FanOut]]] = []
        claimed = self.claimed
        alone: list[tuple[Wire | None, list[FanOut]]] = [(None, self.ops)]
        for index in _pooled_first(nodes):
            node = nodes[index]
            for wire, ops in self._claim(index) if index in claimed else alone:
                if wire is None:
                    try:
                        wire = node.checkout(connect_deadline)
                    except WireError as exc:
                        self._fail(index, ops, exc.failure)
                        continue
                try:
                    self._send(index, wire, ops, now)
                except OSError as exc:
                    node.lose(wire)
                    if wire.reused and not isinstance(exc, TimeoutError):
                        stale.append((index, ops))
                    else:
                        self._fail(index, ops, os_failure(exc))
        for index, ops in stale:
            self._resend(index, ops, self.timeout)
        self.wait = Wait(self.timeout, time.monotonic())

    def _claim(self, index: int) -> list[tuple[Wire | None, list[FanOut]]]:
        """The round's fan-outs grouped by the connection they go out on to node ``index``:
        the idle one that owes the reply of the command a fan-out ends (``behind``), else
        one taken from the pool (``None``)."""
        node = self.nodes[index]
        groups: dict[Wire | None, list[FanOut]] = {}
        for op in self.ops:
            owing = op.behind.get(index) if op.behind else None
            wire: Wire | None = None
            if owing is not None and (owing[0] in groups or _reclaim(node, owing, op, index)):
                wire = owing[0]
            groups.setdefault(wire, []).append(op)
        if node.max_connections is not None and len(groups) > 1 and None in groups:
            # A capped node: the rest go behind a connection the round holds already, rather
            # than wait for one that the round itself may be holding.
            rest = groups.pop(None)
            next(iter(groups.values())).extend(rest)
        return list(groups.items())

    def _send(self, index: int, wire: Wire, ops: list[FanOut], sent: float) -> None:
        """Send the fan-outs' commands on ``wire`` in one write, behind what could not reach
        the node before; the wire then owes their replies (raises ``OSError``)."""
        node = self.nodes[index]
        dues = []
        for op in ops:
            command = op.build(node, wire)
            last = op.last
            if last is None or last[0] is not command:
                last = op.last = (command, as_bytes(command))
            dues.append(Due(command, op.late, sent, last[1] if op.idempotent else None, op))
        # One write (a failed one loses the connection, and the replies owed with it).
        data = last[1] if len(dues) == 1 else b"".join([op.last[1] for op in ops])  # type: ignore[index]
        # What could not reach the node before goes out first, in the same write.
        wire.write(node.owe_later(wire) + data if node.later else data)
        wire.due.extend(dues)
        for op in ops:
            op.replies[index] = TIMED_OUT  # out: it runs on the node when the node gets to it
        self.carried[wire.fd] = (index, wire, dues)
        self.poller.register(wire.fd, select.POLLIN)

    def _resend(
        self, index: int, ops: list[FanOut], timeout: float, cut: Wire | None = None
    ) -> None:
        """The one fresh try on a new connection, for a node whose pooled connection had
        been closed while idle, or ``cut`` after the commands went out on it."""
        node = self.nodes[index]
        wire = _fresh(node, index, ops, timeout, cut)
        if isinstance(wire, Failure):
            self._fail(index, ops, wire)
            return
        try:
            self._send(index, wire, ops, time.monotonic())
        except OSError as exc:
            node.lose(wire)
            self._fail(index, ops, os_failure(exc))

    def _fail(self, index: int, ops: list[FanOut], failure: Failure) -> None:
        for op in ops:
            if not op.finished and op.answer(index, failure):
                self._decided(op)

    # -- reading --------------------------------------------------------------------------------

    def _next_round(self) -> None:
        """Call ``then`` (once): the leader's queue goes out as the next round."""
        then, self.then = self.then, None
        if then is not None:
            then()

    def _read_until(self, me: FanOut) -> None:
        carried, poller = self.carried, self.poller
        while not me.finished:
            if me.pending <= me.majority:
                # A majority answered ``me``: what is left is the slower nodes, which the next
                # round need not wait for.
                self._next_round()
            # Past the deadline this still sweeps up replies that have already arrived.
            remaining = self.wait.remaining(time.monotonic())
            events = poller.poll(remaining * 1000)
            if not events:
                if self.wait.remaining(time.monotonic()):
                    continue  # the process did not run meanwhile: the nodes get their time
                self.expired = True
                self._end_all()
                return
            now = time.monotonic()
            for fd, _ in events:
                on = carried[fd]
                wire = on[1]
                try:
                    wire.read()
                except Incomplete:
                    pass  # the rest is on its way
                except OSError as exc:
                    self._cut(on, exc, remaining)
                    continue
                owed = on[2]
                sent = owed[-1].sent if owed else None
                # Not of a script sent again after NOSCRIPT (Karn's rule: two round trips).
                measured = wire.reused and not any(due.resent for due in owed)
                if self._take_answers(on):
                    del carried[fd]
                    poller.unregister(fd)
                    node = self.nodes[on[0]]
                    node.detector.answered(now, sent)
                    if sent is not None and measured:
                        node.detector.round_trip(now - sent)
                    node.checkin(wire)

    def _cut(self, carried: _Carried, exc: OSError, remaining: float) -> None:
        """A connection broke before it answered: its fan-outs get one fresh try if it had
        been pooled (the node may have closed it while idle), else the failure."""
        index, wire, owed = carried
        del self.carried[wire.fd]
        self.poller.unregister(wire.fd)
        self.nodes[index].lose(wire)
        self._take_answers(carried)
        cut = [due.op for due in owed if not due.op.finished]
        if cut and wire.reused and remaining > 0:
            self._resend(index, cut, remaining, wire)
        else:
            self._fail(index, cut, os_failure(exc))

    def _take_answers(self, carried: _Carried) -> bool:
        """Hand the replies that came in to their fan-outs (a node answers one connection's
        commands in order); whether every one of them came in."""
        index, _, owed = carried
        taken = 0
        for due in owed:
            reply = due.reply
            if reply is OWED:
                break
            taken += 1
            op = due.op
            # A fan-out decided without this node: the reply only had to be read.
            if not op.finished and op.answer(index, reply):
                self._decided(op)
        if taken:
            del owed[:taken]
        return not owed

    def _decided(self, op: FanOut) -> None:
        """``op`` ended: nobody waits for the replies it did not get any more (an acquire
        that ended in time lists the connections that owe them in ``left``); its thread is
        woken with its replies."""
        if op.pending:
            late: dict[int, tuple[int, Wire, Due]] = {}
            now = time.monotonic()
            for index, wire, owed in self.carried.values():
                for due in owed:
                    if due.op is op:
                        due.left = True
                        if wire.reused:
                            due.waited = now - due.sent  # as fan_out's
                        late[wire.fd] = (index, wire, due)
                        if op.in_time:
                            list_left(op.left, index, wire, due)
            # A round sends no copies while it waits; a release a quorum answered still gets
            # them where it is late, as a fan-out's does.
            if (
                op.in_time
                and op.idempotent
                and op.hedge is not None
                and late
                and hedging.lossy(self.nodes, time.monotonic())
            ):
                _send_copies(self.nodes, op, late, {}, set())
        if op.wake is not None:
            _wake(op, _DONE)

    def _end_all(self) -> None:
        """The deadline passed (or the serving thread was interrupted): every fan-out still
        waiting ends with what it has; a node not heard from counts as timed out."""
        for op in self.ops:
            if not op.finished:
                op.finished = True
                self._decided(op)

    def _close(self) -> None:
        """Every fan-out of the round is decided. A connection that still owes some of its
        replies goes back to the pool when the fan-outs they were for ended in time (the next
        user reads what it owes first); otherwise it is given up with the undo of what it
        carried sent behind (:meth:`~.nodes.Node.abandon`)."""
        now = time.monotonic()
        stalled = self.wait.stalled
        for index, wire, owed in self.carried.values():
            overdue = wire.overdue(now, self.timeout + stalled)
            timely = all(due.op.in_time for due in owed) and not overdue
            _put_back(self.nodes[index], wire, timely, self.expired or overdue, self.wait.excused)
        self.carried = {}


def _wake(op: FanOut, role: str) -> None:
    """Wake ``op``'s thread for ``role`` (what it needs for it, ``batch`` or ``round``, is
    set before). The role is set before the release, and the release happens however the
    waker is interrupted: the sleeper goes by the role (see :func:`_sleep`)."""
    wake = op.wake
    assert wake is not None
    try:
        op.role = role
    finally:
        op.wake = None
        wake.release()


class Rounds:
    """The fan-outs of one Redlock's threads. A fan-out started while another thread leads
    one waits for the next round; the leader hands the queue over, as that next round, as
    soon as its own operation is decided. A thread alone pays one uncontended lock for it."""

    def __init__(self, nodes: Sequence[Node], timeout: float) -> None:
        self.nodes = nodes
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queue: list[FanOut] = []
        #: A round is on the wire whose leader's own operation is not decided yet.
        self._leading = False
        #: The thread signal handlers run in (a forked child builds new Rounds).
        self._main = threading.main_thread().ident
        #: A :class:`FanOut`'s ``majority`` over these nodes.
        self._majority = len(nodes) - (len(nodes) // 2 + 1)

    def fan_out(
        self,
        build: CommandBuilder,
        timeout: float | None = None,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, Owing] | None = None,
        behind: Mapping[int, Owing] | None = None,
        idempotent: bool = False,
        *,
        hedge: CommandBuilder | None = None,
    ) -> list[Any]:
        """Send one command to every node at once and collect the replies in node order
        (see :class:`FanOut`). With a ``timeout`` other than the node timeout it goes alone.
        ``hedge`` builds the copy a late node gets on a second connection (an idempotent
        command's is itself; see :func:`fan_out`)."""
        # FanOut(len(self.nodes), build, late, enough, left, behind, idempotent), written
        # out (see _bare): two per lock cycle.
        op = _bare(FanOut)
        op.build = build
        op.late = late
        op.enough = enough
        op.left = left
        op.behind = behind
        op.idempotent = idempotent
        op.cut = op.undone = None
        op.pending = count = len(self.nodes)
        op.replies = [NOT_SENT] * count
        op.majority = self._majority
        hedge = hedge if hedge is not None or not idempotent else build
        if hedge is not None:
            op.hedge = hedge
        if timeout is not None and timeout != self.timeout:
            fan_out(self.nodes, op, timeout)
            return op.replies
        budget = self.timeout
        for node in self.nodes:
            if node.detector.rto > budget:
                budget = self.budget()  # the round trips run longer than the node timeout
                break
        if threading.get_ident() == self._main:
            # Signal handlers run in the main thread, and may raise anywhere (Ctrl-C, a task's
            # soft time limit): it never leads, serves or waits for other threads' fan-outs.
            fan_out(self.nodes, op, budget)
            return op.replies
        if hedge is not None and hedging.lossy(self.nodes, time.monotonic()):
            # A round sends no copies while it waits, and on a lossy link the copies are what
            # beats a lost packet's retransmission: each thread fans out alone, with them.
            fan_out(self.nodes, op, budget)
            return op.replies
        with self._lock:
            leader = not self._leading
            if leader:
                self._leading = True
            else:
                wake = op.wake = threading.Lock()
                wake.acquire()
                self._queue.append(op)
        if leader:
            self._lead(op, [op], budget)
            return op.replies
        interrupted = _sleep(op, wake)
        try:
            if op.role == _LEAD:
                batch, op.batch = op.batch, None
                assert batch is not None
                self._lead(op, batch, budget)
            elif op.role == _SERVE:
                round, op.round = op.round, None
                assert round is not None
                round.serve(op)
        finally:
            if interrupted is not None:
                raise interrupted
        return op.replies

    def _lead(self, op: FanOut, batch: list[FanOut], budget: float) -> None:
        """Send ``batch`` (``op``'s thread leads it): alone, as a plain fan-out; several, as
        a round, waiting ``budget`` seconds for replies. The queue is handed over once a
        majority of nodes answered ``op`` (what is left is the slower nodes: one slow node
        never holds the other threads up)."""
        if len(batch) > 1:
            Round(self.nodes, batch, budget).serve(op, self._hand_over)
        else:
            fan_out(self.nodes, op, budget, self._hand_over)

    def budget(self) -> float:
        """How long an operation waits for replies: the node timeout, or longer while the
        nodes' round trips run longer (:func:`.detector.reply_budget`)."""
        return reply_wait(self.nodes, self.timeout)

    def _hand_over(self) -> None:
        """The queue becomes the next round, led by its first thread."""
        with self._lock:
            batch, self._queue = self._queue, []
            if not batch:
                self._leading = False
                return
        head = batch[0]
        try:
            head.batch = batch
        finally:
            _wake(head, _LEAD)


def _sleep(op: FanOut, wake: threading.Lock) -> BaseException | None:
    """Until ``op``'s thread is given a role (:func:`_wake`). An interrupt (KeyboardInterrupt
    in the main thread) is kept for after, also one raised just after the wake-up: the thread
    may be woken to lead or serve a round other threads wait on (which ends within the node
    timeout)."""
    interrupted = None
    while not op.role:
        try:
            wake.acquire()
        except BaseException as exc:
            interrupted = exc
    return interrupted


def _bodies_first(commands: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """``commands`` with each script's first ``EVALSHA`` in its ``EVAL`` form (which also
    caches the script for the ones after it)."""
    out: list[Sequence[Any]] = list(commands)
    seen: set[Any] = set()
    for position, command in enumerate(out):
        if command[0] == "EVALSHA" and command[1] not in seen:
            seen.add(command[1])
            out[position] = eval_form(command)
    return out


def _batch_replies(wire: Wire, replies: list[Any]) -> list[Any]:
    """A batch's replies, an error reply as its :class:`~.nodes.Failure`."""
    return [reply_failure(r) if r.__class__ is ReplyError else r for r in replies]


def fan_out_batch(
    nodes: Sequence[Node],
    commands: Sequence[Sequence[Any]],
    timeout: float,
    *,
    quorum: int | None = None,
    until: float | None = None,
    answered: list[float | None] | None = None,
) -> list[list[Any] | Failure]:
    """Pipeline ``commands`` to every node at once, in one write per node: per node, the
    replies in command order, or the :class:`~.nodes.Failure` that cut it short.

    Many operations cost one round trip to the slowest node that answers, bounded by
    ``timeout`` (the watchdog renews every due lease this way, so a silent node costs one
    timeout per round, not one per lease).

    A renewal round gives ``quorum`` and ``until`` (monotonic): the replies are worth
    waiting for until then (its leases' validity), however long a large round on a busy host
    takes, and no longer: a round of thousands of leases may take longer than ``timeout``
    on nodes that are merely busy, and counting them out for it would fail the next rounds
    too. Once ``quorum`` nodes answered the whole round, a node still silent gets as long
    again as they took (at least ``timeout``) and is then left behind: the round does not
    wait on a slow node beyond the quorum. ``answered`` (one slot per node) receives when
    each node's replies were all in (None: they were not).
    """
    # The whole batch is one pipeline on each connection, read as one reply: thousands of
    # leases, one object each. Each script's first command carries its body, so a node that
    # lost its script cache (a restart) runs every command of the batch at once.
    batch = Pipelined(pack_many(_bodies_first(commands)), len(commands), _batch_replies)
    results: list[list[Any] | Failure] = [Failure("timeout")] * len(nodes)
    #: fd -> (node index, wire, what this batch waits for on it)
    waiting: dict[int, tuple[int, Wire, Due]] = {}
    poller = select.poll()
    now = time.monotonic()
    start = now
    connect_deadline = now + connect_budget(timeout)
    for index in _pooled_first(nodes):
        try:
            wire = nodes[index].checkout(connect_deadline)
            wire.write(batch.data, timeout)
        except WireError as exc:
            results[index] = exc.failure
            continue
        except OSError as exc:
            nodes[index].lose(wire)
            results[index] = os_failure(exc)
            continue
        due = Due(batch, None, now)
        wire.due.append(due)
        waiting[wire.fd] = (index, wire, due)
        poller.register(wire.fd, select.POLLIN)
    wait = batch_wait(timeout, until, start, time.monotonic())
    complete = 0
    while waiting:
        events = poller.poll(wait.remaining(time.monotonic()) * 1000)
        if not events:
            if wait.remaining(time.monotonic()):
                continue  # the process did not run meanwhile: the nodes get their time
            break
        now = time.monotonic()
        for fd, _ in events:
            index, wire, due = waiting[fd]
            try:
                wire.read()
            except Incomplete:
                if due.reply is OWED:
                    continue  # the rest of the batch is on its way
            except OSError as exc:
                del waiting[fd]
                poller.unregister(fd)
                nodes[index].lose(wire)
                results[index] = os_failure(exc)
                continue
            del waiting[fd]
            poller.unregister(fd)
            nodes[index].detector.answered(now, due.sent)
            nodes[index].checkin(wire)
            results[index] = due.reply
            if answered is not None:
                answered[index] = now
            complete += 1
            if quorum is not None and complete == quorum and waiting:
                batch_quorum_in(wait, start, now, timeout)
    for index, wire, due in waiting.values():
        due.left = True
        nodes[index].went_silent(wait.excused, due.sent)
        nodes[index].abandon(wire)
    return results


def batch_wait(timeout: float, until: float | None, start: float, now: float) -> Wait:
    """The wait of a pipelined round begun at ``start`` (see :func:`fan_out_batch`; the
    asyncio client's renewal rounds wait the same): ``timeout``, or for a renewal round
    until its leases' validity ``until``, if that is later.

    Time in which this process did not run is given back to the nodes as usual, but a
    round never waits past its leases' validity for it (one node timeout at most): a wait
    that runs late on a loaded host, again and again, would otherwise be given back whole
    each time, and the round outlive every lease in it."""
    budget = timeout if until is None else max(until - start, timeout)
    return Wait(budget, now, None if until is None else timeout)


def batch_quorum_in(wait: Wait, start: float, now: float, timeout: float) -> None:
    """A quorum of nodes answered the whole round begun at ``start``: a node still silent
    gets as long again as they took (at least ``timeout``), then is left behind (the round
    does not wait on a slow node beyond the quorum)."""
    took = now - start
    wait.deadline = min(wait.deadline, now + max(took, timeout))
