"""Settings for the test suite; services come from the fixtures in tests/conftest.py."""

from onepiece_platform.settings.base import *  # noqa: F403

DEBUG = False
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
# No collectstatic in tests: WhiteNoise serves frontend/static through the finders, as with DEBUG on;
# the test of production serving collects into a temporary STATIC_ROOT of its own.
STATIC_ROOT = None
WHITENOISE_USE_FINDERS = True
