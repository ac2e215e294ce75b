"""Tokens: unique across forked children and threads, and a release with a stale token never
touches the current holder's lock."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from django_redlock import LockNotOwned
from django_redlock.testing import RedisCluster
from tests.helpers import settled_lock_keys, settled_tokens, tokens_on_nodes, warm_up

HEX32 = re.compile(r"^[0-9a-f]{32}$")
CHILDREN = 100


def _read_lines(fd: int, count: int, timeout: float) -> list[str]:
    data = b""
    deadline = time.monotonic() + timeout
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while data.count(b"\n") < count and time.monotonic() < deadline:
            chunk = pipe.read(65536)
            if not chunk:  # every writer closed its end
                break
            data += chunk
    return data.decode().splitlines()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_tokens_unique_across_100_forked_children(redis_nodes: RedisCluster, make_redlock) -> None:
    """Each child uses the Redlock object it inherited (connections, lease table and all),
    acquires its own name, reports the token through a pipe and releases.

    It also tries the name its parent holds: the inherited lease table must not let the child
    "re-enter" a lock that belongs to the parent (same thread id after fork)."""
    # A generous node timeout: a hundred children on a shared machine must not turn a node
    # answering late into a QuorumError.
    rl = make_redlock(redis_nodes, node_timeout=1.0)
    parent_lock = rl.lock("fork:parent", ttl=30.0)
    assert parent_lock.acquire(blocking=False)
    read_fd, write_fd = os.pipe()
    pids = []
    for i in range(CHILDREN):
        pid = os.fork()
        if pid == 0:  # child: never return into pytest
            code = 1
            try:
                os.close(read_fd)
                mine = rl.lock(f"fork:{i}")
                ok = mine.acquire(blocking=False)
                stolen = rl.lock("fork:parent").acquire(blocking=False)
                line = f"{i} {mine.token} {int(ok)} {int(stolen)}\n"
                os.write(write_fd, line.encode())
                if ok:
                    mine.release()
                code = 0
            except BaseException as exc:  # reported, so a failing child says why
                os.write(write_fd, f"error {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write_fd)
    lines = _read_lines(read_fd, CHILDREN, timeout=60)
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    errors = [line for line in lines if line.startswith("error")]
    assert all(os.WIFEXITED(c) and os.WEXITSTATUS(c) == 0 for c in codes), (errors, codes)
    assert len(lines) == CHILDREN, lines
    records = [line.split() for line in lines]
    assert all(acquired == "1" for _, _, acquired, _ in records), records
    assert all(stolen == "0" for _, _, _, stolen in records), "a child took its parent's lock"
    tokens = [token for _, token, _, _ in records]
    assert all(HEX32.match(t) for t in tokens)
    assert len(set(tokens)) == CHILDREN
    assert parent_lock.token not in tokens
    # The parent still holds its lock, with its own token, on every node.
    assert parent_lock.check()
    assert settled_tokens(redis_nodes, "fork:parent") == [parent_lock.token] * 3
    parent_lock.release()
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_tokens_unique_across_threads(redis_nodes: RedisCluster, make_redlock) -> None:
    rl = make_redlock(redis_nodes)
    # In service first: concurrent *first* use of a brand-new cluster is a separate matter
    # (test_core_basic.py::test_concurrent_first_use_of_a_fresh_cluster).
    warm_up(rl)
    threads, per_thread = 8, 25
    tokens: list[str] = []
    errors: list[BaseException] = []
    guard = threading.Lock()
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        try:
            start.wait(10)
            for i in range(per_thread):
                lock = rl.lock(f"thread:{t}:{i % 3}")
                assert lock.acquire(blocking=False)
                token = lock.token
                lock.release()
                with guard:
                    tokens.append(token)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert not errors, errors
    assert len(tokens) == threads * per_thread
    assert len(set(tokens)) == len(tokens)
    assert all(HEX32.match(t) for t in tokens)


def test_release_after_expiry_and_takeover_raises_and_spares_the_new_holder(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    first_client, second_client = make_redlock(redis_nodes), make_redlock(redis_nodes)
    first = first_client.lock("stale", ttl=0.3)
    assert first.acquire(blocking=False)
    time.sleep(0.35)  # let the first lease expire
    second = second_client.lock("stale", ttl=5.0)
    assert second.acquire(blocking=False)
    # A quorum granted it; on a busy host the third node may have answered late (its grant
    # then undone) or still held the first lease for a moment.
    before = tokens_on_nodes(redis_nodes, "stale")
    assert before.count(second.token) >= 2
    with pytest.raises(LockNotOwned) as info:
        first.release()
    assert info.value.name == "stale"
    # The new holder is untouched: its token where it was, lease intact, check() True.
    assert tokens_on_nodes(redis_nodes, "stale") == before
    assert second.check() is True
    assert second.held
    assert first_client.locked("stale") is True
    second.release()
    assert settled_lock_keys(redis_nodes) == [{}, {}, {}]


def test_release_with_a_stale_token_on_a_quorum_only(
    redis_nodes: RedisCluster, make_redlock
) -> None:
    """The new holder got the lock on a quorum (two nodes) while the old one's copy survives
    on the third: releasing the old lock removes only its own copy and still reports
    LockNotOwned; the new holder keeps its quorum."""
    old_client, new_client = make_redlock(redis_nodes), make_redlock(redis_nodes)
    old = old_client.lock("split", ttl=5.0)
    assert old.acquire(blocking=False)
    # Two nodes lose the old lease (as if it expired there first).
    for node in list(redis_nodes)[:2]:
        with node.client() as c:
            c.delete("redlock:lock:split")
    new = new_client.lock("split", ttl=5.0)
    assert new.acquire(blocking=False)
    assert tokens_on_nodes(redis_nodes, "split") == [new.token, new.token, old.token]
    with pytest.raises(LockNotOwned):
        old.release()
    assert tokens_on_nodes(redis_nodes, "split") == [new.token, new.token, None]
    assert new.check() is True
    new.release()
