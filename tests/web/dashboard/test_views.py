"""The dashboard page and its JSON endpoints: staff only, CSRF on actions, shapes checked before etcd."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from onepiece_platform.engine_link.models import OperatorAction
from onepiece_platform.jobs.models import Job

pytestmark = pytest.mark.django_db


def _client(name: str, staff: bool, csrf: bool = False) -> Client:
    from django.contrib.auth import get_user_model

    c = Client(enforce_csrf_checks=csrf)
    c.force_login(get_user_model().objects.create_user(name, password="pw", is_staff=staff))
    return c


def test_page_is_staff_only() -> None:
    assert "/admin/login/" in Client().get("/dashboard/")["Location"]
    assert "/admin/login/" in _client("user", staff=False).get("/dashboard/")["Location"]
    r = _client("ops", staff=True).get("/dashboard/")
    assert r.status_code == 200
    body = r.content.decode()
    # Served from this site only (no CDN), with the workflows' stage order for the page's chains.
    assert "/static/onepiece/dashboard.js" in body and "/static/onepiece/dashboard.css" in body
    assert '"sd-t2i": ["text_encode", "denoise", "vae_decode", "image_encode"]' in body
    assert '"wan2.1-t2v": ["text_encode", "denoise", "vae_decode", "video_encode"]' in body
    assert "https://" not in body


def test_api_refuses_non_staff_with_403() -> None:
    for c in (Client(), _client("user", staff=False)):
        assert c.get("/dashboard/api/jobs").status_code == 403
        assert c.post("/dashboard/api/actions", "{}", content_type="application/json").status_code == 403


def test_jobs_lists_every_users_jobs() -> None:
    from django.contrib.auth import get_user_model

    owner = get_user_model().objects.create_user("someone")
    Job.objects.create(uid="a" * 32, owner=owner, workflow="sd-t2i", state="in_progress", stage="denoise", progress=40)
    Job.objects.create(owner=owner, workflow="sd-t2i")  # died mid-submit: no UID, not a job yet
    jobs = _client("ops", staff=True).get("/dashboard/api/jobs").json()["jobs"]
    assert [(j["uid"], j["owner"], j["stage"], j["progress"]) for j in jobs] == [("a" * 32, "someone", "denoise", 40)]


def test_jobs_carry_queue_positions_per_workflow_and_a_total(django_assert_max_num_queries) -> None:
    from django.contrib.auth import get_user_model

    owner = get_user_model().objects.create_user("someone")
    for i in range(6):  # alternating workflows: each has its own queue
        Job.objects.create(uid=f"{i:032d}", owner=owner, workflow=("sd-t2i", "wan2.1-i2v")[i % 2])
    Job.objects.create(uid="f" * 32, owner=owner, workflow="sd-t2i", state="in_progress", stage="denoise")
    c = _client("ops", staff=True)
    with django_assert_max_num_queries(8):  # not one query per row: the page asks for 1,000 of them
        body = c.get("/dashboard/api/jobs").json()
    got = {j["uid"]: j["queue_position"] for j in body["jobs"]}
    assert got == {f"{0:032d}": 0, f"{2:032d}": 1, f"{4:032d}": 2, f"{1:032d}": 0, f"{3:032d}": 1,
                   f"{5:032d}": 2, "f" * 32: None}
    assert body["total"] == 7
    assert len(c.get("/dashboard/api/jobs?limit=2").json()["jobs"]) == 2
    assert c.get("/dashboard/api/jobs?limit=x").status_code == 400


@pytest.mark.parametrize("body, why", [
    ({"action": "pin_instance", "args": {"instance": "x", "node": "n1"}}, "action must be"),
    ({"action": "set_mode", "args": {"workflow": "sd-t2i", "mode": "fast"}}, "mode must be one of"),
    ({"action": "set_mode", "args": {"mode": "individual"}}, "workflow is required"),
    ({"action": "move_instance", "args": {"instance": "sd-t2i.denoise.0"}}, "instance and node"),
    ({"action": "undrain_node", "args": {"node": ""}}, "node is required"),
    ({"action": "warm_up", "args": {"workflows": []}}, "non-empty list"),
    ({"action": "warm_up", "args": {"workflows": ["no-such-workflow"]}}, "non-empty list"),
    ({"action": "warm_up", "args": {"workflows": ["sd-t2i"], "nodes": "n1"}}, "list of node names"),
    ({"action": "scale_stage", "args": {"workflow": "sd-t2i"}}, "workflow and stage"),
    ({"action": "scale_stage", "args": {"workflow": "sd-t2i", "stage": "denoise", "instances": -1}}, "whole number"),
    ({"action": "scale_stage", "args": {"workflow": "sd-t2i", "stage": "denoise", "instances": True}}, "whole number"),
    ({"action": "drain_node", "args": {}}, "node is required"),
    ({"action": "drain_node", "args": []}, "must be an object"),
])
def test_actions_check_shape_before_anything_is_recorded(body: dict[str, Any], why: str) -> None:
    r = _client("ops", staff=True).post("/dashboard/api/actions", json.dumps(body), content_type="application/json")
    assert r.status_code == 400 and why in r.json()["error"]
    assert not OperatorAction.objects.exists()


def test_actions_need_the_csrf_token() -> None:
    c = _client("ops", staff=True, csrf=True)
    body = json.dumps({"action": "drain_node", "args": {"node": "n1"}})
    assert c.post("/dashboard/api/actions", body, content_type="application/json").status_code == 403
    assert not OperatorAction.objects.exists()


def test_warm_up_is_queued_then_reports_what_the_task_returned(celery_broker) -> None:
    from onepiece_platform.redis_conn import get_redis

    c = _client("ops", staff=True)
    body = json.dumps({"action": "warm_up", "args": {"workflows": ["sd-t2i"], "nodes": []}})
    a = c.post("/dashboard/api/actions", body, content_type="application/json").json()["action"]
    assert a["status"] == "queued" and get_redis().llen("celery") == 1  # on the real broker, for a worker
    row = OperatorAction.objects.get(pk=a["id"])
    assert c.get("/dashboard/api/actions").json()["actions"][0]["status"] == "queued"  # no worker has run it
    report = {"sd-t2i": {"sent": 1, "completed": 1, "failed": 0, "seconds": 0.5}}
    celery_broker.backend.store_result(row.request_id, report, "SUCCESS")  # what a worker stores when done
    shown = c.get("/dashboard/api/actions").json()["actions"][0]
    assert shown["status"] == "done" and shown["verdict"] == {"ok": True, "report": report}
