"""An unmanaged model that gives the admin page its entry and permissions.

No table is ever created or queried: the locks live on the Redis nodes and the admin views read
them there (the django-rq pattern). The model exists so that Django creates a content type and
two permissions, which the admin checks:

* ``django_redlock.view_lock`` - open the lock list, lock details and the node health panel;
* ``django_redlock.release_lock`` - force-release locks.
"""

from __future__ import annotations

from django.db import models

from .core.validation import MAX_KEY_LENGTH


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
