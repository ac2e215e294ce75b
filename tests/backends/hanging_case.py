"""A database test that never ends, for the cleanup tests of tests/test_backend_database.py:
run by a child pytest with tests/backends/db_settings.py, it writes the name of its test
database to ``REDLOCK_HANG_REPORT`` once that database exists, then waits until the run is
killed (by pytest-timeout, SIGKILL, or Ctrl-C)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from django.db import connection

from tests.backends.database_cases import _test_database_reaped  # noqa: F401  (the cleanup)

# Ctrl-C stands for an interrupted run in a terminal. A run started in the background by a
# non-interactive shell (`cmd &`, as CI scripts and nohup do) has SIGINT ignored, which its
# child processes inherit, and the signal would then never reach this run.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.django_db(transaction=True)
def test_hangs_holding_its_test_database() -> None:
    with connection.cursor() as cursor:  # the test database exists and is in use
        cursor.execute("SELECT 1")
    Path(os.environ["REDLOCK_HANG_REPORT"]).write_text(connection.settings_dict["NAME"])
    threading.Event().wait()
