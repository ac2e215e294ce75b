"""RESP2 encoding and an incremental reply parser, free of I/O.

The hot path (acquire, extend, release) sends one small command per node and reads one small
reply; doing that on plain sockets instead of through a client pool is what makes a 5-node
acquire cost about as much as one redis-py round trip. The sync and async clients share this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Incomplete", "ReplyError", "bulk", "encode", "encode_args", "parse"]


class ReplyError(Exception):
    """An error reply (``-ERR ...``), returned as a value rather than raised mid-fan-out."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class Incomplete(Exception):
    """The buffer does not yet hold a whole reply."""


def _data(arg: Any) -> bytes:
    cls = arg.__class__
    if cls is str:
        return arg.encode()  # type: ignore[no-any-return]
    if cls is bytes:
        return arg  # type: ignore[no-any-return]
    if cls is int or isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, bytes):
        return bytes(arg)
    return (arg if isinstance(arg, str) else str(arg)).encode()


def bulk(arg: Any) -> bytes:
    """One argument as a RESP bulk string."""
    data = _data(arg)
    return b"$%d\r\n%s\r\n" % (len(data), data)


def encode(args: Sequence[Any]) -> bytes:
    """A whole command."""
    return b"*%d\r\n" % len(args) + encode_args(args)


def encode_args(args: Sequence[Any]) -> bytes:
    """Arguments as bulk strings, without the array header (for a command assembled from
    parts encoded once)."""
    # One loop and one join, no call per argument: this runs for every command sent.
    out = []
    for arg in args:
        data = arg.encode() if arg.__class__ is str else _data(arg)
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int]:
    """One reply from ``buf`` at ``pos``: ``(value, next_pos)``; raises :class:`Incomplete`."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind = buf[pos]  # an int: no slice per reply on the hot path
    if kind == 58:  # ":"
        return int(buf[pos + 1 : end]), end + 2
    if kind == 36:  # "$"
        size = int(buf[pos + 1 : end])
        pos = end + 2
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise Incomplete
        return bytes(buf[pos : pos + size]), pos + size + 2
    if kind == 42:  # "*"
        count = int(buf[pos + 1 : end])
        pos = end + 2
        if count < 0:
            return None, pos
        items: list[Any] = []
        for _ in range(count):
            # Integers and strings (the lock scripts' and the marker read's replies) inline:
            # no call per item.
            kind = buf[pos] if pos < len(buf) else 0
            if kind == 58 or kind == 36:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    raise Incomplete
                number = int(buf[pos + 1 : end])
                pos = end + 2
                if kind == 58:
                    items.append(number)
                elif number < 0:
                    items.append(None)
                elif len(buf) < pos + number + 2:
                    raise Incomplete
                else:
                    items.append(bytes(buf[pos : pos + number]))
                    pos += number + 2
            else:
                item, pos = parse(buf, pos)
                items.append(item)
        return items, pos
    if kind == 43:  # "+"
        return bytes(buf[pos + 1 : end]), end + 2
    if kind == 45:  # "-"
        return ReplyError(bytes(buf[pos + 1 : end]).decode(errors="replace")), end + 2
    raise ValueError(f"unexpected RESP reply type {bytes([kind])!r}")
