from django.urls import path

from onepiece_platform.adapters.views import AdapterListView

urlpatterns = [path("adapters", AdapterListView.as_view(), name="adapters")]
