"""Adapters that give every lock library the same three calls, so the bench treats them alike.

Each adapter is built from a list of node URLs and offers:

* ``handle(key)``            - a reusable lock object for ``key`` (what a caller keeps around)
* ``acquire(h, timeout)``    - the library's own *blocking* acquire, bounded by ``timeout`` s
* ``release(h)``             - the library's release
* ``close()``

The adapters call the libraries exactly as their docs show; nothing is patched. Two peers,
redlock-py and redlock-ng, both install a top-level module called ``redlock`` (they overwrite
each other) and redlock-ng pins redis<6 and urllib3<2. So they are never installed into the
environment: :func:`load_isolated` puts each into its own ``pip --target`` directory with
``--no-deps`` and imports it under a private name, next to the redis-py the rest of the bench
uses.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import redis

#: Where isolated peers are installed (``pip install --no-deps --target``).
PEERS_DIR = os.environ.get(
    "REDLOCK_BENCH_PEERS",
    os.path.join(os.path.expanduser("~"), ".cache", "django-redlock-bench", "peers"),
)

TTL = 10.0  #: seconds; every library gets the same lease
#: Whether :func:`load_isolated` may pip-install a missing optional peer (``--no-install``).
ALLOW_INSTALL = True


def _client(url: str) -> redis.Redis:
    parts = urlsplit(url)
    return redis.Redis(host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=0)


def load_isolated(dist: str, module: str, alias: str) -> ModuleType:
    """Import ``module`` of the PyPI distribution ``dist`` from its own target dir as ``alias``."""
    if alias in sys.modules:
        return sys.modules[alias]
    target = os.path.join(PEERS_DIR, dist)
    init = os.path.join(target, module, "__init__.py")
    if not os.path.exists(init):
        if not ALLOW_INSTALL:
            raise ImportError(f"{dist} is not installed in {target} (run without --no-install)")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--target",
                target,
                dist,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not os.path.exists(init):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            raise ImportError(f"pip install {dist} failed: {tail[0]}")
    spec = importlib.util.spec_from_file_location(
        alias, init, submodule_search_locations=[os.path.dirname(init)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules[alias]
        raise
    return mod


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        target = os.path.join(PEERS_DIR, dist)
        if os.path.isdir(target):
            for name in os.listdir(target):
                if name.endswith(".dist-info"):
                    return name.removesuffix(".dist-info").split("-", 1)[-1]
        return "?"


class Adapter:
    label = "?"
    dist = "?"
    #: True when a blocked acquire is woken by the release (no polling); shown in the tables.
    wakes = False

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        self.urls = list(urls)
        self.prefix = prefix

    @property
    def nodes(self) -> int:
        return len(self.urls)

    @property
    def name(self) -> str:
        return f"{self.label} ({self.nodes})"

    def handle(self, key: str) -> Any:
        raise NotImplementedError

    def acquire(self, h: Any, timeout: float) -> bool:
        raise NotImplementedError

    def release(self, h: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @classmethod
    def version(cls) -> str:
        return _version(cls.dist)


class Ours(Adapter):
    label = "django-redlock"
    dist = "django-redlock"
    wakes = True

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        from django_redlock import Redlock

        # Each configuration gets its own key prefix: the restart guard's node marker lives
        # under the prefix, so a 3-node subset of nodes a 1-node config already marked would
        # (rightly) not count as a brand-new cluster.
        self.rl = Redlock(self.urls, key_prefix=prefix, ttl=TTL)

    def handle(self, key: str) -> Any:
        return self.rl.lock(key, ttl=TTL)

    def acquire(self, h: Any, timeout: float) -> bool:
        return bool(h.acquire(blocking=True, timeout=timeout))

    def release(self, h: Any) -> None:
        h.release()

    def close(self) -> None:
        self.rl.close()

    @classmethod
    def version(cls) -> str:
        import django_redlock

        return getattr(django_redlock, "__version__", "?")


class RedisPyLock(Adapter):
    """redis-py's ``Redis.lock`` (single node; a blocked acquire polls every ``sleep``=0.1 s)."""

    label = "redis-py Lock"
    dist = "redis"

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        assert len(self.urls) == 1
        self.client = _client(self.urls[0])

    def handle(self, key: str) -> Any:
        return self.client.lock(f"{self.prefix}:{key}", timeout=TTL)

    def acquire(self, h: Any, timeout: float) -> bool:
        return bool(h.acquire(blocking=True, blocking_timeout=timeout))

    def release(self, h: Any) -> None:
        h.release()

    def close(self) -> None:
        self.client.close()


class PythonRedisLock(Adapter):
    """python-redis-lock (single node; a blocked acquire waits on BLPOP of a signal list)."""

    label = "python-redis-lock"
    dist = "python-redis-lock"
    wakes = True

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        assert len(self.urls) == 1
        import redis_lock

        self.mod = redis_lock
        self.client = _client(self.urls[0])

    def handle(self, key: str) -> Any:
        return self.mod.Lock(self.client, f"{self.prefix}:{key}", expire=int(TTL))

    def acquire(self, h: Any, timeout: float) -> bool:
        # Its timeout is an int of seconds and may not exceed expire.
        return bool(h.acquire(blocking=True, timeout=max(1, min(int(timeout), int(TTL)))))

    def release(self, h: Any) -> None:
        h.release()

    def close(self) -> None:
        self.client.close()


