"""Output retention (issue 38, item 4): a default and a ceiling per key tier, a per-request ``retention`` within
it (native API and both OpenAI routes), recorded on the job; the Celery task ``onepiece.expire_outputs`` deletes
expired outputs and reports objects and bytes; a deleted video or job takes its objects; result URLs never
outlive the retention. Real redis-server, real Swift s3api server."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine.store import JobStore, keys
from engine.store.objects import ObjectStore, result_prefix
from onepiece_platform.accounts.models import ApiKey, PriorityTier
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import client_for, make_user, sd_body

BIG = b"\x89PNG\r\n\x1a\n" + os.urandom(30_000)
DAY = 86400
EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture
def on_store(settings, s3_server, object_store: ObjectStore, web_redis: str) -> Iterator[JobStore]:
    """The platform on a bucket of the real store, and a last stage's worker that stores every output there."""
    from onepiece_platform.engine_link import objects
    from onepiece_platform.jobs import result_urls
    from onepiece_platform.redis_conn import get_redis

    settings.ONEPIECE = {**settings.ONEPIECE,
                         "OBJECT_STORE": s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}"}
    worker = JobStore(get_redis(), objects=ObjectStore(object_store.config))
    yield worker
    worker.objects.close()
    objects._stores.clear()
    result_urls._public.clear()


def _done(c: Any, worker: JobStore, **fields: Any) -> str:
    r = c.post("/api/v1/jobs", {**sd_body(), **fields}, format="json")
    assert r.status_code == 202, r.content
    uid = r.json()["uid"]
    assert worker.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=BIG)
    assert c.get(f"/api/v1/jobs/{uid}").json()["state"] == "completed"
    return uid


@pytest.mark.django_db
def test_retention_defaults_and_ceilings_follow_the_key_tier(alice) -> None:
    user, c, raw = alice
    r = c.post("/api/v1/jobs", sd_body(), format="json")  # an ordinary user: the normal tier's default
    assert r.status_code == 202 and r.json()["retention_s"] == 7 * DAY and r.json()["output_expires_at"] is None
    assert Job.objects.get(uid=r.json()["uid"]).retention == dt.timedelta(days=7)
    r = c.post("/api/v1/jobs", {**sd_body(), "retention": 3600}, format="json")
    assert r.status_code == 202 and r.json()["retention_s"] == 3600
    for bad in (30 * DAY + 1, 0, -5, "1h", True, 1.5):
        r = c.post("/api/v1/jobs", {**sd_body(), "retention": bad}, format="json")
        assert r.status_code == 400 and r.json()["field"] == "retention", (bad, r.content)
    assert "ceiling" in c.post("/api/v1/jobs", {**sd_body(), "retention": 31 * DAY}, format="json").json()["detail"]
    assert Job.objects.count() == 2  # refused before anything was written
    PriorityTier.objects.create(user=user, max_priority="low")  # the operator lowers the user's tier
    r = c.post("/api/v1/jobs", sd_body(), format="json")
    assert r.status_code == 202 and r.json()["retention_s"] == DAY
    assert c.post("/api/v1/jobs", {**sd_body(), "retention": 8 * DAY}, format="json").status_code == 400
    staff, key = make_user("ops", is_staff=True)  # high tier: 30 days by default
    assert client_for(key).post("/api/v1/jobs", sd_body(), format="json").json()["retention_s"] == 30 * DAY
    ApiKey.objects.filter(user=staff).update(max_priority="low")  # a key capped lower gets the lower tier's
    r = client_for(key).post("/api/v1/jobs", {**sd_body(), "retention": 8 * DAY}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "retention"


def test_openai_routes_take_retention_through_extra_body(oa, workers) -> None:
    client, _ = oa
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a cat", size="64x64", extra_body={**EXTRA, "retention": 31 * DAY})
    assert e.value.body["param"] == "retention"
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                             extra_body={**EXTRA, "retention": 31 * DAY})
    assert e.value.body["param"] == "retention"
    assert not Job.objects.exists()
    v = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v", poll_interval_ms=50,
                                      extra_body={**EXTRA, "retention": 600})
    job = Job.objects.get(uid=v.id)
    assert job.retention == dt.timedelta(seconds=600) and v.model_extra["extra"]["retention_s"] == 600
    assert v.expires_at == int(job.retain_until.timestamp())  # the video's content ends then
    client.images.generate(prompt="a cat", size="64x64", extra_body={**EXTRA, "retention": 120})
    assert Job.objects.get(workflow="sd-t2i").retention == dt.timedelta(seconds=120)


