"""pytest plugin of the fault-injection suite: the ``--soak`` option and ``fault_profile``.

Loaded from ``tests/conftest.py`` (``pytest_plugins``). ``--soak`` runs every scenario of
``tests/test_faults.py`` ten times longer (``--soak-scale`` to change the factor) and lifts
the per-test timeout accordingly.
"""

from __future__ import annotations

import pytest

from .harness import Profile


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faults", "fault-injection suite (tests/test_faults.py)")
    group.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="run the fault scenarios in the long soak profile (release checks)",
    )
    group.addoption(
        "--soak-scale",
        type=int,
        default=10,
        help="how many times longer the soak profile runs (default 10)",
    )


def _profile(config: pytest.Config) -> Profile:
    if config.getoption("--soak"):
        return Profile.soak(config.getoption("--soak-scale"))
    return Profile.quick()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    profile = _profile(config)
    if profile.scale == 1:
        return
    for item in items:
        if item.get_closest_marker("faults") and item.module.__name__.endswith("test_faults"):
            item.add_marker(pytest.mark.timeout(120 * profile.scale))


@pytest.fixture(scope="session")
def fault_profile(pytestconfig: pytest.Config) -> Profile:
    """The scenario profile: quick (CI) unless ``--soak`` was given."""
    return _profile(pytestconfig)
