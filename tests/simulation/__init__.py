"""Deterministic simulation of the real lock algorithm (``python -m tests.simulation``).

The core's own steps (:mod:`django_redlock.core.base`) run through a third driver
(:mod:`.engine`) against simulated Redis nodes (:mod:`.node`) that run the package's own Lua
scripts, in virtual time, under seeded fault schedules (:mod:`.scenario`). Every run replays
from its seed; a violation prints the seed, the schedule and a shrunk trace."""

from __future__ import annotations

from .mutants import MUTANTS
from .sweep import KNOWN_ISSUES, Summary, shrink, sweep

__all__ = ["KNOWN_ISSUES", "MUTANTS", "Summary", "shrink", "sweep"]
