"""The migration guide's behaviour tables and the compatibility suites name each other: every
``test_row_*`` a section of docs/migrating.rst names is a test of its suite, and every such test
of the suite is named in the guide (so a row cannot lose its test, nor a test its row)."""

from __future__ import annotations

import re
from types import ModuleType

from tests.helpers import REPO_ROOT

_ROW = re.compile(r"``(test_row_\w+)``")


def section(title: str) -> str:
    """The text of the docs/migrating.rst section headed ``title``, up to the next one."""
    lines = (REPO_ROOT / "docs" / "migrating.rst").read_text().splitlines()
    heads = [
        i
        for i in range(len(lines) - 1)
        if lines[i] and set(lines[i + 1]) == {"-"} and len(lines[i + 1]) >= len(lines[i])
    ]
    start = next(i for i in heads if lines[i] == title)
    end = next((i for i in heads if i > start), len(lines))
    return "\n".join(lines[start:end])


def assert_rows_match(module: ModuleType, *titles: str) -> None:
    named = {name for title in titles for name in _ROW.findall(section(title))}
    defined = {name for name in vars(module) if name.startswith("test_row_")}
    assert named, f"no test_row_* named in {titles}"
    assert named - defined == set(), f"rows naming no test of {module.__name__}"
    assert defined - named == set(), f"tests of {module.__name__} no row names"
