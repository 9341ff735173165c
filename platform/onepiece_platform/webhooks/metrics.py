"""Webhook gauges read from the outbox at scrape time (the delivery worker is another process)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class WebhookCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        from django.db.models import Count, Min
        from django.utils import timezone

        from onepiece_platform.webhooks.models import DELIVERED, FAILED, PENDING, WebhookDelivery

        by_state = GaugeMetricFamily("onepiece_webhook_deliveries", "Webhook deliveries in the outbox by state",
                                     labels=["state"])
        oldest = GaugeMetricFamily("onepiece_webhook_oldest_pending_seconds",
                                   "Age of the oldest delivery not yet accepted by its receiver (0: none)")
        try:
            counts = dict.fromkeys((PENDING, DELIVERED, FAILED), 0)
            counts.update({r["state"]: r["n"] for r in WebhookDelivery.objects.values("state").annotate(n=Count("id"))})
            for state, n in counts.items():
                by_state.add_metric([state], n)
            first = WebhookDelivery.objects.filter(state=PENDING).aggregate(t=Min("created_at"))["t"]
            oldest.add_metric([], (timezone.now() - first).total_seconds() if first else 0.0)
        except Exception:  # a scrape must not fail because the database is briefly unavailable
            pass
        yield by_state
        yield oldest
