from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "onepiece_platform.adapters"
    label = "adapters"
    verbose_name = "LoRA adapters"
