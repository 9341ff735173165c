"""``/livez`` says the process serves; ``/readyz`` checks the services it depends on; ``/metrics`` for Prometheus.

DRF views without authentication, so they appear in the OpenAPI schema like every other route.
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from onepiece_platform.negotiation import BytesOrJsonNegotiation

HEALTH = inline_serializer("Health", {
    "status": serializers.CharField(help_text="ok, degraded (a supervised process is down or restarting) or "
                                              "unavailable (503: the database or Redis)"),
    "checks": serializers.DictField(child=serializers.CharField(), required=False),
    "processes": serializers.DictField(child=serializers.DictField(), required=False,
                                       help_text="onepiece up's children as its supervisor sees them: state (up, "
                                                 "down, starting), pid, restarts, last_exit, since"),
})


def supervised() -> dict[str, dict[str, object]] | None:
    """The supervisor's view of this process's siblings (``onepiece up``), or None where none is configured."""
    from engine.embedded.supervisor import read_status
    from onepiece_platform import conf

    path = conf.get("SUPERVISOR_STATUS")
    return read_status(path) if path else None


@extend_schema(operation_id="livez", auth=[], responses={200: HEALTH})
@api_view(["GET"])
@authentication_classes([])
@permission_classes([AllowAny])
def livez(request: Request) -> Response:
    return Response({"status": "ok"})


@extend_schema(operation_id="readyz", auth=[], responses={200: HEALTH, 503: HEALTH})
@api_view(["GET"])
@authentication_classes([])
@permission_classes([AllowAny])
def readyz(request: Request) -> Response:
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
    body: dict[str, object] = {"status": "ok" if ok else "unavailable", "checks": checks}
    processes = supervised()
    if processes is not None:
        # a child down or restarting degrades the service (jobs wait, webhooks lag) without making this
        # process unready: it still serves, so the answer stays 200
        body["processes"] = processes
        if ok and any(p.get("state") != "up" for p in processes.values()):
            body["status"] = "degraded"
    return Response(body, status=200 if ok else 503)



class MetricsView(APIView):
    """Prometheus text exposition of this process's metrics (any Accept header: Prometheus sends its own)."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]
    content_negotiation_class = BytesOrJsonNegotiation

    @extend_schema(operation_id="metrics", auth=[],
                   responses={(200, "text/plain"): OpenApiResponse(OpenApiTypes.STR, description="Prometheus text")})
    def get(self, request: Request) -> HttpResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        from onepiece_platform.ops.metrics import register_collectors

        register_collectors()
        return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """JSON 404 for paths no route matches (the API's clients parse JSON, not Django's HTML page)."""
    if request.path.startswith("/v1/"):
        return JsonResponse({"error": {"message": "not found", "type": "invalid_request_error", "param": None,
                                       "code": None}}, status=404)
    return JsonResponse({"detail": "Not found."}, status=404)


def server_error(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"detail": "internal error"}, status=500)
