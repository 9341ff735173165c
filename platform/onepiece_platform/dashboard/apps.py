"""Django app config of the operators' dashboard."""

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "onepiece_platform.dashboard"
    label = "dashboard"
    verbose_name = "Dashboard"
