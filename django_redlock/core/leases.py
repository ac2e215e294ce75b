"""What happens to a lease this process holds after it was won: release, the judgement of
renewals and checks, and loss (a part of a client: :class:`.base.RedlockBase` holds one). The
table itself (registration, reentrancy) is :class:`.lock.HeldLeases`, beside the lease."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

from . import clock
from .detector import why_lost
from .errors import LockLost, LockNotOwned
from .events import Listener, LockEvent, emit, heard, logger, printable
from .kinds import listed_name, reader_entry_of, reader_name
from .lock import HeldLeases, Lease
from .nodes import Failure, Node
from .renewal import pauses, renewer

__all__ = ["COURTESY", "DRIFT_FLOOR", "LeaseTable", "replies_of"]

#: Fixed part of the clock-drift allowance (the Redlock spec adds 2 ms for Redis' own expiry
#: granularity).
DRIFT_FLOOR = 0.002

#: Head start, in seconds, that a releaser gives processes its release woke (see
#: ``_courtesy``): enough for a woken waiter's attempt to reach the nodes first.
COURTESY = 0.003


def replies_of(results: list[Any], position: int) -> list[Any]:
    """The nodes' replies to the ``position``-th command of a batch pipelined to every node
    (``results``: per node, its replies in command order, or its Failure)."""
    return [r[position] if isinstance(r, list) else r for r in results]


class LeaseTable(HeldLeases):
    """The lease table of a Redlock client (:class:`~.lock.HeldLeases`) and what happens to a
    lease after it was granted (a part of a client: :class:`.base.RedlockBase` holds one as
    ``leases``).

    ``listeners`` is the client's list (shared, not copied); ``start_renewal`` hands an
    auto-renewed lease to the client's watchdog."""

    def __init__(
        self,
        nodes: list[Node],
        *,
        quorum: int,
        drift_factor: float,
        listeners: list[Listener],
        start_renewal: Callable[[Lease], None],
    ) -> None:
        self.nodes = nodes
        self.quorum = quorum
        self.drift_factor = drift_factor
        self.drift_floor = DRIFT_FLOOR
        super().__init__(listeners, start_renewal)

    def margin(self, ttl: float) -> float:
        return ttl * self.drift_factor + DRIFT_FLOOR

    def _elsewhere(self, lease: Lease) -> LeaseTable | None:
        """The partner table ``lease`` lives in, when an owner re-entered it through this one
        (:meth:`~.lock.HeldLeases.share_holds`): its holds are counted there, and its end is
        told to that client's listeners, which heard of its start."""
        home = lease.home
        return None if home is None or home is self else cast(LeaseTable, home)

    def begin_release(self, lease: Lease) -> bool:
        """Drop one hold; True when the last hold is gone and the nodes must be told (never
        from a forked child: the parent still holds the lock)."""
        home = lease.home
        if home is not self and home is not None:  # _elsewhere(), written out: every release
            return cast(LeaseTable, home).begin_release(lease)
        if lease.foreign:
            return False
        # The last hold, and "lease.validity <= 0" written out (foreign it is not): this runs
        # on every release.
        if lease.count <= 1 and (
            lease.released or lease.lost or lease.valid_until <= clock.monotonic()
        ):
            renewing = lease.auto_renew and (
                lease.renew_until is None or lease.valid_until < lease.renew_until
            )
            if renewing:
                # The watchdog had not run yet (the whole process was frozen): the lease it
                # should have kept is lost, whether or not another owner took the name since.
                self.mark_lost(lease, self._why_ran_out(lease, clock.monotonic()))
            else:
                # Nobody was to renew it: it simply ran out (LockNotOwned, not LockLost).
                lease.ran_out = True
        with self._leases_lock:
            if lease.count > 1:
                lease.count -= 1
                return False
            lease.released = True
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        return True

    def courtesy(self, name: str) -> float:
        """Seconds this process should hold back before contending for ``name`` again: after
        its release told waiting processes, they get a head start, else the releaser would win
        every round (it needs no wake-up) and starve them."""
        if not self._yield_until:  # the common case: nobody was woken; no lock, no sleep
            return 0.0
        with self._leases_lock:
            until = self._yield_until.pop(name, 0.0)
        return max(until - clock.monotonic(), 0.0)

    def _stop_watching(self, lease: Lease) -> None:
        unwatch, lease.unwatch = lease.unwatch, None
        if unwatch is not None:
            unwatch()

    def finish_release(self, lease: Lease, replies: list[Any]) -> None:
        home = lease.home
        if home is not self and home is not None:  # _elsewhere(), written out: every release
            return cast(LeaseTable, home).finish_release(lease, replies)
        if lease.unwatch is not None:  # only an auto-renewed lease listens
            self._stop_watching(lease)
        # A reply above 1: the release woke waiting processes (a loop, not a list: this
        # runs on every release).
        for reply in replies:
            if isinstance(reply, int) and reply > 1:
                self._hold_back(lease.name)
                break
        # A hold ends once: a lease already lost had its "lost" event; "released" is only
        # for one given back while it was still ours.
        if lease.lost:
            listed, what = listed_name(lease.name, lease.token)
            raise LockLost(f"{what} was lost before release: {lease.lost}", listed)
        refused = replies.count(0)
        if lease.ran_out:
            why = "its lease ran out before release"
        elif refused > len(self.nodes) - self.quorum:
            why = (
                f"it was no longer ours on {refused} of {len(self.nodes)} nodes: its lease ran "
                "out there, or they lost it (restarted empty, flushed, removed by hand)"
            )
        else:
            # heard(), written out: this runs on every release, and "released" logs at DEBUG.
            if self.listeners or logger.isEnabledFor(logging.DEBUG):
                emit(self.listeners, LockEvent.of_end("released", lease, None))
            return
        self._lease_event("lost", lease, why)
        listed, what = listed_name(lease.name, lease.token)
        raise LockNotOwned(f"{what}: {why}; it was not exclusive the whole time", listed)

    def _hold_back(self, name: str) -> None:
        """This process's next acquire of ``name`` gives the processes its release woke a
        head start (see :meth:`courtesy`)."""
        now = clock.monotonic()
        with self._leases_lock:
            # Entries live a few ms: dropping the run-out ones keeps the table to the names
            # released just now (per-entity names would otherwise pile up).
            for gone in [n for n, until in self._yield_until.items() if until <= now]:
                del self._yield_until[gone]
            self._yield_until[name] = now + COURTESY

    def detach(self, lease: Lease) -> str:
        """Stop tracking a lease here without releasing it: the process it was taken for
        releases it by token. It is no longer renewed or reentered in this process."""
        home = self._elsewhere(lease)
        if home is not None:
            return home.detach(lease)
        with self._leases_lock:
            lease.released = True
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        if lease.leave_queue is not None:
            lease.leave_queue()
        self._stop_watching(lease)
        return lease.token

    def judge_extend(
        self,
        lease: Lease,
        ttl: float,
        replies: list[Any],
        start: float,
        answered: float | None = None,
    ) -> bool:
        """Whether a quorum extended the lease in time (its new validity counts from
        ``start``, before the commands went out). ``answered``: when the quorum's answers
        were in (default: now); the lease must still have had validity then, so a lease
        that ran out here is never revived, however the nodes answered."""
        ours = sum(1 for r in replies if r == 1)
        margin = self.margin(ttl)
        now = clock.monotonic()
        in_time = (now if answered is None else answered) < lease.valid_until
        if (
            ours >= self.quorum
            and in_time
            and ttl - (now - start) - margin > 0
            and not (lease.released or lease.lost)
        ):
            lease.valid_until = start + ttl - margin
            lease.ttl = ttl
            lease.last_renewal = start
            lease.refused = None
            return True
        gone = sum(1 for r in replies if r == 0)
        if gone > len(self.nodes) - self.quorum:
            self.mark_lost(
                lease,
                f"the nodes refused: the token is gone from {gone} of {len(self.nodes)} nodes",
            )
        elif ours < self.quorum:
            lease.refused = self._too_few(ours, replies)
        else:
            lease.refused = None  # a quorum renewed it, too late: the nodes did not refuse
        return False

    def _too_few(self, ours: int, replies: Sequence[Any]) -> str:
        """How a renewal answered by too few nodes went, node by node."""
        # A node that answered without our copy is named too: blaming only the silent ones
        # hides where the hold had already gone.
        failed = [
            f"{node.name}: {reply}"
            if isinstance(reply, Failure)
            else f"{node.name}: not held there"
            for node, reply in zip(self.nodes, replies, strict=False)
            if isinstance(reply, Failure) or reply == 0
        ]
        detail = f" ({'; '.join(failed)})" if failed else ""
        return f"{ours} of {len(self.nodes)} nodes renewed it, {self.quorum} needed{detail}"

    def wants_renewal(self, lease: Lease, now: float) -> bool:
        """Whether the watchdog renews ``lease`` now (False: it stops renewing it)."""
        if lease.released or lease.lost:
            return False
        if lease.validity <= 0:
            self.mark_lost(lease, self._why_ran_out(lease, now))
            return False
        if lease.abandoned():
            self._let_run_out(lease)
            return False
        if lease.renew_until is None:
            return True
        return lease.acquired + (lease.renewed + 1) * lease.ttl / 3 < lease.renew_until

    def _why_ran_out(self, lease: Lease, now: float, sent: float | None = None) -> str:
        """Why an auto-renewed lease ran out before the watchdog renewed it (see
        :func:`.detector.why_lost`); ``sent``: when the renewal that came too late went out
        (its round took the rest of the lease)."""
        due = lease.last_renewal + lease.ttl / 3
        why = why_lost(
            refused=lease.refused,
            paused=max(pauses.since(lease.last_renewal), renewer.overslept(now)),
            late=max((now if sent is None else sent) - due, 0.0),
            ttl=lease.ttl,
            took=None if sent is None else now - sent,
        )
        return f"the lease ran out before it could be renewed: {why}"

    def judge_renewals(
        self,
        leases: Sequence[Lease],
        replies: list[list[Any]],
        start: float,
        answered: Sequence[float | None] | None = None,
    ) -> list[float | None]:
        """Per lease of one batched renewal (its nodes' replies: :func:`replies_of`; when
        its quorum's answers were in, if the driver knows): when to renew it next, or None
        to stop."""
        whens: list[float | None] = []
        for i, (lease, its) in enumerate(zip(leases, replies, strict=True)):
            at = None if answered is None else answered[i]
            if self.judge_extend(lease, lease.ttl, its, start, at):
                lease.renewed += 1
                # A third of the lease from when this round went out, as its validity
                # counts: a round that took long leaves less time to the next, not more.
                whens.append(start + lease.ttl / 3)
            elif lease.lost or lease.released:
                whens.append(None)
            elif lease.validity <= 0:
                # Its validity ran out while the round was on the wire.
                self.mark_lost(lease, self._why_ran_out(lease, clock.monotonic(), start))
                whens.append(None)
            else:
                # No quorum this time: try again soon, while the lease still has validity.
                whens.append(clock.monotonic() + min(lease.ttl / 10, max(lease.validity / 2, 0.01)))
        return whens

    def judge_check(self, lease: Lease, replies: list[Any]) -> bool:
        """``replies``: each node's lock value (``GET``), which starts with the holder's token
        and a space."""
        head = lease.token.encode() + b" "
        ours = sum(1 for r in replies if isinstance(r, bytes) and r.startswith(head))
        if ours >= self.quorum:
            return True
        answered = sum(1 for r in replies if not isinstance(r, Failure))
        if answered - ours > len(self.nodes) - self.quorum:
            self.mark_lost(lease, "the token is gone from a quorum of nodes")
        return False

    def _let_run_out(self, lease: Lease) -> None:
        """Stop keeping a lease nobody can release (its task or thread ended, and no handle
        holds it): it is left to run out on the nodes, as a crashed process's lease is."""
        with self._leases_lock:
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        self._stop_watching(lease)
        logger.warning(
            "lock %s: %s, and no handle holds it any more: no longer renewed, it runs out in %.1fs",
            printable(lease.name),
            printable(lease.owner),
            lease.validity,
        )

    def mark_lost(self, lease: Lease, why: str) -> None:
        home = self._elsewhere(lease)
        if home is not None:
            return home.mark_lost(lease, why)
        with self._leases_lock:
            if lease.lost is not None or lease.released:
                return
            lease.lost = why
            if self._leases.get(lease.name) is lease:
                del self._leases[lease.name]
        if lease.wake_queue is not None:
            lease.wake_queue()
        self._stop_watching(lease)
        self._lease_event("lost", lease, why)

    def _lease_event(
        self, kind: Literal["released", "lost"], lease: Lease, reason: str | None
    ) -> None:
        """Tell the listeners about the end of a hold (released or lost)."""
        if heard(self.listeners, kind):
            emit(self.listeners, LockEvent.of_end(kind, lease, reason))

    def judge_force_release(self, name: str, replies: list[Any]) -> int:
        tokens = {r.decode() for r in replies if isinstance(r, bytes)}
        removed = sum(1 for r in replies if isinstance(r, bytes))
        entry = reader_entry_of(name)
        with self._leases_lock:
            if entry is None:
                lease = self._leases.get(name)
            else:  # one reader, as listed: its token is in the name
                lease = self._readers.get(entry[1])
                if lease is not None and lease.name != reader_name(entry[0]):
                    lease = None
        if lease is not None and lease.token in tokens:
            self.mark_lost(lease, "force-released by an operator")
        if removed:  # nothing removed (not held, or held by another token now): no release
            emit(
                self.listeners,
                LockEvent("force_released", name, token=next(iter(tokens), None), nodes=removed),
            )
        return removed

    def after_fork(self) -> None:
        super().after_fork()
        self._yield_until: dict[str, float] = {}

    def renewal_failed(self, leases: Sequence[Lease]) -> None:
        """A renewal round raised: its leases cannot be vouched for any more."""
        for lease in leases:
            self.mark_lost(lease, "renewal failed with an unexpected error")
