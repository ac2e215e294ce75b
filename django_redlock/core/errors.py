"""The one place lock errors are defined.

Every error carries the lock ``name`` so a log line or an error page can say which lock was
involved without the caller having to thread it through.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "QuorumError",
    "RedlockError",
    "TrustRefused",
]


class RedlockError(Exception):
    """Base class of every error this library raises about a lock."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockNotAcquired(RedlockError):
    """The lock could not be taken within the allowed time (someone else holds it)."""

    def __init__(
        self, message: str, name: str | None = None, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message, name)
        #: Seconds until the current holder's lease runs out, when the nodes told us.
        self.retry_after = retry_after


class QuorumError(LockNotAcquired):
    """Not enough nodes granted the lock, and at least one of them failed (not merely busy).

    ``failures`` maps each node that did not grant the lock to the reason: ``"timeout"``,
    ``"refused"``, ``"auth"``, ``"held"`` (by another owner), ``"guarded"`` (restart guard) or
    ``"error: ..."``. The message lists them so an operator can act on it.
    """

    def __init__(
        self,
        message: str,
        name: str | None = None,
        *,
        failures: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.failures: dict[str, str] = dict(failures or {})
        if self.failures:
            detail = ", ".join(f"{node}: {why}" for node, why in self.failures.items())
            message = f"{message} ({detail})"
        super().__init__(message, name, retry_after=retry_after)


class LockNotOwned(RedlockError):
    """The caller tried to release or extend a lock that is not (or no longer) its own.

    The current holder's key is never touched when this is raised.
    """


class LockLost(LockNotOwned):
    """A lock we held was lost before we released it: the lease ran out, renewal could not
    reach a quorum, or an operator force-released it."""


class TrustRefused(RedlockError):
    """``trust_cluster()`` refused: some reachable node holds a lock, so the operator's
    assertion "no lock is held" is false, and trusting the nodes now could grant it twice."""
