"""Every Python example in README.md and docs/**/*.rst runs, against real Redis nodes.

The convention (for whoever adds an example later; nothing needs registering):

* **What runs.** In ``.rst`` files, every ``.. code-block:: python`` (also ``.. code::`` and
  ``.. sourcecode::``, ``python3`` too); in ``README.md``, every fenced block marked
  ```` ```python ````. A ``::`` literal block or a ``console``/``text``/``sh`` block is not an
  example and is not run: use those for shell commands, formulas, key formats and output, and
  ``code-block:: python`` for code a reader may paste.
* **How.** One test per page. The page's examples run top to bottom in one namespace, as a
  reader pasting them in order would, so a later example may use what an earlier one defined
  (``celery.rst`` defines ``sync_account`` and then calls it). Each page runs in a fresh
  interpreter (``python tests/test_docs_examples.py PAGE``) so that what examples do to global
  state (registering admin classes, signal receivers, settings) never reaches other tests.
  Tracebacks point at the page's own line numbers.
* **Redis.** Every ``redis://``/``rediss://``/``unix://`` URL written in a page is replaced by
  the URL of a real embedded node (``django_redlock.testing``), one node per distinct URL (at
  least 3), so examples show realistic addresses (``redis://10.0.0.1:6379/0``) and still run;
  nothing ever connects to an address outside this machine. Django is set up with
  ``testproject.settings`` and ``REDLOCK["NODES"]`` = those nodes, and the example Celery app
  (``app``) publishes to an embedded broker node.
* **Names from the reader's project.** A few names that examples use as the reader's own code
  are predefined (see ``READER_NAMES``): ``app`` (a Celery app), ``env`` (reads the
  environment), ``save_invoice``, ``sentry_sdk``, ``order_id``, ``LOGGING``. Anything else an
  example uses must be imported or defined in the page.
* **Settings an example writes.** A block that assigns a module-level ``REDLOCK`` dict (a
  ``settings.py`` excerpt) is applied to Django's settings once it ran, as a reader editing
  ``settings.py`` would (``setting_changed`` is sent, so ``get_locks()`` rebuilds); its
  addresses were replaced like any other. The database is a fresh SQLite file, migrated
  before a page that uses ``get_locks`` or ``DatabaseLocks``, so the database backend works.
* **Errors an example shows.** An example may end by showing the error it raises as a comment
  line, ``# ValueError: ...`` (any exception class name followed by a colon). The test then
  requires that exception, and fails if the example runs without raising it.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"

# The directive may open a list item or a table cell ("   - .. code-block:: python"); its
# content is indented past the column of its "..".
_RST_DIRECTIVE = re.compile(
    r"^(?P<indent>\s*(?:[-*+]\s+)?)\.\. (?:code-block|code|sourcecode)::\s*python3?\s*$"
)
_MD_FENCE = re.compile(r"^```(?:python3?|py)\s*$")
_URL = re.compile(r"(?:rediss?|unix)://[^\s\"'<>`]+")
_SHOWN_ERROR = re.compile(r"^\s*#\s*(?P<name>[A-Z]\w*):\s")


@dataclass(frozen=True)
class Example:
    page: str  # path relative to the repository root
    line: int  # first line of the code in the page (1-based)
    code: str

    def expected_error(self, known: set[str]) -> str | None:
        for text in self.code.splitlines():
            match = _SHOWN_ERROR.match(text)
            if match and match["name"] in known:
                return match["name"]
        return None


def example_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted(DOCS.rglob("*.rst"))]


def _rst_examples(page: str, lines: list[str]) -> list[Example]:
    found = []
    i = 0
    while i < len(lines):
        match = _RST_DIRECTIVE.match(lines[i])
        i += 1
        if not match:
            continue
        indent = len(match["indent"])
        # Directive options (":caption: ...") and blank lines come before the code.
        while i < len(lines) and (
            not lines[i].strip()
            or (lines[i].strip().startswith(":") and _indent(lines[i]) > indent)
        ):
            i += 1
        start, body = i, []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
            body.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(body)).strip("\n")
        if code:
            found.append(Example(page, start + 1, code + "\n"))
    return found


def _md_examples(page: str, lines: list[str]) -> list[Example]:
    found = []
    i = 0
    while i < len(lines):
        if not _MD_FENCE.match(lines[i]):
            i += 1
            continue
        start = i + 1
        i = start
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        found.append(Example(page, start + 1, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return found


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def examples_of(path: Path) -> list[Example]:
    page = str(path.relative_to(REPO_ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    return _md_examples(page, lines) if path.suffix == ".md" else _rst_examples(page, lines)


# --------------------------------------------------------------------------- the tests

if __name__ != "__main__":
    import pytest

    PAGES = [path for path in example_pages() if examples_of(path)]

    def test_the_collector_finds_the_examples() -> None:
        """Guards the convention itself: a parser that silently found nothing would pass."""
        names = {str(path.relative_to(REPO_ROOT)) for path in PAGES}
        assert {"README.md", "docs/usage.rst", "docs/celery.rst", "docs/testing.rst"} <= names
        assert sum(len(examples_of(path)) for path in PAGES) >= 20
        usage = examples_of(DOCS / "usage.rst")
        assert usage[0].code.startswith("from django_redlock import Redlock")
        assert all(not e.code.startswith((" ", "\n")) for p in PAGES for e in examples_of(p))

    @pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
    def test_examples_run(page: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.pop("DJANGO_SETTINGS_MODULE", None)
        result = subprocess.run(
            [sys.executable, __file__, str(page)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        report = result.stdout.strip().splitlines()
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
        ran = json.loads(report[-1])
        assert ran == {"page": str(page.relative_to(REPO_ROOT)), "ran": len(examples_of(page))}


# --------------------------------------------------------------------------- the runner


def _reader_names(broker_url: str) -> dict[str, object]:
    """Names examples use as the reader's own project code (documented above)."""
    import types

    from testproject.celery_app import app, configure

    configure(app, broker_url)
    app.set_current()
    app.set_default()
    written: list[dict[str, object]] = []
    return {
        "app": app,
        "env": lambda name, default="": os.environ.get(name, default),
        "save_invoice": lambda **fields: written.append(fields),
        "sentry_sdk": types.SimpleNamespace(capture_message=lambda message: None),
        "order_id": 42,
        "LOGGING": {"version": 1, "handlers": {}, "loggers": {}},
    }


