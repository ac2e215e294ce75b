"""The size of the uncontended acquire's path, so that it cannot grow back unnoticed.

One warm ``rl.lock(name).acquire(blocking=False)`` on 5 nodes is traced by
``bench/acquire_path.py`` (a ``sys.setprofile`` hook): the distinct package functions it calls
and the files they are in. Which ones run depends on timing: a quorum may answer before the
last node does (the fan-out then takes its early exit), a connection may still owe a reply
(another is opened, and its first acquire sends the whole script). So of a few acquires the
one with the shortest path, which took none of those branches, is held to the limits, the
client's own part of it (everything but the transport) to tighter ones, and every one of them
to a looser bound that the slow branches fit in.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.acquire_path import acquire_paths, files_of
from django_redlock.testing import RedisCluster

#: What one uncontended acquire runs when nothing is late: package functions, and files.
MAX_FUNCTIONS = 25
MAX_FILES = 6

#: The transport: connections, the fan-out and the failure detector.
TRANSPORT = {"core/nodes.py", "core/fanout.py", "core/detector.py"}
#: What the transport's part of that path runs (the common case is written out in the
#: fan-out's frame and the connection's read).
MAX_TRANSPORT_FUNCTIONS = 12
MAX_TRANSPORT_FILES = 2
#: What the rest of that path (the handle, the client, the algorithm, its parts) runs.
MAX_CLIENT_FUNCTIONS = 13
MAX_CLIENT_FILES = 4

#: Any one of the acquires, with late replies and a connection opened meanwhile.
MAX_SLOW_FUNCTIONS = 57


def _described(path: set[tuple[str, str]]) -> str:
    return "\n".join(sorted(f"{file}:{name}" for file, name in path))


def test_one_uncontended_acquire_runs_a_bounded_path(
    redis_cluster_factory: Callable[..., RedisCluster],
) -> None:
    # Nodes of its own, as the bench starts them: the shared ones were flushed for this test,
    # and a first acquire then takes the restart guard's slower path.
    # A hundred, so that on a busy machine at least one of them took no late branch (of
    # twenty, none did once, beside the two other test files the suite runs at once).
    paths = acquire_paths(list(redis_cluster_factory(5).urls), times=100, warm=3)
    # The trace saw the path at all (a hook that recorded nothing would pass the limits).
    assert all(("core/lock.py", "Lock.acquire") in path for path in paths)
    for path in paths:
        assert len(path) <= MAX_SLOW_FUNCTIONS, _described(path)
    quiet = min(paths, key=len)
    client = {(file, name) for file, name in quiet if file not in TRANSPORT}
    assert len(client) <= MAX_CLIENT_FUNCTIONS, _described(quiet)
    assert len(files_of(client)) <= MAX_CLIENT_FILES, _described(quiet)
    transport = quiet - client
    assert len(transport) <= MAX_TRANSPORT_FUNCTIONS, _described(quiet)
    assert len(files_of(transport)) <= MAX_TRANSPORT_FILES, _described(quiet)
    assert len(quiet) <= MAX_FUNCTIONS, _described(quiet)
    assert len(files_of(quiet)) <= MAX_FILES, _described(quiet)
