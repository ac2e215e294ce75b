"""The size of the uncontended acquire's path, so that it cannot grow back unnoticed.

One warm ``rl.lock(name).acquire(blocking=False)`` on 5 nodes is traced by
``bench/acquire_path.py`` (a ``sys.setprofile`` hook): the distinct package functions it calls
and the files they are in. Which ones run depends a little on timing (a quorum may answer
before the last node does, and the fan-out then takes the early exit), so every one of a few
acquires is held to the limits, the slow branch included.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.acquire_path import acquire_paths, files_of
from django_redlock.testing import RedisCluster

#: What one uncontended acquire may run: package functions, and the files they are in.
MAX_FUNCTIONS = 58
MAX_FILES = 10


def test_one_uncontended_acquire_runs_a_bounded_path(
    redis_cluster_factory: Callable[..., RedisCluster],
) -> None:
    # Nodes of its own, as the bench starts them: the shared ones were flushed for this test,
    # and a first acquire then takes the restart guard's slower path.
    paths = acquire_paths(list(redis_cluster_factory(5).urls), times=5, warm=3)
    for path in paths:
        described = "\n".join(sorted(f"{file}:{name}" for file, name in path))
        assert len(path) <= MAX_FUNCTIONS, described
        assert len(files_of(path)) <= MAX_FILES, described
    # The trace saw the path at all (a hook that recorded nothing would pass the limits).
    assert all(("core/lock.py", "Lock.acquire") in path for path in paths)
