"""docs/backends.rst's option defaults and the ``fair`` rule, checked on the backends as built
(building one opens no connection: nothing listens on the addresses used here)."""

from __future__ import annotations

import pytest

from django_redlock.backends.database import DatabaseLocks
from django_redlock.backends.etcd import EtcdLocks

pytestmark = pytest.mark.django_db


def test_database_defaults_and_no_fair_line():
    locks = DatabaseLocks(using="default")
    try:
        assert (locks.ttl, locks.pessimistic, locks.max_poll, locks.loss_check) == (
            30.0,
            False,
            0.2,
            0.25,
        )
        assert (locks.retry_count, locks.retry_delay) == (3, 0.2)
        with pytest.raises(ValueError, match="fair"):
            locks.lock("b:fair", fair=True)
    finally:
        locks.close()


def test_etcd_defaults_and_a_fair_line():
    locks = EtcdLocks(["http://127.0.0.1:1"])
    try:
        assert (locks.root, locks.ttl) == ("/django_redlock", 30.0)
        assert locks.fair is True
        locks.lock("b:fair", fair=True)  # a handle; nothing is sent until acquire()
    finally:
        locks.close()


def test_zookeeper_defaults_and_a_fair_line():
    pytest.importorskip("kazoo")
    from django_redlock.backends.zookeeper import ZooKeeperLocks

    locks = ZooKeeperLocks("127.0.0.1:1")
    try:
        assert (locks.root, locks.session_timeout, locks.connect_timeout, locks.ttl) == (
            "/django_redlock",
            10.0,
            5.0,
            30.0,
        )
        assert locks.fair is True
        locks.lock("b:fair", fair=True)
    finally:
        locks.close()
