"""Endpoints (the secret never shown), and the outbox: every delivery with its attempts, read-only,
with an action that sends failed deliveries again now."""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from onepiece_platform import conf
from onepiece_platform.admin_base import ReadOnlyAdmin, ReadOnlyInline
from onepiece_platform.webhooks.models import (
    FAILED,
    PENDING,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
)


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    list_display = ["id", "url", "api_key", "enabled", "created_at", "updated_at"]
    list_filter = ["enabled"]
    search_fields = ["url", "api_key__prefix", "api_key__user__username"]
    fields = ["api_key", "url", "events", "enabled", "description", "secret_hint", "created_at", "updated_at"]
    readonly_fields = ["api_key", "secret_hint", "created_at", "updated_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # created through the API, where the secret can be shown once


class WebhookAttemptInline(ReadOnlyInline):
    model = WebhookAttempt
    fields = ["number", "at", "status_code", "latency_ms", "error", "address", "url", "worker"]


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):  # the outbox is written by the ledger and worker
    inlines = [WebhookAttemptInline]
    list_display = ["msg_id", "event_type", "job", "target", "state", "attempt_count", "last_status",
                    "next_attempt_at", "created_at", "delivered_at"]
    list_filter = ["state", "event_type", "target"]
    search_fields = ["=msg_id", "=event_id", "=job__uid", "url", "endpoint__url"]
    date_hierarchy = "created_at"
    actions = ["send_again"]

    @admin.action(description="Send failed deliveries again now (same webhook-id; retried for another 24 h)")
    def send_again(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        from onepiece_platform.accounts.models import audit

        now = timezone.now()
        give_up = now + dt.timedelta(seconds=float(conf.get("WEBHOOK_MAX_AGE_S")))
        # only failed ones: a delivered row would reach its receiver twice, and a pending one may be in a
        # worker's hands right now (clearing its claim would let a second worker send it at the same time)
        n = queryset.filter(state=FAILED).update(state=PENDING, next_attempt_at=now, give_up_at=give_up,
                                                 claim_token="")
        audit(request.user, "webhook.send_again", "", count=n)
        skipped = queryset.count() - n
        self.message_user(request, f"{n} failed deliveries queued" + (f"; {skipped} not failed, left as they are"
                                                                     if skipped else ""))
