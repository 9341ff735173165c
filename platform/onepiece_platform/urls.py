"""The platform's root URL table: health, metrics, schema, the APIs, the dashboard and the admin."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from onepiece_platform.accounts.admin_login import throttled_login
from onepiece_platform.jobs import previews
from onepiece_platform.ops import views as ops

urlpatterns = [
    path("livez", ops.livez, name="livez"),
    path("readyz", ops.readyz, name="readyz"),
    path("metrics", ops.MetricsView.as_view(), name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/", include("onepiece_platform.accounts.urls")),
    path("api/v1/", include("onepiece_platform.jobs.urls")),
    path("api/v1/", include("onepiece_platform.webhooks.urls")),
    path("v1/", include("onepiece_platform.jobs.openai_urls")),
    path("v1/", include("onepiece_platform.adapters.urls")),
    path("dashboard/", include("onepiece_platform.dashboard.urls")),
    path("jobs/<str:uid>/watch", previews.watch, name="job-watch"),  # a user's own job, live
    path("admin/login/", throttled_login),  # admin.site.login with failed sign-ins limited
    path("admin/", admin.site.urls),
]

handler404 = "onepiece_platform.ops.views.not_found"
handler500 = "onepiece_platform.ops.views.server_error"
