"""Where the algorithm's steps read the time and draw randomness.

The real drivers leave these as they are (the process's clocks and the ``secrets`` and
``random`` sources). The deterministic simulator (``python -m tests.simulation``) hands in a
virtual clock and a seeded source instead, so a run of the real steps replays from its seed.
Steps call ``clock.monotonic()`` rather than binding the function at import, which is what
lets a driver swap it.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable

__all__ = ["monotonic", "token_hex", "uniform", "wall"]

#: Seconds on a clock that never steps (``time.monotonic``): leases are timed on it.
monotonic: Callable[[], float] = time.monotonic

#: Seconds since the epoch (``time.time``): what a node's clock is compared with.
wall: Callable[[], float] = time.time

#: A random hex string of ``n`` bytes (lock tokens, waiter ids).
token_hex: Callable[[int], str] = secrets.token_hex

#: A random float in ``[a, b]`` (retry jitter).
uniform: Callable[[float, float], float] = random.uniform
