"""The size of the uncontended acquire's path, so that it cannot grow back unnoticed.

One warm ``rl.lock(name).acquire(blocking=False)`` on 5 nodes is traced by
``bench/acquire_path.py`` (a ``sys.setprofile`` hook): the distinct package functions it calls
and the files they are in. Which transport functions run depends on timing (a quorum may
answer before the last node does, and the fan-out then takes its early exit; a connection may
still owe a reply), so every one of a few acquires is held to the limits, the slow branches
included, and the client's own part (everything but the transport) to tighter ones.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.acquire_path import acquire_paths, files_of
from django_redlock.testing import RedisCluster

#: What one uncontended acquire may run: package functions, and the files they are in.
MAX_FUNCTIONS = 58
MAX_FILES = 10

#: The transport: connections, the fan-out and the failure detector.
TRANSPORT = {"core/nodes.py", "core/fanout.py", "core/detector.py"}
#: What the rest (the handle, the client, the algorithm, its parts) may run: it does not
#: depend on timing.
MAX_CLIENT_FUNCTIONS = 22
MAX_CLIENT_FILES = 7


def test_one_uncontended_acquire_runs_a_bounded_path(
    redis_cluster_factory: Callable[..., RedisCluster],
) -> None:
    # Nodes of its own, as the bench starts them: the shared ones were flushed for this test,
    # and a first acquire then takes the restart guard's slower path.
    paths = acquire_paths(list(redis_cluster_factory(5).urls), times=5, warm=3)
    for path in paths:
        described = "\n".join(sorted(f"{file}:{name}" for file, name in path))
        client = {(file, name) for file, name in path if file not in TRANSPORT}
        assert len(client) <= MAX_CLIENT_FUNCTIONS, described
        assert len(files_of(client)) <= MAX_CLIENT_FILES, described
        assert len(path) <= MAX_FUNCTIONS, described
        assert len(files_of(path)) <= MAX_FILES, described
    # The trace saw the path at all (a hook that recorded nothing would pass the limits).
    assert all(("core/lock.py", "Lock.acquire") in path for path in paths)