class Pottery(Adapter):
    """pottery's Redlock (a thread pool per call; a blocked acquire sleeps uniform(0, 0.2) s)."""

    label = "pottery Redlock"
    dist = "pottery"

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        import logging

        from pottery import Redlock

        # pottery logs every contended wait at WARNING; the handoff run would flood the table.
        logging.getLogger("pottery").setLevel(logging.ERROR)
        self.cls = Redlock
        self.masters = {_client(u) for u in self.urls}

    def handle(self, key: str) -> Any:
        return self.cls(key=f"{self.prefix}:{key}", masters=self.masters, auto_release_time=TTL)

    def acquire(self, h: Any, timeout: float) -> bool:
        return bool(h.acquire(blocking=True, timeout=timeout))

    def release(self, h: Any) -> None:
        h.release()

    def close(self) -> None:
        for m in self.masters:
            m.close()


class RedlockNg(Adapter):
    """redlock-ng (nodes one after another; a blocked acquire sleeps uniform(0.1, 0.3) s)."""

    label = "redlock-ng"
    dist = "redlock-ng"

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        self.mod = load_isolated("redlock-ng", "redlock", "_bench_redlock_ng")
        self.rl = self.mod.Redlock(list(self.urls))

    def handle(self, key: str) -> Any:
        return [f"{self.prefix}:{key}", None]

    def acquire(self, h: Any, timeout: float) -> bool:
        # Its blocking mode has no timeout: it loops until it gets the lock.
        h[1] = self.rl.acquire(h[0], int(TTL * 1000), blocking=True)
        return h[1] is not None

    def release(self, h: Any) -> None:
        self.rl.release(h[1])
        h[1] = None

    def close(self) -> None:
        for c in self.rl.client.instances:
            c.close()


class RedlockPy(Adapter):
    """redlock-py (nodes one after another; retries retry_count times, sleeping 0.2 s)."""

    label = "redlock-py"
    dist = "redlock-py"
    RETRY_DELAY = 0.2

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        super().__init__(urls, prefix)
        self.mod = load_isolated("redlock-py", "redlock", "_bench_redlock_py")
        self.rl = self.mod.Redlock(list(self.urls), retry_delay=self.RETRY_DELAY)

    def handle(self, key: str) -> Any:
        return [f"{self.prefix}:{key}", None]

    def acquire(self, h: Any, timeout: float) -> bool:
        # Its only bound on waiting is the retry count.
        self.rl.retry_count = max(1, math.ceil(timeout / self.RETRY_DELAY))
        h[1] = self.rl.lock(h[0], int(TTL * 1000))
        return bool(h[1])

    def release(self, h: Any) -> None:
        self.rl.unlock(h[1])
        h[1] = None

    def close(self) -> None:
        for c in self.rl.servers:
            c.close()


class RawFloor(Adapter):
    """Not a lock library: the least a Python client can do for one acquire+release fan-out.

    Non-blocking sockets opened once, ``SET key token NX PX`` then ``DEL key`` written to every
    node, one ``poll`` for the replies, no Lua, no validity maths, no metadata, no error
    handling. It shows what the machine charges per node (syscalls, wake-ups of the
    redis-server processes) before any lock logic; single-threaded only.
    """

    label = "floor: raw sockets"
    dist = "-"

    def __init__(self, urls: Sequence[str], prefix: str) -> None:
        import select
        import socket

        super().__init__(urls, prefix)
        self.socks = []
        self.poller = select.poll()
        self.by_fd = {}
        for url in self.urls:
            parts = urlsplit(url)
            s = socket.create_connection((parts.hostname, parts.port), 2.0)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            self.socks.append(s)
            self.poller.register(s.fileno(), select.POLLIN)
            self.by_fd[s.fileno()] = s

    def _fan_out(self, command: bytes) -> int:
        for s in self.socks:
            s.send(command)
        left, ok = len(self.socks), 0
        while left:
            for fd, _ in self.poller.poll(1000):
                ok += self.by_fd[fd].recv(4096)[:1] in (b"+", b":")
                left -= 1
        return ok

    def handle(self, key: str) -> Any:
        k = f"{self.prefix}:{key}".encode()
        return (
            b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$32\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n"
            b"$5\r\n10000\r\n" % (len(k), k, os.urandom(16).hex().encode()),
            b"*2\r\n$3\r\nDEL\r\n$%d\r\n%s\r\n" % (len(k), k),
        )

    def acquire(self, h: Any, timeout: float) -> bool:
        return self._fan_out(h[0]) > len(self.socks) // 2

    def release(self, h: Any) -> None:
        self._fan_out(h[1])

    def close(self) -> None:
        for s in self.socks:
            s.close()

    @classmethod
    def version(cls) -> str:
        return "-"


#: Every adapter, by short id (used in the command line and the result files).
ADAPTERS: dict[str, type[Adapter]] = {
    "ours": Ours,
    "redis-py": RedisPyLock,
    "python-redis-lock": PythonRedisLock,
    "pottery": Pottery,
    "redlock-ng": RedlockNg,
    "redlock-py": RedlockPy,
    "floor": RawFloor,
}


def probe(kind: str, urls: Sequence[str]) -> str | None:
    """None when the library can be used here, else why not (printed, and the peer skipped)."""
    try:
        a = ADAPTERS[kind](
            urls[:1] if kind in ("redis-py", "python-redis-lock") else urls, "bench-probe"
        )
        h = a.handle("probe")
        if not a.acquire(h, 1.0):
            return "could not take a free lock"
        a.release(h)
        a.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


Factory = Callable[[], Adapter]
