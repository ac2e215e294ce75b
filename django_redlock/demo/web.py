"""The example project (``testproject`` of a source checkout) set up in the demo's process,
and a real threaded HTTP server for it.

The server runs in a thread of the demo's process rather than in a child, so the tour can hold
a request inside a ``@locked`` view with the project's test gates (``?gate=<name>``) and let it
go once a second request was answered, without any sleep.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["DemoError", "Reply", "WebServer", "fetch", "repository_root", "setup_django"]


class DemoError(RuntimeError):
    """The demo cannot go on (message for the user, no traceback)."""


def repository_root() -> Path:
    """The checkout this package was installed from (editable), which holds ``testproject``."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "testproject" / "settings.py").is_file():
        raise DemoError(
            f"the demo serves the example project testproject/, which is not next to {root}: "
            "run it from a clone of the repository installed with "
            "`python -m pip install -e '.[demo]'`"
        )
    return root


def setup_django(nodes: list[str], workdir: Path) -> None:
    """Configure ``testproject.settings`` for the demo's nodes, with its SQLite database in
    ``workdir``, and run ``django.setup()``. The environment variables set here are the ones
    the project's settings and Celery app read, and a Celery worker started later inherits."""
    root = str(repository_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ["REDLOCK_NODES"] = ",".join(nodes)
    os.environ["REDLOCK_SQLITE"] = str(workdir / "db.sqlite3")
    os.environ.pop("REDLOCK_TEST_DB", None)  # the demo needs no database server: SQLite

    import django

    django.setup()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadedServer(ThreadingMixIn, WSGIServer):
    # A request still waiting inside a view must not keep the process alive at exit.
    daemon_threads = True


class WebServer:
    """The project's WSGI application (plus the admin's static files) on a real HTTP port."""

    def __init__(self, host: str, port: int) -> None:
        from django.contrib.staticfiles.handlers import StaticFilesHandler
        from django.core.wsgi import get_wsgi_application

        app = StaticFilesHandler(get_wsgi_application())
        # Each 423 would be logged as a warning too; the tour prints the answers itself. (Set
        # after get_wsgi_application(): its django.setup() resets the logging configuration.)
        logging.getLogger("django.request").setLevel(logging.ERROR)
        self.note = ""
        try:
            self._server = self._make(host, port, app)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise
            self._server = self._make(host, 0, app)
            self.note = f"port {port} is in use, took {self._server.server_port} instead"
        threading.Thread(target=self._server.serve_forever, name="demo-web", daemon=True).start()

    @staticmethod
    def _make(host: str, port: int, app: Any) -> WSGIServer:
        return make_server(
            host, port, app, server_class=_ThreadedServer, handler_class=_QuietHandler
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_name, self._server.server_port
        address = str(self._server.server_address[0])
        return f"http://{host if address in ('0.0.0.0', '::') else address}:{port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: str


def fetch(url: str, timeout: float = 15.0) -> Reply:
    """GET ``url``; an HTTP error status is a reply too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return Reply(response.status, dict(response.headers), response.read().decode())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, dict(exc.headers), exc.read().decode())
