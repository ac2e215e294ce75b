"""Names of the holds a semaphore and a read/write lock are made of.

A semaphore of ``limit`` permits is ``limit`` mutexes, its *slots*: permit ``k`` of semaphore
``name`` is the lock ``"<name>#permit:<k>"``, taken, renewed, fenced, listed and released as
any lock is. A read/write lock's writer is the lock ``name`` itself; its readers are one hold
per reader, named ``"<name>#read"`` in this process (their per-node state is a set of readers,
see :mod:`.rwscripts`). Every hold of one primitive wakes its waiters on the primitive's one
release channel and shares its fair line, so :func:`base_name` maps a hold back to it.
"""

from __future__ import annotations

__all__ = [
    "PERMIT_SEP",
    "READER_ENTRY",
    "READER_SUFFIX",
    "base_name",
    "is_reader",
    "listed_hold",
    "listed_name",
    "permit_name",
    "permit_of",
    "reader_entry_of",
    "reader_name",
    "reserved_form",
]

#: Between a semaphore's name and its permit's slot number.
PERMIT_SEP = "#permit:"

#: After a read/write lock's name, for the hold of one of its readers.
READER_SUFFIX = "#read"

#: Between a read/write lock's name and a reader's token, in listings (one entry per reader:
#: ``"doc:9#read:<token>"``, which ``force_release`` takes).
READER_ENTRY = "#read:"

#: What every form above starts with: a name without it is no other primitive's hold.
_MARK = "#"
assert all(form.startswith(_MARK) for form in (PERMIT_SEP, READER_SUFFIX, READER_ENTRY))


def permit_name(name: str, slot: int) -> str:
    """The lock that is permit ``slot`` of semaphore ``name``."""
    return f"{name}{PERMIT_SEP}{slot}"


def permit_of(name: str) -> tuple[str, int] | None:
    """``(semaphore, slot)`` when ``name`` is a permit's lock, else None."""
    base, sep, slot = name.rpartition(PERMIT_SEP)
    if sep and base and slot.isdigit() and slot == str(int(slot)):
        return base, int(slot)
    return None


def reader_name(name: str) -> str:
    """The hold of a reader of read/write lock ``name``."""
    return name + READER_SUFFIX


def is_reader(name: str) -> bool:
    return name.endswith(READER_SUFFIX) and len(name) > len(READER_SUFFIX)


def reader_entry_of(name: str) -> tuple[str, str] | None:
    """``(read/write lock, reader token)`` when ``name`` is a listed reader, else None."""
    base, sep, token = name.rpartition(READER_ENTRY)
    if sep and base and token and all(c in "0123456789abcdef" for c in token):
        return base, token
    return None


def listed_name(name: str, token: str) -> tuple[str, str]:
    """How the hold ``name`` taken with ``token`` is named to its user: its listed name
    (which ``lock_info`` and ``force_release`` take: a reader's own entry) and the words an
    error begins with (a reader's names its read/write lock too)."""
    if is_reader(name):
        base = name[: -len(READER_SUFFIX)]
        listed = f"{base}{READER_ENTRY}{token}"
        return listed, f"read lock {base!r} (reader {listed!r})"
    return name, f"lock {name!r}"


def listed_hold(name: str, token: str) -> str | None:
    """The hold a by-token call on ``name`` acts on: a listed reader's own hold (None when
    ``token`` is not that reader's: the listed name means that one reader), else ``name``."""
    entry = reader_entry_of(name)
    if entry is None:
        return name
    base, reader = entry
    return reader_name(base) if reader == token else None


def base_name(name: str) -> str:
    """The primitive a hold belongs to: the semaphore of a permit, the read/write lock of a
    reader, else ``name`` itself."""
    if _MARK not in name:  # the common case, in one test (this runs on every release)
        return name
    if is_reader(name):
        return name[: -len(READER_SUFFIX)]
    permit = permit_of(name)
    return name if permit is None else permit[0]


def reserved_form(name: str) -> str | None:
    """The internal form ``name`` has (a reader's hold or listed entry, a permit), which no
    lock, semaphore or read/write lock may be named: its key would be another primitive's
    hold, listed, looked up and force-released as that hold. Else None."""
    if _MARK not in name:  # the common case, in one test (this runs on every lock())
        return None
    if is_reader(name):
        return f"<name>{READER_SUFFIX}"
    if reader_entry_of(name) is not None:
        return f"<name>{READER_ENTRY}<token>"
    if permit_of(name) is not None:
        return f"<name>{PERMIT_SEP}<k>"
    return None
