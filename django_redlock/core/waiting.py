"""How a blocked acquire waits: a local queue per name, and release notices from the nodes.

Threads of one process that want the same name line up in a local queue, so only the one at the
front contends with the nodes (the local lock in front of Redis of Spring's RedisLockRegistry):
no thundering herd, and a hand-over inside the process costs no round trip to wake up.

Across processes, the release script publishes on the name's channel. One subscriber connection
per node per process (:class:`ReleaseNotices`) serves every waiter of that process, and a waiter
also wakes when the holder's lease runs out (the PTTL the nodes reported), so nobody polls.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from . import clock
from .hedging import lossy
from .lock import Lease
from .nodes import Incomplete, Node, Wire, WireError, pack

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "LINGER",
    "LINGER_NAMES",
    "LOSSY_POLL",
    "NOTICE_GRACE",
    "RECONNECT_DELAY",
    "HolderWatch",
    "HolderWatches",
    "Listener",
    "LocalQueue",
    "ReleaseNotice",
    "ReleaseNotices",
    "Tally",
    "Waiters",
    "confirmations_due",
    "lingered_out",
    "lossy",
]


class LocalQueue:
    """The threads of this process that want one name, first come first served; the one at
    the front talks to the nodes.

    The front place is kept from the start of contention until release. If its holder's lease
    runs out (it was lost, or never released), the next thread moves up anyway, so a forgotten
    lock can stall this process only as long as the lease it had.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._line: deque[object] = deque()
        self._busy = False
        self._lease: Lease | None = None
        self.users = 0  #: threads queued or at the front; the queue is dropped at zero

    def enter(self, deadline: float | None) -> bool:
        ticket = object()
        with self._cond:
            self._line.append(ticket)
            try:
                while self._line[0] is not ticket or (self._busy and not self._holder_gone()):
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        self._line.remove(ticket)
                        self._cond.notify_all()
                        return False
                    if self._line[0] is ticket and self._lease is not None:
                        wait = (
                            self._lease.validity
                            if wait is None
                            else min(wait, self._lease.validity)
                        )
                    self._cond.wait(wait)
            except BaseException:
                self._line.remove(ticket)
                self._cond.notify_all()
                raise
            self._line.popleft()
            self._busy, self._lease = True, None
            return True

    def _holder_gone(self) -> bool:
        return self._lease is not None and self._lease.validity <= 0

    def holder_left(self) -> float | None:
        """Seconds left of the lease this process's holder at the front has (None when the
        front is not holding): what a waiter that gave up in line is told to wait."""
        lease = self._lease
        return None if lease is None else lease.validity

    def hold(self, lease: Lease) -> None:
        with self._cond:
            self._lease = lease
            # The next in line now waits for this lease's end at the latest.
            self._cond.notify_all()

    def leave(self, lease: Lease | None = None) -> None:
        with self._cond:
            if lease is None or self._lease is lease:
                self._busy, self._lease = False, None
                self._cond.notify_all()

    def wake(self) -> None:
        """The front's lease is gone (lost): whoever is next looks again now."""
        with self._cond:
            self._cond.notify_all()


class Listener(Protocol):
    """Told each release a channel announces: the node's index and the released token."""

    def hear(self, node: int, token: bytes) -> None: ...


#: How long a waiter that heard a release on some nodes waits for the rest of a quorum to
#: announce it too before trying anyway (the releasing contender may have held only a few).
NOTICE_GRACE = 0.005


class Tally:
    """Release notices one waiter heard. The name is free once a quorum of nodes announced
    the same release: waking on the first node's notice would find the others still held
    and send every waiter round again (a herd of failed attempts)."""

    def __init__(self, quorum: int) -> None:
        self.quorum = quorum
        self.heard = False  #: some node announced a release
        self.freed = False  #: a quorum of nodes announced the same release
        self._nodes: dict[bytes, set[int]] = {}

    def hear(self, node: int, token: bytes) -> None:
        self.heard = True
        nodes = self._nodes.setdefault(token, set())
        nodes.add(node)
        if len(nodes) >= self.quorum:
            self.freed = True

    @property
    def releases(self) -> int:
        """How many releases (distinct tokens) were heard since the last reset."""
        return len(self._nodes)

    def reset(self) -> None:
        self.heard = self.freed = False
        self._nodes.clear()


