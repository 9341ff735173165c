"""System checks of the platform's own security settings (ids ``onepiece.E0xx``), like DRF's checks.

``onepiece.E001``: with ``ONEPIECE['STRICT_SECRETS']`` (production settings),
``SECRET_KEY`` must be a real secret: not empty, not short, not a placeholder
from the manifests or examples (``change-me``), not Django's or this
project's development key. Anyone holding the key can forge signed result
URLs, sessions and password-reset tokens. Management commands run the check;
the ASGI and WSGI entries run it too (:func:`refuse_weak_secrets`), so a web
process with a weak key refuses to start.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.core.exceptions import ImproperlyConfigured

from onepiece_platform import conf

MIN_SECRET_KEY_CHARS = 50
PLACEHOLDERS = ("change-me", "changeme", "insecure", "placeholder", "secret-key", "example", "xxxx")


def secret_key_problem(key: str) -> str | None:
    """Why ``key`` is not a usable SECRET_KEY, or None."""
    if not key:
        return "SECRET_KEY is empty"
    if len(key) < MIN_SECRET_KEY_CHARS or len(set(key)) < 5:
        return f"SECRET_KEY is too short or too simple (at least {MIN_SECRET_KEY_CHARS} random characters)"
    low = key.lower()
    if key.startswith("django-insecure") or any(p in low for p in PLACEHOLDERS):
        return "SECRET_KEY is a placeholder, not a secret"
    return None


@register(Tags.security)
def check_secret_key(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    if not conf.get("STRICT_SECRETS"):
        return []
    problem = secret_key_problem(getattr(settings, "SECRET_KEY", "") or "")
    if problem is None:
        return []
    return [Error(problem, hint="Set DJANGO_SECRET_KEY to e.g. `python -c 'import secrets; "
                                "print(secrets.token_urlsafe(50))'` (a Kubernetes Secret, the systemd env file).",
                  id="onepiece.E001")]


def refuse_weak_secrets() -> None:
    """Raise ImproperlyConfigured when :func:`check_secret_key` finds an error (server start-up)."""
    errors = check_secret_key()
    if errors:
        raise ImproperlyConfigured("; ".join(f"{e.id}: {e.msg}" for e in errors))
