"""``/livez`` says the process serves; ``/readyz`` checks the services it depends on."""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse


def livez(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    try:
        connection.ensure_connection()
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {exc}"
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1).ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {exc}"
    ok = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status=200 if ok else 503)


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of this process's metrics."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    from onepiece_platform.ops.metrics import register_collectors

    register_collectors()
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
