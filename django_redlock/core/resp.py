"""RESP2 encoding and an incremental reply parser, free of I/O.

The hot path (acquire, extend, release) sends one small command per node and reads one small
reply; doing that on plain sockets instead of through a client pool is what makes a 5-node
acquire cost about as much as one redis-py round trip. The sync and async clients share this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Incomplete", "ReplyError", "bulk", "encode", "parse"]


class ReplyError(Exception):
    """An error reply (``-ERR ...``), returned as a value rather than raised mid-fan-out."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class Incomplete(Exception):
    """The buffer does not yet hold a whole reply."""


def bulk(arg: Any) -> bytes:
    """One argument as a RESP bulk string."""
    if isinstance(arg, bytes):
        data = arg
    elif isinstance(arg, str):
        data = arg.encode()
    elif isinstance(arg, int):
        data = b"%d" % arg
    else:
        data = str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def encode(args: Sequence[Any]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(map(bulk, args))


def parse(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int]:
    """One reply from ``buf`` at ``pos``: ``(value, next_pos)``; raises :class:`Incomplete`."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise Incomplete
        return bytes(buf[pos : pos + size]), pos + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == b"+":
        return line, pos
    if kind == b"-":
        return ReplyError(line.decode(errors="replace")), pos
    raise ValueError(f"unexpected RESP reply type {kind!r}")
