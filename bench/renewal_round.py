"""Client CPU of the watchdog's renewal rounds: what one auto-renewed lease costs this process.

    python bench/renewal_round.py [--leases 1000] [--nodes 3]

Takes ``--leases`` locks on ``--nodes`` real ``redis-server`` nodes (``django_redlock.testing``),
then renews all of them in one round, as the watchdog does when they come due together
(``Redlock._renew``: the round's pipelined fan-out and the judgement of every lease), 5 rounds
at a time, 5 times; prints the least client CPU (``time.process_time``) per round and per
lease, and the wall time of that sample. CPU time, not wall time, is what a busy host rations:
on two cores shared with a load average of 15 a process gets about a tenth of a core, and the
watchdog's rounds must fit in it. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from django_redlock import Redlock  # noqa: E402
from django_redlock.testing import RedisCluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    with RedisCluster(args.nodes) as cluster:
        rl = Redlock(cluster.urls, ttl=60.0)
        try:
            locks = [rl.lock(f"renewal-round:{i}") for i in range(args.leases)]
            for lock in locks:
                if not lock.acquire(blocking=False):
                    raise SystemExit(f"could not take {lock.name}")
            leases = [lock._lease for lock in locks]
            for _ in range(3):  # connections open, scripts cached
                rl._renew(leases)
            samples = []
            for _ in range(5):
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(5):
                    whens = rl._renew(leases)
                samples.append(((time.process_time() - cpu) / 5, (time.perf_counter() - wall) / 5))
                if any(when is None for when in whens):
                    raise SystemExit("a lease was not renewed")
        finally:
            rl.close()
    cpu, wall = min(samples)
    print(
        f"{args.leases} leases on {args.nodes} nodes: client CPU {cpu * 1e3:.1f} ms per round "
        f"({cpu / args.leases * 1e6:.1f} us per lease), wall {wall * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
