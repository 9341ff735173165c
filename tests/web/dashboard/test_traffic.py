"""The traffic figures: accepted from the ledger, rejected where the platform answered 503/429, latency."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db


def _staff() -> Client:
    from django.contrib.auth import get_user_model

    c = Client()
    c.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    return c


def test_rejections_are_counted_by_reason_where_the_platform_answers(proxy_url, alice, settings) -> None:
    from engine.embedded import free_port
    from onepiece_platform.engine_link.models import Rejection
    from onepiece_platform.quotas.models import Quota

    user, api, _ = alice
    codes = [api.post("/api/v1/jobs", sd_body(seed=i), format="json").status_code for i in range(3)]
    assert codes == [202, 202, 503]  # the real Proxy's queue holds 2: the third is turned away
    Quota.objects.create(user=user, max_concurrent_jobs=2)
    assert api.post("/api/v1/jobs", sd_body(seed=9), format="json").status_code == 429
    settings.ONEPIECE = {**settings.ONEPIECE, "PROXY_URL": f"http://127.0.0.1:{free_port('127.0.0.1')}",
                         "PROXY_TIMEOUT_S": 1}
    Quota.objects.filter(user=user).update(max_concurrent_jobs=10)
    assert api.post("/api/v1/jobs", sd_body(seed=10), format="json").status_code == 503  # engine unreachable
    assert api.post("/api/v1/jobs", {"workflow": "sd-t2i", "params": {}}, format="json").status_code == 400
    assert sorted(Rejection.objects.values_list("reason", "status")) == [
        ("engine_busy", 503), ("engine_unreachable", 503), ("quota", 429)]  # a bad request is not traffic

    t = _staff().get("/dashboard/api/traffic?minutes=5&step=60").json()
    sd = t["workflows"]["sd-t2i"]
    assert sd["totals"] == {"accepted": 2, "completed": 0, "rejected": 3}
    assert t["buckets"] == 5 and t["step_s"] == 60
    assert sum(sd["accepted_rps"]) * 60 == pytest.approx(2, rel=1e-3)
    assert {k: sum(v) * 60 for k, v in sd["rejected_rps"].items()} == pytest.approx(
        {"engine_busy": 1, "engine_unreachable": 1, "quota": 1}, rel=1e-3)
    assert t["workflows"]["wan2.1-i2v"]["totals"] == {"accepted": 0, "completed": 0, "rejected": 0}


def test_latency_percentiles_of_completed_jobs_per_bucket(db: None) -> None:
    from django.contrib.auth import get_user_model

    from onepiece_platform.jobs.models import Job

    owner = get_user_model().objects.create_user("someone")
    now = timezone.now()
    for i in range(1, 101):  # 100 jobs that took 1..100 s, finished in the last minute
        j = Job.objects.create(uid=f"{i:032d}", owner=owner, workflow="sd-t2i", state="completed")
        Job.objects.filter(pk=j.pk).update(created_at=now - dt.timedelta(seconds=30 + i),
                                           finished_at=now - dt.timedelta(seconds=30))
    old = Job.objects.create(uid="e" * 32, owner=owner, workflow="sd-t2i", state="completed")
    Job.objects.filter(pk=old.pk).update(created_at=now - dt.timedelta(hours=2),
                                         finished_at=now - dt.timedelta(hours=1))  # outside the window
    t = _staff().get("/dashboard/api/traffic?minutes=10&step=60").json()
    sd: dict[str, Any] = t["workflows"]["sd-t2i"]
    assert sd["totals"]["completed"] == 100
    last = [i for i, v in enumerate(sd["latency_p50_s"]) if v is not None]
    assert len(last) == 1  # one bucket holds them all
    assert sd["latency_p50_s"][last[0]] == pytest.approx(50, abs=0.01)
    assert sd["latency_p99_s"][last[0]] == pytest.approx(99, abs=0.01)


def test_percentile_is_nearest_rank() -> None:
    from onepiece_platform.dashboard.traffic import percentile

    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0 and percentile([4.0, 1.0, 3.0, 2.0], 99) == 4.0


def test_traffic_is_staff_only(db: None) -> None:
    assert Client().get("/dashboard/api/traffic").status_code == 403
    assert _staff().get("/dashboard/api/traffic?minutes=x").status_code == 400