READER_NAMES = ("app", "env", "save_invoice", "sentry_sdk", "order_id", "LOGGING")


def _exception_names() -> set[str]:
    import django_redlock

    names = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    names |= {
        n
        for n in django_redlock.__all__
        if isinstance(getattr(django_redlock, n), type)
        and issubclass(getattr(django_redlock, n), BaseException)
    }
    return names


def run_page(path: Path) -> int:
    from django_redlock.testing import RedisCluster, RedisNode

    examples = examples_of(path)
    urls = list(dict.fromkeys(u for e in examples for u in _URL.findall(e.code)))
    with (
        RedisCluster(max(3, len(urls))) as cluster,
        RedisNode() as broker,
        tempfile.TemporaryDirectory() as tmp,
    ):
        replace = dict(zip(urls, cluster.urls, strict=False))
        os.environ["REDLOCK_NODES"] = ",".join(cluster.urls[:3])
        os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
        text = path.read_text()
        with_database = "get_locks" in text or "DatabaseLocks" in text
        os.environ["REDLOCK_SQLITE"] = str(Path(tmp) / "docs.sqlite3")
        import django

        django.setup()
        if with_database:
            from django.core.management import call_command

            call_command("migrate", verbosity=0)
        namespace: dict[str, object] = {"__name__": "docs_example", **_reader_names(broker.url)}
        known_errors = _exception_names()
        from django.test.utils import override_settings

        applied: object = None
        for example in examples:
            code = _URL.sub(lambda m: replace[m.group(0)], example.code)
            # Leading newlines so that tracebacks show the page's own line numbers.
            compiled = compile("\n" * (example.line - 1) + code, example.page, "exec")
            expected = example.expected_error(known_errors)
            try:
                exec(compiled, namespace)
            except BaseException as exc:
                if expected is not None and type(exc).__name__ == expected:
                    continue
                print(f"{example.page}:{example.line}: the example raised")
                traceback.print_exc(file=sys.stdout)
                return 1
            if expected is not None:
                print(f"{example.page}:{example.line}: shows {expected} but did not raise it")
                return 1
            written = namespace.get("REDLOCK")
            if isinstance(written, dict) and written is not applied:
                override_settings(REDLOCK=written).enable()
                applied = written
    print(json.dumps({"page": str(path.relative_to(REPO_ROOT)), "ran": len(examples)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(run_page(Path(sys.argv[1]).resolve()))
