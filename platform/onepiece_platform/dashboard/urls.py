from django.urls import path

from onepiece_platform.dashboard import views

urlpatterns = [
    path("", views.index, name="dashboard"),
    path("api/jobs", views.jobs, name="dashboard-jobs"),
    path("api/actions", views.actions, name="dashboard-actions"),
]
