# Lock names compare byte for byte on MySQL/MariaDB too. Their default collations ignore case,
# accents and trailing spaces, which made "Invoice:42" and "invoice:42" one lock (and a force
# release of one remove the other). SQLite and PostgreSQL already compare exactly. The plain
# utf8mb4_bin still pads (ignores trailing spaces): the NO PAD binary collations do not.

from django.db import migrations

MODELS = ("DatabaseLock", "DatabaseLockFence", "DatabaseLockMutex")


def binary_names(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    for model_name in MODELS:
        model = apps.get_model("django_redlock", model_name)
        table = schema_editor.quote_name(model._meta.db_table)
        length = model._meta.get_field("name").max_length
        schema_editor.execute(
            f"ALTER TABLE {table} MODIFY name VARCHAR({length}) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
        )


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot roll DDL back: it refuses DDL inside a transaction

    dependencies = [
        ("django_redlock", "0002_database_locks"),
    ]

    operations = [
        migrations.RunPython(binary_names, migrations.RunPython.noop, elidable=False),
    ]
