"""Prometheus metrics of the web process (``onepiece_`` prefix, ``_total`` counters, ``_seconds`` histograms).

Job-state gauges are computed from the ledger at scrape time (a custom
collector), so they are right in every web process and after restarts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REQUESTS = Counter("onepiece_api_requests_total", "API requests answered", ["route", "status"])
REJECTIONS = Counter("onepiece_api_rejections_total", "Submissions refused, by reason", ["reason"])
JOBS_FINISHED = Counter("onepiece_jobs_finished_total", "Jobs that reached a terminal state", ["workflow", "state"])
STAGE_SECONDS = Histogram("onepiece_stage_latency_seconds", "Stage run time reported by the engine's events",
                          ["workflow", "stage"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))


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


_registered = False


def register_collectors() -> None:
    global _registered
    if not _registered:
        REGISTRY.register(JobStateCollector())
        _registered = True
