"""Sentinel-managed groups for the tests: a master and a replica per group (real
redis-server processes) and Sentinels (``redis-server --sentinel``) watching every group.

``SentinelGroups(n)`` starts ``n`` groups and two Sentinels; ``url(i)`` is group ``i``'s
``redis+sentinel://`` node URL; ``failover(i)`` runs ``SENTINEL FAILOVER`` and returns once
the Sentinels announced the new master (``+switch-master``) and it answers as a master.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from django_redlock.testing import RedisNode, RedisStartupError

__all__ = ["SentinelGroups", "SentinelProcess", "SentinelUnavailable"]

#: How long a test waits for the Sentinels to finish a failover (they decide in about a
#: second; a loaded CI machine gets ample room, the wait ends at the event).
FAILOVER_WAIT = 60.0


class SentinelUnavailable(RuntimeError):
    """``redis-server --sentinel`` could not start here (the tests skip, with this reason)."""


class SentinelProcess(RedisNode):
    """One Sentinel: ``redis-server <conf> --sentinel`` on a free loopback port, monitoring
    ``monitors`` (``(service, host, port)``) with quorum 1."""

    def __init__(
        self,
        monitors: list[tuple[str, str, int]],
        *,
        auth_pass: str | None = None,
        **kwargs: object,
    ) -> None:
        self.monitors = monitors
        self.auth_pass = auth_pass
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def _command(self) -> list[str]:
        assert self._dir is not None
        conf = Path(self._dir) / "sentinel.conf"
        if not conf.exists():  # Sentinel rewrites it with what it learns: keep that
            lines = []
            for service, host, port in self.monitors:
                lines += [
                    f"sentinel monitor {service} {host} {port} 1",
                    f"sentinel down-after-milliseconds {service} 1000",
                    f"sentinel failover-timeout {service} 5000",
                    f"sentinel parallel-syncs {service} 1",
                ]
                if self.auth_pass is not None:
                    lines.append(f"sentinel auth-pass {service} {self.auth_pass}")
            conf.write_text("\n".join(lines) + "\n")
        from django_redlock.testing import redis_server_binary

        return [
            self.binary or redis_server_binary(),
            str(conf),
            "--sentinel",
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self._dir),
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(Path(self._dir) / "redis.log"),
        ]  # fmt: skip


class SentinelGroups:
    """``n`` groups (master + replica each) and ``sentinels`` Sentinels (two unless told)
    watching all of them."""

    def __init__(
        self,
        n: int = 3,
        *,
        min_replicas: bool = False,
        password: str | None = None,
        sentinels: int = 2,
    ) -> None:
        self.password = password
        self.services = [f"group{i}" for i in range(n)]
        self.servers: list[RedisNode] = []
        self.sentinels: list[SentinelProcess] = []
        # Off by default: the tests show the client keeps a deposed master (which goes on
        # taking writes until the Sentinels reconfigure it, ~10 s) out of its quorum alone.
        args = ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"]
        if not min_replicas:
            args = []
        try:
            if password is not None:
                args = [*args, "--masterauth", password]
            masters = [RedisNode(extra_args=args, password=password) for _ in range(n)]
            self.servers += masters
            replicas = [
                RedisNode(extra_args=[*args, "--replicaof", m.host, str(m.port)], password=password)
                for m in masters
            ]
            self.servers += replicas
            monitors = [(s, m.host, m.port) for s, m in zip(self.services, masters, strict=True)]
            for _ in range(sentinels):
                try:
                    self.sentinels.append(SentinelProcess(monitors, auth_pass=password))
                except RedisStartupError as exc:
                    raise SentinelUnavailable(
                        f"redis-server --sentinel does not start: {exc}"
                    ) from exc
            for i in range(n):
                self.wait_ready(i)
        except BaseException:
            self.stop()
            raise

    # -- addresses ------------------------------------------------------------------------------

    @property
    def sentinel_hosts(self) -> str:
        return ",".join(f"{s.host}:{s.port}" for s in self.sentinels)

    def url(self, index: int) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis+sentinel://{auth}{self.sentinel_hosts}/{self.services[index]}/0"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self.services))]

    def sentinel_client(self, which: int = 0) -> redis.Redis:
        s = self.sentinels[which]
        return redis.Redis(s.host, s.port, socket_timeout=5, decode_responses=True)

    def master_address(self, index: int) -> tuple[str, int]:
        with self.sentinel_client() as c:
            host, port = c.sentinel_get_master_addr_by_name(self.services[index])
        return host, int(port)

    def server_at(self, address: tuple[str, int]) -> RedisNode:
        return next(s for s in self.servers if (s.host, s.port) == address)

    def master(self, index: int) -> RedisNode:
        return self.server_at(self.master_address(index))

    def replica(self, index: int) -> RedisNode:
        """The group's other server (its replica while no failover is under way)."""
        master = self.master_address(index)
        group = {self.servers[index], self.servers[index + len(self.services)]}
        return next(s for s in group if (s.host, s.port) != master)

    # -- waiting on events ----------------------------------------------------------------------

    def wait_ready(self, index: int) -> None:
        """Until the replica is in sync and every Sentinel knows it as a healthy replica (a
        failover needs one)."""
        service = self.services[index]
        deadline = time.monotonic() + FAILOVER_WAIT
        replica = self.replica(index)
        while True:
            with replica.client(socket_timeout=5, decode_responses=True) as c:
                linked = c.info("replication").get("master_link_status") == "up"
            known = linked
            for which in range(len(self.sentinels)):
                with self.sentinel_client(which) as c:
                    found = c.sentinel_slaves(service)
                known = known and any(
                    int(r["port"]) == replica.port
                    and not ({"s_down", "o_down", "disconnected"} & set(r["flags"].split(",")))
                    and r.get("master-link-status", "ok") == "ok"
                    for r in found
                )
            if known:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service}: the replica never became ready: {found}")
            time.sleep(0.1)  # nothing announces this: polled

    @contextlib.contextmanager
    def switch(self, index: int) -> Iterator[None]:
        """Waits, after the block, for ``+switch-master`` of group ``index`` (the block
        starts a failover), then for the new master to answer as one."""
        service = self.services[index]
        with self.sentinel_client() as c, c.pubsub() as sub:
            sub.subscribe("+switch-master")
            sub.get_message(timeout=5)  # the subscribe confirmation
            yield
            deadline = time.monotonic() + FAILOVER_WAIT
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{service}: no +switch-master")
                message = sub.get_message(timeout=left)
                if message and str(message["data"]).split()[0] == service:
                    break
        new = self.master(index)
        deadline = time.monotonic() + FAILOVER_WAIT
        while True:
            with new.client(socket_timeout=5, decode_responses=True) as c:
                if c.info("replication")["role"] == "master":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service}: the new master never took the role")
            time.sleep(0.05)

    def failover(self, index: int) -> tuple[str, int]:
        """``SENTINEL FAILOVER`` of group ``index``; returns the new master's address."""
        self.wait_ready(index)
        with self.switch(index), self.sentinel_client() as c:
            c.execute_command("SENTINEL", "FAILOVER", self.services[index])
        return self.master_address(index)

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.servers]:
            with contextlib.suppress(Exception):
                proc.stop()
