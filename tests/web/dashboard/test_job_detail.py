"""One job in the dashboard: its stage timeline from the engine's events, its result for staff only."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from tests.fixtures.web import png, sd_body

pytestmark = pytest.mark.django_db


def _session(user: Any) -> Client:
    c = Client()
    c.force_login(user)
    return c


def _run(store: Any, uid: str, stages: list[str]) -> None:
    """Play the workers: stage_started/stage_finished per stage on the real event stream, then the result."""
    for i, stage in enumerate(stages):
        store.event(uid, "stage_started", stage, progress=i * 20, state="in_progress")
        time.sleep(0.01)
        store.event(uid, "stage_finished", stage, progress=i * 20 + 10, state="in_progress")
    store.finish(uid, "sd-t2i", "completed", stages[-1], result=png(32, 32))


def test_timeline_and_result_from_the_reconciled_events(alice, store) -> None:
    from django.contrib.auth import get_user_model

    from onepiece_platform.engine_link.reconciler import Reconciler

    _, api, _ = alice
    uid = api.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    staff = _session(get_user_model().objects.create_user("ops", is_staff=True))
    before = staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]
    assert before["state"] == "queued" and before["result"] is None
    assert all(s["started"] is None for s in before["stages"])
    stages = ["text_encode", "denoise", "vae_decode", "image_encode"]
    _run(store, uid, stages)
    Reconciler(block_ms=0).step()  # the same path production takes: the stream into the ledger

    job = staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]
    assert job["state"] == "completed"
    assert [s["stage"] for s in job["stages"]] == stages  # the workflow's order
    for s in job["stages"]:
        assert s["started"] is not None and s["finished"] is not None and s["finished"] >= s["started"]
    assert job["stages"][0]["finished"] <= job["stages"][1]["started"]  # a chain: one after the other
    assert job["result"] == {"kind": "image", "url": f"/dashboard/api/jobs/{uid}/result"}

    r = staff.get(job["result"]["url"])
    assert r.status_code == 200 and r["Content-Type"] == "image/png" and r.content == png(32, 32)
    assert r["Content-Disposition"].startswith("inline")  # shown in the page, not downloaded


def test_result_and_detail_are_staff_only(alice, store) -> None:
    user, api, _ = alice
    uid = api.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    store.finish(uid, "sd-t2i", "completed", "image_encode", result=png())
    owner = _session(user)  # even the job's owner: the dashboard's endpoints are staff's
    assert owner.get(f"/dashboard/api/jobs/{uid}/result").status_code == 403
    assert owner.get(f"/dashboard/api/jobs/{uid}").status_code == 403
    assert Client().get(f"/dashboard/api/jobs/{uid}/result").status_code == 403
    assert api.get(f"/api/v1/jobs/{uid}/result").status_code == 200  # the owner's own API still serves it


def test_unfinished_and_unknown_jobs(alice, store) -> None:
    from django.contrib.auth import get_user_model

    _, api, _ = alice
    uid = api.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    staff = _session(get_user_model().objects.create_user("ops", is_staff=True))
    assert staff.get(f"/dashboard/api/jobs/{uid}/result").status_code == 409
    assert staff.get(f"/dashboard/api/jobs/{'0' * 32}").status_code == 404
    assert staff.get(f"/dashboard/api/jobs/{'0' * 32}/result").status_code == 404


def test_video_workflows_say_video() -> None:
    from onepiece_platform.dashboard.views import result_kind

    assert result_kind("wan2.1-i2v") == "video" and result_kind("sd-t2i") == "image"
    assert result_kind("no-such-workflow") is None


def test_stage_events_read_after_the_row_finished_still_complete_the_timeline(alice, store) -> None:
    """A status read can finish a row before the reconciler reaches its last stage events (the sweep applies
    the stream first: tests/web/engine_link/test_reconciler.py)."""
    from onepiece_platform.engine_link.reconciler import Reconciler
    from onepiece_platform.jobs.models import Job

    _, api, _ = alice
    uid = api.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    stages = ["text_encode", "denoise", "vae_decode", "image_encode"]
    _run(store, uid, stages)
    assert api.get(f"/api/v1/jobs/{uid}").json()["state"] == "completed"  # from the engine's status
    job = Job.objects.get(uid=uid)
    assert job.state == "completed" and job.stage_times == {}
    Reconciler(block_ms=0).step()
    job.refresh_from_db()
    assert all("started" in job.stage_times[s] and "finished" in job.stage_times[s] for s in stages)
    assert job.state == "completed" and job.progress == 100  # the late events moved nothing else
