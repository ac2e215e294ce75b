# The unmanaged Lock model: no table, only a content type and the permissions the admin uses.

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Lock",
            fields=[
                ("name", models.CharField(max_length=512, primary_key=True, serialize=False)),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "permissions": [("release_lock", "Can force-release locks")],
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
