"""The storage side of fencing tokens: a conditional UPDATE that only a newer holder can win.

A lock taken with ``fencing=True`` carries ``lock.fence``, an integer larger than the fence of
every earlier holder of the same name (docs/guarantees, "Fencing tokens"). The lock alone cannot
stop a holder that was paused past its lease (a GC pause, SIGSTOP, a VM migration) from writing
after it resumes: by then another client may hold the lock and have written already. The
storage has to refuse the late write, and it can, if every write carries the writer's fence and
the row remembers the largest fence that wrote it.

This is the optimistic version check of seed 002 (MySQL: ``UPDATE ... SET version = version + 1
WHERE id = ? AND version = ?``, zero rows affected means someone else wrote first), with the
lock's fence as the version and ``<`` instead of ``=``: the row is written only if its stored
fence is lower than the writer's (or NULL, never written under a fence), in the same statement
that writes the new values and the new fence. A single UPDATE is atomic per row on every
database Django supports (PostgreSQL re-checks the WHERE clause against the committed row after
waiting for a concurrent writer; InnoDB's UPDATE reads the current row under its row lock;
SQLite locks the database), so two writers can never both pass the check, and an older writer
can never overwrite a newer one, whatever order their statements arrive in.

Usage::

    with redlock.lock(f"account:{pk}", fencing=True) as lock:
        account = Account.objects.get(pk=pk)
        if not fenced_update(account, lock.fence, balance=account.balance - 10):
            ...  # a newer holder has written this row: our lock was lost while we worked

The fence column must hold 64-bit integers (``models.BigIntegerField(null=True)``): fences are
seeded from the nodes' clocks in microseconds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from django.db import models, router
from django.db.models import Q

__all__ = ["afenced_update", "fenced_update"]


@runtime_checkable
class _HasFence(Protocol):
    fence: int | None


Target = models.QuerySet[Any] | models.Model
Fence = int | _HasFence


def fenced_update(
    target: Target,
    fence: Fence,
    *,
    fence_field: str = "fence",
    allow_equal: bool = False,
    **values: Any,
) -> bool:
    """Write ``values`` and ``fence`` to the row(s) of ``target`` only where the stored fence is
    lower than ``fence`` (or NULL), in one conditional UPDATE; return whether it won.

    ``target`` is a model instance (its row, by primary key) or a queryset (each row it
    selects is checked on its own). ``fence`` is the lock's fence (an int), or the lock
    itself. ``values`` are the columns to set, as for :meth:`QuerySet.update` (``F()``
    expressions allowed). The SQL is::

        UPDATE t SET <values>, fence = %s WHERE pk = ... AND (fence < %s OR fence IS NULL)

    Returns True when the row was written (for a queryset: at least one row), False when a
    holder with an equal or larger fence had already written it: the caller's lock is stale
    and it must not act as the holder any more. An instance that won also gets ``values``
    (plain ones, not expressions) and the new fence set on its attributes.

    An equal fence is refused by default, so each acquisition writes a row at most once (a
    retried or duplicated write cannot apply twice). ``allow_equal=True`` (``<=``) lets one
    holder write the same row several times; it is just as safe against stale holders, since
    no two acquisitions share a fence.
    """
    queryset, instance, fence = _prepare(target, fence, fence_field, allow_equal, values)
    rows = queryset.update(**{**values, fence_field: fence})
    return _won(rows, instance, fence, fence_field, values)


async def afenced_update(
    target: Target,
    fence: Fence,
    *,
    fence_field: str = "fence",
    allow_equal: bool = False,
    **values: Any,
) -> bool:
    """:func:`fenced_update` for async code (one ``QuerySet.aupdate``)."""
    queryset, instance, fence = _prepare(target, fence, fence_field, allow_equal, values)
    rows = await queryset.aupdate(**{**values, fence_field: fence})
    return _won(rows, instance, fence, fence_field, values)


def _prepare(
    target: Target, fence: Fence, fence_field: str, allow_equal: bool, values: dict[str, Any]
) -> tuple[models.QuerySet[Any], models.Model | None, int]:
    if not isinstance(fence, int) and isinstance(fence, _HasFence):
        if fence.fence is None:
            raise ValueError(
                "this lock has no fence: acquire it with fencing=True (and hold it) first"
            )
        fence = fence.fence
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError(f"fence must be an int (a lock's .fence), got {fence!r}")
    if fence_field in values:
        raise ValueError(f"{fence_field!r} is the fence column: it is set to the fence itself")
    instance: models.Model | None = None
    if isinstance(target, models.Model):
        if target.pk is None:
            raise ValueError("fenced_update needs a saved instance (its pk is None)")
        instance = target
        # The instance's own database, as save() would pick it (a row loaded with .using()
        # is written there, not in the default database).
        db = router.db_for_write(type(target), instance=target)
        queryset = type(target)._base_manager.db_manager(db).filter(pk=target.pk)
    elif isinstance(target, models.QuerySet):
        queryset = target
    else:
        raise TypeError(f"fenced_update takes a model instance or a queryset, got {target!r}")
    # Raises FieldDoesNotExist early, with the model's name, for a wrong fence_field.
    queryset.model._meta.get_field(fence_field)
    lookup = "lte" if allow_equal else "lt"
    older = Q(**{f"{fence_field}__{lookup}": fence}) | Q(**{f"{fence_field}__isnull": True})
    return queryset.filter(older), instance, fence


def _won(
    rows: int,
    instance: models.Model | None,
    fence: int,
    fence_field: str,
    values: dict[str, Any],
) -> bool:
    if instance is None:
        return rows > 0
    if rows != 1:
        return False
    for name, value in values.items():
        if not hasattr(value, "resolve_expression"):
            setattr(instance, name, value)
    setattr(instance, fence_field, fence)
    return True
