"""Settings for the example project the tests and the demo run.

Redis nodes come from ``REDLOCK_NODES`` (comma-separated URLs), which the test suite and the demo
set to the embedded nodes they start; the database is SQLite unless ``REDLOCK_TEST_DB`` names
``postgres`` or ``mysql``.
"""

import os
from importlib.util import find_spec
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = "testproject-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_redlock",
    "testproject",
]

#: Django REST framework is optional: its views (testproject/drf_views.py, under /api/) and
#: apps are there only when it is installed (the ``test`` extra brings it).
HAS_DRF = find_spec("rest_framework") is not None
if HAS_DRF:
    INSTALLED_APPS += ["rest_framework", "rest_framework.authtoken"]
    REST_FRAMEWORK = {
        "DEFAULT_AUTHENTICATION_CLASSES": [
            "rest_framework.authentication.TokenAuthentication",
            "rest_framework.authentication.SessionAuthentication",
        ],
        "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    }

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"
ASGI_APPLICATION = "testproject.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_DB = os.environ.get("REDLOCK_TEST_DB", "sqlite")
if _DB in ("postgres", "mysql"):
    from testproject.databases import server_database

    DATABASES = {"default": server_database(_DB, "test")}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("REDLOCK_SQLITE", str(BASE_DIR / "db.sqlite3")),
        }
    }
# A second database, for what must follow an instance's own database (fenced_update).
DATABASES["second"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}

DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
STATIC_URL = "/static/"

REDLOCK = {
    "NODES": [u for u in os.environ.get("REDLOCK_NODES", "").split(",") if u]
    or ["redis://127.0.0.1:6379/0"],
    "TTL": 10.0,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_redlock": {"handlers": ["console"], "level": "WARNING"}},
}
