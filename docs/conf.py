"""Sphinx configuration for django-redlock."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# autodoc imports django_redlock; its Django layer needs configured settings.
try:
    import django
    from django.conf import settings

    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        settings.configure(
            INSTALLED_APPS=[
                "django.contrib.auth",
                "django.contrib.contenttypes",
                "django.contrib.admin",
                "django_redlock",
            ],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            REDLOCK={"NODES": ["redis://127.0.0.1:6379/0"]},
            USE_TZ=True,
        )
    django.setup()
except Exception as exc:  # the package may not be importable yet; autodoc will say so
    warnings.warn(f"django setup for autodoc failed: {exc!r}", stacklevel=1)

# -- Project information -----------------------------------------------------
project = "django-redlock"
author = "django_redlock developers"
copyright = "2026, django_redlock developers"
try:
    from django_redlock import __version__ as release
except Exception:
    release = "0.0.0"
version = ".".join(release.split(".")[:2])

# -- General configuration ---------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
]
templates_path: list[str] = []
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Intersphinx fetches inventories over the network at build time; CI has none.
# Opt in with DOCS_INTERSPHINX=1.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
if os.environ.get("DOCS_INTERSPHINX") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "django": (
            "https://docs.djangoproject.com/en/stable/",
            "https://docs.djangoproject.com/en/stable/_objects/",
        ),
        "redis": ("https://redis.readthedocs.io/en/stable/", None),
        "celery": ("https://docs.celeryq.dev/en/stable/", None),
    }

# -- HTML output -------------------------------------------------------------
html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = f"django-redlock {release}"
html_static_path = ["_static"]
