pytest_plugins = ["django_redlock.testing"]
