from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "onepiece_platform.ops"
    label = "ops"
    verbose_name = "Operations"
