"""A completed job's output on its ledger row and in its API representation: the object's key, size and SHA-256
(issue 38, item 1), carried by the engine's completion event and applied by the reconciler. Real redis-server,
real Swift s3api server."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from engine.store import JobStore, keys
from engine.store.objects import ObjectStore, result_prefix
from onepiece_platform.engine_link.reconciler import Reconciler, parse
from onepiece_platform.jobs import ledger
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db
BIG = b"\x89PNG\r\n\x1a\n" + os.urandom(40_000)
SMALL = b"\x89PNG\r\n\x1a\n" + os.urandom(500)


@pytest.fixture
def worker(web_redis: str, object_store: ObjectStore) -> Iterator[JobStore]:
    """A last stage's worker: outputs under 1 KiB inline in Redis, larger ones to the store."""
    from onepiece_platform.redis_conn import get_redis

    w = JobStore(get_redis(), objects=ObjectStore(object_store.config), inline_bytes=1024)
    yield w
    w.objects.close()


def _done(c: Any, w: JobStore, data: bytes) -> str:
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    assert w.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=data)
    return uid


def test_the_ledger_records_a_stored_outputs_key_size_and_digest(alice, worker: JobStore,
                                                                 object_store: ObjectStore) -> None:
    _, c, _ = alice
    uid = _done(c, worker, BIG)
    Reconciler(block_ms=0).step(block=False)
    job = Job.objects.get(uid=uid)
    ref = object_store.newest(result_prefix(uid))
    assert ref is not None and job.output_key == ref.key and job.output_key.startswith(result_prefix(uid))
    assert (job.output_size, job.output_sha256) == (len(BIG), hashlib.sha256(BIG).hexdigest())
    assert job.output_content_type == "image/png"
    assert c.get(f"/api/v1/jobs/{uid}").json()["output"] == {
        "key": ref.key, "size": len(BIG), "sha256": hashlib.sha256(BIG).hexdigest(), "content_type": "image/png"}


def test_an_inline_output_has_size_and_digest_but_no_key(alice, worker: JobStore) -> None:
    _, c, _ = alice
    uid = _done(c, worker, SMALL)
    Reconciler(block_ms=0).step(block=False)
    assert c.get(f"/api/v1/jobs/{uid}").json()["output"] == {
        "key": None, "size": len(SMALL), "sha256": hashlib.sha256(SMALL).hexdigest(), "content_type": "image/png"}


def test_the_output_is_recorded_when_a_status_read_finished_the_row_first(alice, worker: JobStore) -> None:
    _, c, _ = alice
    uid = _done(c, worker, BIG)
    got = c.get(f"/api/v1/jobs/{uid}").json()  # the status read finishes the row; the event is not applied yet
    assert got["state"] == "completed" and got["output"] is None
    Reconciler(block_ms=0).step(block=False)
    assert c.get(f"/api/v1/jobs/{uid}").json()["output"]["sha256"] == hashlib.sha256(BIG).hexdigest()
    before = Job.objects.get(uid=uid).output_key
    assert not ledger.record_output(uid, {"key": "results/other", "size": 1, "sha256": "0" * 64,
                                          "content_type": ""})  # set once
    assert Job.objects.get(uid=uid).output_key == before


def test_only_completed_events_carry_an_output(alice, worker: JobStore) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    worker.finish(uid, "sd-t2i", keys.FAILED, "denoise", detail="boom")
    (ended,) = [e for e in worker.events(uid) if e["type"] == keys.FAILED]
    assert "output" not in ended
    done = _done(c, worker, BIG)
    (completed,) = [e for e in worker.events(done) if e["type"] == keys.COMPLETED]
    assert json.loads(completed["output"])["sha256"] == hashlib.sha256(BIG).hexdigest()


@pytest.mark.parametrize("raw, says", [
    ("[]", "not a JSON object"),
    ("{not json", "Expecting property name"),
    ('{"key": 1, "size": 1, "sha256": "%s"}' % ("0" * 64), "output.key"),
    ('{"key": "k", "size": -1, "sha256": "%s"}' % ("0" * 64), "output.size"),
    ('{"key": "k", "size": true, "sha256": "%s"}' % ("0" * 64), "output.size"),
    ('{"key": "k", "size": 1, "sha256": "ABC"}', "output.sha256"),
    ('{"key": "k", "size": 1, "sha256": "%s", "content_type": 5}' % ("0" * 64), "output.content_type"),
])
def test_a_malformed_output_is_a_typed_error(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ledger.parse_output(raw)


def test_a_completion_with_a_malformed_output_still_completes(alice, store) -> None:
    """The output goes unrecorded (and logged); the job's completion is not lost with it."""
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    fields = {"uid": uid, "type": keys.COMPLETED, "stage": "image_encode", "progress": "100", "ts": "1.0",
              "detail": "", "attempt": "1", "output": '{"key": "k", "size": "big"}'}
    ev = parse(fields)
    assert "output" not in ev
    assert ledger.apply_event(**ev)
    assert Job.objects.get(uid=uid).state == "completed" and Job.objects.get(uid=uid).output is None


def test_a_videos_output_is_in_its_extra(alice, worker: JobStore) -> None:
    _, c, _ = alice
    r = c.post("/v1/videos", {"prompt": "a cat", "model": "wan2.1-t2v", "size": "64x64", "seconds": "1"},
               format="json")
    assert r.status_code == 200, r.content
    vid = r.json()["id"]
    assert r.json()["extra"]["output"] is None
    assert worker.finish(vid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=BIG)
    Reconciler(block_ms=0).step(block=False)
    assert c.get(f"/v1/videos/{vid}").json()["extra"]["output"]["sha256"] == hashlib.sha256(BIG).hexdigest()
