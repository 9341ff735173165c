"""Prometheus metrics of the web process (``onepiece_`` prefix, ``_total`` counters, ``_seconds`` histograms).

Job-state gauges are computed from the ledger at scrape time (a custom
collector), so they are right in every web process and after restarts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

REQUESTS = Counter("onepiece_api_requests_total", "API requests answered", ["route", "status"])
REJECTIONS = Counter("onepiece_api_rejections_total", "Submissions refused, by reason", ["reason"])
JOBS_FINISHED = Counter("onepiece_jobs_finished_total", "Jobs that reached a terminal state", ["workflow", "state"])
STAGE_SECONDS = Histogram("onepiece_stage_latency_seconds", "Stage run time reported by the engine's events",
                          ["workflow", "stage"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

STAGE_BATCH_SIZE = Histogram("onepiece_stage_batch_size", "Requests a stage run shared its steps with (itself "
                             "included; 1: alone)", ["workflow", "stage"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))


class JobStateCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        from django.db.models import Count

        from onepiece_platform.jobs.models import Job

        g = GaugeMetricFamily("onepiece_jobs", "Jobs in the ledger by workflow and state", labels=["workflow", "state"])
        try:
            rows = Job.objects.filter(uid__isnull=False).values("workflow", "state").annotate(n=Count("id"))
            for row in rows:
                g.add_metric([row["workflow"], row["state"]], row["n"])
        except Exception:  # a scrape must not fail because the database is briefly unavailable
            pass
        yield g


class LedgerCollector(Collector):
    """The reconciler's counts, read from the database (the reconciler is another process)."""

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        from django.db.models import Count

        from onepiece_platform.engine_link.models import DeadLetter, HeldEvent, StreamCursor

        events = CounterMetricFamily("onepiece_ledger_events", "Engine events the reconciler dealt with, by outcome "
                                     "(retried: transient failures tried again)", labels=["outcome"])
        dead = GaugeMetricFamily("onepiece_ledger_dead_letters", "Engine events that can never apply, by reason",
                                 labels=["reason"])
        held = GaugeMetricFamily("onepiece_ledger_held_events", "Events waiting for their job to be known")
        gaps = CounterMetricFamily("onepiece_ledger_stream_gaps", "Times the engine's event stream no longer held "
                                   "the reconciler's cursor (trimmed by its cap, or Redis restarted): events may "
                                   "have been lost unread, and their jobs were swept")
        try:
            c = StreamCursor.objects.filter(name="events").first()
            for outcome in ("applied", "retried", "held", "dead"):
                events.add_metric([outcome], getattr(c, outcome) if c else 0)
            gaps.add_metric([], c.gaps if c else 0)
            counts = {reason: 0 for reason, _ in DeadLetter.REASONS}
            counts.update({r["reason"]: r["n"] for r in DeadLetter.objects.values("reason").annotate(n=Count("id"))})
            for reason, n in counts.items():
                dead.add_metric([reason], n)
            held.add_metric([], HeldEvent.objects.count())
        except Exception:  # a scrape must not fail because the database is briefly unavailable
            pass
        yield events
        yield dead
        yield held
        yield gaps


_registered = False


def register_collectors() -> None:
    global _registered
    if not _registered:
        REGISTRY.register(JobStateCollector())
        REGISTRY.register(LedgerCollector())
        from onepiece_platform.webhooks.metrics import WebhookCollector

        REGISTRY.register(WebhookCollector())
        _registered = True
