"""Production: PostgreSQL, secrets from the environment, TLS terminated in front."""

import os

from engine import envs
from onepiece_platform.settings.base import *  # noqa: F403

DEBUG = False
# empty or a placeholder is refused by the system check onepiece.E001 (onepiece_platform/ops/checks.py)
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
ALLOWED_HOSTS = os.environ["DJANGO_ALLOWED_HOSTS"].split(",")
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("POSTGRES_DB", "onepiece"),
        "USER": os.environ.get("POSTGRES_USER", "onepiece"),
        "PASSWORD": os.environ.get("POSTGRES_PASSWORD", ""),
        "HOST": os.environ.get("POSTGRES_HOST", "localhost"),
        "PORT": os.environ.get("POSTGRES_PORT", "5432"),
        "CONN_MAX_AGE": 60,
    }
}
# TLS is terminated by the ingress / load balancer, which sets X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# ...and appends the client's address to X-Forwarded-For (used to rate-limit failed authentications).
ONEPIECE = {**ONEPIECE, "TRUSTED_PROXY_HOPS": envs.TRUSTED_PROXY_HOPS,  # noqa: F405
            "STRICT_SECRETS": True,
            # webhooks: https only (ONEPIECE_WEBHOOK_REQUIRE_HTTPS=0 allows http), never a private address
            "WEBHOOK_REQUIRE_HTTPS": envs.WEBHOOK_REQUIRE_HTTPS != "0",
            "WEBHOOK_ALLOW_PRIVATE": False}
SECURE_SSL_REDIRECT = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_HSTS_SECONDS = 31536000
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
