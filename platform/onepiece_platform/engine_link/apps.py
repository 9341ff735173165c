"""Django app config of engine_link (the platform's link to the engine)."""

from django.apps import AppConfig


class EngineLinkConfig(AppConfig):
    name = "onepiece_platform.engine_link"
    label = "engine_link"
    verbose_name = "Engine link"
