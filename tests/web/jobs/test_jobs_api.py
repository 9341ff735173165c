"""Native jobs API over the in-process engine front and the real job store; tests play the workers."""

from __future__ import annotations

import base64

import pytest

from engine.store import keys
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import png, sd_body, wan_body

pytestmark = pytest.mark.django_db


def test_submit_detail_complete_result(alice, store) -> None:
    _, c, _ = alice
    r = c.post("/api/v1/jobs", sd_body(), format="json")
    assert r.status_code == 202, r.content
    job = r.json()
    uid = job["uid"]
    assert job["state"] == "queued" and job["queue_position"] == 0 and job["cost_estimate_gpu_s"] > 0
    assert job["links"]["self"] == f"/api/v1/jobs/{uid}" and r.headers["Location"] == job["links"]["self"]
    assert Job.objects.get(uid=uid).params["guidance_scale"] == 7.5  # resolved, defaults filled
    assert c.get(f"/api/v1/jobs/{uid}/result").status_code == 409
    store.event(uid, keys.STAGE_STARTED, "denoise", 40, state=keys.IN_PROGRESS)
    d = c.get(f"/api/v1/jobs/{uid}").json()
    assert (d["state"], d["stage"], d["progress"], d["queue_position"]) == ("in_progress", "denoise", 40, None)
    assert store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=png())
    d = c.get(f"/api/v1/jobs/{uid}").json()
    assert d["state"] == "completed" and d["progress"] == 100 and d["finished_at"]
    res = c.get(f"/api/v1/jobs/{uid}/result")
    assert res.status_code == 200 and res["Content-Type"] == "image/png" and res.content == png()


