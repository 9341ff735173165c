"""Websockets: /ws/jobs/<uid> to its owner only, /ws/cluster to staff at least once a second."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from engine.store import keys
from onepiece_platform.jobs import ledger
from tests.fixtures.web import sd_body

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


def _session(user: Any) -> str:
    c = Client()
    c.force_login(user)
    return c.cookies["sessionid"].value


def _connect(path: str, session: str | None, origin: bytes = b"http://localhost") -> WebsocketCommunicator:
    from onepiece_platform.asgi import application

    headers = [(b"host", b"localhost"), (b"origin", origin)]
    if session:
        headers.append((b"cookie", f"sessionid={session}".encode()))
    return WebsocketCommunicator(application, path, headers=headers)


@pytest.fixture
def job(alice: Any) -> str:
    return str(alice[1].post("/api/v1/jobs", sd_body(), format="json").json()["uid"])


async def test_owner_gets_state_then_every_change(alice, job, store) -> None:
    session = await database_sync_to_async(_session)(alice[0])
    ws = _connect(f"/ws/jobs/{job}", session)
    connected, _ = await ws.connect()
    assert connected
    first = await ws.receive_json_from(timeout=5)
    assert first["job"]["uid"] == job and first["job"]["state"] == "queued"
    await database_sync_to_async(ledger.apply_event)(job, keys.PROGRESS, "denoise", 40, 1.0, "")
    update = await ws.receive_json_from(timeout=5)
    assert (update["job"]["state"], update["job"]["stage"], update["job"]["progress"]) == ("in_progress", "denoise", 40)
    await database_sync_to_async(ledger.finish)(job, "completed")
    done = await ws.receive_json_from(timeout=5)
    assert done["job"]["state"] == "completed" and done["job"]["progress"] == 100
    await ws.disconnect()


async def test_reconnect_resyncs_to_the_current_state(alice, job) -> None:
    session = await database_sync_to_async(_session)(alice[0])
    ws = _connect(f"/ws/jobs/{job}", session)
    await ws.connect()
    await ws.receive_json_from(timeout=5)
    await ws.disconnect()
    await database_sync_to_async(ledger.finish)(job, "cancelled", "cancelled by owner")  # missed while away
    ws = _connect(f"/ws/jobs/{job}", session)
    await ws.connect()
    again = await ws.receive_json_from(timeout=5)
    assert again["job"]["state"] == "cancelled" and again["job"]["detail"] == "cancelled by owner"
    await ws.disconnect()


async def test_other_users_job_is_refused_like_a_missing_one(alice, bob, job) -> None:
    session = await database_sync_to_async(_session)(bob[0])
    for path in (f"/ws/jobs/{job}", "/ws/jobs/" + "0" * 32):
        ws = _connect(path, session)
        assert await _refused(ws) == 4404
        await ws.disconnect()


async def test_anonymous_and_foreign_origin_are_refused(alice, job) -> None:
    ws = _connect(f"/ws/jobs/{job}", None)
    assert await _refused(ws) == 4401
    await ws.disconnect()
    session = await database_sync_to_async(_session)(alice[0])
    for origin in (b"https://evil.example", b"http://localhost:9999", b"null"):
        ws = _connect(f"/ws/jobs/{job}", session, origin=origin)
        connected, _ = await ws.connect()
        assert not connected, origin  # another site (or another port of this host) cannot use the cookies
        await ws.disconnect()


@pytest.fixture
def cluster_etcd(etcd_server: Any, settings: Any, web_redis: str) -> Any:
    from onepiece_platform.engine_link.cluster import reset_clusters

    settings.ETCD_URL = etcd_server.url
    reset_clusters()
    yield
    reset_clusters()


async def test_cluster_state_reaches_staff_every_second(cluster_etcd, alice) -> None:
    from django.contrib.auth import get_user_model

    staff = await database_sync_to_async(get_user_model().objects.create_user)("op", password="x", is_staff=True)
    ws = _connect("/ws/cluster", await database_sync_to_async(_session)(staff))
    connected, _ = await ws.connect()
    assert connected
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stamps = [(await ws.receive_json_from(timeout=5))["cluster"]["ts"] for _ in range(3)]
    elapsed = loop.time() - t0
    assert stamps == sorted(stamps) and elapsed < 3.0  # first at once, then one per second
    assert all(b - a <= 1.5 for a, b in zip(stamps, stamps[1:], strict=False))
    await ws.disconnect()
    ws = _connect("/ws/cluster", await database_sync_to_async(_session)(alice[0]))
    assert await _refused(ws) == 4403
    await ws.disconnect()


async def _refused(ws: Any) -> int:
    """The close code of a refused socket: accepted, then closed with the code (a close before the accept
    would be an HTTP 403 at the handshake, and a browser would never see the code)."""
    connected, _ = await ws.connect()
    assert connected
    msg = await ws.receive_output(timeout=5)
    assert msg["type"] == "websocket.close", msg
    return int(msg["code"])
