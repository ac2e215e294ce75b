"""README.md's promises not backed elsewhere, on real redis-server processes: a
``QuorumError`` names each node that did not grant and why, ``held`` included."""

from __future__ import annotations

import pytest

from django_redlock import QuorumError


def test_quorum_error_names_a_node_that_said_held(redis_cluster_factory, make_redlock):
    cluster = redis_cluster_factory(3)
    holder = make_redlock(cluster).lock("readme:q", ttl=20)
    assert holder.acquire(blocking=False)
    cluster[1].kill()
    cluster[2].kill()
    other = make_redlock(cluster, node_timeout=0.2)
    with pytest.raises(QuorumError) as caught:
        with other.lock("readme:q", timeout=0.3):
            pass
    failures = caught.value.failures
    assert failures[cluster[0].url] == "held", failures
    assert failures[cluster[1].url].startswith("refused"), failures
    assert failures[cluster[2].url].startswith("refused"), failures
    assert f"{cluster[0].url}: held" in str(caught.value)
