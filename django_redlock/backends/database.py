"""Locks in a database table (Django ORM: SQLite, PostgreSQL, MySQL/MariaDB).

The table (:class:`~django_redlock.models.DatabaseLock`, shipped with a migration) has one row
per held lock: a unique ``name`` (the unique index of seed 002 is what makes a second holder
fail), the holder's ``token``, metadata, ``fence`` and the lease's end ``expires_us``. Every
time is read from the DATABASE clock inside the statement (``NOW_US`` below), never from a
client, so clients with skewed clocks agree on when a lease ended.

* acquire: ``INSERT`` if absent (insert wins); otherwise one ``UPDATE ... WHERE name = %s AND
  expires_us <= now`` takes an expired row over atomically;
* release / extend / check compare the token in the statement's ``WHERE``;
* fences come from a counter row per name (:class:`DatabaseLockFence`) bumped in the same
  transaction that grants the lock, so they increase strictly in grant order and survive the
  lock row's deletion;
* all of it runs on connections of this backend's own (one per thread, autocommit), never the
  caller's: a lock is neither committed nor rolled back with the caller's ``atomic()`` block
  or ``ATOMIC_REQUESTS`` transaction;
* a connection the server or the network dropped (pgbouncer, idle timeouts, failovers) is
  replaced, and the statement runs again on the new one, once, where that is safe (see
  :meth:`DatabaseLocks._sql` and :meth:`DatabaseLocks._insert_or_take`);
* every wait on the database is bounded (``request_timeout``, see :meth:`DatabaseLocks._bounded`):
  a server or network that stops answering sends no error, and a driver waits for ever for
  the reply (PostgreSQL without ``connect_timeout``, MySQL without ``read_timeout``); a
  statement that outlives its operation's deadline has its socket shut down, which the
  driver reports as a dropped connection;
* waiting: on PostgreSQL a release sends ``NOTIFY`` and waiters ``LISTEN``; elsewhere a bounded
  backoff (5 ms doubling to ``max_poll``, never past the holder's lease end);
* a holder hears when its row is removed by anyone else (a force release) within
  ``loss_check`` seconds: while a manager holds locks, one thread of its own looks their rows
  up in one statement (by primary key) every ``loss_check`` seconds, and on PostgreSQL at once
  when the ``NOTIFY`` of a removal or a take-over names one of them; a row gone, or held by
  another token, marks the lock lost.

``pessimistic=True`` (PostgreSQL, MySQL/MariaDB) also holds ``SELECT ... FOR UPDATE`` on a
mutex row in a transaction of its own connection for the lock's whole life: waiters queue in
the database's lock manager instead of polling, and a holder whose connection dies (crash,
SIGKILL) frees the lock at once instead of after its lease. Trade-offs (docs/backends.rst): one
database connection and one open transaction per held lock (PostgreSQL's VACUUM cannot clean
behind a long one; ``idle_in_transaction_session_timeout`` ends it), a network partition leaves
the lock held until the server notices the dead connection, and every user of a name must use
the same mode.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import Error, InterfaceError, OperationalError, connections
from django.db.utils import load_backend

from ..core import LockInfo, NodeHealth, check_flag, check_positive
from .base import BackendLock, BackendLocks, Grant, check_name, holder_meta, spawn, unreachable

__all__ = ["DatabaseLocks"]

T = TypeVar("T")

logger = logging.getLogger("django_redlock")

LOCKS = "django_redlock_databaselock"
FENCES = "django_redlock_databaselockfence"
MUTEXES = "django_redlock_databaselockmutex"
CHANNEL = "django_redlock"

#: The database's clock in microseconds since the epoch, as one SQL expression per vendor
#: (constant within a statement: statement_timestamp(), NOW(6), julianday('now')).
NOW_US = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000000 AS BIGINT)",
    "mysql": "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
}
BEGIN = {"postgresql": "BEGIN", "mysql": "START TRANSACTION", "sqlite": "BEGIN IMMEDIATE"}
VERSION = {"postgresql": "SHOW server_version", "mysql": "SELECT VERSION()"}
VERSION["sqlite"] = "SELECT sqlite_version()"


def insert_absent(vendor: str, table: str, columns: str, values: str) -> str:
    """Insert a row unless its unique key exists (0 rows affected then, no error)."""
    if vendor == "mysql":
        return f"INSERT IGNORE INTO {table} ({columns}) VALUES ({values})"
    return f"INSERT INTO {table} ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING"


def bump_fence(vendor: str) -> str:
    """Add one to a name's fence counter, creating it at 1."""
    insert = f"INSERT INTO {FENCES} (name, value) VALUES (%s, 1) "
    if vendor == "mysql":
        return insert + "ON DUPLICATE KEY UPDATE value = value + 1"
    return insert + f"ON CONFLICT (name) DO UPDATE SET value = {FENCES}.value + 1"


#: Tries of a step the database rolled back as a deadlock victim.
DEADLOCK_RETRIES = 5

#: MySQL/MariaDB errors that mean the connection is gone: server has gone away, lost during
#: query, lost at reading, connection killed (MariaDB), idle timeout (MySQL 8), shutdown.
MYSQL_DROPPED = frozenset({2006, 2013, 2055, 1927, 4031, 1053})

LOCK_COLUMNS = "name, token, meta, fence, acquired_us, expires_us, lease_us, renewals"
#: Seconds between two purges of the rows whose lease ended, by one manager that releases locks:
#: a row stays after its lease until its name is taken again, and a name never used twice
#: (a Celery revoke's note, a per-request key) would stay for ever.
PURGE_EVERY = 60.0


def private_memory_database(name: str) -> bool:
    """Whether an SQLite NAME opens a database private to each connection: ``:memory:``, or
    a ``mode=memory`` URI without ``cache=shared`` (Django's own in-memory test database
    shares its cache, so it is fine)."""
    if name == ":memory:":
        return True
    query = name.partition("?")[2].split("&") if name.startswith("file:") else []
    return "mode=memory" in query and "cache=shared" not in query


