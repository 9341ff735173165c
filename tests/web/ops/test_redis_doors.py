"""With Redis stopped (a real redis-server of the test's own), the doors that read it answer 503 with
Retry-After before any response starts, never a 500 and never a 200 with a cut body: the admin's sign-in
(its failure limit is in Redis), the dashboard's job and preview endpoints, and the streamed result of both
APIs (issue 39, finding 3)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from engine.embedded import RedisServer
from tests.fixtures.web import client_for, make_user, sd_body

pytestmark = pytest.mark.django_db


@pytest.fixture
def own_redis(tmp_path: Path, settings: Any) -> Iterator[RedisServer]:
    """A redis-server only this test uses (the session's is shared), which it stops."""
    from channels.layers import channel_layers

    from onepiece_platform import redis_conn
    from onepiece_platform.engine_link.client import reset_engines

    server = RedisServer("redis-server", tmp_path / "redis").start()
    settings.REDIS_URL = server.url
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [server.url]}}}
    channel_layers.backends.clear()
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.local.LocalEngineClient",
                         "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}
    redis_conn.close_all()
    reset_engines()
    try:
        yield server
    finally:
        redis_conn.close_all()
        reset_engines()
        channel_layers.backends.clear()
        server.stop()


def _assert_503(response: Any, what: str) -> None:
    assert response.status_code == 503, (what, response.status_code)
    assert not response.streaming, what  # answered whole: nothing was started and then cut
    assert int(response["Retry-After"]) > 0, what


def test_admin_sign_in_is_a_503_while_redis_is_down(own_redis: RedisServer) -> None:
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("root", password="a-long-admin-password")
    c = Client()
    assert c.post("/admin/login/", {"username": "root", "password": "a-guess"}).status_code == 200  # the form
    own_redis.stop()
    assert c.get("/admin/login/").status_code == 200  # the page itself needs no Redis
    _assert_503(c.post("/admin/login/", {"username": "root", "password": "another-guess"}), "failed sign-in")
    # the right password too: whether this address is over the failure limit cannot be known
    _assert_503(c.post("/admin/login/", {"username": "root", "password": "a-long-admin-password"}), "sign-in")


def test_the_dashboards_job_and_preview_are_a_503_while_redis_is_down(own_redis: RedisServer) -> None:
    from django.contrib.auth import get_user_model

    _, key = make_user("previewer")
    r = client_for(key).post("/api/v1/jobs", sd_body(preview_every=1), format="json")
    assert r.status_code == 202, r.content
    uid = r.json()["uid"]
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("ops", password="pw", is_staff=True))
    assert staff.get(f"/dashboard/api/jobs/{uid}/preview").status_code == 204  # none yet
    own_redis.stop()
    _assert_503(staff.get(f"/dashboard/api/jobs/{uid}/preview"), "dashboard preview")
    _assert_503(staff.get(f"/dashboard/api/jobs/{uid}"), "dashboard job")
    assert staff.get("/dashboard/api/jobs").status_code == 200  # the ledger alone: no Redis


def test_a_stream_asked_for_while_redis_is_down_is_a_503_not_a_cut_200(own_redis: RedisServer) -> None:
    from engine.store import JobStore, keys
    from onepiece_platform.jobs.models import Job

    _, key = make_user("streamer")
    c = client_for(key)
    r = c.post("/v1/videos", {"prompt": "a cat", "size": "32x32", "seconds": "1"}, format="json")
    assert r.status_code == 200, r.content
    uid = r.json()["id"]
    store = JobStore.from_url(own_redis.url)
    try:
        assert store.finish(uid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=b"\0\0\0\x08ftyp")
    finally:
        store.close()
    assert c.get(f"/v1/videos/{uid}").json()["status"] == "completed"  # the ledger knows: no engine read
    assert Job.objects.get(uid=uid).state == "completed"
    own_redis.stop()
    r = c.get(f"/v1/videos/{uid}/content", {"stream": "true"})
    _assert_503(r, "openai stream")
    assert r.json()["error"]["type"]  # in OpenAI's error shape
    _assert_503(c.get(f"/api/v1/jobs/{uid}/result", {"stream": "true"}), "native stream")
