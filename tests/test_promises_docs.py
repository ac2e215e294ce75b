"""The docs back their claims by naming tests (``test_flushed_node_does_not_vote_at_once``,
``tests/test_trust.py``): every test and test file README.md and docs/*.rst name exists, so a
renamed or removed test cannot leave a page pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]
TEST_NAME = re.compile(r"``(?:(tests/[\w/]+\.py)::)?(test_\w+)``")
TEST_FILE = re.compile(r"\btests/[\w/]+\.py\b")


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_a_page_names_exists() -> None:
    tests = defined_tests()
    missing = []
    for page in PAGES:
        for path, name in TEST_NAME.findall(page.read_text()):
            if path and f"def {name}(" not in (ROOT / path).read_text():
                missing.append(f"{page.name}: {path}::{name}")
            elif name not in tests:
                missing.append(f"{page.name}: {name}")
    assert not missing, missing


def test_every_test_file_a_page_names_exists() -> None:
    missing = [
        f"{page.name}: {path}"
        for page in PAGES
        for path in TEST_FILE.findall(page.read_text())
        if not (ROOT / path).exists()
    ]
    assert not missing, missing


def test_the_collector_sees_the_names() -> None:
    text = (ROOT / "docs" / "guarantees.rst").read_text()
    assert "test_flushed_node_does_not_vote_at_once" in {n for _, n in TEST_NAME.findall(text)}


BENCH_FILE = re.compile(r"(?<![\w/.~-])bench/[\w/.-]+\.(?:py|md|txt|json|rst)\b")


def test_every_benchmark_script_and_result_a_page_names_exists() -> None:
    """Numbers the pages present as measured name the script that measures them and, often,
    the file that holds the run: both must be in the repository."""
    named = {(page.name, path) for page in PAGES for path in BENCH_FILE.findall(page.read_text())}
    assert len(named) > 10, named
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, missing
