"""This process's id, kept current across fork: ``os.getpid()`` is a system call, and the hot
path asks on every look at a lease and every connection it takes from a pool."""

from __future__ import annotations

import os

__all__ = ["ThisProcess"]


class ThisProcess:
    """``ThisProcess.pid`` is the id of the process reading it."""

    pid = os.getpid()

    @classmethod
    def forked(cls) -> None:
        cls.pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=ThisProcess.forked)
