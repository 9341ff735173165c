"""Settings shared by every environment. Environment-specific files override."""

from __future__ import annotations

import os
from pathlib import Path

from engine import envs

REPO_ROOT = Path(__file__).resolve().parents[3]
# every ONEPIECE_* variable is read through engine.envs (its one default); a relative state folder (the
# default, .onepiece) is the repository's, wherever the web process was started
STATE_DIR = REPO_ROOT / envs.STATE_DIR

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure-development-key-change-me")
DEBUG = False
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "onepiece_platform.ops",
    "onepiece_platform.accounts",
    "onepiece_platform.quotas",
    "onepiece_platform.jobs",
    "onepiece_platform.engine_link",
    "onepiece_platform.dashboard",
    "onepiece_platform.videos",
    "onepiece_platform.webhooks",
    "onepiece_platform.adapters",
]

MIDDLEWARE = [
    "onepiece_platform.ops.middleware.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the dashboard's) from STATIC_ROOT after `collectstatic`, compressed and cached,
    # with no web server in front needed; with DEBUG on, runserver's own handler serves them.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "onepiece_platform.urls"
ASGI_APPLICATION = "onepiece_platform.asgi.application"
WSGI_APPLICATION = "onepiece_platform.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": envs.SQLITE_PATH or str(STATE_DIR / "db.sqlite3"),
        # The web process and the reconciler write at once. WAL lets readers run beside the one
        # writer; IMMEDIATE takes the write lock at BEGIN, so a writer waits its turn (up to
        # ``timeout`` seconds) instead of failing with "database is locked" when a read
        # transaction tries to become a write one.
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = STATE_DIR / "static"
STATICFILES_DIRS = [REPO_ROOT / "frontend" / "static"] if (REPO_ROOT / "frontend" / "static").is_dir() else []
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # gzip/brotli copies at collectstatic time; names stay unhashed (the template's {% static %} works
    # with or without a manifest, so a missing collectstatic is a 404, not a 500 on every page)
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

REDIS_URL = envs.REDIS_URL or envs.LOCAL_REDIS_URL
ETCD_URL = envs.ETCD_URL or envs.LOCAL_ETCD_URL

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # A socket timeout above the layer's 5 s blocking pop (BZPOPMIN): redis-py 8 defaults it to 5 s,
        # which turns every quiet websocket's wait into a TimeoutError and drops the socket
        # (django/channels_redis#422).
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]},
    }
}

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "onepiece_platform.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # Quotas are atomic counters (onepiece_platform.quotas), not DRF's read-then-write throttles.
    "DEFAULT_THROTTLE_CLASSES": [],
    "EXCEPTION_HANDLER": "onepiece_platform.api_errors.exception_handler",
    # JSON nested too deeply, form fields that are not UTF-8: 400s, not a RecursionError or U+FFFD in a
    # prompt (onepiece_platform.strict)
    "DEFAULT_PARSER_CLASSES": [
        "onepiece_platform.strict.StrictJSONParser",
        "onepiece_platform.strict.StrictFormParser",
        "onepiece_platform.strict.StrictMultiPartParser",
    ],
}

# The platform's own settings (defaults and meanings: onepiece_platform/conf.py).
ONEPIECE = {
    "PROXY_URL": envs.PROXY_URL,
    "ENGINE_CLIENT": envs.ENGINE_CLIENT,
    "PROXY_TOKEN": envs.PROXY_TOKEN or "",
    "SUPERVISOR_STATUS": envs.SUPERVISOR_STATUS,
    "OBJECT_STORE": envs.OBJECT_STORE or "",
    "OBJECT_STORE_PUBLIC_URL": envs.OBJECT_STORE_PUBLIC_URL or "",
}
# Bodies are bounded before parsing (413); Django's own cap sits just above the platform's.
DATA_UPLOAD_MAX_MEMORY_SIZE = (16 << 20) * 4 // 3 + (128 << 10)
SPECTACULAR_SETTINGS = {
    "TITLE": "OnePiece API",
    "DESCRIPTION": "Serving multi-stage AIGC workflows (image-to-video, text-to-image).",
    "VERSION": "0.1.0",
}

# Celery runs administrative jobs only (model warm-up, clean-up); JSON only.
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BEAT_SCHEDULE = {
    "clean-up": {"task": "onepiece.clean_up", "schedule": 3600.0},
    # outputs whose retention ended (jobs' retention: docs/api.md), deleted within 5 minutes of it
    "expire-outputs": {"task": "onepiece.expire_outputs", "schedule": 300.0},
}
DEFAULT_EXCEPTION_REPORTER_FILTER = "onepiece_platform.debug.RedactingReporterFilter"  # service URLs hold passwords
