"""Redis stopped and restarted under the web platform (a real redis-server of the test's own, stopped and
started again empty on the same port): every route that needs it answers 503 with Retry-After while it
is down, never a 500; jobs in flight when it came back empty are submitted again under their UIDs and
complete."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.embedded import RedisServer
from tests.fixtures.web import client_for, make_user, sd_body, wan_body

pytestmark = pytest.mark.django_db


class OwnRedis:
    """A redis-server only this test uses (the session's is shared): it can stop it and start it again."""

    def __init__(self, folder: Path) -> None:
        self.server = RedisServer("redis-server", folder).start()

    def stop(self) -> None:
        self.server.stop()

    def restart_empty(self) -> None:
        """Started again on the same port with the same password, and nothing in it (no persistence)."""
        self.server.stop()
        self.server = RedisServer("redis-server", self.server.data_dir, port=self.server.port).start()


@pytest.fixture
def own_redis(tmp_path: Path, settings: Any) -> Iterator[OwnRedis]:
    from channels.layers import channel_layers

    from onepiece_platform import redis_conn
    from onepiece_platform.engine_link.client import reset_engines

    r = OwnRedis(tmp_path / "redis")
    settings.REDIS_URL = r.server.url
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [r.server.url]}}}
    channel_layers.backends.clear()
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.local.LocalEngineClient",
                         "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}
    redis_conn.close_all()
    reset_engines()
    try:
        yield r
    finally:
        redis_conn.close_all()
        reset_engines()
        channel_layers.backends.clear()
        r.stop()


def _assert_503(response: Any, what: str) -> None:
    assert response.status_code == 503, (what, response.status_code, response.content[:300])
    assert int(response["Retry-After"]) > 0, what


def test_while_redis_is_down_every_submit_and_every_wrong_key_is_a_503(own_redis: OwnRedis) -> None:
    _, key = make_user("outage")
    c = client_for(key)
    assert c.post("/api/v1/jobs", sd_body(), format="json").status_code == 202  # serving before
    own_redis.stop()
    _assert_503(c.post("/api/v1/jobs", sd_body(seed=1), format="json"), "native submit")
    _assert_503(c.post("/api/v1/jobs", wan_body(), format="json"), "native submit with an image")
    r = c.post("/v1/videos", {"prompt": "a cat", "size": "32x32", "seconds": "1"}, format="json")
    _assert_503(r, "openai video")
    assert r.json()["error"]["type"]  # in OpenAI's error shape
    _assert_503(c.post("/v1/images/generations", {"prompt": "a cat", "size": "64x64"}, format="json"),
                "openai image")
    wrong = client_for("op_000000000000_nothing")  # the failed-authentication counter is in Redis
    _assert_503(wrong.post("/api/v1/jobs", sd_body(), format="json"), "wrong key, native")
    _assert_503(wrong.get("/api/v1/jobs"), "wrong key, list")
    _assert_503(wrong.post("/v1/images/generations", {"prompt": "x"}, format="json"), "wrong key, openai")
    _assert_503(client_for("Bearer two words").get("/api/v1/jobs"), "malformed Authorization")
    own_redis.restart_empty()
    assert c.post("/api/v1/jobs", sd_body(seed=2), format="json").status_code == 202  # and serving after


def _settle(reconciler: Any, uids: list[str], timeout: float = 30) -> dict[str, Any]:
    """Apply the engine's events until every job in ``uids`` is finished in the ledger."""
    import time

    from onepiece_platform.jobs.models import TERMINAL, Job

    deadline = time.monotonic() + timeout
    while True:
        reconciler.step()
        jobs = {j.uid: j for j in Job.objects.filter(uid__in=uids)}
        if all(j.state in TERMINAL for j in jobs.values()):
            return jobs
        assert time.monotonic() < deadline, {u: j.state for u, j in jobs.items()}


def test_jobs_in_flight_when_redis_restarts_empty_complete_under_their_uids(own_redis: OwnRedis,
                                                                            settings: Any) -> None:
    from engine.store import JobStore, keys
    from engine.workflow import message as wm
    from onepiece_platform.engine_link.reconciler import Reconciler
    from onepiece_platform.jobs.models import Job, JobInput
    from tests.fixtures.workers import Workers

    settings.ONEPIECE = {**settings.ONEPIECE, "LOST_AFTER_S": 0.0, "PROXY_TIMEOUT_S": 0.0}
    _, key = make_user("inflight")
    c = client_for(key)
    uids = [c.post("/api/v1/jobs", body, format="json").json()["uid"]
            for body in (sd_body(), wan_body(quality="high", preview_every=1))]
    assert JobInput.objects.filter(job__uid=uids[1], name="image").exists()  # the first frame is kept
    store = JobStore.from_url(own_redis.server.url)
    store.event(uids[1], keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    store.close()
    reconciler = Reconciler(block_ms=0)
    reconciler.step()
    assert Job.objects.get(uid=uids[1]).stage_times["text_encode"]["attempt"] == 1

    own_redis.restart_empty()  # status hashes, first-stage messages, events: all gone
    assert reconciler.sweep() == 0  # nothing failed: both submitted again, under their UIDs
    assert {j.uid: (j.state, j.resubmissions) for j in Job.objects.filter(uid__in=uids)} == {
        u: ("queued", 1) for u in uids}
    kept = JobStore.from_url(own_redis.server.url)  # the message submitted again carries the job's options
    try:
        again = wm.decode(kept.r.get(keys.input_key(uids[1]))).header
    finally:
        kept.close()
    assert again.options == {"quality": "high", "preview_every": 1} and "quality" not in again.params
    workers = Workers(own_redis.server.url)  # the engine runs what it was handed again
    try:
        jobs = _settle(reconciler, uids)
    finally:
        workers.close()
    assert all(j.state == "completed" for j in jobs.values()), {u: (j.state, j.detail) for u, j in jobs.items()}
    for uid in uids:
        doc = c.get(f"/api/v1/jobs/{uid}").json()
        assert doc["state"] == "completed" and doc["resubmissions"] == 1, doc
        assert c.get(f"/api/v1/jobs/{uid}/result").status_code == 200
    # the second submission's stage runs are a new attempt beside the first's
    runs = {(r["stage"], r["attempt"]) for r in c.get(f"/api/v1/jobs/{uids[1]}").json()["stage_runs"]}
    assert {("text_encode", 1), ("denoise", 2)} <= runs, runs
    assert not JobInput.objects.filter(job__uid__in=uids).exists()  # dropped once finished


def test_resubmissions_are_bounded(own_redis: OwnRedis, settings: Any) -> None:
    from onepiece_platform.engine_link.reconciler import Reconciler
    from onepiece_platform.engine_link.resubmit import LOST
    from onepiece_platform.jobs.models import Job

    settings.ONEPIECE = {**settings.ONEPIECE, "LOST_AFTER_S": 0.0, "PROXY_TIMEOUT_S": 0.0, "RESUBMIT_MAX": 1}
    _, key = make_user("twice-lost")
    uid = client_for(key).post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    reconciler = Reconciler(block_ms=0)
    own_redis.restart_empty()
    assert reconciler.sweep() == 0 and Job.objects.get(uid=uid).resubmissions == 1
    own_redis.restart_empty()  # lost again: out of attempts
    assert reconciler.sweep() == 1
    job = Job.objects.get(uid=uid)
    assert job.state == "failed" and job.detail == f"{LOST}; submitted again 1 times"
