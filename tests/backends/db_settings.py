"""Settings for the database-backend tests: testproject's, with the database chosen by
``REDLOCK_BACKEND_DB`` (sqlite | postgres | mysql). The test process's pytest-django creates
the test database; the child processes it starts get its name in ``REDLOCK_BACKEND_DB_NAME``.
"""

import os

from testproject.settings import *  # noqa: F403

KIND = os.environ.get("REDLOCK_BACKEND_DB", "sqlite")
NAME = os.environ.get("REDLOCK_BACKEND_DB_NAME", "test")
#: A test database of our own: several runs on one server never drop each other's.
TEST_NAME = os.environ.get("REDLOCK_BACKEND_TEST_DB", f"test_redlock_backends_{os.getpid()}")

if KIND == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": NAME,
            "HOST": os.environ.get("REDLOCK_PG_HOST", "127.0.0.1"),
            "USER": "postgres",
            "TEST": {"NAME": TEST_NAME},
        }
    }
elif KIND == "mysql":
    try:
        import MySQLdb  # noqa: F401  (mysqlclient, when installed)
    except ImportError:
        import pymysql

        pymysql.install_as_MySQLdb()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": NAME,
            "HOST": os.environ.get("REDLOCK_MYSQL_HOST", "127.0.0.1"),
            "USER": "root",
            "TEST": {"NAME": TEST_NAME},
        }
    }
else:  # a file, so that child processes share it (an in-memory test database is per process)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": NAME,
            "TEST": {"NAME": NAME},
            "OPTIONS": {"timeout": 30},
        }
    }
