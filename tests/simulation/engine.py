"""Virtual time, the simulated network and processes, and the third driver: it runs the
core's own steps (:mod:`django_redlock.core.base`) as the sync and async drivers do, but
every fan-out goes to :class:`~.node.SimNode` objects over simulated connections.

One event loop, one thread: a client thread is a generator (:class:`Task`) that yields what it
waits for. Only the task running reads the clock (its process's drifting monotonic clock,
handed to the steps through :mod:`django_redlock.core.clock`)."""

from __future__ import annotations

import contextlib
import copy
import heapq
import random
from collections.abc import Callable, Generator, Iterator
from typing import Any

import hiredis

from django_redlock.core import clock, scripts
from django_redlock.core.algorithm import Contender, Finally, Listen, Pause, Send, SendBatch, Wait
from django_redlock.core.base import RedlockBase
from django_redlock.core.leases import LeaseTable
from django_redlock.core.lock import Lease, LockBase
from django_redlock.core.nodes import TIMED_OUT, Failure, Pipelined, ReplyError, pack, reply_failure
from django_redlock.core.process import ThisProcess

from .node import SimNode

__all__ = ["Cancelled", "Gen", "Proc", "SimLeaseTable", "SimRedlock", "Sleep", "Task", "World"]

Gen = Generator[Any, Any, Any]


class Cancelled(BaseException):
    """Thrown into a task that is cancelled mid-operation (asyncio cancel, KeyboardInterrupt)."""


class Sleep:
    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Park:
    """A task waiting for something; resumed once (by the event or by its timer)."""

    __slots__ = ("done", "task", "value")

    def __init__(self) -> None:
        self.task: Task | None = None
        self.done = False
        self.value: Any = None

    def resume(self, value: Any = None) -> None:
        if self.done:
            return
        self.done = True
        self.value = value
        task, self.task = self.task, None
        if task is not None:
            task.world.at(task.world.now, task.wake, self, value)


class Notice:
    """A release-notice subscription of one waiter (:class:`Listen`)."""

    def __init__(self) -> None:
        self.fired = False
        self.park: Park | None = None
        self.dead = False  #: a subscribed node dropped it (crash, restart)

    def fire(self) -> None:
        self.fired = True
        if self.park is not None:
            park, self.park = self.park, None
            park.resume()


class Conn:
    """A connection of one client thread to one node: FIFO both ways. The attributes the
    core's builders and folds read (``run_id``, ``vote_marker`` ...) are a real wire's."""

    def __init__(self, node: SimNode, proc: Proc) -> None:
        self.node = node
        self.epoch = node.epoch
        self.run_id = node.run_id
        self.run_id_arg = node.run_id.encode()
        # A simulated node never replicates: no replication id, the run id alone is compared.
        self.replid = ""
        # INFO's uptime, to the second, read on this process's wall clock.
        self.started = proc.wall() - int(node.wall() - node.started_wall)
        self.vote_marker: list[bytes] | None = None
        self.trusted_at: float | None = None
        self.last_out = 0.0
        self.last_back = 0.0
        self.broken = False
        #: When the link cut it: what had not run on the node by then never runs (the
        #: server drops a reset connection's unread commands), and no reply comes back.
        self.cut_at: float | None = None


class Proc:
    """A client process: its clocks, its Redlock (lease table) and its threads."""

    def __init__(self, world: World, pid: int, rate: float, offset: float) -> None:
        self.world = world
        self.pid = pid
        self.rate = rate
        self.mono_offset = offset
        self.wall_offset = 1_700_000_000.0 + offset
        self.stalled_until = 0.0
        self.rl: SimRedlock | None = None
        self.renewals: dict[int, tuple[float, Lease]] = {}
        self.renewer: Task | None = None
        self.renewer_park: Park | None = None
        self.renewing: set[int] = set()
        self.notices: list[tuple[SimNode, bytes, Notice]] = []

    def mono(self) -> float:
        return self.mono_offset + self.world.now * self.rate

    def wall(self) -> float:
        return self.wall_offset + self.world.now * self.rate

    def real_of(self, mono: float) -> float:
        return (mono - self.mono_offset) / self.rate


