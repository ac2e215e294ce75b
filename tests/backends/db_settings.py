"""Settings for the database-backend tests: testproject's, with the database chosen by
``REDLOCK_BACKEND_DB`` (sqlite | postgres | mysql). The test process's pytest-django creates
the test database; the child processes it starts get its name in ``REDLOCK_BACKEND_DB_NAME``.
"""

import os

from testproject.settings import *  # noqa: F403
from tests.backends.databases import database_name

KIND = os.environ.get("REDLOCK_BACKEND_DB", "sqlite")
NAME = os.environ.get("REDLOCK_BACKEND_DB_NAME", "test")
#: A test database of our own, named after the process that creates it: several runs on one
#: server never drop each other's, and one whose creator died is dropped by its reaper or the
#: next run's sweep (tests/backends/databases.py).
TEST_NAME = os.environ.get("REDLOCK_BACKEND_TEST_DB") or database_name()

if KIND in ("postgres", "mysql"):
    from testproject.databases import server_database

    DATABASES = {"default": server_database(KIND, NAME, TEST={"NAME": TEST_NAME})}
else:  # a file, so that child processes share it (an in-memory test database is per process)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": NAME,
            "TEST": {"NAME": NAME},
            "OPTIONS": {"timeout": 30},
        }
    }
