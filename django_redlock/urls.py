"""``path("redlock/", include("django_redlock.urls"))``: the probe views (and the Prometheus
metrics when ``REDLOCK["METRICS"]`` is on and ``prometheus_client`` is installed)."""

from django.urls import URLPattern, path

from . import views

app_name = "django_redlock"

urlpatterns: list[URLPattern] = [
    path("ready/", views.ready, name="ready"),
    path("live/", views.live, name="live"),
    path("metrics/", views.metrics, name="metrics"),
]