@pytest.mark.django_db
def test_expire_outputs_deletes_expired_objects_and_reports_what_it_freed(alice, on_store: JobStore,
                                                                           object_store: ObjectStore,
                                                                           caplog) -> None:
    from onepiece_platform.engine_link.tasks import expire_outputs

    _, c, _ = alice
    expired, fresh, _old_row = (_done(c, on_store, retention=r) for r in (60, 3600, 60))
    Job.objects.filter(uid=expired).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=61))
    Job.objects.filter(uid=_old_row).update(retention=None)  # a row from before retention: kept with the row
    with caplog.at_level(logging.INFO, logger="onepiece_platform.engine_link.tasks"):
        report = expire_outputs.apply().get()
    assert report == {"jobs": 1, "objects": 1, "bytes": len(BIG)}
    assert f"1 jobs, 1 objects, {len(BIG)} bytes freed" in caplog.text
    assert object_store.newest(result_prefix(expired)) is None
    assert object_store.newest(result_prefix(fresh)) is not None and object_store.newest(result_prefix(_old_row))
    r = c.get(f"/api/v1/jobs/{expired}/result")
    assert r.status_code == 410 and "deleted" in r.json()["detail"]
    assert c.get(f"/api/v1/jobs/{fresh}/result").status_code == 200
    assert expire_outputs.apply().get() == {"jobs": 0, "objects": 0, "bytes": 0}  # done once


@pytest.mark.django_db
def test_an_output_past_its_retention_is_refused_before_the_clean_up_runs(alice, on_store: JobStore) -> None:
    _, c, _ = alice
    uid = _done(c, on_store, retention=60)
    Job.objects.filter(uid=uid).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=61))
    r = c.get(f"/api/v1/jobs/{uid}/result")
    assert r.status_code == 410 and "retention ended" in r.json()["detail"]


def _http(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("public", [True, False])
def test_result_urls_never_outlive_the_retention(oa, workers, on_store: JobStore, settings, s3_server,
                                                 live_server, public: bool) -> None:
    from onepiece_platform.engine_link import objects

    if public:
        settings.ONEPIECE = {**settings.ONEPIECE, "OBJECT_STORE_PUBLIC_URL": s3_server.endpoint}
    workers.store.objects = on_store.objects  # the test's workers store every output there
    client, _ = oa
    try:
        v = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v", poll_interval_ms=50,
                                          extra_body={**EXTRA, "retention": 300})
        auth = {"Authorization": f"Bearer {client.api_key}"}
        status, body = _http(f"{live_server.url}/v1/videos/{v.id}/content?response_format=url", auth)
        assert status == 200, body
        got, until = json.loads(body), int(Job.objects.get(uid=v.id).retain_until.timestamp())
        assert time.time() < got["expires_at"] <= until < time.time() + 301  # an hour's URL cut to the retention
        assert _http(got["url"])[0] == 200
        Job.objects.filter(uid=v.id).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=301))
        status, body = _http(f"{live_server.url}/v1/videos/{v.id}/content?response_format=url", auth)
        assert status == 410 and "retention" in json.loads(body)["error"]["message"]
        if not public:  # the platform's own URL is refused from the retention's end on
            assert _http(got["url"])[0] == 410
    finally:
        workers.store.objects = None
        objects._stores.clear()


def test_a_deleted_video_takes_its_objects_even_when_redis_forgot_it(oa, workers, on_store: JobStore,
                                                                      object_store: ObjectStore) -> None:
    from onepiece_platform.redis_conn import get_redis

    workers.store.objects = on_store.objects
    client, _ = oa
    try:
        v = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v", poll_interval_ms=50,
                                          extra_body=EXTRA)
        assert object_store.newest(result_prefix(v.id)) is not None
        get_redis().flushdb()  # the engine no longer knows the job: the ledger names the objects
        assert client.videos.delete(v.id).deleted
        assert object_store.newest(result_prefix(v.id)) is None
        assert Job.objects.get(uid=v.id).output_purged_at is not None
    finally:
        workers.store.objects = None


