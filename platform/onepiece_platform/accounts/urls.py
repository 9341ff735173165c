"""URL routes of the API keys' REST API (under /api/v1/)."""

from django.urls import path

from onepiece_platform.accounts.api import views

urlpatterns = [
    path("keys", views.ApiKeyListView.as_view(), name="api-keys"),
    path("keys/<int:pk>", views.ApiKeyDetailView.as_view(), name="api-key-detail"),
]
