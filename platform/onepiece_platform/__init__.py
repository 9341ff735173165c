"""The OnePiece web platform (Django project package)."""

from onepiece_platform.celery_app import app as celery_app

__all__ = ["celery_app"]
