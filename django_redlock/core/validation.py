"""Argument checks shared by the sync and async clients.

Everything here runs before any network call, so bad input can never leave a lock half-taken.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

from .kinds import base_name, is_reader, permit_of, reader_entry_of, reserved_form

__all__ = [
    "MAX_DURATION",
    "MAX_KEY_LENGTH",
    "MAX_META_BYTES",
    "MAX_NODE_TIMEOUT",
    "MAX_RETRY_COUNT",
    "MIN_FAIR_HEARTBEAT",
    "check_fair_heartbeat",
    "check_flag",
    "check_handle_options",
    "check_meta",
    "check_name",
    "check_node_timeout",
    "check_pattern",
    "check_positive",
    "check_prefix",
    "check_reentry_fence",
    "check_retry_count",
    "check_timeout",
    "check_token",
    "default_max_ttl",
]

#: Longest lock name accepted (characters). Longer names are almost always a bug (a whole
#: request body used as key); the Django layer hashes long keys before they get here.
MAX_KEY_LENGTH = 512


#: A reader's token in its listed name (``"name#read:<token>"``): 16 random bytes in hex.
READER_TOKEN_LENGTH = 32


#: Longest duration accepted (seconds; one year): leases, max_ttl, delays, heartbeats and finite
#: waits. Milliseconds of it fit every integer the nodes and the OS take (PEXPIRE, poll(),
#: Condition.wait), so nothing accepted here can overflow later, after a key was written.
MAX_DURATION = 365 * 86400.0

#: Longest ``node_timeout`` (seconds): a per-node wait is meant to be a few tens of ms; beyond
#: a minute it is a mistake (and poll() takes at most ~24 days in ms).
MAX_NODE_TIMEOUT = 60.0

#: Largest ``retry_count``: beyond it, ask for a ``timeout`` instead.
MAX_RETRY_COUNT = 1000

#: Largest holder ``meta`` (bytes of JSON): it goes to every node with every acquire and
#: renewal, and is shown on the admin page; bulk data belongs elsewhere.
MAX_META_BYTES = 64 * 1024


def _encodable(label: str, text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{label} {text!r} is not valid Unicode (lone surrogate)") from None


def check_name(name: object, *, listed: bool = False) -> str:
    """A lock name, checked. Without ``listed``, the name a user gives a lock, semaphore or
    read/write lock: none of the forms the package names their holds with. With ``listed``,
    a hold's name as a listing shows it (a permit, a reader's entry, for ``lock_info``,
    ``force_release`` and the by-token calls), which may pass the limit by its suffix."""
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("lock name must not be empty")
    if not name.isascii():  # an ASCII name encodes (the common case, without a copy)
        _encodable("lock name", name)
    if len(name) > MAX_KEY_LENGTH and not (listed and _listed_hold_fits(name)):
        raise ValueError(
            f"lock name is {len(name)} characters long, the limit is {MAX_KEY_LENGTH}: "
            f"{name[:40]!r}..."
        )
    form = None if listed else reserved_form(name)
    if form is not None:
        raise ValueError(
            f"lock name {name!r} has the form {form!r}, reserved for the holds of semaphores "
            "and read/write locks"
        )
    return name


def _listed_hold_fits(name: str) -> bool:
    """Whether ``name``, over the limit, is a hold of a semaphore or read/write lock whose own
    name is within it: those are listed under their primitive's name plus a suffix, and a
    listed name must stay usable."""
    permit = permit_of(name)
    if permit is not None:
        return len(permit[0]) <= MAX_KEY_LENGTH and permit[1] < MAX_LIMIT
    entry = reader_entry_of(name)
    if entry is not None:
        return len(entry[0]) <= MAX_KEY_LENGTH and len(entry[1]) <= READER_TOKEN_LENGTH
    return is_reader(name) and len(base_name(name)) <= MAX_KEY_LENGTH


def check_pattern(pattern: object) -> str:
    """A listing's glob on lock names (``live_locks``)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__} {pattern!r}")
    _encodable("pattern", pattern)
    return pattern


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"key_prefix must be a str, got {prefix!r}")
    # No ':' either: under prefix "app:lock" the lock "x" would share the key of lock
    # "lock:x" under prefix "app" (keys are "<prefix>:lock:<name>").
    if not prefix or any(c in prefix for c in "*?[]{}\\: ") or not prefix.isprintable():
        raise ValueError(
            f"key_prefix {prefix!r} must be non-empty, without ':', glob characters, spaces "
            "or control characters"
        )
    _encodable("key_prefix", prefix)
    return prefix


