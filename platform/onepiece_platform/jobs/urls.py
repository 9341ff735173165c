"""URL routes of the native job API (under /api/v1/): jobs, their results and previews, workflows."""

from django.urls import path

from onepiece_platform.jobs import previews
from onepiece_platform.jobs.api import views

urlpatterns = [
    path("jobs", views.JobListCreateView.as_view(), name="job-list"),
    path("jobs/<str:uid>", views.JobDetailView.as_view(), name="job-detail"),
    path("jobs/<str:uid>/result", views.JobResultView.as_view(), name="job-result"),
    path("jobs/<str:uid>/preview", previews.JobPreviewView.as_view(), name="job-preview"),
    path("workflows", views.WorkflowListView.as_view(), name="workflow-list"),
]
