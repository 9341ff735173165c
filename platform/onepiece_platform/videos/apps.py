"""Django app config of videos; loads the decode and encode libraries once, before any request."""

from django.apps import AppConfig


class VideosConfig(AppConfig):
    name = "onepiece_platform.videos"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Decode and encode libraries load here, once, before any request: imported lazily by the first
        # requests instead, two threads of the server could import numpy at the same time, and one of them
        # can get the module half initialised ("partially initialized module 'numpy'", seen under load).
        import imageio  # noqa: F401
        import numpy  # noqa: F401
        from PIL import Image  # noqa: F401