def _number(label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{label} must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{label} {value!r} is out of range") from None
    if math.isnan(number):
        raise ValueError(f"{label} must be a number, got {value!r}")
    return number


def default_max_ttl(ttl: float) -> float:
    """``max_ttl`` when none is given: the longer of ``ttl`` and a minute (the restart guard
    keeps a node that lost its data out of the vote that long)."""
    return max(ttl, 60.0)


def check_positive(
    label: str, value: object, *, allow_zero: bool = False, maximum: float = MAX_DURATION
) -> float:
    """Seconds, finite, > 0 (or >= 0 with ``allow_zero``) and at most ``maximum``."""
    number = _number(label, value)
    if number < 0 or (number == 0 and not allow_zero) or math.isinf(number):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{label} must be finite and {bound}, got {value!r}")
    if number > maximum:
        raise ValueError(f"{label} must be at most {maximum:g} seconds, got {value!r}")
    return number


#: The shortest ``fair_heartbeat``: a waiter asks the nodes at least every third of it, so a
#: heartbeat of a millisecond made one waiter send tens of thousands of commands a second.
MIN_FAIR_HEARTBEAT = 0.1


def check_fair_heartbeat(value: object) -> float:
    number = check_positive("fair_heartbeat", value)
    if number < MIN_FAIR_HEARTBEAT:
        raise ValueError(
            f"fair_heartbeat must be at least {MIN_FAIR_HEARTBEAT:g} seconds (a waiter asks "
            f"the nodes every third of it), got {value!r}"
        )
    return number


def check_node_timeout(value: object) -> float:
    return check_positive("node_timeout", value, maximum=MAX_NODE_TIMEOUT)


def check_retry_count(value: object, label: str = "retry_count") -> int:
    """A number of retries, in 0..MAX_RETRY_COUNT; ``label`` names the argument the caller
    passed (``retry_count`` of a client, ``retries`` of a handle)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {value!r}")
    if not 0 <= value <= MAX_RETRY_COUNT:
        raise ValueError(
            f"{label} must be between 0 and {MAX_RETRY_COUNT}, got {value!r} "
            "(for a longer wait pass a timeout)"
        )
    return value


def check_timeout(value: object) -> float | None:
    """``None`` (use the retry policy), or seconds >= 0; ``inf`` waits for ever."""
    if value is None:
        return None
    number = _number("timeout", value)
    if number < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {value!r}")
    if MAX_DURATION < number < math.inf:
        raise ValueError(
            f"timeout must be at most {MAX_DURATION:g} seconds, got {value!r} "
            "(float('inf') waits for ever)"
        )
    return number


def check_token(token: object) -> str:
    """A holder's token as :attr:`Lock.token` or ``detach()`` handed it out: a non-empty str."""
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {token!r}")
    if not token:
        raise ValueError("token must not be empty")
    return token


def check_meta(
    meta: object, *, str_keys: bool = True, besides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Holder details for the admin page: a dict (with ``str_keys``, of str keys: they become
    JSON) that can be written as JSON (other values as their ``str()``) in at most
    :data:`MAX_META_BYTES`, together with the client's details ``besides`` that go with it;
    a copy is returned. None is an empty dict."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict, got {meta!r}")
    if str_keys:
        bad = [k for k in meta if not isinstance(k, str)]
        if bad:
            raise TypeError(f"meta keys must be str, got {bad[0]!r} in {meta!r}")
    try:
        size = len(json.dumps(meta, default=str, allow_nan=False))  # ASCII: a char, a byte
    except (TypeError, ValueError) as exc:  # a circular reference, a key JSON cannot take
        raise ValueError(f"meta cannot be written as JSON: {exc}") from None
    with_client = ""
    if besides and meta and size <= MAX_META_BYTES:
        size = len(json.dumps({**besides, **meta}, default=str))
        with_client = " with the client's"
    if size > MAX_META_BYTES:
        raise ValueError(
            f"meta is {size} bytes of JSON{with_client}, the limit is {MAX_META_BYTES}: it "
            "goes to every node with every acquire and renewal"
        )
    return dict(meta)


def check_flag(label: str, value: object) -> bool:
    """A yes/no option: True or False, nothing that merely looks like one (``"no"`` is
    truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{label} must be True or False, got {value!r}")
    return value


def check_handle_options(
    name: str,
    auto_renew: object,
    fencing: object,
    fair: object,
    blocking: object,
    owner: object,
    renew_for: object,
    /,
) -> float | None:
    """The options every lock service's handle takes, checked alike (the Redlock's, the
    backends'): flags that are bools, a hashable ``owner`` (it keys the reentrancy table)
    and ``renew_for`` only with ``auto_renew`` (it caps the renewal). Returns ``renew_for``
    as seconds, or None."""
    # Plain bools need no check (every handle runs this): the checks only find which is not.
    if not (
        auto_renew.__class__ is fencing.__class__ is fair.__class__ is blocking.__class__ is bool
    ):
        check_flag("auto_renew", auto_renew)
        check_flag("fencing", fencing)
        check_flag("fair", fair)
        check_flag("blocking", blocking)
    if owner is not None:
        try:
            hash(owner)
        except TypeError:
            raise TypeError(f"owner must be hashable, got {owner!r}") from None
    if renew_for is None:
        return None
    seconds = check_positive("renew_for", renew_for)
    if not auto_renew:
        raise ValueError(
            f"renew_for={renew_for!r} caps auto-renewal: {name!r} needs auto_renew=True"
        )
    return seconds


#: The most permits a semaphore may have: each is a slot read by every acquire that finds
#: the first one it tries taken.
MAX_LIMIT = 1000


def check_limit(limit: object, label: str = "limit") -> int:
    """A semaphore's number of permits: an int in 1..MAX_LIMIT."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{label} must be an int (a semaphore's permits), got {limit!r}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"{label} must be 1..{MAX_LIMIT}, got {limit!r}")
    return limit


def check_reentry_fence(name: str, fencing: bool, fence: int | None) -> None:
    """A reentrant hold shares the outer acquisition's fence; it cannot draw one the outer
    acquisition did not (an error rather than a silent None)."""
    if fencing and fence is None:
        raise ValueError(
            f"lock {name!r} is already held by this owner without fencing; a "
            "reentrant hold cannot add a fence (take the outer lock with fencing=True)"
        )