@pytest.mark.django_db
def test_a_deleted_job_row_takes_its_objects(alice, on_store: JobStore, object_store: ObjectStore,
                                             django_capture_on_commit_callbacks) -> None:
    """An operator deletes a job in the admin, or a user and their jobs with them: the objects go after commit."""
    from onepiece_platform.engine_link.reconciler import Reconciler

    user, c, _ = alice
    one, two = _done(c, on_store), _done(c, on_store)
    Reconciler(block_ms=0).step(block=False)  # the ledger records the outputs' keys
    assert Job.objects.get(uid=one).output_key.startswith(result_prefix(one))
    with django_capture_on_commit_callbacks(execute=True):
        Job.objects.filter(uid=one).delete()
    assert object_store.newest(result_prefix(one)) is None and object_store.newest(result_prefix(two))
    with django_capture_on_commit_callbacks(execute=True):
        user.delete()
    assert object_store.newest(result_prefix(two)) is None


def test_the_celery_beat_runs_expire_outputs_every_five_minutes() -> None:
    from onepiece_platform.celery_app import app

    app.loader.import_default_modules()  # the worker's autodiscovery: engine_link.tasks
    entry = next(e for e in app.conf.beat_schedule.values() if e["task"] == "onepiece.expire_outputs")
    assert entry["schedule"] == 300.0 and "onepiece.expire_outputs" in app.tasks


def test_a_remix_keeps_its_sources_retention_within_the_keys_tier(oa, workers) -> None:
    """A remix names no retention: the source's where this key's tier allows it, else the tier's default; or
    its own, within the ceiling (400 naming retention over it)."""
    from onepiece_platform.quotas.models import Quota

    client, user = oa
    Quota.objects.create(user=user, max_concurrent_jobs=20)
    workers.hold = True  # the sources stay queued: a remix needs only their parameters and options
    make = {"prompt": "a cat", "size": "64x64", "model": "wan2.1-t2v"}
    short = client.videos.create(**make, extra_body={**EXTRA, "retention": 600})
    long = client.videos.create(**make, extra_body={**EXTRA, "retention": 20 * DAY})
    plain = client.videos.create(**make, extra_body=EXTRA)  # the tier's default, 7 days

    def kept(video_id: str, **extra: Any) -> dt.timedelta:
        return Job.objects.get(uid=client.videos.remix(video_id, prompt="a dog", extra_body=extra).id).retention

    assert kept(short.id) == dt.timedelta(seconds=600)  # not the tier's default
    assert kept(long.id) == dt.timedelta(days=20) and kept(plain.id) == dt.timedelta(days=7)
    assert kept(short.id, retention=120) == dt.timedelta(seconds=120)
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.remix(short.id, prompt="a dog", extra_body={"retention": 31 * DAY})
    assert e.value.body["param"] == "retention"
    PriorityTier.objects.create(user=user, max_priority="low")  # the operator lowers the tier: ceiling 7 days
    assert kept(long.id) == dt.timedelta(days=1)  # over the ceiling now: the low tier's default
    assert kept(short.id) == dt.timedelta(seconds=600)
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.remix(short.id, prompt="a dog", extra_body={"retention": 8 * DAY})
    assert e.value.body["param"] == "retention"


def test_a_remixs_objects_go_with_it_never_with_its_source(oa, workers, on_store: JobStore,
                                                          object_store: ObjectStore) -> None:
    """Deleting the source leaves its remixes' objects (they download); a deleted remix takes its own, and the
    retention clean-up deletes a remix's once the retention it inherited ends."""
    from onepiece_platform.engine_link.tasks import expire_outputs

    workers.store.objects = on_store.objects
    client, _ = oa
    try:
        source = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v",
                                               poll_interval_ms=50, extra_body={**EXTRA, "retention": 600})
        one, two = (client.videos.poll(client.videos.remix(source.id, prompt=p).id, poll_interval_ms=50)
                    for p in ("a dog", "a fox"))
        assert one.status == two.status == "completed"
        assert all(object_store.newest(result_prefix(v.id)) for v in (source, one, two))
        assert client.videos.delete(source.id).deleted
        assert object_store.newest(result_prefix(source.id)) is None
        assert object_store.newest(result_prefix(one.id)) and object_store.newest(result_prefix(two.id))
        assert client.videos.download_content(one.id).read()[4:8] == b"ftyp"
        assert client.videos.delete(one.id).deleted
        assert object_store.newest(result_prefix(one.id)) is None and object_store.newest(result_prefix(two.id))
        Job.objects.filter(uid=two.id).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=601))
        assert expire_outputs.apply().get()["jobs"] == 1  # 600 s, the source's, not the tier's 7 days
        assert object_store.newest(result_prefix(two.id)) is None
    finally:
        workers.store.objects = None
