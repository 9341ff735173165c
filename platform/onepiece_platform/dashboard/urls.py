"""URL routes of the operators' dashboard: its page, its JSON reads and its scaling actions."""

from django.urls import path

from onepiece_platform.dashboard import actions, views

urlpatterns = [
    path("", views.index, name="dashboard"),
    path("api/jobs", views.jobs, name="dashboard-jobs"),
    path("api/jobs/<str:uid>", views.job_detail, name="dashboard-job"),
    path("api/jobs/<str:uid>/result", views.job_result, name="dashboard-job-result"),
    path("api/jobs/<str:uid>/preview", views.job_preview, name="dashboard-job-preview"),
    path("api/traffic", views.traffic, name="dashboard-traffic"),
    path("api/actions", actions.actions, name="dashboard-actions"),
]
