"""The wire format as the transport uses it: redis-py packs the commands, hiredis parses the
replies. What is checked is the package's use of them: replies cut anywhere (as TCP may
deliver them) come out whole and in order, error replies are values with their code, a
service that is not Redis is a :class:`ProtocolError`, and an encoded command reads back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from django_redlock.core.nodes import (
    ProtocolError,
    ReplyError,
    as_eval,
    pack,
    pack_many,
    reader,
    unpack,
)
from django_redlock.core.scripts import RELEASE


def wire_form(value: Any) -> bytes:
    """How a Redis server sends ``value`` (RESP2)."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    return b"*%d\r\n" % len(value) + b"".join(wire_form(v) for v in value)


replies = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(replies, min_size=1, max_size=4), st.data())
def test_replies_cut_anywhere_come_out_whole_and_in_order(values: list[Any], data) -> None:
    stream = b"".join(wire_form(v) for v in values)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(stream)), max_size=6)))
    parser = reader()
    out: list[Any] = []
    start = 0
    for end in [*cuts, len(stream)]:
        parser.feed(stream[start:end])
        start = end
        while (value := parser.gets()) is not False:
            out.append(value)
    assert out == values


def test_error_replies_are_values_with_their_code() -> None:
    parser = reader()
    parser.feed(b"-NOSCRIPT No matching script.\r\n:1\r\n")
    error = parser.gets()
    assert isinstance(error, ReplyError) and error.code == "NOSCRIPT"
    assert parser.gets() == 1
    assert parser.gets() is False


def test_a_service_that_is_not_redis_is_a_protocol_error() -> None:
    parser = reader()
    parser.feed(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(ProtocolError):
        parser.gets()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=30) | st.integers(0, 2**40), min_size=1, max_size=6))
def test_commands_read_back(args: list[Any]) -> None:
    command = [b"ECHO", *args]
    expected = [a if isinstance(a, bytes) else str(a).encode() for a in command]
    assert unpack(pack(command)) == expected
    both = pack_many([command, ["PING"]])
    parser = reader()
    parser.feed(both)
    assert parser.gets() == expected and parser.gets() == [b"PING"]


def test_an_evalsha_becomes_its_eval() -> None:
    command = pack(["EVALSHA", RELEASE.sha, 1, "k", "t", "c"])
    assert unpack(as_eval(command)) == [b"EVAL", RELEASE.body.encode(), b"1", b"k", b"t", b"c"]
