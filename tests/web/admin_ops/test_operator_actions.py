"""Admin: scaling actions reach the real Node Manager through etcd; warm-up and clean-up on Celery."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.test import Client

from engine.coord.keys import Keyspace
from engine.manager.election import connect
from engine.manager.node_manager import ManagerConfig, NodeManager
from engine.store import keys
from onepiece_platform.accounts.models import AuditEntry
from onepiece_platform.engine_link.models import OperatorAction
from onepiece_platform.jobs.models import Job
from tests.fixtures.coord import leading_election
from tests.fixtures.web import png, sd_body

pytestmark = pytest.mark.django_db
WF = "sd-t2i"


@pytest.fixture
def nm(etcd_server: Any, settings: Any, web_redis: str) -> Any:
    from onepiece_platform.engine_link.cluster import reset_clusters

    root = f"/onepiece-webtest-{uuid.uuid4().hex[:6]}"
    settings.ETCD_URL = etcd_server.url
    settings.ONEPIECE = {**settings.ONEPIECE, "ETCD_ROOT": root}
    reset_clusters()
    client = connect(etcd_server.url)
    times = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
    for node in ("n1", "n2"):
        inst = {f"{WF}.{s}.x{node}": {"workflow": WF, "stage": s, "last_stage_s": t} for s, t in times.items()}
        client.put(Keyspace(root).node(node), json.dumps({"node": node, "instances": inst}))
    election = leading_election(client, root, ttl=60)  # no keep-alive thread here
    manager = NodeManager(client, election, ManagerConfig(workflows={WF: "/models/sd"}, root=root, slots_per_node=5))
    manager.tick()  # the leader writes assignments
    yield manager
    election.resign()
    client.delete_prefix(root + "/")
    reset_clusters()


@pytest.fixture
def staff_client(db: None) -> Client:
    from django.contrib.auth import get_user_model

    c = Client()
    c.force_login(get_user_model().objects.create_superuser("ops", password="pw"))
    return c


def _add(c: Client, action: str, args: dict[str, Any]) -> OperatorAction:
    r = c.post("/admin/engine_link/operatoraction/add/", {"action": action, "args": json.dumps(args)})
    assert r.status_code == 302, r.content[:2000]
    return OperatorAction.objects.latest("created_at")


def test_scale_stage_and_drain_node_go_through_the_leader(nm, staff_client) -> None:
    a = _add(staff_client, "scale_stage", {"workflow": WF, "stage": "denoise", "instances": 3})
    assert a.status == "submitted" and a.request_id
    bad = _add(staff_client, "drain_node", {"node": "nope"})
    nm.tick()  # the leader validates and applies queued actions
    r = staff_client.post("/admin/engine_link/operatoraction/",
                          {"action": "refresh_verdicts", "_selected_action": [a.pk, bad.pk]})
    assert r.status_code == 302
    a.refresh_from_db()
    bad.refresh_from_db()
    assert a.status == "accepted" and a.verdict["fence_token"] is not None
    assert bad.status == "refused" and "nope" in bad.verdict["error"]
    assert nm.overrides.stages[f"{WF}/denoise"] == {"min": 3, "max": 3}
    assert AuditEntry.objects.filter(action="cluster.scale_stage", actor__username="ops").exists()


def test_non_staff_cannot_act(nm, alice) -> None:
    c = Client()
    c.force_login(alice[0])
    r = c.post("/admin/engine_link/operatoraction/add/", {"action": "drain_node", "args": '{"node": "n1"}'})
    assert r.status_code == 302 and "/admin/login/" in r["Location"]
    assert OperatorAction.objects.count() == 0


def test_cluster_snapshot(nm, alice) -> None:
    from onepiece_platform.engine_link.cluster import get_cluster

    alice[1].post("/api/v1/jobs", sd_body(), format="json")
    snap = get_cluster().snapshot()
    assert set(snap["nodes"]) == {"n1", "n2"} and snap["inflight"][WF]["jobs"] == 1 and snap["ts"] > 0


def test_celery_is_json_only_and_acks_late() -> None:
    from kombu.exceptions import ContentDisallowed
    from kombu.serialization import dumps, loads

    from onepiece_platform.celery_app import app

    assert set(app.conf.accept_content) == {"json"} and app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost
    ctype, enc, body = dumps({"x": 1}, serializer="pickle")
    with pytest.raises(ContentDisallowed):
        loads(body, ctype, enc, accept=app.conf.accept_content)


def test_clean_up_is_idempotent(alice, store) -> None:
    import datetime as dt

    from onepiece_platform.engine_link.tasks import clean_up

    _, c, _ = alice
    old, deleted, fresh = (c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(3))
    for uid in (old, deleted, fresh):
        store.finish(uid, WF, keys.COMPLETED, "image_encode", result=png())
        c.get(f"/api/v1/jobs/{uid}")
    Job.objects.filter(uid=old).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=40))
    Job.objects.filter(uid=deleted).update(hidden=True)
    # its web process died mid-submit; the engine never spoke of it, so the sweep failed it as lost
    stuck = Job.objects.create(uid="d" * 32, owner=alice[0], workflow=WF, idempotency_key="died-mid-submit",
                               submitting=True, state="failed")
    Job.objects.filter(pk=stuck.pk).update(created_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
    assert clean_up.apply(kwargs={"retention_days": 30}).get() == {"ledger_rows": 1, "results": 2, "abandoned": 1}
    assert clean_up.apply(kwargs={"retention_days": 30}).get() == {"ledger_rows": 0, "results": 0, "abandoned": 0}
    assert store.result(fresh) == png() and not Job.objects.filter(uid=old).exists()


def test_warm_up_sends_one_small_request_per_instance(nm, store, workers_thread) -> None:
    from onepiece_platform.engine_link.tasks import warm_up

    for node in ("n1", "n2"):  # each node's text_encode instance publishes its route
        inst = f"{WF}.text_encode.x{node}"
        nm.client.put(Keyspace(nm.cfg.root).route(WF, "text_encode", inst),
                      json.dumps({"address": f"shm://{inst}", "node": node, "instance": inst}))
    report = warm_up.apply(args=[[WF], ["n1"]], kwargs={"timeout_s": 10}).get()
    assert report[WF]["sent"] == 1 and report[WF]["completed"] == 1 and report[WF]["failed"] == 0
    report = warm_up.apply(args=[[WF], ["n1", "n2"]], kwargs={"timeout_s": 10}).get()
    assert report[WF]["sent"] == 2 and report[WF]["completed"] == 2


@pytest.fixture
def workers_thread(web_redis: str) -> Any:
    from tests.fixtures.workers import Workers

    w = Workers(web_redis)
    yield w
    w.close()


def test_clean_up_goes_in_batches_and_counts_jobs_not_what_is_deleted_with_them(alice, store) -> None:
    """Five old jobs with two stage runs each, in batches of two: every job and its runs and result go,
    ``ledger_rows`` counts the five jobs (not the 15 rows), a recent job stays."""
    import datetime as dt

    from onepiece_platform.engine_link.tasks import clean_up
    from onepiece_platform.jobs.models import StageRun

    _, c, _ = alice
    uids = []
    for i in range(6):  # one at a time: the user may run only a few at once
        uid = c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"]
        store.finish(uid, WF, keys.COMPLETED, "image_encode", result=png())
        c.get(f"/api/v1/jobs/{uid}")
        uids.append(uid)
    old, fresh = uids[:5], uids[5]
    for uid in old:
        job = Job.objects.get(uid=uid)
        job.stage_runs.all().delete()
        StageRun.objects.bulk_create([StageRun(job=job, stage=s, started=1.0, finished=2.0)
                                      for s in ("denoise", "vae_decode")])
    Job.objects.filter(uid__in=old).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=40))
    report = clean_up.apply(kwargs={"retention_days": 30, "batch": 2}).get()
    assert report == {"ledger_rows": 5, "results": 5, "abandoned": 0}
    assert not Job.objects.filter(uid__in=old).exists() and not StageRun.objects.filter(job__uid__in=old).exists()
    assert all(store.result(u) is None for u in old) and store.result(fresh) == png()
    assert Job.objects.filter(uid=fresh).exists()
