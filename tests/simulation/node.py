"""A simulated Redis node: a keyspace with per-key expiry on the node's own (drifting,
stepping) clock, the commands the lock scripts and the fast path use, and the package's own
Lua scripts run by Lua 5.1 (``lupa``) with ``redis.call`` served by this keyspace.

One command list of one connection runs at once, in order; a paused node queues what
arrives and runs it when it resumes, connection by connection in an order the run's random
source picks (a frozen server reads its sockets in no particular order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lupa import lua51

from django_redlock.core import scripts
from django_redlock.core.nodes import ReplyError

__all__ = ["LuaError", "SimNode", "lua_runtime"]

_OK = b"OK"


class LuaError(Exception):
    """A script's error (``redis.call`` raised, or the script failed)."""


class _Status(bytes):
    """A status reply (``+OK``): Lua sees it as ``{ok = ...}``."""


_RUNTIME: Any = None
_COMPILED: dict[str, Any] = {}
#: The node whose script is running (one script runs at a time in the whole simulation).
_CURRENT: list[SimNode] = []


def lua_runtime() -> Any:
    global _RUNTIME
    if _RUNTIME is None:
        lua = lua51.LuaRuntime(unpack_returned_tuples=True, encoding=None)
        lua.execute(
            b"redis = {}\n"
            b"function __mkredis(call, pcall_)\n"
            b"  redis.call = function(...) local ok, r = call(...) "
            b"if ok then return r end error(r, 2) end\n"
            b"  redis.pcall = function(...) local ok, r = call(...) "
            b"if ok then return r end return {err = r} end\n"
            b"end\n"
            b"cjson = {encode = function(t) return '[]' end}\n"
        )
        lua.globals().__mkredis(_lua_call, None)
        _RUNTIME = lua
    return _RUNTIME


def _compile(body: str) -> Any:
    fn = _COMPILED.get(body)
    if fn is None:
        lua = lua_runtime()
        fn = lua.execute(b"return function(KEYS, ARGV)\n" + body.encode() + b"\nend")
        _COMPILED[body] = fn
    return fn


def _arg(value: Any) -> bytes:
    if value.__class__ is bytes:
        return value
    if isinstance(value, float):
        # Redis formats a Lua number argument with %.17g: integers print without a point.
        return b"%d" % int(value) if value.is_integer() else repr(value).encode()
    if isinstance(value, int):
        return b"%d" % value
    return str(value).encode()


def _to_lua(lua: Any, reply: Any) -> Any:
    if reply is None:
        return False
    if reply.__class__ is _Status:
        return lua.table_from({b"ok": bytes(reply)})
    if isinstance(reply, list):
        return lua.table_from([_to_lua(lua, r) for r in reply])
    return reply


def _lua_call(*args: Any) -> Any:
    node = _CURRENT[-1]
    command = [_arg(a) for a in args]
    try:
        reply = node.command(command)
    except ReplyError as exc:
        return False, str(exc).encode()
    if isinstance(reply, ReplyError):
        return False, str(reply).encode()
    return True, _to_lua(lua_runtime(), reply)


def _from_lua(value: Any) -> Any:
    if value is None or value is False:
        return None
    if value is True:
        return 1
    if isinstance(value, float):
        return int(value)
    if isinstance(value, (int, bytes)):
        return value
    # A Lua table: {ok = s}, {err = s}, or an array up to its first nil.
    ok = value[b"ok"]
    if ok is not None:
        return _Status(ok)
    err = value[b"err"]
    if err is not None:
        return ReplyError(err.decode(errors="replace"))
    out: list[Any] = []
    i = 1
    while True:
        item = value[i]
        if item is None:
            return out
        out.append(_from_lua(item))
        i += 1


