"""An unmanaged model that gives the admin page its entry and permissions.

No table is ever created or queried: the locks live on the Redis nodes and the admin views read
them there (the django-rq pattern). The model exists so that Django creates a content type and
two permissions, which the admin checks:

* ``django_redlock.view_lock`` - open the lock list, lock details and the node health panel;
* ``django_redlock.release_lock`` - force-release locks.
"""

from __future__ import annotations

from django.db import models

from .core import MAX_KEY_LENGTH


class Lock(models.Model):
    """A lock on the Redis nodes, as the admin shows it (never saved)."""

    name: models.CharField[str, str] = models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True)

    class Meta:
        managed = False
        # Only "view": adding, changing and deleting rows make no sense for Redis keys.
        default_permissions = ("view",)
        permissions = [("release_lock", "Can force-release locks")]
        verbose_name = "lock"
        verbose_name_plural = "locks"

    def __str__(self) -> str:
        return self.name


class DatabaseLock(models.Model):
    """A lock held through :class:`django_redlock.backends.database.DatabaseLocks`.

    Times are microseconds since the epoch by the database's clock (written by the backend's
    SQL, never by a client), so every client agrees on when a lease ended.
    """

    name: models.CharField[str, str] = models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True)
    token: models.CharField[str, str] = models.CharField(max_length=64)
    meta: models.TextField[str, str] = models.TextField(default="{}")  # JSON
    fence: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(null=True)
    acquired_us: models.BigIntegerField[int, int] = models.BigIntegerField()
    expires_us: models.BigIntegerField[int, int] = models.BigIntegerField()
    lease_us: models.BigIntegerField[int, int] = models.BigIntegerField()
    renewals: models.IntegerField[int, int] = models.IntegerField(default=0)

    class Meta:
        default_permissions = ()
        verbose_name = "database lock"

    def __str__(self) -> str:
        return self.name


class DatabaseLockFence(models.Model):
    """The last fence handed out per lock name; outlives the lock rows, so fences of a name
    keep increasing after its lock was released or force-released."""

    name: models.CharField[str, str] = models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True)
    value: models.BigIntegerField[int, int] = models.BigIntegerField()

    class Meta:
        default_permissions = ()


class DatabaseLockMutex(models.Model):
    """One row per name a ``pessimistic`` database lock was taken on: the row its holder keeps
    ``SELECT ... FOR UPDATE`` on for the lock's life."""

    name: models.CharField[str, str] = models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True)

    class Meta:
        default_permissions = ()
