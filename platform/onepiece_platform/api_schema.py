"""Error responses for the OpenAPI schema: every authenticated operation can answer 401 and 429.

429 comes from the failed-authentication limit as well as from quotas, so it
is documented on every operation that takes an API key.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers


class PageSerializer(serializers.Serializer):
    # A page of a native list; a subclass declares ``results``. (No docstring: it would become the
    # description of every page in the OpenAPI schema.)
    count = serializers.IntegerField()
    next = serializers.CharField(allow_null=True)
    previous = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    """Every error of the native API: ``detail`` always; ``field`` names the culprit where there is one."""

    detail = serializers.CharField()
    field = serializers.CharField(required=False)
    errors = serializers.DictField(required=False, help_text="all validation messages, by field")
    reason = serializers.CharField(required=False, help_text="which quota (concurrent, gpu_seconds)")
    state = serializers.CharField(required=False)


def native_errors(*codes: int, authenticated: bool = True) -> dict[int, OpenApiResponse]:
    wanted = set(codes) | ({401, 429} if authenticated else set())
    return {c: OpenApiResponse(ErrorSerializer) for c in sorted(wanted)}
