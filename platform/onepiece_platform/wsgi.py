"""WSGI entry (management and plain HTTP deployments); the product runs on ASGI."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "onepiece_platform.settings.local")
application = get_wsgi_application()

from onepiece_platform.ops.checks import refuse_weak_secrets  # noqa: E402 - needs the settings loaded

refuse_weak_secrets()