def connection_dropped(wrapper: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a statement on ``wrapper``, means the server or the network
    dropped the connection (rather than an SQL error on a live connection). No round trip."""
    if wrapper.vendor == "sqlite":
        return False
    raw = wrapper.connection
    if raw is None:
        return True
    if wrapper.vendor == "postgresql":
        return bool(raw.closed)  # psycopg marks a connection closed once the server is gone
    cause = exc.__cause__
    code = cause.args[0] if cause is not None and cause.args else None
    return code in MYSQL_DROPPED or getattr(raw, "open", True) is False  # PyMySQL: open


def dropped_while_idle(wrapper: Any) -> bool:
    """Whether the server closed an idle connection of ours (or wrote to it, which it does
    only to say why it closes it: "terminating connection due to administrator command"):
    its socket is readable. A poll of the socket, no round trip; False when the driver
    does not show its socket (the failure of the next statement tells then)."""
    raw = wrapper.connection
    if raw is None or wrapper.vendor == "sqlite":
        return False
    if getattr(raw, "closed", False) or getattr(raw, "open", True) is False:
        return True  # psycopg's closed, PyMySQL's open
    fd = _socket_fd(raw)
    if fd is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # POLLHUP and POLLERR are always reported
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except Exception:  # no socket to poll: a new connection costs less than a failure
        return True


def discard(wrapper: Any) -> None:
    """Close a connection that may be dead already (its next use connects anew)."""
    with contextlib.suppress(Error):  # closing a dropped connection may fail: closed all the same
        wrapper.close()


def _socket_fd(raw: Any) -> int | None:
    """The socket descriptor of a driver's connection (psycopg's fileno(), PyMySQL's
    _sock), or None (SQLite, or a driver that does not show it)."""
    for holder in (raw, getattr(raw, "_sock", None)):
        fileno = getattr(holder, "fileno", None)
        if fileno is not None:
            with contextlib.suppress(Exception):
                return int(fileno())
    return None


def abandon(wrapper: Any) -> None:
    """Let go of a connection inherited through fork without ending the parent's session.

    As Celery's Django fixup does, the child's copy of the socket is closed before the
    driver object goes: closing through the driver would first send the protocol's goodbye
    (PostgreSQL's Terminate, MySQL's COM_QUIT) on the socket the parent still talks on, and
    the server would end the parent's session (and with it the parent's pessimistic locks).
    /dev/null is put in the socket's place (dup2: the descriptor number is never free for a
    new socket of another thread to take), so the driver's close writes its goodbye there.
    """
    raw = wrapper.connection
    if raw is None:
        return
    fd = _socket_fd(raw)
    if fd is not None:
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
    if fd is not None or wrapper.vendor == "sqlite":
        with contextlib.suppress(Exception):  # it only frees the child's memory and descriptor
            raw.close()
    wrapper.connection = None


def cut(wrapper: Any) -> bool:
    """Shut a connection's socket down (both ways) so that a statement blocked on it wakes
    up with an error the driver reports as a dropped connection. The descriptor stays open
    (it is the driver's to close): shutdown acts on the socket, here through a duplicate.
    Whether there was a socket to shut down (none while the driver is still connecting)."""
    raw = wrapper.connection
    fd = None if raw is None else _socket_fd(raw)
    if fd is None:
        return False
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    return True


class _Watchdog:
    """Cuts (:func:`cut`) the connection of a statement still running at its deadline: one
    thread per manager, started on demand, that ends after a second with nothing armed.

    A driver blocked on a silent socket cannot be told to stop any other way: PostgreSQL's
    ``statement_timeout`` and cancel requests need an answering server, and the drivers'
    read timeouts are per connection (PyMySQL) or absent (psycopg).
    """

    LINGER = 1.0
    #: How often a connection still being set up at its deadline is looked at again: the
    #: driver's connect has its own timeout, but the statements Django runs once it is
    #: connected (PostgreSQL's SET TIME ZONE, MySQL's server variables) have none.
    RECUT = 0.02

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Any]] = {}  #: key -> (deadline, wrapper)
        self._fired: set[int] = set()
        self._keys = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, wrapper: Any) -> int:
        with self._cond:
            self._keys += 1
            self._armed[self._keys] = (deadline, wrapper)
            self._thread = self._thread or spawn("lock-watchdog", self._run)
            self._cond.notify()
            return self._keys

    def disarm(self, key: int) -> bool:
        """Stop watching; whether the deadline passed (the connection was cut, or is to be
        cut once the driver has connected it). Under the same lock as the cut, so
        a connection is never cut after its statement returned (its socket may be closed and
        its descriptor number reused by then)."""
        with self._cond:
            self._armed.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

    def _run(self) -> None:
        idle_since = time.monotonic()
        with self._cond:
            while True:
                now = time.monotonic()
                for key, (deadline, wrapper) in list(self._armed.items()):
                    if deadline <= now:
                        self._fired.add(key)
                        if cut(wrapper):
                            del self._armed[key]
                        else:  # no socket yet: cut it as soon as the driver has one
                            self._armed[key] = (now + self.RECUT, wrapper)
                if self._armed:
                    idle_since = now
                    self._cond.wait(min(d for d, _ in self._armed.values()) - now)
                elif now - idle_since >= self.LINGER:
                    self._thread = None
                    return
                else:
                    self._cond.wait(self.LINGER)


class _Mutex:
    """A pessimistic lock's connection, in the transaction holding the mutex row; ``guard``
    keeps the holder's thread and its renewal thread from using it at the same time."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.guard = threading.Lock()


class DatabaseLocks(BackendLocks):
    """Locks in the ``DATABASES[using]`` database (see the module docstring).

    ``OPTIONS``: ``using`` (a DATABASES alias, default ``"default"``), ``ttl`` (default lease,
    seconds), ``pessimistic`` (bool), ``max_poll`` (longest sleep between two attempts while
    waiting without LISTEN/NOTIFY, seconds), ``loss_check`` (how often a holder's rows are
    looked up to notice a force release, seconds, default 0.25), ``request_timeout`` (how long
    one operation waits for the database, connecting included, seconds, default 5),
    ``retry_count``/``retry_delay`` (how long ``acquire(timeout=None)`` waits, as on the
    Redlock).
    """

    service = "database"

    def __init__(
        self,
        using: str = "default",
        *,
        ttl: float = 30.0,
        pessimistic: bool = False,
        max_poll: float = 0.2,
        loss_check: float = 0.25,
        request_timeout: float = 5.0,
        retry_count: int = 3,
        retry_delay: float = 0.2,
    ) -> None:
        super().__init__(ttl=ttl, retry_count=retry_count, retry_delay=retry_delay)
        if not isinstance(using, str) or using not in connections.settings:
            raise ValueError(f"DatabaseLocks: using={using!r} names no database in DATABASES")
        self.using = using
        self.vendor = connections[using].vendor
        self.node_name, self.label = f"{self.vendor}:{using}", f"database {using!r}"
        if self.vendor not in NOW_US:
            raise ValueError(f"DatabaseLocks: database {using!r} ({self.vendor}) is not supported")
        self.pessimistic = check_flag("DatabaseLocks: pessimistic", pessimistic)
        if pessimistic and self.vendor == "sqlite":
            raise ValueError("DatabaseLocks: pessimistic=True needs PostgreSQL or MySQL/MariaDB")
        self.max_poll = check_positive("max_poll", max_poll)
        self.loss_check = check_positive("loss_check", loss_check)
        self.request_timeout = check_positive("request_timeout", request_timeout)
        self._now = NOW_US[self.vendor]
        self._fresh()
        # The first purge a period after the start too: a short-lived manager (a command, a
        # test) adds no statement, and a long-lived one's first is as late as its next.
        self._purge_due = time.monotonic() + PURGE_EVERY

    # -- connections ----------------------------------------------------------------------------

    def unusable_reason(self) -> str | None:
        """Why this database cannot hold locks at all, or None (system check E106)."""
        name = str(connections[self.using].settings_dict.get("NAME") or "")
        if self.vendor == "sqlite" and private_memory_database(name):
            return (
                f"DatabaseLocks: database {self.using!r} is an in-memory SQLite database "
                f"({name!r}) that every connection sees as its own empty copy; the lock "
                "connections would not see each other's locks. Use a file, or a shared-cache "
                "URI such as 'file:locks?mode=memory&cache=shared' (one process only)."
            )
        return None

    def caveat(self) -> str | None:
        """A setting under which these locks misbehave, or None (system check W101)."""
        if self.vendor == "sqlite" and connections[self.using].settings_dict.get("ATOMIC_REQUESTS"):
            return (
                f"DatabaseLocks: SQLite database {self.using!r} has ATOMIC_REQUESTS=True. SQLite "
                "has one writer: a view that writes holds the write lock until its request "
                "ends, so releasing the view's lock (a write on the lock's own connection) "
                "waits for it, fails with 'database is locked' after the busy timeout, and the "
                "lock stays held until its lease ends."
            )
        return None

    def unavailable(self) -> tuple[type[BaseException], ...]:
        return (OperationalError, InterfaceError)

    def _after_fork(self) -> None:
        # The parent's listener and row-watch threads do not run here, and every connection
        # opened so far is the parent's: drop them all without a goodbye (see abandon()).
        with contextlib.suppress(Exception):
            for wrapper in list(self._opened):
                abandon(wrapper)
        self._fresh()

    def _fresh(self) -> None:
        """No connection yet, nor any thread that uses one (started on demand)."""
        self._local = threading.local()
        self._opened: list[Any] = []
        self._opened_lock = threading.Lock()
        self._listener: _Listener | None = None
        self._listener_lock = threading.Lock()
        self._row_watch = _RowWatch(self)
        self._watchdog = _Watchdog()
        self._sweep = _Sweep(self)

    def _connection(self, *, idle: bool = False) -> Any:
        """This thread's own connection (autocommit), separate from Django's. ``idle``: it is
        not in a transaction, so one the server dropped meanwhile is replaced before use."""
        self._this_process()
        wrapper = getattr(self._local, "wrapper", None)
        if wrapper is None:
            wrapper = self._local.wrapper = self._open()
        elif idle and dropped_while_idle(wrapper):
            discard(wrapper)  # the next statement connects anew: none of it was sent
        return wrapper

    def _open(self, *, wait: float | None = 0.0) -> Any:
        """A new connection of ours (not connected yet). ``wait``: how long its statements
        may wait in the server beyond ``request_timeout`` (None: for ever), for MySQL's
        read timeout, the only bound on reading its handshake."""
        self._this_process()
        reason = self.unusable_reason()
        if reason:  # checked here too: a test runner may swap the NAME after the checks ran
            raise ImproperlyConfigured(reason)

        settings_dict = copy.deepcopy(connections[self.using].settings_dict)
        if self.vendor == "mysql":
            # No gap locks, and a non-matching UPDATE lets go of the row at once: fewer
            # deadlocks between a release and a fencing attempt.
            options = settings_dict.setdefault("OPTIONS", {})
            options["isolation_level"] = "read committed"
            # PyMySQL and mysqlclient read and write without a timeout by default: a server
            # that stops answering would hold the caller for ever, handshake included.
            limit = None if wait is None else self.request_timeout + wait
            if limit is not None:
                options.setdefault("write_timeout", math.ceil(limit))
                options.setdefault("read_timeout", math.ceil(limit))
        backend = load_backend(settings_dict["ENGINE"])
        wrapper = backend.DatabaseWrapper(settings_dict, alias=f"{self.using}:locks")
        wrapper.inc_thread_sharing()  # close() may run in another thread
        with self._opened_lock:
            self._opened.append(wrapper)
        return wrapper

    def _drop_thread_connection(self) -> None:
        """Close this thread's connection for good (a thread of ours that ends)."""
        wrapper = getattr(self._local, "wrapper", None)
        if wrapper is not None:
            self._local.wrapper = None
            self._forget(wrapper)

    def _forget(self, wrapper: Any) -> None:
        """Close a connection of :meth:`_open` for good (``close()`` need not close it again)."""
        discard(wrapper)
        with self._opened_lock:
            if wrapper in self._opened:
                self._opened.remove(wrapper)

    def _end_mutex(self, mutex: _Mutex) -> None:
        """End a pessimistic lock's transaction: the next waiter gets the row. ROLLBACK first:
        closing alone lets the server drop the row lock only when it notices the closed
        socket, after a quick re-acquire may already have been refused."""
        with mutex.guard:
            try:
                if mutex.wrapper.connection is not None:  # cursor() would connect anew
                    with self._bounded(mutex.wrapper), mutex.wrapper.cursor() as cursor:
                        cursor.execute("ROLLBACK")
            except Error:  # the connection is already gone, and its row lock with it
                pass
            finally:
                self._forget(mutex.wrapper)

    def _mutex_alive(self, mutex: _Mutex) -> bool:
        """Whether the transaction holding a pessimistic lock still runs. A round trip on its
        connection: a socket that the server has not closed yet proves nothing."""
        with mutex.guard:
            wrapper = mutex.wrapper
            if wrapper.connection is None or dropped_while_idle(wrapper):
                return False
            try:
                with self._bounded(wrapper), wrapper.cursor() as cursor:
                    cursor.execute("SELECT 1")
                    cursor.fetchall()
            except Error:
                return False
            return True

    def _mutex_lost(self, grant: Grant) -> bool:
        """Whether the connection of a pessimistic lock died, and with its transaction the
        lock (a waiter may hold it now). Then the holder lost it (``held`` is False from
        now on), and its row is deleted at once (by token: a waiter that took it over keeps
        it), not left to block until its lease ends."""
        mutex = grant.state
        if mutex is None or self._mutex_alive(mutex):
            return False
        grant.state = None
        self._end_mutex(mutex)
        self._mark_lost(grant, "the database connection holding the pessimistic lock was lost")
        self._retrying(self._delete, grant)
        return True

    @contextlib.contextmanager
    def _budget(self) -> Iterator[None]:
        """One operation's deadline, ``request_timeout`` from now, for every statement and
        connection in the block (the replacement of a dropped connection and a statement's
        repeat included). Inside another's block it is that one's."""
        if getattr(self._local, "deadline", None) is not None:
            yield
            return
        self._local.deadline = time.monotonic() + self.request_timeout
        self._local.timed_out = False
        try:
            yield
        finally:
            self._local.deadline = None

    @contextlib.contextmanager
    def _bounded(self, wrapper: Any, wait: float | None = 0.0) -> Iterator[None]:
        """Connect ``wrapper`` if it is not, and run the block (statements on it) by the
        deadline of the operation (:meth:`_budget`) plus ``wait`` (a wait in the server's
        lock manager that the statement bounds itself; None: no bound at all).

        * Connecting: the driver's own ``connect_timeout`` (PostgreSQL, MySQL), set to the
          time left, unless ``OPTIONS`` sets a shorter one. libpq counts whole seconds, at
          least 2, so a connection begun at the deadline's edge may end up to 2 s past it.
        * A statement: a silent server answers nothing, not even a cancel request, so at the
          deadline the :class:`_Watchdog` shuts its socket down; the driver's error is
          raised as Django's ``OperationalError`` naming the database and the timeout, and
          the connection counts as dropped.

        SQLite has no server to stop answering (its waits are its busy timeout): unbounded.
        """
        if self.vendor == "sqlite":
            yield
            return
        with self._budget():
            deadline = self._local.deadline
            if wrapper.connection is None:
                left = self._left(deadline)
                options = wrapper.settings_dict.setdefault("OPTIONS", {})
                chosen = connections[self.using].settings_dict.get("OPTIONS", {})
                limit = min(left, float(chosen.get("connect_timeout") or math.inf))
                # Whole seconds (mysqlclient's and libpq's reading), at least libpq's 2.
                least = 2 if self.vendor == "postgresql" else 1
                options["connect_timeout"] = max(least, math.ceil(limit))
                # Watched too: once the driver is connected, Django runs statements of its
                # own on the new connection (SET TIME ZONE, the server's variables), which
                # the driver's connect_timeout does not bound. Cut at the deadline, or as
                # soon as the driver's connect returns after it.
                with self._cut_at(self._watchdog.arm(deadline, wrapper)):
                    wrapper.ensure_connection()
            self._left(deadline)
            if wait is None:
                yield
            else:
                with self._cut_at(self._watchdog.arm(deadline + wait, wrapper)):
                    yield

    @contextlib.contextmanager
    def _cut_at(self, key: int) -> Iterator[None]:
        """Stop watching (:class:`_Watchdog`) at the block's end; a block that failed after
        its connection was cut at the deadline raises Django's ``OperationalError`` naming
        the database and ``request_timeout``. (A block that ended well before its cut keeps
        its result: the next statement finds the connection dropped and replaces it.)"""
        try:
            yield
        except Exception as exc:
            if not self._watchdog.disarm(key):
                raise
            raise self._timed_out() from exc
        finally:
            self._watchdog.disarm(key)  # a second disarm is a no-op

    def _left(self, deadline: float) -> float:
        """Seconds left before ``deadline``; an OperationalError when none are."""

        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out()
        return left

    def _timed_out(self) -> Exception:
        """The operation ran out of ``request_timeout`` (noted for the caller's bookkeeping):
        Django's ``OperationalError`` naming the database and the timeout."""
        self._local.timed_out = True
        return OperationalError(
            f"database {self.using!r} did not answer within {self.request_timeout:g} s "
            "(request_timeout)"
        )

    def _sql(
        self,
        sql: str,
        params: Iterable[Any] = (),
        *,
        fetch: bool = False,
        repeat: bool = True,
        took: str | None = None,
    ) -> Any:
        """Run one statement on this thread's connection: rows (fetch) or the row count.

        A connection the server or the network dropped is replaced, and the statement goes
        through on the new one:

        * when the drop shows before the statement is sent (the idle connection's socket was
          closed by the server, :func:`dropped_while_idle`): nothing reached the server, so
          any statement is safe to send on the new connection;
        * when the statement failed because the connection dropped (it may have run, its
          reply lost): once more, if ``repeat`` says that running it twice does no harm.
          Every statement here is such, but for ``force_release`` without a token (a second
          ``DELETE WHERE name`` could delete the lock of a holder that took the name in
          between): see the callers for why a repeat is harmless.

        Inside a transaction (``self._local.in_transaction``) nothing is replaced or repeated
        alone (the transaction died with its connection): :meth:`_retrying` runs the whole
        step again.

        ``took``: the token of a take, noted in ``self._local.took`` once the statement is
        sent (if its outcome is never known, :meth:`_take` deletes it); a statement given up
        before it was sent (no time left, no connection) granted nothing.
        """
        in_transaction = getattr(self._local, "in_transaction", False)
        with self._budget():
            for attempt in (1, 2):
                wrapper = self._connection(idle=not in_transaction)
                try:
                    with self._bounded(wrapper), wrapper.cursor() as cursor:
                        if took is not None:
                            self._local.took = took
                        cursor.execute(sql.replace("NOW_US", self._now), list(params))
                        return cursor.fetchall() if fetch else cursor.rowcount
                except Error as exc:
                    # A statement cut at its deadline: the connection is gone, and the repeat
                    # finds the deadline passed.
                    timed_out = getattr(self._local, "timed_out", False)
                    dropped = timed_out or connection_dropped(wrapper, exc)
                    discard(wrapper)  # a broken connection is reopened by the next statement
                    if dropped and in_transaction:
                        self._local.dropped_in_transaction = exc
                    if not dropped or in_transaction or not repeat or attempt == 2:
                        raise
                    self._local.repeated = True
        raise AssertionError("unreachable")

    # -- acquiring ------------------------------------------------------------------------------

    _DELETE_TAKE = f"DELETE FROM {LOCKS} WHERE name = %s AND token = %s"

    def _take(
        self, handle: BackendLock, token: str, blocking: bool, deadline: float | None
    ) -> Grant | None:
        meta = holder_meta(handle.meta)
        mutex = None
        if self.pessimistic:
            mutex = self._hold_mutex(handle.name, blocking, deadline)
            if mutex is None:
                return None
        try:
            grant = self._contend(
                handle, token, meta, blocking and mutex is None, deadline, force=mutex is not None
            )
        except BaseException as exc:
            timed_out = getattr(self._local, "timed_out", False)
            if mutex is not None and timed_out:
                # No ROLLBACK to wait for: the server ends the transaction, and frees the
                # row lock, when it sees the connection closed.
                self._forget(mutex.wrapper)
            elif mutex is not None:
                self._end_mutex(mutex)
            if isinstance(exc, self.unavailable()) and getattr(self._local, "took", None) == token:
                # A take whose reply was lost may have granted the row to this token, which
                # nobody will hold: deleted by token (nobody else's). At once when the
                # database answers (not when the take ran out of time: the delete would
                # wait as long again), and by the sweep thread until it is sure.
                deleted = False
                if not timed_out:
                    with contextlib.suppress(*self.unavailable()):
                        deleted = bool(self._sql(self._DELETE_TAKE, [handle.name, token]))
                if not deleted:
                    self._sweep.add(handle.name, token, handle.ttl)
            raise
        if grant is None and mutex is not None:
            self._end_mutex(mutex)
        elif grant is not None:
            grant.state = mutex
        return grant

    def _purge_expired(self) -> None:
        """Delete the rows whose lease ended, at most every :data:`PURGE_EVERY` seconds, after
        a release (a take that found such a row, deleted before it took it over, tries again:
        :meth:`_contend`). A failure is left to the next purge: the lock was released."""
        now = time.monotonic()
        if now < self._purge_due:
            return
        self._purge_due = now + PURGE_EVERY
        try:
            with self._budget():
                self._sql(f"DELETE FROM {LOCKS} WHERE expires_us <= NOW_US")
        except Exception:
            logger.debug("could not purge the expired lock rows", exc_info=True)

    def _contend(
        self,
        handle: BackendLock,
        token: str,
        meta: dict[str, Any],
        blocking: bool,
        deadline: float | None,
        *,
        force: bool,
    ) -> Grant | None:
        pause, first, vanished = 0.005, True, False
        wake: threading.Event | None = None
        try:
            while True:
                # One request_timeout for each attempt (the first one's LISTEN included).
                with self._budget():
                    if first and blocking and self.vendor == "postgresql":
                        # Not listening, it polls: its attempts tell whether the database
                        # answers.
                        with contextlib.suppress(*self.unavailable()):
                            wake = self._listen(handle.name)
                    first = False
                    started = time.monotonic()
                    fence = self._retrying(self._attempt, handle, token, meta, force=force)
                    if fence is not False:
                        grant = Grant(handle.name, token, handle.ttl, None, started + handle.ttl)
                        grant.meta, grant.fence = meta, fence
                        return grant
                    handle.retry_after = self._time_left(handle.name)
                if handle.retry_after is None and not vanished:
                    # The row went between the take's two statements (released, or purged
                    # after its lease ended): the name is free, so once more, at once.
                    vanished = True
                    continue
                now = time.monotonic()
                if not blocking or (deadline is not None and now >= deadline):
                    return None
                limit = self.max_poll if wake is None else 1.0
                if handle.retry_after is not None:
                    limit = min(limit, handle.retry_after + 0.001)
                wait = min(pause if wake is None else limit, limit)
                if deadline is not None:
                    wait = min(wait, deadline - now)
                if wake is not None:
                    wake.wait(wait)
                    wake.clear()
                else:
                    time.sleep(wait)
                    pause = min(pause * 2, self.max_poll)
        finally:
            if wake is not None and self._listener is not None:
                self._listener.forget(handle.name, wake)

    def _retrying(self, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``step`` again when the database chose it as a deadlock victim (its
        transaction was rolled back, so running it again is safe), and once on a new
        connection when its connection dropped inside its transaction (the transaction died
        with it unless its COMMIT ran: every step run here is safe to run again then, see
        :meth:`_insert_or_take`)."""
        deadlocks = 0
        replayed = False
        while True:
            self._local.dropped_in_transaction = None
            try:
                return step(*args, **kwargs)
            except Error as exc:
                if self._local.dropped_in_transaction is exc and not replayed:
                    replayed = self._local.repeated = True
                    continue
                cause = exc.__cause__
                code = getattr(cause, "sqlstate", None) or (cause.args[:1] if cause else None)
                deadlocks += 1
                if (
                    not isinstance(exc, OperationalError)
                    or code not in ("40P01", "40001", (1213,))
                    or deadlocks == DEADLOCK_RETRIES
                ):
                    raise
                time.sleep(0.001 * 2 ** (deadlocks - 1))

    def _attempt(
        self, handle: BackendLock, token: str, meta: dict[str, Any], *, force: bool
    ) -> int | bool | None:
        """One try: the fence (None without fencing) when granted, False when held."""
        row = [handle.name, token, json.dumps(meta, default=str)]
        lease_us = int(handle.ttl * 1_000_000)
        if not handle.fencing:
            return None if self._insert_or_take(row, None, lease_us, force) else False
        self._sql(BEGIN[self.vendor])  # on a connection checked for a drop while idle
        self._local.in_transaction = True
        try:
            self._sql(bump_fence(self.vendor), [handle.name])
            fence = self._sql(
                f"SELECT value FROM {FENCES} WHERE name = %s", [handle.name], fetch=True
            )[0][0]
            granted = self._insert_or_take(row, fence, lease_us, force)
            # A COMMIT whose connection dropped may have run: _retrying runs this attempt
            # again, which bumps the fence once more and takes the row of its own token
            # over (see _insert_or_take). The fence of the lost reply is never handed out;
            # fences still increase in grant order.
            self._sql("COMMIT" if granted else "ROLLBACK")
        except BaseException:
            if self._connection().connection is not None:  # a dropped one rolled back itself
                self._sql("ROLLBACK")
            raise
        finally:
            self._local.in_transaction = False
        return int(fence) if granted else False

    def _insert_or_take(
        self, row: list[Any], fence: int | None, lease_us: int, force: bool
    ) -> bool:
        """Insert the lock row; if one exists, take it over when its lease ended (or when
        ``force``: the pessimistic mutex proves its holder is gone). One statement each.

        Either statement may have run when its connection dropped before the reply came
        back: the row is then ours, under this attempt's token, and the repeat (on a new
        connection, see :meth:`_sql`) finds the INSERT's key taken. So the take-over also
        matches a row of our own token: the token is fresh for this acquire (128 random
        bits), so only our own lost reply can have written it, and taking it over again
        grants it once, to us, with a fresh lease. Without it the repeat would refuse, and
        the row granted by the lost reply would block everyone, an orphan, until its lease
        ended. No double grant either: the row has one token, and a holder whose lease still
        runs is never taken over.
        """
        values = "%s, %s, %s, %s, NOW_US, NOW_US + %s, %s, 0"
        params = [*row, fence, lease_us, lease_us]
        insert = insert_absent(self.vendor, LOCKS, LOCK_COLUMNS, values)
        if self._sql(insert, params, took=row[1]):
            return True
        free = ("", []) if force else (" AND (expires_us <= NOW_US OR token = %s)", [row[1]])
        update = (
            f"UPDATE {LOCKS} SET token = %s, meta = %s, fence = %s, acquired_us = NOW_US, "
            f"expires_us = NOW_US + %s, lease_us = %s, renewals = 0 WHERE name = %s{free[0]}"
        )
        params = [row[1], row[2], fence, lease_us, lease_us, row[0], *free[1]]
        if self.vendor == "postgresql":
            # A take-over ends the previous holder's lock as a release does: its NOTIFY tells
            # that holder's row watch at once, which otherwise looks only every few seconds
            # while it listens. Inside the fencing transaction it is sent at COMMIT.
            update = f"WITH taken AS ({update} RETURNING name) "
            update += "SELECT pg_notify(%s, name) FROM taken"
            return bool(self._sql(update, [*params, CHANNEL], fetch=True, took=row[1]))
        return bool(self._sql(update, params, took=row[1]))

    def _time_left(self, name: str) -> float | None:
        rows = self._sql(
            f"SELECT expires_us - NOW_US FROM {LOCKS} WHERE name = %s", [name], fetch=True
        )
        return max(rows[0][0] / 1e6, 0.0) if rows else None

    def _hold_mutex(self, name: str, blocking: bool, deadline: float | None) -> _Mutex | None:
        """A connection in a transaction holding FOR UPDATE on ``name``'s mutex row, or None
        when another holder has it (NOWAIT, or the lock wait ran out)."""
        # Read first: inserting a duplicate would wait for the holder's row lock on MySQL.
        if not self._sql(f"SELECT 1 FROM {MUTEXES} WHERE name = %s", [name], fetch=True):
            insert = insert_absent(self.vendor, MUTEXES, "name", "%s")
            self._sql(insert, [name])
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        if self.vendor == "postgresql":  # lock_timeout 0 = wait for ever
            wait = f"SET LOCAL lock_timeout = {0 if left is None else math.ceil(left * 1000)}"
        else:  # whole seconds only; a year stands for ever
            seconds = 31536000 if left is None else math.ceil(left)
            wait = f"SET SESSION innodb_lock_wait_timeout = {seconds}"
        nowait = "" if blocking else " NOWAIT"
        # The row lock's wait is the server's to end (above); request_timeout bounds the rest.
        queue = None if blocking and left is None else (left or 0.0)
        if queue and self.vendor == "mysql":
            queue = float(math.ceil(queue))  # innodb_lock_wait_timeout, above
        wrapper = self._open(wait=queue)
        try:
            with self._budget():
                # Connected first: reading the server's kind must not open and close it.
                with self._bounded(wrapper):
                    wrapper.ensure_connection()
                if left is not None and self.vendor == "mysql" and wrapper.mysql_is_mariadb:
                    # MariaDB can stop the statement itself at the fraction of a second.
                    wait += f", SESSION max_statement_time = {left:.3f}"
                with self._bounded(wrapper, queue), wrapper.cursor() as cursor:
                    cursor.execute(BEGIN[self.vendor])
                    cursor.execute(wait)
                    cursor.execute(
                        f"SELECT name FROM {MUTEXES} WHERE name = %s FOR UPDATE{nowait}", [name]
                    )
        except OperationalError:
            self._forget(wrapper)
            if getattr(self._local, "timed_out", False):
                raise  # the database did not answer: not a lock held by another
            return None
        except BaseException:
            self._forget(wrapper)
            raise
        return _Mutex(wrapper)

    # -- holding --------------------------------------------------------------------------------

    def _watch(self, grant: Grant) -> None:
        self._row_watch.add(grant)

    def _unwatch(self, grant: Grant) -> None:
        self._row_watch.remove(grant)
        mutex = grant.state
        if grant.lost is not None and mutex is not None:
            # Lost while its pessimistic transaction runs: end it, or it would hold the
            # mutex row (and a connection) until the handle is garbage.
            grant.state = None
            self._end_mutex(mutex)

    def _rows_held(self, grants: list[Grant]) -> set[tuple[str, str]]:
        """(name, token) of each of ``grants`` whose row is still there, by primary key."""
        found: set[tuple[str, str]] = set()
        for start in range(0, len(grants), 500):
            names = [grant.name for grant in grants[start : start + 500]]
            marks = ", ".join(["%s"] * len(names))
            rows = self._sql(
                f"SELECT name, token FROM {LOCKS} WHERE name IN ({marks})", names, fetch=True
            )
            found.update((str(name), str(token)) for name, token in rows)
        return found

    def _reaching(self, grant: Grant, verb: str) -> Any:
        """A database that could not be reached to ``verb`` a held lock: QuorumError."""
        after = "; the lock stays as it was there (held by its token until its lease ends)"
        return self._verdict(grant.name, verb, self.unavailable(), after)

    def _give_back(self, grant: Grant) -> bool:
        # One request_timeout for the whole release, a pessimistic one's ROLLBACK included.
        with self._reaching(grant, "release"), self._budget():
            if self._mutex_lost(grant):
                return False
            mutex = grant.state
            try:
                self._local.repeated = False
                gone = self._retrying(self._delete, grant)
                # The DELETE may have run before its connection dropped, and its repeat found
                # no row of our token: that is our own DELETE while our lease lasts
                # (valid_until is counted from before the take, so it ends before the
                # database's lease; a pessimistic holder's transaction was alive above, so no
                # waiter took it over). Only a force_release in the same instant would be
                # reported as our release.
                released = gone or (self._local.repeated and grant.validity > 0)
            finally:
                if mutex is not None:
                    grant.state = None
                    self._end_mutex(mutex)
        self._purge_expired()  # after the release: its waiters are told first
        return released

    def _delete(self, grant: Grant) -> bool:
        if self.vendor == "postgresql":
            # The DELETE and the wake-up of the waiters in one statement.
            gone = f"WITH gone AS ({self._DELETE_TAKE} RETURNING name) "
            notify = gone + "SELECT pg_notify(%s, name) FROM gone"
            return bool(self._sql(notify, [grant.name, grant.token, CHANNEL], fetch=True))
        return bool(self._sql(self._DELETE_TAKE, [grant.name, grant.token]))

    def _renew(self, grant: Grant, ttl: float) -> bool:
        with self._reaching(grant, "extend"), self._budget():
            if self._mutex_lost(grant):
                return False
            lease_us = int(ttl * 1_000_000)  # a repeat after a lost reply renews again: harmless
            return bool(
                self._sql(
                    f"UPDATE {LOCKS} SET expires_us = NOW_US + %s, lease_us = %s, renewals = "
                    "renewals + 1 WHERE name = %s AND token = %s AND expires_us > NOW_US",
                    [lease_us, lease_us, grant.name, grant.token],
                )
            )

    def _still_held(self, grant: Grant) -> bool:
        with self._budget():
            return not self._mutex_lost(grant) and self._live(grant.name, grant.token)

    def _live(self, name: str, *token: str) -> bool:
        """Whether ``name`` is held (by ``token``, when given) with lease left."""
        mine = " AND token = %s" if token else ""
        sql = f"SELECT 1 FROM {LOCKS} WHERE name = %s{mine} AND expires_us > NOW_US"
        return bool(self._sql(sql, [name, *token], fetch=True))

    def _adopt(self, name: str, token: str) -> Grant | None:
        return Grant(name, token, self.ttl, None, time.monotonic() + self.ttl)

    def _remove(self, name: str, token: str | None) -> int:
        mine, params = ("", [name]) if token is None else (" AND token = %s", [name, token])
        # By token, a repeat after a lost reply deletes nothing more; by name alone, it could
        # delete the lock of a holder that took the name in between: not repeated then.
        delete = f"DELETE FROM {LOCKS} WHERE name = %s{mine}"
        removed = self._sql(delete, params, repeat=token is not None)
        if removed and self.vendor == "postgresql":
            self._sql("SELECT pg_notify(%s, %s)", [CHANNEL, name], fetch=True)
        return int(bool(removed))

    def locked(self, name: str) -> bool:
        self._this_process()
        return self._live(check_name(name, listed=True))

    def _infos(self, wanted: Callable[[str], bool]) -> Iterable[LockInfo]:
        rows = self._sql(
            "SELECT name, token, meta, fence, acquired_us, expires_us - NOW_US, lease_us, "
            f"renewals FROM {LOCKS} WHERE expires_us > NOW_US",
            fetch=True,
        )
        for name, token, meta, fence, acquired_us, left_us, lease_us, renewals in rows:
            if wanted(name):
                held = {"token": token, "meta": json.loads(meta), "acquired_us": acquired_us}
                held["renewals"] = renewals
                yield self._info(name, held, left_us / 1e6, lease_us / 1e6, fence)

    def health(self) -> list[NodeHealth]:
        node = self.node_name
        try:
            with self._budget():
                started = time.perf_counter()
                # Only live rows: an expired one stays until its name is taken again or
                # released, and the list never shows it.
                rows = self._sql(
                    f"SELECT NOW_US, (SELECT COUNT(*) FROM {LOCKS} WHERE expires_us > NOW_US)",
                    fetch=True,
                )
                latency = time.perf_counter() - started
                version = str(self._sql(VERSION[self.vendor], fetch=True, repeat=False)[0][0])
        except Exception as exc:
            return [unreachable(node, exc)]
        db_now, count = rows[0]
        mariadb = self.vendor == "mysql" and "mariadb" in version.lower()
        offset = db_now / 1e6 - time.time()
        found = {"version": version, "lock_keys": int(count), "clock_offset": offset}
        return [
            NodeHealth(node, True, latency, server="mariadb" if mariadb else self.vendor, **found)
        ]

    def close(self) -> None:
        self._this_process()  # in a forked child: close the child's own, never the parent's
        self._row_watch.close()
        self._sweep.close()
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for wrapper in opened:
            wrapper.close()
        self._local = threading.local()

    # -- LISTEN / NOTIFY ------------------------------------------------------------------------

    def _listen(self, name: str) -> threading.Event | None:
        """An event set when ``name`` may have been released, or None when the listener is
        not ready within the operation's deadline (another thread is setting it up, on a
        database that may not answer): the waiter polls then."""
        self._this_process()
        deadline = getattr(self._local, "deadline", None)
        wait = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._listener_lock.acquire(timeout=wait):
            return None
        try:
            listener, _ = self._live_listener()
        finally:
            self._listener_lock.release()
        return listener.subscribe(name)

    def _listening(self) -> tuple[bool, bool]:
        """Make sure removals are heard (PostgreSQL's LISTEN, for the row watch): whether
        they are, and whether listening began just now (a removal before it was not heard)."""
        self._this_process()
        with self._listener_lock:
            try:
                return True, self._live_listener()[1]
            except Exception:  # unreachable now: the row watch polls meanwhile
                return False, False

    def _live_listener(self) -> tuple[_Listener, bool]:
        """The listener, on a new connection when its own dropped, and whether it is new.
        Under ``_listener_lock``."""
        if self._listener is not None and not self._listener.alive:
            self._listener.stop()
            self._listener = None
        if self._listener is not None:
            return self._listener, False
        wrapper = self._open()
        try:
            with self._bounded(wrapper):
                self._listener = _Listener(wrapper, self._row_watch.notice)
        except BaseException:
            self._forget(wrapper)
            raise
        return self._listener, True


class _Listener:
    """One PostgreSQL connection per DatabaseLocks that LISTENs and wakes the waiters of a
    released name (a waiter registers before its attempt, so no release is missed)."""

    def __init__(self, wrapper: Any, notice: Callable[[str | None], None]) -> None:
        self._wrapper = wrapper
        self._notice = notice  #: told every name removed (the row watch)
        self._waiters: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._broken = False
        with wrapper.cursor() as cursor:  # a failure is Django's OperationalError, as elsewhere
            cursor.execute(f"LISTEN {CHANNEL}")
        self._thread = spawn("lock-listen", self._run)

    def subscribe(self, name: str) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(name, set()).add(event)
        return event

    def forget(self, name: str, event: threading.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(name)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[name]

    def _run(self) -> None:
        connection = self._wrapper.connection
        while not self._stopped:
            try:
                for notice in connection.notifies(timeout=0.5):
                    with self._lock:
                        waiters = list(self._waiters.get(notice.payload, ()))
                    for event in waiters:
                        event.set()
                    self._notice(notice.payload)
            except Exception:
                if self._stopped:
                    return
                # The connection broke: wake everyone (they re-try and fall back to timeouts),
                # and the row watch (it looks its rows up, and listens anew: dead already,
                # this listener is replaced rather than waited on).
                self._broken = True
                with self._lock:
                    everyone = [e for group in self._waiters.values() for e in group]
                for event in everyone:
                    event.set()
                self._notice(None)
                return

    @property
    def alive(self) -> bool:
        return not self._broken and self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._thread.join(2)
        discard(self._wrapper)


class _RowWatch:
    """Tells holders that their row was removed by anyone else (a force release, a take-over
    after a pause): one thread per DatabaseLocks while it holds locks, which looks their rows
    up every ``loss_check`` seconds, and at once when PostgreSQL's NOTIFY of a removal or a
    take-over names one of them (the lookup then tells a stale notice, of the previous
    holder's release, from a removal of ours). A row gone, or holding another token, marks
    the lock lost. Our own release stops watching before it deletes the row. A lookup that
    fails (the database is down) tells nothing: the holder's lease runs on as usual.
    """

    #: Longest wait between two lookups while NOTIFY tells of removals (a safety net).
    NOTIFIED = 5.0
    #: How long the thread waits for new locks, once it holds none, before it ends.
    LINGER = 1.0

    def __init__(self, locks: DatabaseLocks) -> None:
        self._locks = locks
        self._held: dict[str, Grant] = {}  #: token -> grant
        self._mutex = threading.Lock()
        self._due = threading.Event()  #: set to look up at once
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, grant: Grant) -> None:
        with self._mutex:
            self._held[grant.token] = grant
            self._closed = False
            self._thread = self._thread or spawn("lock-row-watch", self._run)

    def remove(self, grant: Grant) -> None:
        with self._mutex:
            if self._held.get(grant.token) is grant:
                del self._held[grant.token]

    def notice(self, name: str | None) -> None:
        """A row named ``name`` was removed or taken over (PostgreSQL's NOTIFY), or
        (None) notices may have been missed: the listening connection broke."""
        with self._mutex:
            mine = name is None or any(grant.name == name for grant in self._held.values())
        if mine:
            self._due.set()

    def close(self) -> None:
        """Stop watching, and wait (a few seconds at most) until the thread has stopped, so
        it opens no connection after the manager closed its own."""
        with self._mutex:
            self._closed = True
            self._held.clear()
            thread = self._thread
        self._due.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._watch()
                    return
                except Exception:
                    # A dead watch would leave every holder of this manager deaf to force
                    # releases for good: it looks again after loss_check.
                    logger.exception("lock row watch failed; looking again")
                    self._due.wait(self._locks.loss_check)
        finally:
            with self._mutex:
                if self._thread is threading.current_thread():
                    self._thread = None  # ended by an error beyond Exception: add() restarts
            self._locks._drop_thread_connection()

    def _watch(self) -> None:
        if self._locks.vendor == "sqlite":
            # In a shared-cache database (Django's in-memory test database) a reader's
            # table lock makes a concurrent writer fail at once, busy timeout or not: the
            # lookups take none. They read single autocommitted rows, so nothing is lost.
            with contextlib.suppress(Exception):
                self._locks._sql("PRAGMA read_uncommitted = 1")
        idle_since: float | None = None
        while True:
            with self._mutex:
                grants = list(self._held.values())
                idle = idle_since is not None and time.monotonic() - idle_since >= self.LINGER
                if self._closed or (not grants and idle):
                    self._thread = None
                    return
            listening, began = False, False
            if grants and self._locks.vendor == "postgresql":
                listening, began = self._locks._listening()
            if not began:  # else look up at once: a removal before LISTEN went unheard
                self._due.wait(self.NOTIFIED if listening else self._locks.loss_check)
            self._due.clear()
            with self._mutex:
                grants = list(self._held.values())
            if not grants:
                idle_since = idle_since or time.monotonic()
                continue
            idle_since = None
            try:
                present = self._locks._rows_held(grants)
            except Exception:  # the database cannot answer now: nothing learnt
                continue
            for grant in grants:
                if (grant.name, grant.token) not in present:
                    self._lost(grant)

    def _lost(self, grant: Grant) -> None:
        with self._mutex:
            if self._held.get(grant.token) is not grant:
                return  # released meanwhile: our own delete, not a loss
            del self._held[grant.token]
        self._locks._mark_lost(grant, "its row was removed (a force release, or taken over)")


class _Sweep:
    """Deletes, by token, the rows of takes whose outcome was never learnt (the database
    stopped answering in the middle): one thread per manager while there are any.

    A take's statement may reach the database after its client gave up on it (a partition
    that heals delivers what was sent; the proxy of the tests forwards it when it is resumed)
    and grant a whole lease from then to a token nobody holds. So a delete that finds no row
    proves nothing yet: the sweep deletes again every ``PAUSE`` seconds until one removes the
    row, or for one lease after the database first answered. While it does not answer, the
    sweep keeps trying. ``close()`` gives it up (such rows then end with their leases).
    """

    PAUSE = 0.5

    def __init__(self, locks: DatabaseLocks) -> None:
        self._locks = locks
        #: (name, token) -> [lease seconds, monotonic end of the sweep or None before the
        #: database first answered]
        self._pending: dict[tuple[str, str], list[float | None]] = {}
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, token: str, ttl: float) -> None:
        with self._mutex:
            self._pending[(name, token)] = [ttl, None]
            self._stop.clear()
            self._thread = self._thread or spawn("lock-sweep", self._run)

    def pending(self) -> list[tuple[str, str]]:
        """The (name, token) of the takes still swept."""
        with self._mutex:
            return list(self._pending)

    def close(self) -> None:
        with self._mutex:
            self._pending.clear()
            thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * self._locks.request_timeout + 5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._mutex:
                    entries = list(self._pending.items())
                    if not entries:
                        self._thread = None
                        return
                for (name, token), entry in entries:
                    try:
                        removed = self._locks._delete(Grant(name, token, 0.0, None, 0.0))
                    except Exception:  # not answering yet: tried again after the pause
                        continue
                    now = time.monotonic()
                    with self._mutex:
                        lease, until = entry
                        if until is None:
                            entry[1] = until = now + float(lease or 0.0)
                        if removed or now >= until:
                            self._pending.pop((name, token), None)
                self._stop.wait(self.PAUSE)
        finally:
            with self._mutex:
                if self._thread is threading.current_thread():
                    self._thread = None
            self._locks._drop_thread_connection()
