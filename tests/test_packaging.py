"""What a packager and a newcomer read matches what the repository does.

* The README's image and the project URLs point at the one docs site (there is no public
  repository address), and the image is a file the docs build publishes there.
* Every ``package_data`` and ``MANIFEST.in`` pattern matches a file (none is left from code
  that moved, like the old ``*.lua`` patterns).
* The classifiers claim exactly the Python and Django versions the tox matrix and ``.ci/run``
  run (and the README's "Requirements" names them), and ``.ci/run`` runs the README's test
  command verbatim.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
CI_RUN = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
DOCS_SITE = "https://django-redlock.readthedocs.io/"
DOCS_LATEST = DOCS_SITE + "en/latest/"


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.strip().splitlines() if line.strip()]


def test_readme_images_are_absolute_urls_of_published_files() -> None:
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README)
    assert images, "the README shows the admin page"
    for url in images:
        assert url.startswith(DOCS_LATEST), url
        # Sphinx publishes docs/_static/* as <site>/_static/*.
        assert (REPO_ROOT / "docs" / url.removeprefix(DOCS_LATEST)).is_file(), url


def test_project_urls_all_point_at_the_docs_site() -> None:
    metadata = _setup_cfg()["metadata"]
    assert metadata["url"] == DOCS_SITE
    urls = dict(line.split(" = ", 1) for line in _lines(metadata["project_urls"]))
    assert {"Documentation", "Changelog"} <= set(urls)
    for name, url in urls.items():
        assert url.startswith(DOCS_LATEST), (name, url)
        page = url.removeprefix(DOCS_LATEST)
        if page.endswith(".html"):
            assert (REPO_ROOT / "docs" / page.replace(".html", ".rst")).is_file(), (name, url)


def test_package_data_patterns_match_files() -> None:
    package = REPO_ROOT / "django_redlock"
    for pattern in _lines(_setup_cfg()["options.package_data"]["django_redlock"]):
        assert list(package.glob(pattern)), f"package_data pattern {pattern!r} matches nothing"


def test_manifest_patterns_match_files() -> None:
    for line in _lines((REPO_ROOT / "MANIFEST.in").read_text(encoding="utf-8")):
        if line.startswith("#"):
            continue
        command, *args = line.split()
        if command == "include":
            paths = args
        elif command in ("graft", "prune"):
            paths = args if command == "graft" else []
        elif command == "recursive-include":
            directory, *patterns = args
            paths = []
            for pattern in patterns:
                assert list((REPO_ROOT / directory).rglob(pattern)), line
        else:
            raise AssertionError(f"MANIFEST.in command not checked here: {line}")
        for path in paths:
            assert list(REPO_ROOT.glob(path)), f"MANIFEST.in: {line!r} matches nothing"


def _tox_envs() -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "tox.ini")
    return _lines(config["tox"]["envlist"])


def test_classifiers_claim_what_tox_and_ci_run() -> None:
    classifiers = _lines(_setup_cfg()["metadata"]["classifiers"])
    claimed_python = {
        c.rsplit(" :: ", 1)[1] for c in classifiers if re.search(r"Python :: 3\.\d+$", c)
    }
    claimed_django = {
        c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Framework :: Django :: ")
    }
    pairs = [re.fullmatch(r"py3(\d+)-dj(\d)(\d)", env) for env in _tox_envs()]
    tested = [(f"3.{m[1]}", f"{m[2]}.{m[3]}") for m in pairs if m]
    assert tested, _tox_envs()
    assert claimed_python == {python for python, _ in tested}
    assert claimed_django == {django for _, django in tested}
    # .ci/run runs each of those pairs (SUPPORTED_PAIRS), and only those.
    assert _ci_pairs() == sorted(tested)


def _ci_pairs() -> list[tuple[str, str]]:
    block = re.search(r"^SUPPORTED_PAIRS=\((.*?)^\)", CI_RUN, re.S | re.M)
    assert block, "SUPPORTED_PAIRS in .ci/run"
    pairs = re.findall(r'"(3\.\d+) Django>=(\d+\.\d+),<[\d.]+"', block[1])
    return sorted(pairs)


def test_readme_requirements_name_the_pairs_ci_runs() -> None:
    requirements = README.split("## Requirements", 1)[1].split("\n## ", 1)[0]
    text = " ".join(requirements.split())
    for python, django in _ci_pairs():
        assert f"Python {python} with Django {django}" in text, (python, django)
    installation = " ".join((REPO_ROOT / "docs" / "installation.rst").read_text().split())
    for python, django in _ci_pairs():
        assert f"Python {python} with Django {django}" in installation, (python, django)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = "python -m pip install -e '.[test]' && python -m pytest"
    assert f"```sh\n{command}\n```" in README
    assert f'"{command}"' in CI_RUN


def test_readme_docs_command_builds_the_celery_api_page_strictly() -> None:
    match = re.search(
        r"`(python -m pip install -e '\.\[([^\]]+)\]' && sphinx-build [^`]+)`", README
    )
    assert match, "the README gives the docs command"
    assert {"docs", "celery"} <= set(match[2].split(","))
    assert " -W " in match[1]
