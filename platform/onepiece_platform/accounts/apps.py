"""Django app config of accounts; registers the OpenAPI Bearer scheme when the app is ready."""

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "onepiece_platform.accounts"
    label = "accounts"
    verbose_name = "Accounts and API keys"

    def ready(self) -> None:
        from onepiece_platform.accounts import schema  # noqa: F401 - registers the OpenAPI scheme
