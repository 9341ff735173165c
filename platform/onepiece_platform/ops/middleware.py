"""Counts every answered request by route pattern (not raw path: UIDs would explode the label set)."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from onepiece_platform.ops.metrics import REQUESTS


class RequestMetricsMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = match.route if match is not None else "unmatched"
        REQUESTS.labels(route=route, status=str(response.status_code)).inc()
        return response