class HolderWatch:
    """A holder's ear on its own lock's channel: an operator's force release publishes the
    token it removed on every node that had it, so once a quorum of nodes announced it the
    holder learns that the lock is gone (``held`` turns False) instead of at its next
    renewal. Fewer nodes are not enough: the holder's own undo of a copy on a node that
    answered its acquire late publishes the token too (see :class:`.fanout.FanOut`), and so
    does its own release, after the lease was marked released, which this ignores."""

    def __init__(self, lease: Lease, lost: Callable[[Lease, str], None], quorum: int) -> None:
        self._lease = lease
        self.token = lease.token.encode()
        self._lost = lost
        self._removed = Tally(quorum)

    def hear(self, node: int, token: bytes) -> None:
        if token != self.token or self._lease.released or self._lease.lost:
            return
        self._removed.hear(node, token)
        if self._removed.freed:
            self._lost(self._lease, "force-released by an operator")


class HolderWatches:
    """The :class:`HolderWatch` of every auto-renewed lease of a client, by token: one
    listener on the holders' channel (where a force release announces the token it removed)
    serves them all, so holding many locks costs one subscription per node, not one per lock.
    Adding and removing a watch sends nothing."""

    def __init__(self) -> None:
        self._by_token: dict[bytes, HolderWatch] = {}

    def __len__(self) -> int:
        return len(self._by_token)

    def add(self, watch: HolderWatch) -> None:
        self._by_token[watch.token] = watch

    def remove(self, watch: HolderWatch) -> None:
        if self._by_token.get(watch.token) is watch:
            del self._by_token[watch.token]

    def hear(self, node: int, token: bytes) -> None:
        watch = self._by_token.get(token)
        if watch is not None:
            watch.hear(node, token)


#: How many node timeouts a waiter waits at most for a release notice while its nodes are
#: behind a lossy link (see :class:`ReleaseNotice`).
LOSSY_POLL = 2


class ReleaseNotice(Tally):
    """A waiting thread's view of its name's release channel.

    ``poll``: the longest wait for a notice, or None for no bound. On a lossy link a notice is
    a packet too, held up 200 ms or more by TCP's retransmission, and so is everything behind
    it on the one subscriber connection per node (and a subscription's confirmation): a
    waiter there looks again after ``poll`` instead of sleeping until the holder's lease end.
    """

    def __init__(self, quorum: int, poll: float | None = None) -> None:
        super().__init__(quorum)
        self._cond = threading.Condition()
        self.poll = poll

    def hear(self, node: int, token: bytes) -> None:
        with self._cond:
            super().hear(node, token)
            self._cond.notify_all()

    def wait(self, timeout: float) -> int:
        """Until a quorum announced a release (or a grace period after a partial one), or
        ``timeout`` seconds; then forget what was heard, ready for the next round. Returns
        how many releases (distinct tokens) some node announced: 0 for none."""
        if self.poll is not None and self.poll < timeout:
            timeout = self.poll
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._cond.wait_for(lambda: self.heard, timeout):
                grace = min(NOTICE_GRACE, max(deadline - time.monotonic(), 0.0))
                self._cond.wait_for(lambda: self.freed, grace)
            releases = self.releases
            self.reset()
            return releases


#: Seconds between attempts to reconnect a subscriber connection that dropped.
RECONNECT_DELAY = 0.1