class Task:
    """A client thread: a generator of waits, resumed by the event loop."""

    def __init__(self, world: World, proc: Proc, gen: Gen | None, name: str) -> None:
        self.world, self.proc, self.name = world, proc, name
        self.gen: Gen = gen if gen is not None else iter(())  # type: ignore[assignment]
        self.done = False
        self.conns: dict[int, Conn] = {}
        self.parked: Park | None = None
        self.cancel_pending = False
        self.in_acquire = False
        self.owner = ("thread", name)
        world.tasks.append(self)

    def start(self, at: float) -> None:
        self.world.at(at, self.step, None)

    def step(self, value: Any) -> None:
        if self.done:
            return
        world, proc = self.world, self.proc
        if proc.stalled_until > world.now:
            world.at(proc.stalled_until, self.step, value)
            return
        world.current = proc
        ThisProcess.pid = proc.pid
        self.parked = None
        try:
            if self.cancel_pending:
                self.cancel_pending = False
                wait = self.gen.throw(Cancelled())
            else:
                wait = self.gen.send(value)
        except StopIteration:
            self.done = True
            return
        except Cancelled:
            self.done = True
            return
        self._park(wait)

    def wake(self, park: Park, value: Any) -> None:
        """Resume after ``park`` (unless the task was cancelled off it meanwhile)."""
        if self.parked is park:
            self.step(value)

    def _park(self, wait: Any) -> None:
        world = self.world
        if wait.__class__ is Sleep:
            park = Park()
            park.task = self
            self.parked = park
            world.at(world.now + max(wait.seconds, 0.0), park.resume, None)
        elif isinstance(wait, Park):
            if wait.done:
                self.parked = None
                world.at(world.now, self.step, wait.value)
            else:
                wait.task = self
                self.parked = wait
        else:
            raise TypeError(f"task {self.name} yielded {wait!r}")

    def cancel(self) -> None:
        """Interrupt whatever the task waits for now."""
        if self.done or self.parked is None or self.parked.done:
            return  # not waiting, or already woken: it runs on before it could be interrupted
        park, self.parked = self.parked, None
        park.task = None
        self.cancel_pending = True
        self.world.at(self.world.now, self.step, None)


class FanOp(Park):
    """One command to every node; resumed with the replies in node order."""

    __slots__ = ("answered", "enough", "late", "left", "replies", "wires")

    def __init__(self, n: int) -> None:
        super().__init__()
        self.replies: list[Any] = [None] * n
        self.answered = [False] * n
        self.wires: list[Conn | None] = [None] * n
        self.enough: Callable[[list[Any]], bool] | None = None
        self.late: Callable[[], bytes] | None = None
        self.left: dict[int, Any] | None = None


def _commands(data: bytes) -> list[list[bytes]]:
    """The commands in an encoded buffer (a command is the array it is sent as)."""
    reader = hiredis.Reader()
    reader.feed(data)
    out = []
    while (cmd := reader.gets()) is not False:
        out.append(cmd)
    return out


def _args(command: Any) -> list[bytes]:
    return [
        a if a.__class__ is bytes else (b"%d" % a if isinstance(a, int) else str(a).encode())
        for a in command
    ]


class SimLeaseTable(LeaseTable):
    """The lease table with the simulator's records of losses and renewals (``sim``: the
    client it is a part of)."""

    sim: SimRedlock

    def mark_lost(self, lease: Lease, why: str) -> None:
        already = lease.lost is not None or lease.released
        super().mark_lost(lease, why)
        if not already and lease.lost is not None:
            self.sim.world.on_lost(self.sim.proc, lease, why)

    def judge_extend(self, lease: Lease, *args: Any) -> bool:
        ok = super().judge_extend(lease, *args)
        if ok:
            self.sim.world.on_valid(self.sim.proc, lease)
        return ok

    def part_of(self, sim: SimRedlock) -> None:
        """This table (a copy of it, after a fork) as ``sim``'s."""
        self.sim, self.nodes, self.start_renewal = sim, sim.nodes, sim._start_renewal


