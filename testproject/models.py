"""Models of the example project: a row written under a fenced lock (tests/test_fencing_orm.py
and docs/guarantees, "Fencing tokens")."""

from django.db import models


class Account(models.Model):
    """A balance that lock holders update with :func:`django_redlock.fencing.fenced_update`.

    ``fence`` is the fence of the last holder that wrote the row (NULL: never written under a
    lock). It is a 64-bit column: fences are seeded from the Redis nodes' clocks in microseconds.
    """

    name = models.CharField(max_length=100, default="")
    balance = models.IntegerField(default=0)
    fence = models.BigIntegerField(null=True, blank=True)

    class Meta:
        app_label = "testproject"

    def __str__(self) -> str:
        return f"{self.name or self.pk}: {self.balance} (fence {self.fence})"
