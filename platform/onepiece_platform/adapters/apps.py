"""Django app config of adapters (LoRA adapters on the platform)."""

from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "onepiece_platform.adapters"
    label = "adapters"
    verbose_name = "LoRA adapters"
