"""Embedded defaults for one machine (`onepiece up`).

``onepiece up`` passes a SECRET_KEY generated into its state folder
(DJANGO_SECRET_KEY) and turns DEBUG on only with ``--debug`` (ONEPIECE_DEBUG):
a debug error page shows settings, service URLs and paths to whoever gets one.
"""

from engine import envs
from onepiece_platform.settings.base import *  # noqa: F403

DEBUG = envs.DEBUG.lower() in ("1", "true", "yes")
# No collectstatic step on one machine: WhiteNoise serves the dashboard's files from the finders.
WHITENOISE_USE_FINDERS = True
# Webhook receivers and output_upload_url buckets on this machine or its network are what a local set-up calls
# (production refuses them); ONEPIECE_WEBHOOK_ALLOW_PRIVATE=0 refuses them here too (a shared host; the audit).
ONEPIECE = {**ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": envs.WEBHOOK_ALLOW_PRIVATE != "0"}  # noqa: F405
