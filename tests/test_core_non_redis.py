"""A configured address that speaks RESP but is not Redis (issue: an outside tester's fake nodes
answering every command with one canned reply): it is a failed node, "not a Redis server", for
the sync and the asyncio client alike. An attempt it fails is undone on the real nodes (never a
half-taken lock), ``health()`` shows it down with that reason, and a quorum of real nodes still
locks. Real redis-server nodes; the fakes are small thread-based TCP services."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest

from django_redlock import QuorumError
from tests.helpers import occupy, tokens_on_nodes, warm_up

#: One canned reply to every command: valid RESP, of a shape no lock command gets from Redis.
CANNED = pytest.mark.parametrize(
    "reply",
    [b"*0\r\n", b":1\r\n", b"$-1\r\n", b"+OK\r\n"],
    ids=["empty-array", "integer", "nil", "ok"],
)

#: What an impostor answers to INFO: enough of a Redis server's INFO to pass the handshake.
_INFO = b"# Server\r\nredis_version:7.0.0\r\nrun_id:" + b"f" * 40 + b"\r\nuptime_in_seconds:5\r\n"
IMPOSTOR_INFO = b"$%d\r\n%s\r\n" % (len(_INFO), _INFO)

#: Generous: a fake answering late would be a timeout, not the failure under test.
NODE_TIMEOUT = 0.5


def _read_command(stream) -> list[bytes] | None:
    """One command (a RESP array of bulk strings, or an inline line); None at the end."""
    line = stream.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return line.split()
    args = []
    for _ in range(int(line[1:])):
        size = int(stream.readline()[1:])
        args.append(stream.read(size + 2)[:-2])
    return args


@contextlib.contextmanager
def resp_service(reply: bytes, info: bytes | None = None) -> Iterator[str]:
    """A TCP service speaking RESP that is not Redis: every command gets ``reply``; INFO gets
    ``info`` when given (an impostor that passes the handshake). Yields its URL."""
    if info is not None:
        # Each impostor its own run id (of the same length), as each server has: two nodes
        # reaching one run id are one server, which the client refuses to count twice.
        info = info.replace(b"f" * 40, secrets.token_hex(20).encode())
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    conns: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), conn, conn.makefile("rb") as stream:
            while True:
                command = _read_command(stream)
                if command is None:
                    return
                is_info = info is not None and command and command[0].upper() == b"INFO"
                conn.sendall(info if is_info else reply)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the test is over
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        acceptor.join(5)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _assert_failed_as_not_redis(error: QuorumError, fakes: list[str]) -> None:
    for fake in fakes:
        assert fake in str(error)
        assert "not a Redis server" in error.failures[fake], error.failures


def _assert_down_as_not_redis(health, fakes: list[str]) -> None:
    """The fakes are down, "not a Redis server" (not a parser's own words); the rest up."""
    for h in health:
        if h.node not in fakes:
            assert h.reachable and h.status != "down", h
            continue
        assert not h.reachable and h.status == "down", h
        assert "not a Redis server" in (h.error or ""), h.error
        assert "has no attribute" not in h.error


def _refused_on_held(events, fake: str, real: str) -> None:
    """The one attempt was refused (a quorum answered: granted there, held on ``real``), the
    fake counted as a failed node, not as an answer."""
    [contended] = [e for e in events if e.kind == "contended"]
    assert f"{real}: held" in contended.reason
    assert f"{fake}: error: not a Redis server" in contended.reason


# ---- a service answering every command with one canned reply ---------------------------------


@CANNED
def test_acquire_is_a_quorum_error_and_attempt_undone(redis_nodes, make_redlock, reply) -> None:
    warm_up(make_redlock(redis_nodes))  # a cluster in service: the real node votes
    with resp_service(reply) as fake1, resp_service(reply) as fake2:
        rl = make_redlock([redis_nodes.urls[0], fake1, fake2], node_timeout=NODE_TIMEOUT)
        with pytest.raises(QuorumError) as info:
            rl.lock("canned").acquire(blocking=False)
        _assert_failed_as_not_redis(info.value, [fake1, fake2])
        assert tokens_on_nodes(redis_nodes, "canned")[0] is None


@CANNED
def test_acquire_is_a_quorum_error_and_attempt_undone_async(
    redis_nodes, make_redlock, make_async_redlock, reply
) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply) as fake1, resp_service(reply) as fake2:
        rl = make_async_redlock([redis_nodes.urls[0], fake1, fake2], node_timeout=NODE_TIMEOUT)

        async def main() -> QuorumError:
            try:
                with pytest.raises(QuorumError) as info:
                    await rl.lock("canned").acquire(blocking=False)
                return info.value
            finally:
                await rl.close()

        _assert_failed_as_not_redis(asyncio.run(main()), [fake1, fake2])
        assert tokens_on_nodes(redis_nodes, "canned")[0] is None


@CANNED
def test_health_shows_it_down_as_not_redis(redis_nodes, make_redlock, reply) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply) as fake1, resp_service(reply) as fake2:
        rl = make_redlock([redis_nodes.urls[0], fake1, fake2], node_timeout=NODE_TIMEOUT)
        _assert_down_as_not_redis(rl.health(), [fake1, fake2])


@CANNED
def test_health_shows_it_down_as_not_redis_async(
    redis_nodes, make_redlock, make_async_redlock, reply
) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply) as fake1, resp_service(reply) as fake2:
        rl = make_async_redlock([redis_nodes.urls[0], fake1, fake2], node_timeout=NODE_TIMEOUT)

        async def main():
            try:
                return await rl.health()
            finally:
                await rl.close()

        _assert_down_as_not_redis(asyncio.run(main()), [fake1, fake2])


