"""The Redlock core: stdlib and redis-py only. It never imports Django or Celery."""

from .asyncio import AsyncLock, AsyncRedlock
from .errors import (
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumError,
    RedlockError,
    TrustRefused,
)
from .events import LockEvent, emit
from .info import (
    HOLDER_PLACE,
    NODE_STATUSES,
    PID_SPACE,
    STALE_RENEWAL_FRACTION,
    STUCK_REASONS,
    LockInfo,
    NodeHealth,
    NodeLockState,
    process_gone,
)
from .listing import glob_escape
from .lock import Lock
from .nodes import NodeSpec, connection_args, node_identity, parse_spec, redact
from .redlock import Redlock
from .validation import (
    MAX_DURATION,
    MAX_KEY_LENGTH,
    MAX_META_BYTES,
    MAX_NODE_TIMEOUT,
    MAX_RETRY_COUNT,
    check_flag,
    check_meta,
    check_name,
    check_node_timeout,
    check_positive,
    check_prefix,
    check_retry_count,
    check_timeout,
    check_token,
)

__all__ = [
    "HOLDER_PLACE",
    "MAX_DURATION",
    "MAX_KEY_LENGTH",
    "MAX_META_BYTES",
    "MAX_NODE_TIMEOUT",
    "MAX_RETRY_COUNT",
    "NODE_STATUSES",
    "PID_SPACE",
    "STALE_RENEWAL_FRACTION",
    "STUCK_REASONS",
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
    "NodeSpec",
    "QuorumError",
    "Redlock",
    "RedlockError",
    "TrustRefused",
    "check_flag",
    "check_meta",
    "check_name",
    "check_node_timeout",
    "check_positive",
    "check_prefix",
    "check_retry_count",
    "check_timeout",
    "check_token",
    "connection_args",
    "emit",
    "glob_escape",
    "node_identity",
    "parse_spec",
    "process_gone",
    "redact",
]
