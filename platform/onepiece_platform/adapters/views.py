"""``GET /v1/adapters``: the adapters clients may name in ``lora`` (name, workflow, targets, created; never a
path), read through the engine's registry reader."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.adapters.registry import store
from onepiece_platform.api_schema import native_errors


class AdapterSerializer(serializers.Serializer):
    name = serializers.CharField(help_text='what a request names in lora: [{"name": ..., "scale": ...}]')
    object = serializers.CharField(default="adapter")
    workflow = serializers.CharField(help_text="the workflow (model) it adapts; other workflows refuse it")
    targets = serializers.ListField(child=serializers.CharField(), help_text="the modules of the model it adapts")
    rank = serializers.IntegerField()
    scale_default = serializers.FloatField(help_text="the scale a request that names none gets")
    digest = serializers.CharField(help_text="sha256 of its weights (the job records it)")
    created = serializers.IntegerField(help_text="unix s")


class AdapterListSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = AdapterSerializer(many=True)


def listing(workflow: str | None = None) -> list[dict[str, object]]:
    return [{**a.public(), "object": "adapter", "created": int(a.created)} for a in store().list(workflow)]


class AdapterListView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="listAdapters", parameters=[OpenApiParameter("workflow", str)],
                   responses={200: AdapterListSerializer, **native_errors()})
    def get(self, request: Request) -> Response:
        workflow = request.query_params.get("workflow") or None
        return Response({"object": "list", "data": listing(workflow)})
