"""Argument checks shared by the sync and async clients.

Everything here runs before any network call, so bad input can never leave a lock half-taken.
"""

from __future__ import annotations

import math
from numbers import Real

__all__ = ["MAX_KEY_LENGTH", "check_name", "check_positive", "check_prefix", "check_timeout"]

#: Longest lock name accepted (characters). Longer names are almost always a bug (a whole
#: request body used as key); the Django layer hashes long keys before they get here.
MAX_KEY_LENGTH = 512


def _encodable(label: str, text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{label} {text!r} is not valid Unicode (lone surrogate)") from None


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("lock name must not be empty")
    _encodable("lock name", name)
    if len(name) > MAX_KEY_LENGTH:
        raise ValueError(
            f"lock name is {len(name)} characters long, the limit is {MAX_KEY_LENGTH}: "
            f"{name[:40]!r}..."
        )
    return name


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


def check_positive(label: str, value: object, *, allow_zero: bool = False) -> float:
    number = _number(label, value)
    if number < 0 or (number == 0 and not allow_zero) or math.isinf(number):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{label} must be finite and {bound}, got {value!r}")
    return number


def check_timeout(value: object) -> float | None:
    """``None`` (use the retry policy), or seconds >= 0; ``inf`` waits for ever."""
    if value is None:
        return None
    number = _number("timeout", value)
    if number < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {value!r}")
    return number