class SimNode:
    """One simulated Redis server (and the replica it may fail over to)."""

    def __init__(self, index: int, now: Callable[[], float]) -> None:
        self.index = index
        self.name = f"node{index}"
        self._real_now = now
        self.data: dict[bytes, Any] = {}
        self.expires: dict[bytes, int] = {}
        self.rate = 1.0  #: clock rate against simulated real time
        self.offset = 1_700_000_000.0  #: wall seconds at real time 0
        self.run_id = ""
        self.started_wall = 0.0  #: the node's wall clock when its server process started
        self.epoch = 0  #: incarnation: a restart or failover cuts every connection
        self.up = True
        self.paused = False
        self.queued: list[tuple[Any, list[list[bytes]], Callable[[list[Any]], None]]] = []
        self.subscribers: dict[bytes, list[Any]] = {}
        self.publish_hook: Callable[[SimNode, bytes], int] | None = None
        #: Script bodies by SHA (a mutant may swap a body); EVAL of an unknown body runs it.
        self.scripts: dict[str, str] = dict(scripts.BODIES)
        self.body_swap: dict[str, str] = {}
        #: Tokens whose release ran here (an acquire landing after its own undo is a leak).
        self.released: set[bytes] = set()
        self.leak_hook: Callable[[SimNode, bytes, str], None] | None = None
        self.running = ""  #: the body of the script running now ("" for a plain command)
        self.commands_run = 0

    # -- clock -----------------------------------------------------------------------------

    def wall(self) -> float:
        return self.offset + self._real_now() * self.rate

    def ms(self) -> int:
        return int(self.wall() * 1000)

    # -- keyspace --------------------------------------------------------------------------

    def _alive(self, key: bytes) -> bool:
        exp = self.expires.get(key)
        if exp is not None and exp <= self.ms():
            del self.expires[key]
            self.data.pop(key, None)
            return False
        return key in self.data

    def get(self, key: bytes) -> Any:
        return self.data[key] if self._alive(key) else None

    def lock_keys(self) -> dict[bytes, bytes]:
        """Every live lock key and its value."""
        return {
            k: v
            for k in list(self.data)
            if b":lock:" in k and self._alive(k) and isinstance(v := self.data[k], bytes)
        }

    def command(self, c: list[bytes]) -> Any:
        self.commands_run += 1
        name = c[0].upper()
        handler = _COMMANDS.get(name)
        if handler is None:
            return ReplyError(f"ERR unknown command '{name.decode()}' in the simulator")
        return handler(self, c)

    def run_script(self, body: str, c: list[bytes]) -> Any:
        body = self.body_swap.get(body, body)
        nkeys = int(c[2])
        keys, argv = c[3 : 3 + nkeys], c[3 + nkeys :]
        if body == scripts.RELEASE.body and argv:
            self.released.add(argv[0])
        lua = lua_runtime()
        fn = _compile(body)
        _CURRENT.append(self)
        self.running = body
        try:
            result = fn(lua.table_from(keys), lua.table_from(argv))
        except Exception as exc:  # a Lua error: redis.call raised, or the script failed
            return ReplyError(f"ERR Error running script: {exc}")
        finally:
            _CURRENT.pop()
            self.running = ""
        return _from_lua(result)

    def set_lock(self, key: bytes, value: bytes) -> None:
        if self.leak_hook is not None and b":lock:" in key:
            token = value.split(b" ", 1)[0]
            if token in self.released:
                self.leak_hook(self, token, self.running)

    def flush(self) -> None:
        self.data.clear()
        self.expires.clear()

    def snapshot(self) -> tuple[dict[bytes, Any], dict[bytes, int]]:
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.data.items()}
        return data, dict(self.expires)


# -- commands --------------------------------------------------------------------------------


def _set(n: SimNode, c: list[bytes]) -> Any:
    key, value = c[1], c[2]
    nx = keepttl = False
    px = None
    i = 3
    while i < len(c):
        opt = c[i].upper()
        if opt == b"NX":
            nx = True
        elif opt == b"PX":
            px = int(c[i + 1])
            i += 1
        elif opt == b"KEEPTTL":
            keepttl = True
        i += 1
    if nx and n._alive(key):
        return None
    n.set_lock(key, value)
    n.data[key] = value
    if px is not None:
        n.expires[key] = n.ms() + px
    elif not keepttl:
        n.expires.pop(key, None)
    return _Status(_OK)


def _get(n: SimNode, c: list[bytes]) -> Any:
    v = n.get(c[1])
    if v is not None and not isinstance(v, bytes):
        return ReplyError("WRONGTYPE Operation against a key holding the wrong kind of value")
    return v


def _del(n: SimNode, c: list[bytes]) -> Any:
    count = 0
    for key in c[1:]:
        if n._alive(key):
            del n.data[key]
            n.expires.pop(key, None)
            count += 1
    return count


