"""Django app config of ops (health, metrics); registers the system checks when the app is ready."""

from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "onepiece_platform.ops"
    label = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        from onepiece_platform.ops import checks  # noqa: F401 - registers the system checks
