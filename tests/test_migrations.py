"""What ``manage.py migrate django_redlock`` creates, as docs/installation.rst says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

INSTALLATION = Path(__file__).resolve().parent.parent / "docs" / "installation.rst"
TABLES = {
    "django_redlock_databaselock",
    "django_redlock_databaselockfence",
    "django_redlock_databaselockmutex",
}


@pytest.mark.django_db
def test_the_migrations_create_three_tables_and_two_permissions():
    from django.contrib.auth.models import Permission
    from django.db import connection

    tables = {t for t in connection.introspection.table_names() if t.startswith("django_redlock")}
    assert tables == TABLES  # the admin's Lock model is unmanaged: no table of its own
    codenames = set(
        Permission.objects.filter(content_type__app_label="django_redlock").values_list(
            "codename", flat=True
        )
    )
    assert codenames == {"view_lock", "release_lock"}


def test_the_installation_page_names_exactly_those_tables():
    text = INSTALLATION.read_text()
    assert set(re.findall(r"``(django_redlock_\w+)``", text)) == TABLES
    assert "three tables" in text
