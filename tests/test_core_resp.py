"""The RESP reply parser: every reply shape the nodes send, whole or cut anywhere."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from django_redlock.core.resp import Incomplete, ReplyError, parse


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


@settings(max_examples=300, deadline=None)
@given(replies, st.binary(max_size=8))
def test_every_reply_parses_back_and_stops_at_its_end(value: Any, after: bytes) -> None:
    data = wire_form(value)
    assert parse(bytearray(data + after)) == (value, len(data))
    assert parse(data + after) == (value, len(data))


@settings(max_examples=200, deadline=None)
@given(replies)
def test_a_reply_cut_anywhere_is_incomplete(value: Any) -> None:
    data = wire_form(value)
    for cut in range(len(data)):
        with pytest.raises(Incomplete):
            parse(bytearray(data[:cut]))


def test_pipelined_replies_parse_one_after_another() -> None:
    # What an uncontended acquire gets back: SET's +OK, PTTL, HMGET of the marker.
    data = b"+OK\r\n:30000\r\n*2\r\n$4\r\nabcd\r\n$16\r\n1795560454739336\r\n"
    first, pos = parse(data)
    second, pos = parse(data, pos)
    third, pos = parse(data, pos)
    assert (first, second, third) == (b"OK", 30000, [b"abcd", b"1795560454739336"])
    assert pos == len(data)


def test_error_and_nil_array_replies() -> None:
    error, end = parse(b"-NOSCRIPT No matching script\r\n")
    assert isinstance(error, ReplyError) and error.code == "NOSCRIPT" and end == 30
    assert parse(b"*-1\r\n") == (None, 5)
    with pytest.raises(ValueError, match="unexpected RESP reply type"):
        parse(b"?what\r\n")