def confirmations_due(subscribed: Iterable[int], nodes: Sequence[Node]) -> int:
    """How many of the nodes with a subscriber connection (``subscribed``, by index) a new
    subscription waits to be confirmed by: a majority of all nodes at most, and not those
    unreachable now (a lock operation's connection attempt timed out), whose confirmation
    would only come after the timeout.

    A majority is enough: the holder's lock stood on a majority, so its release is announced
    on at least one node of any majority that confirmed, and one announcement wakes a waiter
    (after :data:`NOTICE_GRACE`). Waiting for every node would make each new waiter pay the
    node timeout whenever one subscriber connection is behind a lost packet, which on a lossy
    link is most of the time (a subscriber connection carries every waiter's traffic)."""
    reachable = sum(1 for index in subscribed if nodes[index].unreachable() is None)
    return min(reachable, len(nodes) // 2 + 1)


#: Seconds a name's waiter channel stays subscribed after its last waiter of this process
#: left (see :class:`Waiters`).
LINGER = 2.0

#: At most this many names keep a waiter id (and a lingering channel) per process; the name
#: waited for least recently gives its up first.
LINGER_NAMES = 64


class Waiters:
    """The waiter id this process waits under, per name, kept from one acquire to the next.

    On a hot key a process waits again right after each release. With a new id each time,
    each acquire would subscribe to a new channel on every node, wait for the confirmations
    (a round trip through the listener thread) and unsubscribe after: six messages each way
    per acquisition, about as many as the acquire itself. With the same id, the channel stays
    subscribed (:data:`LINGER` seconds after its last waiter left) and the next acquire
    listens at once.

    One id per name is enough: only the front of the name's local queue waits (a fair lock
    too: its place in line is named after the id, see :class:`.fairness.FairLine`). A
    notice that comes while nobody of this process waits is dropped; a release tells the id
    only while it is among the name's waiters (or first in its line) on that node, which it
    leaves when its acquire ends."""

    def __init__(self) -> None:
        self._ids: dict[str, tuple[str, bytes]] = {}  # name -> (waiter id, its channel)
        self.channels: set[bytes] = set()  #: the channels that linger

    def waiter(self, name: str, channel: Callable[[str], str]) -> tuple[str, bytes | None]:
        """The id to wait for ``name`` under (``channel``: its channel, from an id), and the
        channel of the id the name gave up (its subscription no longer lingers), if any."""
        entry = self._ids.pop(name, None)
        if entry is None:
            waiter = clock.token_hex(8)
            entry = (waiter, channel(waiter).encode())
            self.channels.add(entry[1])
        self._ids[name] = entry
        dropped = None
        if len(self._ids) > LINGER_NAMES:
            _, dropped = self._ids.pop(next(iter(self._ids)))
            self.channels.discard(dropped)
        return entry[0], dropped


def lingered_out(
    lingering: dict[bytes, float], listeners: dict[bytes, list[Listener]], now: float, linger: float
) -> tuple[list[bytes], float]:
    """The lingering channels (``lingering``: when their last listener left) that nobody
    listened to for ``linger`` seconds, and when the next one could be (``now + linger`` at
    the latest: a channel listened to now starts its time when its last listener leaves)."""
    done, due = [], now + linger
    for name, since in lingering.items():
        if listeners.get(name):
            continue
        if since + linger <= now:
            done.append(name)
        else:
            due = min(due, since + linger)
    return done, due


class ReleaseNotices:
    """Subscribes to release channels on every node and wakes local waiters.

    One listener thread per instance while anyone listens; it survives any connection error
    (a dropped subscriber connection is opened again and its channels subscribed again), and
    :meth:`close` stops it and closes its wake-up pipe.
    """

    def __init__(self, nodes: Sequence[Node], timeout: float) -> None:
        self._nodes = nodes
        self._timeout = timeout
        self._quorum = len(nodes) // 2 + 1
        self._lock = threading.Lock()
        self._wires: dict[int, Wire] = {}  # node index -> subscriber connection
        self._waiters: dict[bytes, list[Listener]] = {}
        self._confirmed: dict[bytes, set[int]] = {}
        self._confirm = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._wake_w = -1  #: the running thread's wake-up pipe (write end)
        self._ids = Waiters()
        #: The channels of :attr:`_ids` subscribed, and when their last listener left
        #: (``time.monotonic``): one with no listener stays :data:`LINGER` seconds more.
        self._lingering: dict[bytes, float] = {}

    def waiter_id(self, name: str, channel: Callable[[str], str]) -> str:
        """The id this process waits for ``name`` under, the same from one acquire to the
        next (see :class:`Waiters`); ``channel`` makes an id's channel."""
        with self._lock:
            waiter, dropped = self._ids.waiter(name, channel)
            # Its channel stops lingering: dropped now unless someone listens (then at unwatch).
            lingered = dropped is not None and self._lingering.pop(dropped, None) is not None
            if lingered and dropped is not None and not self._waiters.get(dropped):
                self._drop(dropped)
            return waiter

    @contextlib.contextmanager
    def listening(self, channel: str) -> Iterator[ReleaseNotice]:
        """What ``channel`` announces, subscribed before this returns on a majority of nodes
        (or every node that could be reached within the node timeout, if fewer): see
        :func:`confirmations_due`; on a lossy link (:func:`lossy`) not waited for, and the
        waiter looks again after :data:`LOSSY_POLL` node timeouts at the latest."""
        name = channel.encode()
        event = ReleaseNotice(self._quorum)
        if lossy(self._nodes, time.monotonic()):
            # Confirmations come behind whatever the subscriber connections still carry
            # (most new waiters paid the whole node timeout for them at 15 % loss); a waiter
            # that polls does not need them.
            event.poll = LOSSY_POLL * self._timeout
            self.watch(name, event)
        else:
            self.watch(name, event, confirm=True)
        try:
            yield event
        finally:
            self.unwatch(name, event)

    def watch(self, name: bytes, listener: Listener, *, confirm: bool = False) -> None:
        """Pass what channel ``name`` announces to ``listener.hear(node, token)`` until
        :meth:`unwatch`; with ``confirm``, wait (up to the node timeout) until the nodes
        confirmed the subscription."""
        with self._lock:
            first = name not in self._waiters
            listeners = self._waiters.setdefault(name, [])
            listeners.append(listener)
            if not first:
                if len(listeners) == 1 and len(self._wires) < len(self._nodes):
                    self._connect_all()  # lingered, with no one to reconnect it for
                return
            self._confirmed[name] = set()
            fresh = self._connect_all()
            for index, wire in self._wires.items():
                if index not in fresh:
                    self._send(wire, ["SUBSCRIBE", name])
            self._start()
            deadline = time.monotonic() + self._timeout
            due = confirmations_due(self._wires, self._nodes)
            while confirm and len(self._confirmed.get(name, ())) < due:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._confirm.wait(remaining)

    def keep(self, name: bytes, listener: Listener) -> None:
        """:meth:`watch` for a listener that stays for good (never unwatched): a no-op once it
        listens, except after :meth:`close`, which it undoes (the connections are opened
        again, subscribed to every channel with listeners)."""
        with self._lock:
            listeners = self._waiters.setdefault(name, [])
            if listener in listeners and self._thread is not None:
                return
            first = not listeners
            if listener not in listeners:
                listeners.append(listener)
            fresh = self._connect_all()
            if first:
                for index, wire in self._wires.items():
                    if index not in fresh:
                        self._send(wire, ["SUBSCRIBE", name])
            self._start()

    def unwatch(self, name: bytes, listener: Listener) -> None:
        with self._lock:
            listeners = self._waiters.get(name, [])
            if listener in listeners:
                listeners.remove(listener)
            if not listeners and name in self._waiters:
                if name in self._ids.channels:
                    # Kept subscribed (with no listener) for this process's next waiter of
                    # the name; the listener thread unsubscribes it later (see _sweep),
                    # woken for it when it had nothing to time.
                    if not self._lingering and self._thread is not None:
                        os.write(self._wake_w, b"x")
                    self._lingering[name] = time.monotonic()
                else:
                    self._drop(name)

    def _sweep(self) -> float | None:
        """Unsubscribe the lingering channels nobody listened to for :data:`LINGER` seconds;
        returns the seconds until the next could be due, or None when none lingers. Under
        ``_lock``."""
        if not self._lingering:
            return None
        now = time.monotonic()
        done, due = lingered_out(self._lingering, self._waiters, now, LINGER)
        for name in done:
            self._drop(name)
        return due - now if self._lingering else None

    def _drop(self, name: bytes) -> None:
        """Unsubscribe ``name``, which nobody listens to any more. Under ``_lock``."""
        self._lingering.pop(name, None)
        del self._waiters[name]
        self._confirmed.pop(name, None)
        for wire in self._wires.values():
            self._send(wire, ["UNSUBSCRIBE", name])

    def close(self) -> None:
        """Drop the subscriber connections and stop the listener thread (waiters then fall
        back to the lease timer; the next waiter starts it again)."""
        with self._lock:
            for wire in self._wires.values():
                wire.close()
            self._wires = {}
            for name in list(self._lingering):
                if not self._waiters.get(name):
                    self._lingering.pop(name)
                    del self._waiters[name]
                    self._confirmed.pop(name, None)
            thread, self._thread = self._thread, None
            if thread is not None:
                os.write(self._wake_w, b"x")
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)

    def _start(self) -> None:
        if self._thread is None:
            wake_r, self._wake_w = os.pipe()
            self._thread = threading.Thread(
                target=self._run, args=(wake_r, self._wake_w), name="redlock-release-notices"
            )
            self._thread.daemon = True
            self._thread.start()

    def _connect_all(self) -> set[int]:
        """Open the missing subscriber connections, each subscribed to every channel with
        waiters; returns the new ones."""
        fresh: set[int] = set()
        for index, node in enumerate(self._nodes):
            if index in self._wires:
                continue
            try:
                wire = node.connect(self._timeout)
            except WireError:
                continue  # that node's waiters fall back to the lease timer
            self._wires[index] = wire
            if self._waiters:
                self._send(wire, ["SUBSCRIBE", *self._waiters])
            fresh.add(index)
        if fresh and self._thread is not None:
            os.write(self._wake_w, b"x")
        return fresh

    def _send(self, wire: Wire, command: list[object]) -> None:
        try:
            wire.write(pack(command))
        except OSError:
            wire.close()

    def _run(self, wake_r: int, wake_w: int) -> None:
        me = threading.current_thread()
        reconnect_at = 0.0
        try:
            while True:
                with self._lock:
                    if self._thread is not me:
                        return  # closed (or replaced after a close)
                    for index, wire in list(self._wires.items()):
                        if wire.fileno() < 0:  # closed after a failed send
                            del self._wires[index]
                    linger = self._sweep()
                    # Lingering channels alone are not worth reconnecting for.
                    listened = any(self._waiters.values())
                    missing = listened and len(self._wires) < len(self._nodes)
                    if missing and time.monotonic() >= reconnect_at:
                        self._connect_all()
                        reconnect_at = time.monotonic() + RECONNECT_DELAY
                    wires = {wire.fileno(): (index, wire) for index, wire in self._wires.items()}
                    missing = listened and len(self._wires) < len(self._nodes)
                poller = select.poll()
                poller.register(wake_r, select.POLLIN)
                for fd in wires:
                    poller.register(fd, select.POLLIN)
                wait = RECONNECT_DELAY if missing else None
                if linger is not None:
                    wait = linger if wait is None else min(wait, linger)
                for fd, _ in poller.poll(None if wait is None else wait * 1000):
                    if fd == wake_r:
                        os.read(wake_r, 64)
                        continue
                    index, wire = wires[fd]
                    try:
                        self._drain(index, wire)
                    except OSError:  # reset, closed, or not RESP: connect again
                        with self._lock:
                            wire.close()
                            if self._wires.get(index) is wire:
                                del self._wires[index]
        finally:
            os.close(wake_r)
            os.close(wake_w)

    def _drain(self, index: int, wire: Wire) -> None:
        wire.feed()
        while True:
            try:
                message = wire.take()
            except Incomplete:
                return
            if not isinstance(message, list) or len(message) < 3:
                continue
            kind, channel = message[0], message[1]
            with self._lock:
                if kind == b"subscribe" and channel in self._confirmed:
                    self._confirmed[channel].add(index)
                    self._confirm.notify_all()
                listeners = list(self._waiters.get(channel, ())) if kind == b"message" else []
            # Outside the lock: a listener may act on the lock (a holder marks it lost).
            for listener in listeners:
                listener.hear(index, message[2])
