"""A holder asking its own semaphore or read-lock handle again: the non-reentrant rule of
docs/guarantees.rst ("Owners and reentrancy") that a lock and a write lock follow, False for
``blocking=False``, False after its ``timeout``, ``RuntimeError`` for a wait with no bound, and
never a second permit or reader that the handle then forgets (sync, asyncio, nested ``with``,
a reentrant client)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redlock import LockNotAcquired
from tests.helpers import release_listeners, wait_until

KINDS = ["semaphore", "read_lock", "write_lock"]


def _handle(rl, kind: str, name: str, **kwargs):
    if kind == "semaphore":
        return rl.semaphore(name, 3, **kwargs)
    return getattr(rl, kind)(name, **kwargs)


def _listed(rl, name: str) -> list[str]:
    return sorted(info.name for info in rl.live_locks(f"{name}*"))


@pytest.mark.parametrize("reentrant_client", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_same_handle_again_by_its_holder(
    redis_nodes, make_redlock, kind: str, reentrant_client: bool
) -> None:
    rl = make_redlock(redis_nodes, reentrant=reentrant_client)
    handle = _handle(rl, kind, "again", ttl=10.0, auto_renew=True)
    assert handle.acquire(blocking=False)
    token, listed = handle.token, _listed(rl, "again")
    assert handle.acquire(blocking=False) is False
    t0 = time.monotonic()
    assert handle.acquire(timeout=0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 5.0  # it waited out its timeout, no longer
    with pytest.raises(RuntimeError, match="wait for itself"):
        handle.acquire()
    assert handle.token == token and handle.held  # the failed asks left the hold alone
    assert _listed(rl, "again") == listed  # and took no second permit or reader
    handle.release()
    assert not handle.held
    assert _listed(rl, "again") == []  # nothing left for the watchdog to renew
    if kind != "semaphore":
        writer = rl.write_lock("again", ttl=10.0)
        assert writer.acquire(blocking=False)  # no forgotten reader holds the writer off
        writer.release()


@pytest.mark.parametrize("kind", KINDS)
def test_nested_with_on_a_handle_with_a_timeout(redis_nodes, make_redlock, kind: str) -> None:
    rl = make_redlock(redis_nodes)
    handle = _handle(rl, kind, "nested", ttl=30.0, timeout=0.3)
    with handle:
        token = handle.token
        with pytest.raises(LockNotAcquired, match="already holds"):
            with handle:
                raise AssertionError("entered a hold this owner already has")
        assert handle.token == token and handle.held
    assert not handle.held
    assert _listed(rl, "nested") == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_handle_again_by_its_holder_asyncio(
    redis_nodes, make_async_redlock, kind: str
) -> None:
    rl = make_async_redlock(redis_nodes)

    async def main() -> None:
        handle = _handle(rl, kind, "a-again", ttl=30.0, auto_renew=True, timeout=0.3)
        async with handle:
            token = handle.token
            assert await handle.acquire(blocking=False) is False
            assert await handle.acquire(timeout=0.3) is False
            assert await asyncio.wait_for(handle.acquire(timeout=0.3), 5) is False
            with pytest.raises(RuntimeError, match="wait for itself"):
                await handle.acquire(timeout=float("inf"))
            with pytest.raises(LockNotAcquired, match="already holds"):
                async with handle:
                    raise AssertionError("entered a hold this owner already has")
            assert handle.token == token and handle.held
        assert not handle.held
        assert sorted(i.name for i in await rl.live_locks("a-again*")) == []

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["semaphore", "read_lock"])
def test_a_hold_that_ran_out_is_taken_anew_by_a_waiting_ask(
    redis_nodes, make_redlock, kind: str
) -> None:
    rl = make_redlock(redis_nodes)
    handle = _handle(rl, kind, "ranout", ttl=0.5)
    assert handle.acquire(blocking=False)
    token = handle.token
    assert handle.acquire(timeout=5.0)  # once the first hold ran out (0.5 s), a new one
    assert handle.token != token and handle.held
    handle.release()
    # The first hold's keys outlive its local validity by the drift margin, no longer.
    wait_until(lambda: _listed(rl, "ranout") == [], timeout=2.0)


@pytest.mark.parametrize("kind", ["semaphore", "read_lock"])
def test_a_named_owner_s_waiting_ask_is_woken_by_its_other_thread_s_release(
    redis_nodes, make_redlock, kind: str
) -> None:
    """One ``owner=`` shared by two threads is one holder: the second thread's ask waits for
    the first one's hold to end, and takes one at its release (not after its timeout)."""
    rl = make_redlock(redis_nodes, retry_delay=5.0)
    handle = _handle(rl, kind, "job", ttl=30.0, owner="job-1")
    assert handle.acquire(blocking=False)
    got: list[bool] = []
    asking = threading.Event()

    def ask() -> None:
        asking.set()
        got.append(handle.acquire(timeout=20.0))

    thread = threading.Thread(target=ask)
    thread.start()
    asking.wait()
    # The ask waits on the name's release channel.
    wait_until(lambda: any(release_listeners(n, "redlock:released:job") for n in redis_nodes))
    assert not got and len(_listed(rl, "job")) == 1
    handle.release()
    thread.join(4.0)
    assert got == [True] and handle.held
    assert len(_listed(rl, "job")) == 1
    handle.release()
    assert _listed(rl, "job") == []
