from django.apps import AppConfig


class VideosConfig(AppConfig):
    name = "onepiece_platform.videos"
    default_auto_field = "django.db.models.BigAutoField"
