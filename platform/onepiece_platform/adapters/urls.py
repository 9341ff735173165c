"""URL route of the adapters clients may name (GET /v1/adapters)."""

from django.urls import path

from onepiece_platform.adapters.views import AdapterListView

urlpatterns = [path("adapters", AdapterListView.as_view(), name="adapters")]
