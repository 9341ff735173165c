from django.contrib import admin
from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from onepiece_platform.ops import views as ops

urlpatterns = [
    path("livez", ops.livez, name="livez"),
    path("readyz", ops.readyz, name="readyz"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("admin/", admin.site.urls),
]