def _exists(n: SimNode, c: list[bytes]) -> Any:
    return sum(1 for key in c[1:] if n._alive(key))


def _pttl(n: SimNode, c: list[bytes]) -> Any:
    if not n._alive(c[1]):
        return -2
    exp = n.expires.get(c[1])
    return -1 if exp is None else exp - n.ms()


def _pexpire(n: SimNode, c: list[bytes]) -> Any:
    if not n._alive(c[1]):
        return 0
    n.expires[c[1]] = n.ms() + int(c[2])
    return 1


def _incr(n: SimNode, c: list[bytes]) -> Any:
    v = int(n.get(c[1]) or b"0") + 1
    n.data[c[1]] = b"%d" % v
    return v


def _hset(n: SimNode, c: list[bytes]) -> Any:
    h = n.get(c[1])
    if h is None:
        h = n.data[c[1]] = {}
    added = 0
    for i in range(2, len(c) - 1, 2):
        added += c[i] not in h
        h[c[i]] = c[i + 1]
    return added


def _hmget(n: SimNode, c: list[bytes]) -> Any:
    h = n.get(c[1]) or {}
    return [h.get(f) for f in c[2:]]


def _time(n: SimNode, c: list[bytes]) -> Any:
    us = int(n.wall() * 1_000_000)
    return [b"%d" % (us // 1_000_000), b"%d" % (us % 1_000_000)]


def _publish(n: SimNode, c: list[bytes]) -> Any:
    return 0 if n.publish_hook is None else n.publish_hook(n, c[1])


def _ping(n: SimNode, c: list[bytes]) -> Any:
    return _Status(b"PONG")


def _score(s: bytes) -> float:
    return {b"-inf": float("-inf"), b"+inf": float("inf"), b"inf": float("inf")}.get(s) or float(s)


def _zadd(n: SimNode, c: list[bytes]) -> Any:
    z = n.get(c[1])
    if z is None:
        z = n.data[c[1]] = {}
    i, nx = 2, False
    if c[2].upper() == b"NX":
        nx, i = True, 3
    added = 0
    for j in range(i, len(c) - 1, 2):
        member = c[j + 1]
        if nx and member in z:
            continue
        added += member not in z
        z[member] = _score(c[j])
    return added


def _zrem(n: SimNode, c: list[bytes]) -> Any:
    z = n.get(c[1]) or {}
    removed = 0
    for m in c[2:]:
        if m in z:
            del z[m]
            removed += 1
    return removed


def _zsorted(z: dict[bytes, float]) -> list[bytes]:
    return [m for m, _ in sorted(z.items(), key=lambda kv: (kv[1], kv[0]))]


def _zrange(n: SimNode, c: list[bytes]) -> Any:
    members = _zsorted(n.get(c[1]) or {})
    start, stop = int(c[2]), int(c[3])
    stop = len(members) + stop if stop < 0 else stop
    return members[start : stop + 1]


def _zrangebyscore(n: SimNode, c: list[bytes]) -> Any:
    z = n.get(c[1]) or {}
    lo, hi = _score(c[2]), _score(c[3])
    return [m for m in _zsorted(z) if lo <= z[m] <= hi]


def _eval(n: SimNode, c: list[bytes]) -> Any:
    return n.run_script(c[1].decode(), c)


def _evalsha(n: SimNode, c: list[bytes]) -> Any:
    body = n.scripts.get(c[1].decode())
    if body is None:
        return ReplyError("NOSCRIPT No matching script.")
    return n.run_script(body, c)


_COMMANDS: dict[bytes, Callable[[SimNode, list[bytes]], Any]] = {
    b"SET": _set,
    b"GET": _get,
    b"DEL": _del,
    b"EXISTS": _exists,
    b"PTTL": _pttl,
    b"PEXPIRE": _pexpire,
    b"INCR": _incr,
    b"HSET": _hset,
    b"HMGET": _hmget,
    b"TIME": _time,
    b"PUBLISH": _publish,
    b"PING": _ping,
    b"ZADD": _zadd,
    b"ZREM": _zrem,
    b"ZRANGE": _zrange,
    b"ZRANGEBYSCORE": _zrangebyscore,
    b"EVAL": _eval,
    b"EVALSHA": _evalsha,
}
