"""Everything the demo starts, and its teardown on any way out.

The demo freezes processes with SIGSTOP, runs a Celery worker in a session of its own and
redis-server processes in theirs, so neither a terminal's Ctrl-C nor the interpreter's exit
hooks reach all of them (multiprocessing's exit hook even waits forever for a frozen child).
Every process and temp folder is therefore recorded here as it is started, and
:meth:`Resources.close` removes them with SIGKILL, which also ends a frozen process, without
waiting for anything to shut down gracefully: nothing the demo started holds data worth
keeping, and SIGINT, SIGTERM or SIGHUP must leave nothing behind within two seconds. A SIGKILLed
demo runs none of this: each process and folder is also handed to the reaper of
:mod:`django_redlock.testing` (which outlives the demo and acts when it is gone).

Why the demo runs in a thread (:func:`run_until_stopped`): an exception raised by a signal
handler lands wherever the main thread happens to be, and is lost when that is a ``__del__``
method or a weakref callback, or leaves a library half-way through. So the main thread only
waits, on a socket that both the end of the demo and every stop signal
(:func:`signal.set_wakeup_fd`) write to, and the teardown never races with the demo: each start
of a process goes through :meth:`Resources.spawning`, which refuses once the teardown began.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..testing import (
    RedisCluster,
    RedisNode,
    _forget_reaping,
    _reap_folder_with_owner,
    _reap_with_owner,
)

__all__ = ["STOP_SIGNALS", "Resources", "Stopped", "run_until_stopped"]

#: The signals that end the demo (SIGHUP: the terminal went away).
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_DONE = b"\0"  # written to the wake-up socket when the demo ends; signal numbers are > 0


class Stopped(BaseException):
    """Raised in the demo's thread when it tries to start something after the teardown began
    (a BaseException, so no ``except Exception`` in a step goes on regardless)."""


class Resources:
    """A registry of what the demo started, torn down by :meth:`close` (idempotent)."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self._nodes: list[RedisNode] = []
        self._children: list[multiprocessing.process.BaseProcess] = []
        self._sessions: list[subprocess.Popen[bytes]] = []
        self._dirs: list[Path] = []
        self._gate = threading.Lock()
        self._closed = False
        #: Set once the demo serves: from then on a stop signal is the normal way out.
        self.serving = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began."""
        return self._closed

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Hold off the teardown while something is started and recorded; :class:`Stopped`
        once it began."""
        with self._gate:
            if self._closed:
                raise Stopped
            yield

    # ---------------------------------------------------------------- registration

    def start_cluster(self, cluster: RedisCluster) -> None:
        """Record a cluster's nodes and start them (in parallel)."""
        with self.spawning():
            self._nodes.extend(cluster.nodes)
            cluster.start()

    def start_node(self, node: RedisNode) -> None:
        """Record a single node and start it."""
        with self.spawning():
            self._nodes.append(node)
            node.start()

    def restart_node(self, node: RedisNode) -> None:
        """Crash a recorded node and start it again, empty."""
        with self.spawning():
            node.restart(empty=True)

    def child(
        self, target: Callable[..., object], *args: Any
    ) -> multiprocessing.process.BaseProcess:
        """Fork a child running ``target(*args)``, recorded."""
        process = multiprocessing.get_context("fork").Process(
            target=_child_main, args=(target, *args)
        )
        with self.spawning():
            self._children.append(process)
            process.start()
            assert process.pid is not None
            _reap_with_owner(process.pid)  # a SIGKILLed demo runs no close()
        return process

    def session(self, args: list[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a command in a session of its own (so its whole process group can be
        killed: a Celery worker and its pool), recorded."""
        with self.spawning():
            proc: subprocess.Popen[bytes] = subprocess.Popen(
                args, start_new_session=True, stdin=subprocess.DEVNULL, **popen_kwargs
            )
            self._sessions.append(proc)
            _reap_with_owner(proc.pid, group=True)
        return proc

    def temp_dir(self, prefix: str) -> Path:
        """A new temp folder, removed by :meth:`close`."""
        with self.spawning():
            path = Path(tempfile.mkdtemp(prefix=prefix))
            self._dirs.append(path)
            _reap_folder_with_owner(path)
        return path

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """SIGKILL every recorded process (frozen ones included), reap them, remove the
        temp folders. Only the process that created the registry does anything."""
        if os.getpid() != self.owner:
            return
        with self._gate:  # waits for a start in progress to be recorded
            if self._closed:
                return
            self._closed = True
        # Kill everything first, then wait: the processes die in parallel.
        for proc in self._sessions:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        for child in self._children:
            if child.pid is not None and child.exitcode is None:
                with contextlib.suppress(OSError):
                    child.kill()
        for node in self._nodes:
            with contextlib.suppress(Exception):
                node.kill()  # SIGKILL and reap; its folder stays until stop()
        for proc in self._sessions:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        for child in self._children:
            if child.pid is not None:
                child.join(timeout=1)
        for node in self._nodes:
            with contextlib.suppress(Exception):
                node.stop()  # nothing left to stop: removes the folder
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)
            _reap_folder_with_owner(path, forget=True)
        for pid in [p.pid for p in self._sessions] + [c.pid for c in self._children if c.pid]:
            _forget_reaping(pid)


def _child_main(target: Callable[..., object], *args: Any) -> None:
    """A forked child: stop signals act as they would on any program (the parent cleans up),
    and they no longer wake the parent's main thread."""
    signal.set_wakeup_fd(-1)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    target(*args)


def run_until_stopped(resources: Resources, demo: Callable[[], int | None]) -> int:
    """Run ``demo()`` in a thread until it returns an exit status, or, when it returns None
    (serving), until a stop signal. On a stop signal everything is torn down and the process
    exits at once (status 0 while serving, else 128 + the signal number)."""
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    status: list[int] = []

    def thread_main() -> None:
        code: int | None = 1
        try:
            code = demo()
        except Stopped:
            return
        except BaseException:
            if not resources.closed:  # after a stop signal, failures are the teardown's
                traceback.print_exc()
        if code is not None:
            status.append(code)
            wake_write.send(_DONE)

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        # The wake-up socket does the work in the demo; a child forked a moment ago that
        # gets the signal before _child_main reset it just ends.
        if os.getpid() != resources.owner:
            os._exit(128 + signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    try:
        threading.Thread(target=thread_main, name="demo", daemon=True).start()
        while True:
            byte = wake_read.recv(1)
            if byte == _DONE:
                resources.close()
                print("Stopped: no node, process or temp folder of the demo is left.")
                return status[0]
            if byte and byte[0] in STOP_SIGNALS:
                break
        signum = signal.Signals(byte[0])
        code = 0 if resources.serving else 128 + signum
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            print(f"\n{signum.name}: stopping everything the demo started ...", flush=True)
        resources.close()
        with contextlib.suppress(OSError):
            print("Stopped: no node, process or temp folder of the demo is left.", flush=True)
            sys.stderr.flush()
        # At once: the demo's thread may still be inside a step whose processes just died.
        os._exit(code)
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, action in previous.items():
            signal.signal(signum, action)
