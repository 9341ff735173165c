"""Celery for administrative jobs only (model warm-up, clean-up), never for inference."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "onepiece_platform.settings.local")

app = Celery("onepiece_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
