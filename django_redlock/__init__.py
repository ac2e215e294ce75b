"""Distributed locks for Django and Celery over independent Redis nodes (Redlock).

The core names import without Django; ``locked`` and ``get_redlock`` load the Django layer on
first use, so ``from django_redlock import Redlock`` works in any Python process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import (
    AsyncLock,
    AsyncReadLock,
    AsyncRedlock,
    AsyncSemaphore,
    AsyncWriteLock,
    Lock,
    LockInfo,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    NodeHealth,
    QuorumError,
    ReadLock,
    Redlock,
    RedlockError,
    Semaphore,
    WriteLock,
)

if TYPE_CHECKING:
    from .backends.registry import get_async_locks, get_locks
    from .conf import get_async_redlock, get_redlock
    from .decorators import locked

__version__ = "0.1.0"

__all__ = [
    "AsyncLock",
    "AsyncReadLock",
    "AsyncRedlock",
    "AsyncSemaphore",
    "AsyncWriteLock",
    "Lock",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "NodeHealth",
    "QuorumError",
    "ReadLock",
    "Redlock",
    "RedlockError",
    "Semaphore",
    "WriteLock",
    "get_async_locks",
    "get_async_redlock",
    "get_locks",
    "get_redlock",
    "locked",
]

_LAZY = {
    "get_locks": "django_redlock.backends.registry",
    "get_async_locks": "django_redlock.backends.registry",
    "get_redlock": "django_redlock.conf",
    "get_async_redlock": "django_redlock.conf",
    "locked": "django_redlock.decorators",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'django_redlock' has no attribute {name!r}")
