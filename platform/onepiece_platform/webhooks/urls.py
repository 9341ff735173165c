"""URL routes of the webhooks' REST API (under /api/v1/): endpoints and their deliveries."""

from django.urls import path

from onepiece_platform.webhooks.api import views

urlpatterns = [
    path("webhooks", views.EndpointListView.as_view(), name="webhook-list"),
    path("webhooks/<int:pk>", views.EndpointDetailView.as_view(), name="webhook-detail"),
    path("webhooks/<int:pk>/deliveries", views.DeliveryListView.as_view(), name="webhook-deliveries"),
]
