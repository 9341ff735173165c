"""A user's own API keys: list, create (the key is shown once), revoke."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from onepiece_platform.accounts.api.serializers import ApiKeySerializer, NewApiKeySerializer
from onepiece_platform.accounts.models import ApiKey, audit
from onepiece_platform.api_schema import native_errors


class ApiKeyListView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="listApiKeys", responses={200: ApiKeySerializer(many=True), **native_errors()})
    def get(self, request: Request) -> Response:
        keys = ApiKey.objects.filter(user=request.user).select_related("user", "user__priority_tier")
        return Response(ApiKeySerializer(keys, many=True).data)

    @extend_schema(operation_id="createApiKey", request=ApiKeySerializer, responses={201: NewApiKeySerializer, **native_errors(400, 403)})
    def post(self, request: Request) -> Response:
        """Only from a signed-in session (dashboard, admin): a key that could mint keys would let a
        stolen key outlive its own revocation through children that never expire."""
        if isinstance(request.auth, ApiKey):
            raise PermissionDenied("API keys are created from a signed-in session, not with another API key")
        s = ApiKeySerializer(data=request.data)
        s.is_valid(raise_exception=True)
        key, raw = ApiKey.issue(request.user, s.validated_data.get("name", ""), s.validated_data.get("expires_at"))
        audit(request.user, "api_key.issue", key.prefix)
        key.key = raw  # type: ignore[attr-defined]
        return Response(NewApiKeySerializer(key).data, status=status.HTTP_201_CREATED)


class ApiKeyDetailView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="revokeApiKey", request=None, responses={200: ApiKeySerializer, **native_errors(403, 404)})
    def delete(self, request: Request, pk: int) -> Response:
        """Revoke (idempotent); another user's key is 404."""
        key = get_object_or_404(ApiKey, pk=pk, user=request.user)
        key.revoke()
        audit(request.user, "api_key.revoke", key.prefix)
        return Response(ApiKeySerializer(key).data)
