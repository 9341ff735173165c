"""The engine's ETA of an unfinished job through the web platform, against the real Proxy (whose jobs never
run here): the native job status (``eta`` and the ``OnePiece-ETA`` header), the ``/v1/videos`` object (its
``extra``), and the job's websocket (an ``eta`` message after the job's state); a finished job has none."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async

from engine.store import keys
from onepiece_platform.jobs import ledger
from tests.fixtures.web import sd_body, wan_body
from tests.web.websockets.test_consumers import _connect, _session

ETA_KEYS = {"eta_s", "eta_p90_s", "provisional", "queue_ahead"}


def _check(eta: dict[str, Any]) -> None:
    assert set(eta) == ETA_KEYS, eta
    assert eta["eta_s"] > 0 and eta["eta_p90_s"] >= eta["eta_s"]
    assert eta["provisional"] is True  # nothing finished on this deployment yet: the gate cannot have passed


@pytest.mark.django_db
def test_job_status_and_video_object_carry_the_engines_eta(proxy_url: str, alice: Any, store: Any) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    r = c.get(f"/api/v1/jobs/{uid}")
    assert r.status_code == 200, r.content
    _check(r.json()["eta"])
    assert r.headers["OnePiece-ETA"].startswith("p50=") and r.headers["OnePiece-ETA"].endswith("provisional=1")

    video = c.post("/api/v1/jobs", wan_body(), format="json").json()["uid"]
    r = c.get(f"/v1/videos/{video}")
    assert r.status_code == 200, r.content
    _check(r.json()["extra"]["eta"])
    assert "OnePiece-ETA" in r.headers

    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png!")
    r = c.get(f"/api/v1/jobs/{uid}")
    assert r.json()["state"] == "completed" and r.json()["eta"] is None and "OnePiece-ETA" not in r.headers


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_job_socket_sends_the_eta_after_the_state(proxy_url: str, alice: Any) -> None:
    uid = (await database_sync_to_async(alice[1].post)("/api/v1/jobs", sd_body(), format="json")).json()["uid"]
    ws = _connect(f"/ws/jobs/{uid}", await database_sync_to_async(_session)(alice[0]))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    first = await ws.receive_json_from(timeout=5)
    assert first["type"] == "job" and first["job"]["state"] == "queued"
    eta = await ws.receive_json_from(timeout=5)
    assert eta["type"] == "eta" and eta["uid"] == uid
    _check({k: v for k, v in eta.items() if k not in ("type", "uid")})
    await database_sync_to_async(ledger.finish)(uid, "cancelled", "cancelled by owner")
    done = await ws.receive_json_from(timeout=5)
    assert done["type"] == "job" and done["job"]["state"] == "cancelled"
    assert await ws.receive_nothing(timeout=0.5)  # no ETA for a finished job
    await ws.disconnect()