class SimRedlock(RedlockBase):
    """The core's decisions with the simulator's hooks for what a driver does around them
    (renewal, loss, and records of each hold)."""

    lease_table_class = SimLeaseTable
    leases: SimLeaseTable
    world: World
    proc: Proc

    def _start_renewal(self, lease: Lease) -> None:
        self.world.driver.add_renewal(self.proc, lease)


class World:
    """Simulated real time, the nodes, the network between processes and nodes, faults."""

    def __init__(self, seed: int, n_nodes: int) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.client_rng = random.Random(seed ^ 0x5EED)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.nodes = [SimNode(i, self._now) for i in range(n_nodes)]
        self.tasks: list[Task] = []
        self.procs: list[Proc] = []
        self.current: Proc | None = None
        self.driver = Driver(self)
        # Network: per node extra delay and drop probability, partitions (proc pid, node).
        self.base_delay = (0.0002, 0.002)
        self.extra_delay: dict[int, float] = {}
        self.drop: dict[int, float] = {}
        self.cut: set[tuple[int, int]] = set()
        self.heal_at: dict[tuple[int, int], float] = {}
        self.log: list[str] = []
        self.trace = False
        self.events = 0
        self.messages = 0
        self.duplicates = 0
        self.on_lost: Callable[[Proc, Lease, str], None] = lambda p, lease, why: None
        self.on_valid: Callable[[Proc, Lease], None] = lambda p, lease: None
        self.on_leak: Callable[[SimNode, bytes, str], None] = lambda n, t, b: None
        self.mutant: str | None = None
        for node in self.nodes:
            node.publish_hook = self._publish
            node.leak_hook = lambda n, t, b: self.on_leak(n, t, b)
        self._tokens = 0

    def _now(self) -> float:
        return self.now

    # -- events ----------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, fn, args = heapq.heappop(heap)
            if t > self.now:
                self.now = t
            self.events += 1
            fn(*args)
        self.now = max(self.now, t_end)

    def note(self, text: str) -> None:
        if self.trace:
            self.log.append(f"{self.now:9.4f} {text}")

    # -- the clock and randomness the steps read -------------------------------------------

    def mono(self) -> float:
        p = self.current
        assert p is not None
        return p.mono_offset + self.now * p.rate

    def wall(self) -> float:
        p = self.current
        assert p is not None
        return p.wall_offset + self.now * p.rate

    def token_hex(self, n: int) -> str:
        return f"{self.client_rng.getrandbits(8 * n):0{2 * n}x}"

    def uniform(self, a: float, b: float) -> float:
        return self.client_rng.uniform(a, b)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The core reads this world's clocks and random source meanwhile."""
        saved = (clock.monotonic, clock.wall, clock.token_hex, clock.uniform, ThisProcess.pid)
        clock.monotonic, clock.wall = self.mono, self.wall
        clock.token_hex, clock.uniform = self.token_hex, self.uniform
        try:
            yield
        finally:
            clock.monotonic, clock.wall, clock.token_hex, clock.uniform, ThisProcess.pid = saved

    # -- processes -------------------------------------------------------------------------

    def new_proc(self, rate: float, offset: float, **config: Any) -> Proc:
        pid = 1000 + len(self.procs)
        proc = Proc(self, pid, rate, offset)
        urls = [f"redis://sim{node.index}.invalid:6379/0" for node in self.nodes]
        prev, self.current = self.current, proc
        ThisProcess.pid = pid
        try:
            rl = SimRedlock(urls, **config)
        finally:
            self.current = prev
        rl.world, rl.proc = self, proc
        if self.mutant == "quorum_half":
            rl.quorum = max(1, len(self.nodes) // 2)
        rl.leases.part_of(rl)
        rl.leases.quorum = rl.quorum
        proc.rl = rl
        self.procs.append(proc)
        return proc

    def fork(self, parent: Proc) -> Proc:
        """A child process: a copy of the parent's memory (its leases too, which it never
        holds), its own connections, the same clocks."""
        assert parent.rl is not None
        child = Proc(self, 1000 + len(self.procs), parent.rate, parent.mono_offset)
        rl = copy.copy(parent.rl)
        rl.nodes = [copy.copy(n) for n in parent.rl.nodes]
        for n in rl.nodes:
            n.later = copy.copy(n.later)
        leases = copy.copy(parent.rl.leases)
        leases._leases = {k: copy.copy(v) for k, v in leases._leases.items()}
        rl.leases = leases
        leases.part_of(rl)
        rl.proc = child
        rl._compose()  # the copy's algorithm and policies read the copy, not the parent
        prev_pid = ThisProcess.pid
        ThisProcess.pid = child.pid
        rl._after_fork()
        ThisProcess.pid = prev_pid
        child.rl = rl
        self.procs.append(child)
        return child

    # -- network ---------------------------------------------------------------------------

    def delay(self, node: int) -> float:
        lo, hi = self.base_delay
        d = self.rng.uniform(lo, hi)
        extra = self.extra_delay.get(node)
        if extra:
            d += self.rng.uniform(0, extra)
        return d

    def _publish(self, node: SimNode, channel: bytes) -> int:
        count = 0
        for proc in self.procs:
            for n, ch, notice in proc.notices:
                if n is node and ch == channel and not notice.dead:
                    count += 1
                    if (proc.pid, node.index) not in self.cut:
                        self.at(self.now + self.delay(node.index), notice.fire)
        return count

    def send(
        self,
        task: Task,
        i: int,
        conn: Conn,
        commands: list[list[bytes]],
        on_reply: Callable[[Conn, list[Any]], None] | None,
    ) -> float | None:
        """Commands out on ``conn`` (FIFO), run by node ``i`` in order, replies back. Returns
        None, or, when the link failed and cut the connection, the moment the client can
        know it (after the node ran the commands, if they got there at all)."""
        self.messages += 1
        if conn.cut_at is not None:
            # The link already failed; the client learns it at the cut: this never runs.
            return max(conn.cut_at, self.now)
        node = self.nodes[i]
        pid = task.proc.pid
        t = self.now + self.delay(i)
        cut = None
        drop = self.drop.get(i, 0.0)
        if drop and self.rng.random() < drop:
            # The link fails: the command runs or not, the reply never comes back, and the
            # connection is cut (the client learns it at the cut; the next command after
            # that opens a new connection).
            cut = max(t, conn.last_out)
            if self.rng.random() < 0.5:
                conn.cut_at = self.now  # lost on the way: nothing queued behind runs either
                return cut
            conn.cut_at = cut  # it runs (if the node is running then); the reply is lost
            on_reply = None
        if (pid, i) in self.cut:
            t = max(t, self.heal_at.get((pid, i), float("inf")))
        t = max(t, conn.last_out)
        conn.last_out = t
        if t == float("inf"):
            return cut
        self.at(t, self._arrive, node, conn, commands, on_reply, pid)
        return None if cut is None else t

    def _arrive(
        self,
        node: SimNode,
        conn: Conn,
        commands: list[list[bytes]],
        on_reply: Callable[[Conn, list[Any]], None] | None,
        pid: int,
    ) -> None:
        if conn.cut_at is not None and self.now > conn.cut_at:
            return
        if not node.up or node.epoch != conn.epoch:
            conn.broken = True
            if on_reply is not None:
                self.at(self.now + self.delay(node.index), on_reply, conn, [_REFUSED])
            return
        if node.paused:
            node.queued.append(
                (conn, commands, lambda r: self._reply(node, conn, r, on_reply, pid))
            )
            return
        replies = [node.command(c) for c in commands]
        self._reply(node, conn, replies, on_reply, pid)

    def _reply(
        self,
        node: SimNode,
        conn: Conn,
        replies: list[Any],
        on_reply: Callable[[Conn, list[Any]], None] | None,
        pid: int,
    ) -> None:
        if on_reply is None:
            return
        t = self.now + self.delay(node.index)
        if (pid, node.index) in self.cut:
            t = max(t, self.heal_at.get((pid, node.index), float("inf")))
        t = max(t, conn.last_back)
        conn.last_back = t
        if conn.cut_at is not None and t > conn.cut_at:
            return
        if t != float("inf"):
            self.at(t, on_reply, conn, replies)

    def resume_node(self, node: SimNode) -> None:
        """A paused server runs what queued up: each connection's commands in order, the
        connections in an order of the run's random source."""
        node.paused = False
        queued, node.queued = node.queued, []
        by_conn: dict[int, list[Any]] = {}
        order: list[int] = []
        for item in queued:
            key = id(item[0])
            if key not in by_conn:
                by_conn[key] = []
                order.append(key)
            by_conn[key].append(item)
        self.rng.shuffle(order)
        for key in order:
            for conn, commands, done in by_conn[key]:
                if node.up and node.epoch == conn.epoch and conn.cut_at is None:
                    done([node.command(c) for c in commands])


#: What a connection the node closed (crash, restart, failover) answers.
_REFUSED = Failure("refused", "connection reset by the simulated node")


class Driver:
    """Runs the core's steps for a task: the simulator's counterpart of ``Redlock._drive``."""

    def __init__(self, world: World) -> None:
        self.world = world
        #: Every acquire attempt's token (the steps name it for the undo on cancellation).
        self.tokens: set[str] = set()
        #: Lock operations sent to the nodes: acquire attempts, releases, lease renewals.
        self.ops = 0

    # -- connections -------------------------------------------------------------------------

    def conn(self, task: Task, i: int, fresh: bool = False) -> Conn | None:
        node = self.world.nodes[i]
        conn = None if fresh else task.conns.get(i)
        if (
            conn is None
            or conn.broken
            or conn.epoch != node.epoch
            or (conn.cut_at is not None and self.world.now >= conn.cut_at)
        ):
            if not node.up:
                return None
            conn = Conn(node, task.proc)
            if not fresh:
                task.conns[i] = conn
        return conn

    # -- fan-out -----------------------------------------------------------------------------

    def fan_out(
        self,
        task: Task,
        build: Callable[[Any, Any], Any],
        timeout: float | None = None,
        late: Callable[[], bytes] | None = None,
        enough: Callable[[list[Any]], bool] | None = None,
        left: dict[int, Any] | None = None,
        behind: Any = None,
        idempotent: bool = False,
    ) -> FanOp:
        world = self.world
        rl = task.proc.rl
        assert rl is not None
        n = len(world.nodes)
        op = FanOp(n)
        op.enough, op.late, op.left = enough, late, left
        for i in range(n):
            new_conn = world.mutant == "undo_new_connection" and behind is not None
            conn = self.conn(task, i, fresh=new_conn)
            if conn is None:
                op.answered[i] = True
                op.replies[i] = _REFUSED
                continue
            op.wires[i] = conn
            node = rl.nodes[i]
            built = build(node, conn)
            if built.__class__ is Pipelined:
                commands = _commands(built.data)
            elif isinstance(built, bytes):
                commands = _commands(built)
            else:
                commands = [_args(built)]
            later = [c for item in rl.nodes[i].take_later() for c in _commands(item)]
            if later:
                world.send(task, i, conn, later, None)
            on_reply = self._on_reply(op, i, built, idempotent, task)
            cut = world.send(task, i, conn, commands, on_reply)
            if cut is not None and (idempotent or late is not None):
                # The connection was reset with the command out: sent again on a new one
                # (a duplicate, if the first one ran), as the sync driver does.
                node_i = world.nodes[i]
                if node_i.up:
                    again = Conn(node_i, task.proc)
                    again.last_out = cut  # sent once the client saw the reset
                    task.conns[i] = again
                    op.wires[i] = again
                    world.duplicates += 1
                    world.send(task, i, again, commands, on_reply)
        if not all(op.answered):
            world.at(world.now + (timeout or rl.node_timeout), self._timeout, op, task)
        self._check_done(op, rl.quorum)
        return op

    def _on_reply(
        self, op: FanOp, i: int, built: Any, idempotent: bool, task: Task
    ) -> Callable[[Conn, list[Any]], None]:
        def on_reply(conn: Conn, raw: list[Any]) -> None:
            if op.done or op.answered[i]:
                return
            if len(raw) == 1 and raw[0] is _REFUSED:
                reply: Any = _REFUSED
            elif built.__class__ is Pipelined:
                if built.count == 1:
                    r = raw[0]
                    r = reply_failure(r) if isinstance(r, ReplyError) else r
                    reply = built.fold(conn, [r])
                else:
                    reply = built.fold(conn, raw)
            else:
                r = raw[0]
                reply = reply_failure(r) if isinstance(r, ReplyError) else r
            op.answered[i] = True
            op.replies[i] = reply
            rl = task.proc.rl
            assert rl is not None
            self._check_done(op, rl.quorum)

        return on_reply

    def _check_done(self, op: FanOp, quorum: int) -> None:
        if op.done:
            return
        answered = sum(op.answered)
        if answered == len(op.answered):
            op.resume(op.replies)
        elif op.enough is not None and answered >= quorum and op.enough(op.replies):
            for i, a in enumerate(op.answered):
                if not a:
                    op.replies[i] = TIMED_OUT
                    if op.left is not None:
                        op.left[i] = op.wires[i]
            op.resume(op.replies)

    def _timeout(self, op: FanOp, task: Task) -> None:
        if op.done:
            return
        for i, a in enumerate(op.answered):
            if not a:
                op.replies[i] = TIMED_OUT
                conn = op.wires[i]
                if op.late is not None and conn is not None:
                    # The undo goes behind the command on its connection (a new one would
                    # overtake a command still queued on the node).
                    if self.world.mutant == "undo_new_connection":
                        conn = self.conn(task, i, fresh=True) or conn
                    self.world.send(task, i, conn, _commands(op.late()), None)
        op.resume(op.replies)

    def batch(
        self,
        task: Task,
        commands: list[list[Any]],
        leases: list[Lease],
        answered: list[float | None] | None = None,
    ) -> FanOp:
        """A :class:`SendBatch`: every command pipelined to every node; per node its
        replies in order, or a Failure (and in ``answered``, when they came, on the
        process's monotonic clock)."""
        world = self.world
        proc = task.proc
        rl = proc.rl
        assert rl is not None
        n = len(world.nodes)
        op = FanOp(n)
        sent = [
            ["PING"] if lease.released else c for lease, c in zip(leases, commands, strict=False)
        ]
        encoded = [_args(c) for c in sent]
        for i in range(n):
            conn = self.conn(task, i)
            if conn is None:
                op.answered[i] = True
                op.replies[i] = _REFUSED
                continue
            later = [c for item in rl.nodes[i].take_later() for c in _commands(item)]
            if later:
                world.send(task, i, conn, later, None)

            def on_reply(conn: Conn, raw: list[Any], i: int = i) -> None:
                if op.done or op.answered[i]:
                    return
                op.answered[i] = True
                op.replies[i] = raw[0] if len(raw) == 1 and raw[0] is _REFUSED else raw
                if answered is not None and op.replies[i] is not _REFUSED:
                    answered[i] = proc.mono_offset + world.now * proc.rate
                self._check_done(op, n)

            world.send(task, i, conn, encoded, on_reply)
        if not all(op.answered):
            world.at(world.now + rl.node_timeout, self._timeout, op, task)
        self._check_done(op, n)
        return op

    # -- the steps ---------------------------------------------------------------------------

    def drive(self, task: Task, steps: Gen) -> Gen:
        """Run ``steps`` for ``task``; a generator the task yields from."""
        finals: list[Finally] = []
        notices: list[Notice] = []
        try:
            result = yield from self._steps(task, steps, finals, notices)
        except Cancelled:
            yield from self._cleanup(task, finals, notices)
            raise
        yield from self._cleanup(task, finals, notices)
        return result

    def _cleanup(self, task: Task, finals: list[Finally], notices: list[Notice]) -> Gen:
        proc = task.proc
        if notices:
            proc.notices = [x for x in proc.notices if x[2] not in notices]
        for final in finals:
            if not final.cancelled:
                yield self.fan_out(task, final.send.build)

    def _steps(self, task: Task, steps: Gen, finals: list[Finally], notices: list[Notice]) -> Gen:
        world = self.world
        rl = task.proc.rl
        assert rl is not None
        reply: Any = None
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as done:
                return done.value
            reply = None
            cls = step.__class__
            if cls is Send:
                if step.undo_if_cancelled and step.undo_if_cancelled[1] not in self.tokens:
                    self.tokens.add(step.undo_if_cancelled[1])
                    self.ops += 1
                if world.mutant == "fence_skip" and _is_fence(step):
                    reply = [1] * len(world.nodes)
                    step.started = step.ended = clock.monotonic()
                    continue
                step.started = clock.monotonic()
                try:
                    reply = yield self.fan_out(task, *step.args)
                except Cancelled:
                    steps.close()
                    if step.undo_if_cancelled:
                        yield from self.release_everywhere(task, *step.undo_if_cancelled)
                    raise
                step.ended = clock.monotonic()
            elif cls is SendBatch:
                reply = yield from self._batch(task, step)
            elif cls is Pause:
                yield Sleep(step.seconds / task.proc.rate)
            elif cls is Listen:
                notice = Notice()
                channel = step.channel.encode()
                for node in world.nodes:
                    if node.up and (task.proc.pid, node.index) not in world.cut:
                        task.proc.notices.append((node, channel, notice))
                notices.append(notice)
                reply = notice
            elif cls is Wait:
                notice = step.notice
                if notice.fired:
                    notice.fired = False
                    reply = True  # woken by a release: the next attempt leads with one node
                    continue
                park = Park()
                notice.park = park
                if not (world.mutant == "notice_dies" and notice.dead):
                    world.at(world.now + step.seconds / task.proc.rate, park.resume)
                yield park
                reply = notice.fired
                notice.fired = False
                notice.park = None
            elif cls is Finally:
                finals.append(step)
            else:
                raise TypeError(f"unknown step {step!r}")

    def _batch(self, task: Task, step: SendBatch) -> Gen:
        proc = task.proc
        self.ops += len(step.leases)
        for lease in step.leases:
            proc.renewing.add(id(lease))
        try:
            if self.world.mutant == "renewal_serial":
                # One lease after the other, each waiting for every node.
                per: list[list[Any]] = [[] for _ in self.world.nodes]
                for lease, command in zip(step.leases, step.commands, strict=False):
                    op = yield self.batch(task, [command], [lease])
                    for i, r in enumerate(op):
                        per[i].append(r[0] if isinstance(r, list) else r)
                return [
                    p
                    if not any(isinstance(x, Failure) for x in p)
                    else next(x for x in p if isinstance(x, Failure))
                    for p in per
                ]
            step.answered = [None] * len(self.world.nodes)
            return (yield self.batch(task, step.commands, step.leases, step.answered))
        finally:
            for lease in step.leases:
                proc.renewing.discard(id(lease))

    # -- what the sync client does around the steps ---------------------------------------

    def release_everywhere(self, task: Task, name: str, token: str, behind: Any = None) -> Gen:
        rl = task.proc.rl
        assert rl is not None
        command = rl.keys.release_command(name, token)
        self.ops += 1
        replies = yield self.fan_out(
            task,
            lambda n, w: command,
            enough=rl._released_by_quorum,
            behind=behind,
            idempotent=True,
        )
        rl._keep_unreached(command, replies)
        return replies

    def acquire(self, task: Task, handle: LockBase, blocking: bool, timeout: float | None) -> Gen:
        """``Redlock._acquire`` without the local queue (each simulated thread contends on
        its own)."""
        rl = task.proc.rl
        assert rl is not None
        owner = task.owner
        start = clock.monotonic()
        try:
            deadline = rl.algorithm.deadline(start, timeout, None)
            courtesy = rl.leases.courtesy(handle.name) if blocking else 0.0
            if courtesy:
                yield Sleep(courtesy / task.proc.rate)
            first = None
            if blocking and not handle.fair and not courtesy:
                alone = yield from self.drive(task, rl._alone_steps(handle, owner, start))
                if isinstance(alone, Lease):
                    return alone
                first = alone
            contend = rl.algorithm.contend(
                Contender(handle, owner), blocking, deadline, None, start, first, courtesy > 0
            )
            return (yield from self.drive(task, contend))
        except Cancelled:
            for won in rl.leases.won_unreturned([handle.name], owner, start):
                with contextlib.suppress(Exception):
                    yield from self.release(task, won)
            raise

    def release(self, task: Task, lease: Lease) -> Gen:
        """``Redlock._release``: waits for a renewal of the lease on the wire first."""
        proc = task.proc
        rl = proc.rl
        assert rl is not None
        while id(lease) in proc.renewing:
            yield Sleep(0.001)
        if not rl.leases.begin_release(lease):
            return
        behind, lease.behind = lease.behind, None
        replies = yield from self.release_everywhere(task, lease.name, lease.token, behind)
        rl.leases.finish_release(lease, replies)

    # -- the watchdog ----------------------------------------------------------------------

    def add_renewal(self, proc: Proc, lease: Lease) -> None:
        proc.renewals[id(lease)] = (clock.monotonic() + lease.ttl / 3, lease)
        if proc.renewer is None:
            proc.renewer = Task(self.world, proc, self._renewer(proc), f"renewer-{proc.pid}")
            proc.renewer.start(self.world.now)
        elif proc.renewer_park is not None:
            park, proc.renewer_park = proc.renewer_park, None
            park.resume()

    def _renewer(self, proc: Proc) -> Gen:
        task = proc.renewer
        assert task is not None and proc.rl is not None
        while True:
            live = {k: v for k, v in proc.renewals.items() if not (v[1].released or v[1].lost)}
            proc.renewals = live
            if not live:
                park = Park()
                proc.renewer_park = park
                yield park
                continue
            first = min(when for when, _ in live.values())
            now = clock.monotonic()
            if first > now:
                park = Park()
                proc.renewer_park = park
                self.world.at(self.world.now + (first - now) / proc.rate, park.resume)
                yield park
                proc.renewer_park = None
                continue
            horizon = now + 0.05
            due = [lease for when, lease in live.values() if when <= horizon]
            for lease in due:
                del proc.renewals[id(lease)]
            try:
                whens = yield from self.drive(task, proc.rl._renew_steps(due))
            except Exception:
                proc.rl.leases.renewal_failed(due)
                continue
            for lease, when in zip(due, whens, strict=False):
                if when is not None:
                    proc.renewals[id(lease)] = (when, lease)


def _is_fence(step: Send) -> bool:
    try:
        built = step.build(None, None)  # type: ignore[arg-type]
    except Exception:
        return False
    return isinstance(built, list) and len(built) > 1 and built[1] == scripts.FENCE_SYNC.sha


def encode_command(args: list[Any]) -> bytes:
    return pack(args)
