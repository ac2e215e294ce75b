"""URLs of :mod:`testproject.drf_views`, included under ``/api/`` when DRF is installed."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from . import drf_views

router = SimpleRouter()
router.register("accounts", drf_views.AccountViewSet, basename="api-account")

urlpatterns = [
    path("orders/<int:order_id>/pay/", drf_views.order_pay, name="api-order-pay"),
    path("invoices/<int:invoice_id>/", drf_views.InvoiceAPIView.as_view(), name="api-invoice"),
    *router.urls,
]
