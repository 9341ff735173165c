"""Settings for the test suite; services come from the fixtures in tests/conftest.py."""

import os
import secrets

from engine import envs
from onepiece_platform.settings.base import *  # noqa: F403

# The Proxy's shared secret for this test run: set in the environment (tests/conftest.py does the same,
# whichever loads first), so every Proxy a fixture starts and every client a test makes agree on it.
os.environ.setdefault("ONEPIECE_PROXY_TOKEN", secrets.token_urlsafe(24))
ONEPIECE = {**ONEPIECE, "PROXY_TOKEN": envs.PROXY_TOKEN}  # noqa: F405

DEBUG = False
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
# No collectstatic in tests: WhiteNoise serves frontend/static through the finders, as with DEBUG on;
# the test of production serving collects into a temporary STATIC_ROOT of its own.
STATIC_ROOT = None
WHITENOISE_USE_FINDERS = True
