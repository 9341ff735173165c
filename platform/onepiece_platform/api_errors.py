"""One DRF exception handler: the platform's refusals become HTTP answers with a ``detail``.

  Invalid                 400 (413 for sizes), with ``field``
  QuotaExceeded           429 + Retry-After (the user's quota)
  IdempotencyInProgress   409
  EngineRejected          passed through: 400 with ``field``, or 503 + Retry-After (engine capacity)
  EngineError             503 + Retry-After (engine unreachable)
  Redis away              503 + Retry-After (engine.store.outage: the counters, the failed-authentication
                          limit and the job store live there; stopped or restarting is a moment, not a 500)
  ApiError                its status
"""

from __future__ import annotations

from typing import Any

from django.http import Http404
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from engine.store import outage
from onepiece_platform.engine_link.client import EngineError, EngineRejected
from onepiece_platform.jobs.services import IdempotencyInProgress, Invalid
from onepiece_platform.ops import metrics
from onepiece_platform.quotas.counters import QuotaExceeded

ENGINE_DOWN_RETRY_S = 5


class ApiError(Exception):
    """Any other refusal with its status (502 engine failure, 504 wait timed out...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error(status: int, detail: str, field: str = "", retry_after: int | None = None,
          **extra: Any) -> Response:
    body: dict[str, Any] = {"detail": detail, **extra}
    if field:
        body["field"] = field
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return Response(body, status=status, headers=headers)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, Invalid):
        metrics.REJECTIONS.labels(reason="invalid").inc()
        return error(exc.status, exc.message, exc.field)
    if isinstance(exc, QuotaExceeded):
        metrics.REJECTIONS.labels(reason=f"quota_{exc.reason}").inc()
        return error(429, exc.message, retry_after=exc.retry_after, reason=exc.reason)
    if isinstance(exc, IdempotencyInProgress):
        return error(409, "a request with this Idempotency-Key is still being submitted; retry shortly",
                     retry_after=1)
    if isinstance(exc, EngineRejected):
        metrics.REJECTIONS.labels(reason="engine_capacity" if exc.status == 503 else "engine_invalid").inc()
        return error(exc.status, exc.message, exc.field, exc.retry_after if exc.status == 503 else None)
    if isinstance(exc, EngineError):
        metrics.REJECTIONS.labels(reason="engine_unreachable").inc()
        return error(503, f"the engine is unreachable: {exc}", retry_after=ENGINE_DOWN_RETRY_S)
    if isinstance(exc, outage.UNAVAILABLE):
        metrics.REJECTIONS.labels(reason="redis_unavailable").inc()
        return error(503, "the service's store is unavailable; retry shortly", retry_after=outage.RETRY_AFTER_S)
    if isinstance(exc, ApiError):
        return error(exc.status, exc.message)
    if isinstance(exc, ValidationError):
        return _validation(exc)
    if isinstance(exc, Http404):  # get_object_or_404's message names the model class ("No Job matches ...")
        return error(404, "not found: no such object, or not yours")
    return drf_handler(exc, context)


def _validation(exc: ValidationError) -> Response:
    """DRF's ``{field: [messages]}`` as ``{"detail": first message, "field": first field, "errors": all}``."""
    errors = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
    field, messages = next(iter(errors.items()), ("", ["invalid request"]))
    first = messages
    while isinstance(first, (list, dict)) and first:
        first = first[0] if isinstance(first, list) else next(iter(first.values()))
    return error(400, f"{field}: {first}" if field != "non_field_errors" else str(first),
                 "" if field == "non_field_errors" else str(field), errors=errors)
