"""Django app config of webhooks; registers the delivery lease's system check when the app is ready."""

from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "onepiece_platform.webhooks"
    label = "webhooks"
    verbose_name = "Completion webhooks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from onepiece_platform.webhooks import checks  # noqa: F401 - registers the system check