@CANNED
def test_quorum_of_real_nodes_locks_beside_it(redis_nodes, make_redlock, reply) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply) as fake:
        rl = make_redlock([*redis_nodes.urls[:2], fake], node_timeout=NODE_TIMEOUT)
        lock = rl.lock("beside")
        assert lock.acquire(blocking=False)
        assert tokens_on_nodes(redis_nodes, "beside")[:2] == [lock.token, lock.token]
        lock.release()
        assert tokens_on_nodes(redis_nodes, "beside") == [None, None, None]
        # Held on one real node: the fake is no vote, so one grant of three, undone.
        occupy(redis_nodes[1], "beside")
        events = []
        rl.listeners.append(events.append)
        assert not rl.lock("beside").acquire(blocking=False)
        _refused_on_held(events, fake, redis_nodes.urls[1])
        assert tokens_on_nodes(redis_nodes, "beside")[:2] == [None, "stale-lease"]


@CANNED
def test_quorum_of_real_nodes_locks_beside_it_async(
    redis_nodes, make_redlock, make_async_redlock, reply
) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply) as fake:
        rl = make_async_redlock([*redis_nodes.urls[:2], fake], node_timeout=NODE_TIMEOUT)

        events = []
        rl.listeners.append(events.append)

        async def main() -> None:
            try:
                lock = rl.lock("beside")
                assert await lock.acquire(blocking=False)
                assert tokens_on_nodes(redis_nodes, "beside")[:2] == [lock.token, lock.token]
                await lock.release()
                assert tokens_on_nodes(redis_nodes, "beside") == [None, None, None]
                occupy(redis_nodes[1], "beside")
                events.clear()
                assert not await rl.lock("beside").acquire(blocking=False)
            finally:
                await rl.close()

        asyncio.run(main())
        _refused_on_held(events, fake, redis_nodes.urls[1])
        assert tokens_on_nodes(redis_nodes, "beside")[:2] == [None, "stale-lease"]


# ---- an impostor: a plausible INFO passes the handshake, the lock commands get canned replies --
# The restart guard on: the first attempt on a connection is the acquire script; off: the
# plain SET NX PX pipelined with PTTL.

GUARD = pytest.mark.parametrize("restart_guard", [True, False], ids=["script", "set"])


@CANNED
@GUARD
def test_impostor_acquire_is_a_quorum_error_and_attempt_undone(
    redis_nodes, make_redlock, reply, restart_guard
) -> None:
    warm_up(make_redlock(redis_nodes))
    with (
        resp_service(reply, IMPOSTOR_INFO) as fake1,
        resp_service(reply, IMPOSTOR_INFO) as fake2,
    ):
        rl = make_redlock(
            [redis_nodes.urls[0], fake1, fake2],
            node_timeout=NODE_TIMEOUT,
            restart_guard=restart_guard,
        )
        with pytest.raises(QuorumError) as info:
            rl.lock("impostor").acquire(blocking=False)
        _assert_failed_as_not_redis(info.value, [fake1, fake2])
        assert tokens_on_nodes(redis_nodes, "impostor")[0] is None


@CANNED
@GUARD
def test_impostor_acquire_is_a_quorum_error_and_attempt_undone_async(
    redis_nodes, make_redlock, make_async_redlock, reply, restart_guard
) -> None:
    warm_up(make_redlock(redis_nodes))
    with (
        resp_service(reply, IMPOSTOR_INFO) as fake1,
        resp_service(reply, IMPOSTOR_INFO) as fake2,
    ):
        rl = make_async_redlock(
            [redis_nodes.urls[0], fake1, fake2],
            node_timeout=NODE_TIMEOUT,
            restart_guard=restart_guard,
        )

        async def main() -> QuorumError:
            try:
                with pytest.raises(QuorumError) as info:
                    await rl.lock("impostor").acquire(blocking=False)
                return info.value
            finally:
                await rl.close()

        _assert_failed_as_not_redis(asyncio.run(main()), [fake1, fake2])
        assert tokens_on_nodes(redis_nodes, "impostor")[0] is None


# Not nil: the sync probe's redis-py client opens with HELLO 3, and its RESP3 parser reads a
# RESP2 nil as a length to wait for; the impostor shows down after the client's socket timeout
# ("Timeout reading from socket"), as it did before.
@pytest.mark.parametrize(
    "reply", [b"*0\r\n", b":1\r\n", b"+OK\r\n"], ids=["empty-array", "integer", "ok"]
)
def test_impostor_health_shows_it_down_as_not_redis(redis_nodes, make_redlock, reply) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply, IMPOSTOR_INFO) as fake:
        rl = make_redlock([*redis_nodes.urls[:2], fake], node_timeout=NODE_TIMEOUT)
        _assert_down_as_not_redis(rl.health(), [fake])


@CANNED
def test_impostor_health_shows_it_down_as_not_redis_async(
    redis_nodes, make_redlock, make_async_redlock, reply
) -> None:
    warm_up(make_redlock(redis_nodes))
    with resp_service(reply, IMPOSTOR_INFO) as fake:
        rl = make_async_redlock([*redis_nodes.urls[:2], fake], node_timeout=NODE_TIMEOUT)

        async def main():
            try:
                return await rl.health()
            finally:
                await rl.close()

        _assert_down_as_not_redis(asyncio.run(main()), [fake])
