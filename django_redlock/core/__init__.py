"""The Redlock core: stdlib and redis-py only. It never imports Django or Celery."""

from .asyncio import AsyncLock, AsyncRedlock
from .errors import LockLost, LockNotAcquired, LockNotOwned, QuorumError, RedlockError
from .events import LockEvent
from .info import LockInfo, NodeHealth, NodeLockState
from .lock import Lock
from .redlock import Redlock

__all__ = [
    "AsyncLock",
    "AsyncRedlock",
    "Lock",
    "LockEvent",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "NodeHealth",
    "NodeLockState",
    "QuorumError",
    "Redlock",
    "RedlockError",
]
