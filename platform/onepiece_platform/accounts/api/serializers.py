"""API keys as clients see them: never the secret, except once in the answer to a create."""

from __future__ import annotations

from django.utils import timezone
from rest_framework import serializers

from onepiece_platform.accounts.models import ApiKey


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: never its secret."""

    active = serializers.BooleanField(read_only=True)
    max_priority = serializers.CharField(source="max_priority_allowed", read_only=True,
                                         help_text="the highest request priority this key may use: its "
                                                   "owner's tier (set by an operator; by default high for "
                                                   "staff, normal for others), or lower where the key is capped")

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "created_at", "expires_at", "revoked_at", "last_used_at", "active",
                  "max_priority"]
        read_only_fields = ["id", "prefix", "created_at", "revoked_at", "last_used_at", "active", "max_priority"]

    def validate_expires_at(self, value):  # type: ignore[no-untyped-def]
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("expires_at must be in the future")
        return value


class NewApiKeySerializer(ApiKeySerializer):
    """The answer to a create: the full key, shown this once."""

    key = serializers.CharField(read_only=True)

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
