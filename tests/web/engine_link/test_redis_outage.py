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
    from onepiece_platform import redis_conn
    from onepiece_platform.engine_link.client import reset_engines

    r = OwnRedis(tmp_path / "redis")
    settings.REDIS_URL = r.server.url
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.local.LocalEngineClient",
                         "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}
    redis_conn.close_all()
    reset_engines()
    try:
        yield r
    finally:
        redis_conn.close_all()
        reset_engines()
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
