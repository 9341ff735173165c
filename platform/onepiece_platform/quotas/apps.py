from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "onepiece_platform.quotas"
    label = "quotas"
    verbose_name = "Quotas"
