"""The dependency rule: the core (and the package's top-level names) never import Django or
Celery. Checked in a fresh interpreter, so this test process's own imports cannot hide it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO_ROOT, run_python

CHECK = """
import sys
import django_redlock.core
import django_redlock
from django_redlock import (Redlock, LockNotAcquired, LockNotOwned, LockLost, QuorumError,
                            RedlockError)
from django_redlock.core import Lock, LockInfo, NodeHealth
# Using the core without a network call: build a client and a lock handle.
rl = Redlock(["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"])
rl.lock("k", ttl=5)
bad = sorted(m for m in sys.modules
             if m == "django" or m.startswith("django.") or m == "celery"
             or m.startswith("celery.") or m == "kombu" or m.startswith("kombu."))
print("BAD", bad)
assert not bad, bad
print("OK")
"""


def test_core_imports_no_django_or_celery() -> None:
    result = run_python(CHECK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_core_sources_do_not_name_django_or_celery() -> None:
    """Also statically: no import statement in django_redlock/core/ (lazy ones included)."""
    core = Path(REPO_ROOT) / "django_redlock" / "core"
    offenders = []
    for path in sorted(core.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in ("django", "celery", "kombu"):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                offenders.append(
                    f"{path.name}:{node.lineno} imports outside the core "
                    f"(from {'.' * node.level}{node.module or ''})"
                )
    assert not offenders, offenders
