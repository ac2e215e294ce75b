from django.apps import AppConfig


class RedlockConfig(AppConfig):
    name = "django_redlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        # Registers the system checks and the signals, and the observability receivers the
        # settings ask for (Prometheus metrics with REDLOCK["METRICS"], OpenTelemetry spans
        # where opentelemetry-api is installed). Nothing here may touch Redis: the shared
        # Redlock is built on first use (django_redlock.conf.get_redlock).
        from . import checks, metrics, signals, tracing  # noqa: F401
        from .backends import checks as backend_checks  # noqa: F401

        signals.install()
        metrics.install_from_settings()
        tracing.install_from_settings()
