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


def test_no_import_cycle_inside_the_core() -> None:
    """Modules of django_redlock/core/ import each other in one direction only: the graph of
    their relative imports (lazy and TYPE_CHECKING ones included) has no cycle."""
    core = Path(REPO_ROOT) / "django_redlock" / "core"
    modules = {path.stem for path in core.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(core.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:  # "from . import scripts"
                    deps.update(alias.name for alias in node.names if alias.name in modules)
        graph[path.stem] = deps - {path.stem}
    assert graph["redlock"] and graph["asyncio"], graph  # the parse found the imports
    graph.pop("__init__")
    _assert_acyclic(graph)


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = path[path.index(module) :]
            raise AssertionError("import cycle: " + " -> ".join((*cycle, module)))
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_integrations_import_only_what_the_core_exports() -> None:
    """Outside django_redlock/core/, the package imports the core through
    ``django_redlock.core`` (its ``__all__``), never its modules: the core may be rearranged
    inside without touching the Django, Celery, admin or backend layers."""
    import django_redlock.core

    package = Path(REPO_ROOT) / "django_redlock"
    exported = set(django_redlock.core.__all__)
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if "core" in path.relative_to(package).parts[:1]:
            continue
        depth = len(path.relative_to(package).parts) - 1  # levels below django_redlock/
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                target = "." * node.level + (node.module or "")
                into_core = node.level == depth + 1 and (node.module or "").startswith("core")
            else:
                target = node.module or ""
                into_core = target.startswith("django_redlock.core")
            if not into_core:
                continue
            where = f"{path.relative_to(package)}:{node.lineno}"
            if target.rstrip(".").endswith("core"):
                missing = [a.name for a in node.names if a.name not in exported]
                if missing:
                    offenders.append(f"{where} imports unexported {missing}")
            else:
                offenders.append(f"{where} imports a core module ({target})")
    assert not offenders, offenders


def _package_import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules its import statements name
    (lazy ones and TYPE_CHECKING ones included), resolved to dotted names."""
    root = Path(REPO_ROOT)
    modules: dict[str, Path] = {}
    for path in (root / "django_redlock").rglob("*.py"):
        dotted = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[dotted.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                deps.update(submodules or ({target} & modules.keys()))
        graph[name] = deps - {name}
    return graph


def test_no_import_cycle_anywhere_in_the_package() -> None:
    """The whole package's modules import each other in one direction only (settings ->
    conf -> core, integrations -> conf -> core): no cycle, lazy imports included, so no module
    needs a function-level import to break one."""
    graph = _package_import_graph()
    assert "django_redlock.core.redlock" in graph["django_redlock.core"], graph[
        "django_redlock.core"
    ]
    assert "django_redlock.setting" in graph["django_redlock.conf"]  # the parse resolved them
    _assert_acyclic(graph)


def test_the_algorithm_reads_no_clock_and_draws_no_random_number() -> None:
    """``core/algorithm.py`` is the spec's control flow only: the time comes from the driver
    (a ``Send``'s ``started``/``ended``) and the jitter from the source the client hands in,
    so it imports neither a clock nor a random source, nor the transport's sockets; the
    deterministic simulator relies on it."""
    path = Path(REPO_ROOT) / "django_redlock" / "core" / "algorithm.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(alias.name for alias in node.names if node.module is None)
    assert imported, "the parse found the imports"
    forbidden = {"time", "random", "secrets", "clock", "datetime", "socket", "select", "uuid"}
    assert not imported & forbidden, imported & forbidden
