"""Per-user quotas: atomic counters (429 + Retry-After), per-request limits, release exactly once."""

from __future__ import annotations

import threading

import pytest

from engine.store import keys
from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas import counters
from onepiece_platform.quotas.models import Limits, Quota
from tests.fixtures.web import sd_body, wan_body

pytestmark = pytest.mark.django_db


def test_concurrent_jobs_limit_is_429_and_freed_by_a_terminal_state(alice, store) -> None:
    user, c, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=2)
    uids = [c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(2)]
    r = c.post("/api/v1/jobs", sd_body(seed=9), format="json")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and r.json()["reason"] == "concurrent"
    assert Job.objects.count() == 2
    store.finish(uids[0], "sd-t2i", keys.FAILED, "denoise", detail="x")
    c.get(f"/api/v1/jobs/{uids[0]}")  # the transition releases the slot, once
    c.get(f"/api/v1/jobs/{uids[0]}")
    assert counters.usage(user.pk)[0] == 1
    assert c.post("/api/v1/jobs", sd_body(seed=9), format="json").status_code == 202


def test_daily_gpu_seconds_is_429_until_midnight(alice) -> None:
    user, c, _ = alice
    one = c.post("/api/v1/jobs", sd_body(height=512, width=512, num_inference_steps=50), format="json").json()
    Quota.objects.create(user=user, gpu_seconds_per_day=one["cost_estimate_gpu_s"] * 1.5)
    r = c.post("/api/v1/jobs", sd_body(height=512, width=512, num_inference_steps=50, seed=1), format="json")
    assert r.status_code == 429 and r.json()["reason"] == "gpu_seconds"
    assert 1 <= int(r.headers["Retry-After"]) <= 86401


def test_measured_cost_replaces_the_estimate(alice, store) -> None:
    user, c, _ = alice
    job = c.post("/api/v1/jobs", sd_body(), format="json").json()
    uid = job["uid"]
    from onepiece_platform.jobs import ledger

    ledger.apply_event(uid, keys.STAGE_STARTED, "denoise", 0, 100.0, "")
    ledger.apply_event(uid, keys.STAGE_FINISHED, "denoise", 50, 102.5, "")
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    d = c.get(f"/api/v1/jobs/{uid}").json()
    assert d["cost_measured_gpu_s"] == pytest.approx(2.5)
    assert counters.usage(user.pk) == (0, pytest.approx(2.5))


def test_cancelled_before_start_refunds_the_estimate(alice, store) -> None:
    user, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    assert counters.usage(user.pk)[1] > 0
    store.finish(uid, "sd-t2i", keys.CANCELLED, "", detail="cancelled in queue")
    c.get(f"/api/v1/jobs/{uid}")
    assert counters.usage(user.pk) == (0, 0.0)


@pytest.mark.parametrize("limit,body,field", [
    ({"max_pixels": 64 * 64}, sd_body(height=128, width=128), "size"),
    ({"max_steps": 2}, sd_body(num_inference_steps=3), "num_inference_steps"),
    ({"max_frames": 5}, wan_body(num_frames=9), "num_frames"),
])
def test_per_request_limits_are_400_before_the_engine(alice, store, limit, body, field) -> None:
    user, c, _ = alice
    Quota.objects.create(user=user, **limit)
    r = c.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 400 and r.json()["field"] == field
    assert store.events() == []  # the engine never saw it


def test_reserve_is_atomic_under_races(web_redis) -> None:
    limits = Limits(3, 1e9, 1, 1, 1)
    wins: list[bool] = []
    barrier = threading.Barrier(16)

    def go(i: int) -> None:
        barrier.wait()
        try:
            counters.reserve(4242, f"{i:032x}", 1.0, limits)
            wins.append(True)
        except counters.QuotaExceeded:
            wins.append(False)

    threads = [threading.Thread(target=go, args=(i,), name=f"quota-race-{i}") for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 3 and counters.usage(4242)[0] == 3


def test_counters_lost_with_redis_are_seeded_from_the_ledger(alice, store) -> None:
    user, c, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=2)
    for i in range(2):
        assert c.post("/api/v1/jobs", sd_body(seed=i), format="json").status_code == 202
    store.r.flushdb()  # Redis restarted: counters gone, the ledger still says 2 running
    assert c.post("/api/v1/jobs", sd_body(seed=5), format="json").status_code == 429


def test_counters_seeded_after_a_restart_follow_a_late_correction_exactly(alice, store) -> None:
    """Redis restarts with a job finished (charged its estimate: no stage time read yet) and one running;
    the seed writes both jobs' records, so the stage time that arrives afterwards moves the spend by exactly
    its correction, and the running job's end frees its slot once."""
    from onepiece_platform.engine_link.reconciler import Reconciler
    from onepiece_platform.jobs import ledger

    user, c, _ = alice
    done, running = (c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(2))
    store.finish(done, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    assert c.get(f"/api/v1/jobs/{done}").json()["cost_measured_gpu_s"] is None  # the estimate is charged
    store.r.flushdb()  # Redis restarted
    third = c.post("/api/v1/jobs", sd_body(seed=3), format="json").json()["uid"]  # seeds the counters
    ledger.apply_event(done, keys.STAGE_STARTED, "denoise", 0, 100.0, "")
    ledger.apply_event(done, keys.STAGE_FINISHED, "denoise", 50, 101.5, "")
    for uid in (running, third):
        store.finish(uid, "sd-t2i", keys.FAILED, "denoise", detail="x")
        c.get(f"/api/v1/jobs/{uid}")
    Reconciler(block_ms=0).sweep()
    charged = sum(j.charge_gpu_s for j in Job.objects.filter(owner=user))
    assert Job.objects.get(uid=done).cost_measured_gpu_s == pytest.approx(1.5)
    assert counters.usage(user.pk) == (0, pytest.approx(charged))


def test_a_job_finishing_while_the_seed_reads_the_ledger_is_counted_once(alice, store) -> None:
    """The seed reads the ledger twice (the movable jobs, then the day's spend). A running job that finishes
    between the two reads, charged less than its estimate and settled into the restarted Redis before the
    seed lands, still leaves the spend equal to the ledger's charges (it was short by estimate - measured)."""
    from django.db import connection

    from onepiece_platform.jobs import ledger

    user, c, _ = alice
    running = c.post("/api/v1/jobs", sd_body(seed=1), format="json").json()["uid"]
    ledger.apply_event(running, keys.STAGE_STARTED, "denoise", 0, 100.0, "")
    ledger.apply_event(running, keys.STAGE_FINISHED, "denoise", 50, 100.25, "")  # measured 0.25 s
    store.r.flushdb()  # Redis restarted
    interleaved: list[str] = []

    def finish_between_the_reads(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not interleaved and "charge_version" in sql and "SELECT" in sql.upper():
            interleaved.append(sql)  # the seed's first read has the estimate; the job finishes now
            ledger.finish(running, keys.COMPLETED)
        return result

    with connection.execute_wrapper(finish_between_the_reads):
        assert c.post("/api/v1/jobs", sd_body(seed=2), format="json").status_code == 202
    assert interleaved, "the seed did not read the ledger"
    done = Job.objects.get(uid=running)
    assert done.state == keys.COMPLETED and done.cost_measured_gpu_s == pytest.approx(0.25)
    assert done.cost_estimate_gpu_s != pytest.approx(0.25)  # the race moves the charge
    charged = sum(j.charge_gpu_s for j in Job.objects.filter(owner=user))
    assert counters.usage(user.pk) == (1, pytest.approx(charged))
