"""Django app config of quotas (per-user limits and counters)."""

from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "onepiece_platform.quotas"
    label = "quotas"
    verbose_name = "Quotas"