def test_video_result_is_mp4(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", wan_body(), format="json").json()["uid"]
    store.finish(uid, "wan2.1-i2v", keys.COMPLETED, "video_encode", result=b"\x00\x00\x00\x18ftypmp42")
    res = c.get(f"/api/v1/jobs/{uid}/result")
    assert res["Content-Type"] == "video/mp4" and res.content.startswith(b"\x00\x00\x00\x18ftyp")


def test_multipart_upload(alice) -> None:
    _, c, _ = alice
    import io
    import json

    f = io.BytesIO(png())
    f.name = "first.png"
    r = c.post("/api/v1/jobs", {"workflow": "wan2.1-i2v", "params": json.dumps(wan_body()["params"]), "image": f},
               format="multipart")
    assert r.status_code == 202, r.content


def test_idempotency_key_returns_the_same_uid(alice) -> None:
    _, c, _ = alice
    a = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    b = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    other = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-2")
    assert a.status_code == b.status_code == 202
    assert a.json()["uid"] == b.json()["uid"] != other.json()["uid"]
    assert Job.objects.count() == 2


@pytest.mark.parametrize("body,field", [
    ({"workflow": "nope"}, "workflow"),
    (sd_body(height=65), "height"),
    (sd_body(num_inference_steps=0), "num_inference_steps"),
    (sd_body(prompt="  "), "prompt"),
    (sd_body(bogus=1), "bogus"),
    ({**wan_body(), "inputs": {}}, "image"),
    ({**wan_body(), "inputs": {"image": "!!!"}}, "image"),
    ({**wan_body(), "inputs": {"image": base64.b64encode(b"not an image").decode()}}, "image"),
    (wan_body(num_frames=10), "num_frames"),
])
def test_invalid_submissions_are_400_naming_the_field(alice, body, field) -> None:
    _, c, _ = alice
    r = c.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 400, r.content
    doc = r.json()
    assert doc.get("field") == field or field in doc, doc
    assert Job.objects.count() == 0


def test_list_is_paginated_and_filtered(alice, bob, store) -> None:
    _, c, _ = alice
    uids = [c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(3)]
    c.post("/api/v1/jobs", wan_body(), format="json")
    bob[1].post("/api/v1/jobs", sd_body(), format="json")
    store.finish(uids[0], "sd-t2i", keys.FAILED, "denoise", detail="boom")
    c.get(f"/api/v1/jobs/{uids[0]}")
    page = c.get("/api/v1/jobs", {"page_size": 2}).json()
    assert page["count"] == 4 and len(page["results"]) == 2 and page["next"]
    assert c.get("/api/v1/jobs", {"workflow": "sd-t2i"}).json()["count"] == 3
    failed = c.get("/api/v1/jobs", {"state": "failed"}).json()["results"]
    assert [j["uid"] for j in failed] == [uids[0]] and failed[0]["detail"] == "boom"
    assert c.get("/api/v1/jobs", {"state": "bogus"}).status_code == 400
    assert c.get("/api/v1/jobs", {"page": 99}).status_code == 404


def test_queue_position_counts_earlier_queued_jobs(alice) -> None:
    _, c, _ = alice
    uids = [c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(3)]
    assert [c.get(f"/api/v1/jobs/{u}").json()["queue_position"] for u in uids] == [0, 1, 2]


def test_cancel_is_idempotent_and_reaches_the_engine(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    r1, r2 = c.delete(f"/api/v1/jobs/{uid}"), c.delete(f"/api/v1/jobs/{uid}")
    assert r1.status_code == r2.status_code == 202 and r1.json()["cancel_requested"]
    assert store.cancel_requested(uid)  # every stage's worker polls this flag between steps
    store.finish(uid, "sd-t2i", keys.CANCELLED, "denoise", detail="cancelled at step 1")
    r3 = c.delete(f"/api/v1/jobs/{uid}")
    assert r3.status_code == 200 and r3.json()["state"] == "cancelled"


def test_cancel_of_a_job_the_engine_lost_finishes_it(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    store.r.flushdb()  # Redis restarted
    r = c.delete(f"/api/v1/jobs/{uid}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"


def test_result_lost_with_redis_is_410(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=png())
    assert c.get(f"/api/v1/jobs/{uid}").json()["state"] == "completed"
    store.r.flushdb()
    r = c.get(f"/api/v1/jobs/{uid}/result")
    assert r.status_code == 410 and "expired or was lost" in r.json()["detail"]


def test_workflows_list_params_and_limits(alice) -> None:
    _, c, _ = alice
    wfs = {w["name"]: w for w in c.get("/api/v1/workflows").json()}
    assert set(wfs) >= {"sd-t2i", "wan2.1-i2v"}
    steps = next(p for p in wfs["sd-t2i"]["params"] if p["name"] == "num_inference_steps")
    assert steps["maximum"] == 150 and steps["type"] == "int" and steps["max_length"] is None
    prompt = next(p for p in wfs["sd-t2i"]["params"] if p["name"] == "prompt")
    from engine.workflow import get_workflow

    assert prompt["type"] == "str" and prompt["max_length"] == get_workflow("sd-t2i").param("prompt").max_length > 0
    assert wfs["wan2.1-i2v"]["inputs"] == ["image"] and wfs["wan2.1-i2v"]["output"] == "video"
    assert wfs["sd-t2i"]["limits"]["max_concurrent_jobs"] == 4


def test_repeat_while_the_first_is_being_submitted_is_409_and_counts_nothing(alice, store) -> None:
    from onepiece_platform.quotas import counters

    user, c, _ = alice
    Job.objects.create(uid="b" * 32, owner=user, workflow="sd-t2i", idempotency_key="k-busy",
                       submitting=True)  # claimed, not yet accepted
    r = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-busy")
    assert r.status_code == 409 and r.headers["Retry-After"] == "1"
    assert counters.usage(user.pk) == (0, 0.0) and store.events() == []


def test_repeat_of_an_accepted_key_is_answered_even_at_the_quota(alice) -> None:
    from onepiece_platform.quotas.models import Quota

    user, c, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=1)
    first = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1").json()["uid"]
    again = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert again.status_code == 202 and again.json()["uid"] == first  # the key is answered before the quota
    assert c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-2").status_code == 429
    assert Job.objects.filter(owner=user).count() == 1  # the refused one left no row behind
