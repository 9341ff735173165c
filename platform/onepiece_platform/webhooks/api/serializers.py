"""Webhook endpoints as clients send and see them (never the secret, except once at creation), and the
deliveries with every attempt."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from onepiece_platform.api_schema import PageSerializer
from onepiece_platform.strict import RefuseUnknownFields
from onepiece_platform.webhooks import ssrf
from onepiece_platform.webhooks.events import EVENT_TYPES
from onepiece_platform.webhooks.models import PENDING, WebhookAttempt, WebhookDelivery, WebhookEndpoint


def _vetted(url: str) -> str:
    try:
        ssrf.vet(url)
    except ssrf.UnsafeUrl as exc:
        raise serializers.ValidationError(str(exc)) from None
    return url.strip()


class _EndpointFields(RefuseUnknownFields):
    url = serializers.CharField(max_length=ssrf.MAX_URL, help_text="http(s) URL that receives the events (POST)")
    events = serializers.ListField(child=serializers.ChoiceField(choices=EVENT_TYPES), allow_empty=False,
                                   max_length=len(EVENT_TYPES), help_text="event types sent to the URL; default all")
    enabled = serializers.BooleanField(help_text="false: nothing is sent to the URL (its secret still signs the "
                                                 "per-request webhook_url deliveries)")
    description = serializers.CharField(max_length=200, allow_blank=True)

    def validate_url(self, value: str) -> str:
        return _vetted(value)

    def validate_events(self, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class EndpointCreateSerializer(_EndpointFields):
    api_key = serializers.IntegerField(required=False, min_value=1,
                                       help_text="the key whose jobs' events are sent (id from GET /api/v1/keys); "
                                                 "required from a signed-in session, implied with an API key")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("events", "enabled", "description"):
            self.fields[name].required = False


class EndpointUpdateSerializer(_EndpointFields):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for f in self.fields.values():
            f.required = False


class EndpointSerializer(serializers.ModelSerializer):
    api_key = serializers.IntegerField(source="api_key_id", read_only=True)
    secret_hint = serializers.CharField(read_only=True, help_text="the secret's first characters")
    events = serializers.ListField(child=serializers.CharField(), read_only=True)

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "api_key", "url", "events", "enabled", "description", "secret_hint", "created_at",
                  "updated_at"]
        read_only_fields = fields


class NewEndpointSerializer(EndpointSerializer):
    """The answer to a create: the signing secret, shown this once."""

    secret = serializers.CharField(read_only=True, help_text="whsec_...: verifies every delivery's signature")

    class Meta(EndpointSerializer.Meta):
        fields = [*EndpointSerializer.Meta.fields, "secret"]
        read_only_fields = fields


class AttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookAttempt
        fields = ["number", "at", "url", "address", "status_code", "latency_ms", "error", "worker"]
        read_only_fields = fields


class DeliverySerializer(serializers.ModelSerializer):
    webhook_id = serializers.CharField(source="msg_id", read_only=True, help_text="the webhook-id header")
    job = serializers.CharField(source="job.uid", read_only=True, help_text="the job's (video's) id")
    url = serializers.CharField(source="destination", read_only=True)
    next_attempt_at = serializers.SerializerMethodField(help_text="when it is tried next (pending only)")
    attempts = AttemptSerializer(many=True, read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = ["webhook_id", "event_id", "event_type", "job", "target", "url", "state", "attempt_count",
                  "next_attempt_at", "give_up_at", "created_at", "delivered_at", "last_status", "last_error",
                  "attempts"]
        read_only_fields = fields

    @extend_schema_field({"type": "string", "format": "date-time", "nullable": True})
    def get_next_attempt_at(self, d: WebhookDelivery) -> str | None:
        return serializers.DateTimeField().to_representation(d.next_attempt_at) if d.state == PENDING else None


class DeliveryPageSerializer(PageSerializer):
    results = DeliverySerializer(many=True)


class DeliveryListFilter(serializers.Serializer):
    state = serializers.ChoiceField(choices=["pending", "delivered", "failed"], required=False)
