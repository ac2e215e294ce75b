# The lock tables of the database backend (django_redlock.backends.database).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redlock", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="DatabaseLock",
            fields=[
                ("name", models.CharField(max_length=512, primary_key=True, serialize=False)),
                ("token", models.CharField(max_length=64)),
                ("meta", models.TextField(default="{}")),
                ("fence", models.BigIntegerField(null=True)),
                ("acquired_us", models.BigIntegerField()),
                ("expires_us", models.BigIntegerField()),
                ("lease_us", models.BigIntegerField()),
                ("renewals", models.IntegerField(default=0)),
            ],
            options={
                "verbose_name": "database lock",
                "default_permissions": (),
            },
        ),
        migrations.CreateModel(
            name="DatabaseLockFence",
            fields=[
                ("name", models.CharField(max_length=512, primary_key=True, serialize=False)),
                ("value", models.BigIntegerField()),
            ],
            options={
                "default_permissions": (),
            },
        ),
        migrations.CreateModel(
            name="DatabaseLockMutex",
            fields=[
                ("name", models.CharField(max_length=512, primary_key=True, serialize=False)),
            ],
            options={
                "default_permissions": (),
            },
        ),
    ]
