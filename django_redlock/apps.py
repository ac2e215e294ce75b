from django.apps import AppConfig


class RedlockConfig(AppConfig):
    name = "django_redlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        # Registers the system checks; nothing here may touch Redis.
        from . import checks  # noqa: F401
