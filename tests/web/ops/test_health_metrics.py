"""/livez, /readyz and Prometheus /metrics."""

from __future__ import annotations

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from engine.store import keys
from onepiece_platform.jobs import ledger
from onepiece_platform.quotas.models import Quota
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = Client().get("/metrics", HTTP_ACCEPT="text/plain;version=0.0.4")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.content.decode()) for s in fam.samples}


def test_health(web_redis) -> None:
    c = Client()
    assert c.get("/livez").json() == {"status": "ok"}
    r = c.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_readyz_is_503_without_redis(settings, db) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    r = Client().get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["redis"].startswith("error")


def test_metrics_count_requests_rejections_states_and_stage_latency(alice, store) -> None:
    user, c, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=1)
    before = _samples()
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    assert c.post("/api/v1/jobs", sd_body(seed=2), format="json").status_code == 429
    ledger.apply_event(uid, keys.STAGE_STARTED, "denoise", 0, 10.0, "")
    ledger.apply_event(uid, keys.STAGE_FINISHED, "denoise", 50, 10.4, "")
    after = _samples()

    def delta(name: str, **labels: str) -> float:
        k = (name, tuple(sorted(labels.items())))
        return after.get(k, 0.0) - before.get(k, 0.0)

    assert delta("onepiece_api_requests_total", route="api/v1/jobs", status="202") == 1
    assert delta("onepiece_api_requests_total", route="api/v1/jobs", status="429") == 1
    assert delta("onepiece_api_rejections_total", reason="quota_concurrent") == 1
    assert after[("onepiece_jobs", (("state", "in_progress"), ("workflow", "sd-t2i")))] == 1
    assert delta("onepiece_stage_latency_seconds_count", workflow="sd-t2i", stage="denoise") == 1
    assert delta("onepiece_stage_latency_seconds_bucket", workflow="sd-t2i", stage="denoise", le="0.5") == 1
    Client(HTTP_AUTHORIZATION="Bearer op_bad_key").get("/api/v1/workflows")
    assert _samples()[("onepiece_api_rejections_total", (("reason", "auth_failed"),))] >= 1
