"""The OpenAI-compatible surface's shared parts: its error shape and its base view.

Errors use OpenAI's shape ``{"error": {message, type, param, code}}`` with the same status codes and
Retry-After as the native API. The routes are in their apps: videos (``onepiece_platform.videos.api``)
and images (``onepiece_platform.jobs.api.openai_images``), mounted by ``onepiece_platform.jobs.openai_urls``.
"""

from __future__ import annotations

import logging
from typing import Any

from drf_spectacular.utils import OpenApiResponse
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from onepiece_platform.jobs import services
from onepiece_platform.jobs.api import openai_serializers as s
from onepiece_platform.jobs.result_urls import URL_MAX_AGE_S as URL_MAX_AGE_S
from onepiece_platform.jobs.result_urls import URL_SALT as URL_SALT
from onepiece_platform.jobs.result_urls import sign_result_url as sign_result_url

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 410: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 502: "server_error", 503: "server_error",
          504: "server_error"}


def _openai_error(data: Any, status: int) -> dict[str, Any]:
    message, param = "error", None
    if isinstance(data, dict):
        if "detail" in data:
            message, param = str(data["detail"]), data.get("field")
        elif data:
            param = next(iter(data))
            v = data[param]
            message = f"{param}: {v[0] if isinstance(v, list) and v else v}"
    elif isinstance(data, list) and data:
        message = str(data[0])
    code = data.get("reason") if isinstance(data, dict) else None
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


ERRORS = {c: OpenApiResponse(s.OpenAIErrorSerializer) for c in (400, 401, 403, 404, 409, 410, 413, 429, 502, 503,
                                                                        504)}


def error_responses(*codes: int) -> dict[int, OpenApiResponse]:
    """Errors in OpenAI's shape; 401 and 429 (failed-authentication limit) on every operation."""
    return {c: ERRORS[c] for c in sorted(set(codes) | {401, 429})}


class OpenAIView(APIView):
    """Errors in OpenAI's shape; everything else as the native API."""

    permission_classes = [IsAuthenticated]

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        response.data = _openai_error(response.data, response.status_code)
        return response

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(response, Response) and response.status_code >= 400 and "error" not in (response.data or {}):
            response.data = _openai_error(response.data, response.status_code)
        return super().finalize_response(request, response, *args, **kwargs)


def output_options(d: dict[str, Any]) -> services.OutputOptions:
    """The output's options of a validated create request (OnePiece extensions, sent in extra_body)."""
    return services.OutputOptions(d.get("retention"), d.get("output_upload_url", ""), d["keep_output"])
