"""``/api/v1/webhooks``: an API key's endpoint (one per key) and its deliveries.

Scoped like every native route: a signed-in session sees the endpoints of all its user's keys, an API
key sees only its own; anything else is 404, never 403 and never someone else's data.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from onepiece_platform.accounts.models import ApiKey, audit
from onepiece_platform.api_errors import error
from onepiece_platform.api_schema import native_errors
from onepiece_platform.jobs.services import Invalid
from onepiece_platform.strict import AsciiPageNumberPagination
from onepiece_platform.webhooks import signing
from onepiece_platform.webhooks.api.serializers import (
    DeliveryListFilter,
    DeliveryPageSerializer,
    DeliverySerializer,
    EndpointCreateSerializer,
    EndpointSerializer,
    EndpointUpdateSerializer,
    NewEndpointSerializer,
)
from onepiece_platform.webhooks.events import EVENT_TYPES
from onepiece_platform.webhooks.models import WebhookDelivery, WebhookEndpoint


def own_endpoints(request: Request) -> QuerySet[WebhookEndpoint]:
    qs = WebhookEndpoint.objects.filter(api_key__user=request.user)
    if isinstance(request.auth, ApiKey):
        qs = qs.filter(api_key=request.auth)
    return qs


def _key_for(request: Request, wanted: int | None) -> ApiKey:
    """The key a new endpoint belongs to: the calling key, or (from a session) the user's key named."""
    if isinstance(request.auth, ApiKey):
        if wanted is not None and wanted != request.auth.pk:
            raise Invalid("api_key", "an API key manages its own webhook endpoint only")
        return request.auth
    if wanted is None:
        raise Invalid("api_key", "api_key is required from a signed-in session: the id of one of your keys")
    key = ApiKey.objects.filter(pk=wanted, user=request.user).first()
    if key is None or not key.active:
        raise Invalid("api_key", f"you have no active API key {wanted}")
    return key


class EndpointListView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="listWebhookEndpoints", responses={200: EndpointSerializer(many=True),
                                                                   **native_errors()})
    def get(self, request: Request) -> Response:
        return Response(EndpointSerializer(own_endpoints(request), many=True).data)

    @extend_schema(operation_id="createWebhookEndpoint", request=EndpointCreateSerializer,
                   responses={201: NewEndpointSerializer, **native_errors(400, 409)})
    def post(self, request: Request) -> Response:
        """One endpoint per API key; the answer carries its ``whsec_`` secret, shown this once."""
        s = EndpointCreateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        d = s.validated_data
        key = _key_for(request, d.get("api_key"))
        try:
            with transaction.atomic():
                endpoint = WebhookEndpoint.objects.create(
                    api_key=key, url=d["url"], events=d.get("events") or list(EVENT_TYPES),
                    enabled=d.get("enabled", True), description=d.get("description", ""),
                    secret=signing.new_secret())
        except IntegrityError:
            return error(409, "this API key has a webhook endpoint already: change it (PATCH) or delete it first",
                         "api_key")
        audit(request.user, "webhook.create", str(endpoint.pk), url=endpoint.url, api_key=key.prefix)
        return Response(NewEndpointSerializer(endpoint).data, status=status.HTTP_201_CREATED)


class EndpointDetailView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="getWebhookEndpoint", responses={200: EndpointSerializer, **native_errors(404)})
    def get(self, request: Request, pk: int) -> Response:
        return Response(EndpointSerializer(get_object_or_404(own_endpoints(request), pk=pk)).data)

    @extend_schema(operation_id="updateWebhookEndpoint", request=EndpointUpdateSerializer,
                   responses={200: EndpointSerializer, **native_errors(400, 404)})
    def patch(self, request: Request, pk: int) -> Response:
        """Change the URL, the events, enable or disable (pending deliveries to a disabled endpoint wait)."""
        endpoint = get_object_or_404(own_endpoints(request), pk=pk)
        s = EndpointUpdateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        for name, value in s.validated_data.items():
            setattr(endpoint, name, value)
        endpoint.save()
        audit(request.user, "webhook.update", str(endpoint.pk), **{k: v for k, v in s.validated_data.items()})
        return Response(EndpointSerializer(endpoint).data)

    @extend_schema(operation_id="deleteWebhookEndpoint", request=None,
                   responses={204: None, **native_errors(404)})
    def delete(self, request: Request, pk: int) -> Response:
        """Delete the endpoint, its secret and its deliveries (pending ones are not sent)."""
        endpoint = get_object_or_404(own_endpoints(request), pk=pk)
        audit(request.user, "webhook.delete", str(endpoint.pk), url=endpoint.url)
        endpoint.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class DeliveryPagination(AsciiPageNumberPagination):
    page_size = 20
    page_size_query_param = "page_size"
    max_page_size = 100


class DeliveryListView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="listWebhookDeliveries",
                   parameters=[OpenApiParameter("state", str, enum=["pending", "delivered", "failed"]),
                               OpenApiParameter("page", int), OpenApiParameter("page_size", int)],
                   responses={200: DeliveryPageSerializer, **native_errors(400, 404)})
    def get(self, request: Request, pk: int) -> Response:
        """The endpoint's deliveries, newest first, each with every attempt (status, latency, error)."""
        endpoint = get_object_or_404(own_endpoints(request), pk=pk)
        f = DeliveryListFilter(data=request.query_params)
        f.is_valid(raise_exception=True)
        qs = (WebhookDelivery.objects.filter(endpoint=endpoint).select_related("job", "endpoint")
              .prefetch_related("attempts"))
        if "state" in f.validated_data:
            qs = qs.filter(state=f.validated_data["state"])
        pager = DeliveryPagination()
        page = pager.paginate_queryset(qs, request, view=self)
        return pager.get_paginated_response(DeliverySerializer(page, many=True).data)
