"""The database servers of the example project, the tests and the benchmarks: one place for
their addresses (``REDLOCK_PG_HOST`` / ``REDLOCK_MYSQL_HOST``, set by ``.ci/run``) and for the
MySQL driver.
"""

from __future__ import annotations

import os
from typing import Any


def install_mysql_driver() -> None:
    """Make ``import MySQLdb`` work before Django's MySQL backend is loaded.

    Django imports ``MySQLdb`` (mysqlclient, a C extension that needs the MySQL client
    headers to build). The ``test`` and ``bench`` extras ship PyMySQL instead (pure Python,
    nothing to compile); mysqlclient is used when it happens to be installed.
    """
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        import pymysql

        pymysql.install_as_MySQLdb()


def server_database(kind: str, name: str, **extra: Any) -> dict[str, Any]:
    """A ``DATABASES`` entry for the local ``kind`` server ("postgres": user postgres;
    "mysql": MariaDB/MySQL, user root without password)."""
    if kind == "postgres":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "HOST": os.environ.get("REDLOCK_PG_HOST", "127.0.0.1"),
            "USER": "postgres",
            **extra,
        }
    install_mysql_driver()
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": name,
        "HOST": os.environ.get("REDLOCK_MYSQL_HOST", "127.0.0.1"),
        "USER": "root",
        **extra,
    }
