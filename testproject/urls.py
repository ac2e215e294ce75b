from django.conf import settings
from django.contrib import admin
from django.urls import include, path

from . import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("redlock/", include("django_redlock.urls")),
    path("orders/<int:order_id>/pay/", views.order_pay, name="order-pay"),
    path("orders/<int:order_id>/pay-wait/", views.order_pay_wait, name="order-pay-wait"),
    path("reports/<slug:name>/", views.report, name="report"),
    path("profile/", views.profile, name="profile"),
    path("ledger/<str:account>/", views.ledger, name="ledger"),
    path("invoices/<int:invoice_id>/", views.InvoiceView.as_view(), name="invoice"),
    path(
        "async-invoices/<int:invoice_id>/", views.AsyncInvoiceView.as_view(), name="async-invoice"
    ),
    path("exports/<slug:name>.csv", views.export, name="export"),
    path("async-exports/<slug:name>.csv", views.async_export, name="async-export"),
    path("renewed-exports/<slug:name>.csv", views.renewed_export),
    path("renewed-async-exports/<slug:name>.csv", views.renewed_async_export),
    path("ping/", views.ping, name="ping"),
    path("ping-locked/", views.ping_locked, name="ping-locked"),
]

if settings.HAS_DRF:
    urlpatterns.append(path("api/", include("testproject.drf_urls")))
