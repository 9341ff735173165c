"""Live previews on the platform (issue 28 item 2): ``preview_every`` on the native API and both OpenAI routes
(extra_body), ``GET /api/v1/jobs/<uid>/preview`` (the latest, to its owner), the job's websocket sending the
previews in step order, the dashboard's job view and the owner's watch page. The previews are written to the
real redis-server as a denoise worker writes them (JobStore.preview.add)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.test import Client

from engine.store import keys
from engine.workflow import message as wm
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _sd(**params: Any) -> dict[str, Any]:
    body = sd_body()
    body["params"] = {**body["params"], **params}
    return body


def test_native_api_checks_preview_every_and_serves_the_latest(alice, bob, store) -> None:
    _, c, _ = alice
    for bad in (-1, 1.5, 10_000):
        r = c.post("/api/v1/jobs", _sd(preview_every=bad), format="json")
        assert r.status_code == 400 and r.json()["field"] == "preview_every", r.json()
    assert not Job.objects.exists()  # refused before anything was written or sent
    r = c.post("/api/v1/jobs", _sd(preview_every=2), format="json")
    assert r.status_code == 202
    uid = r.json()["uid"]
    assert wm.decode(store.r.get(keys.input_key(uid))).header.options["preview_every"] == 2  # on to the stages
    assert c.get(f"/api/v1/jobs/{uid}/preview").status_code == 204  # none yet
    store.preview.add(uid, "denoise", 2, 4, b"\x89PNG two")
    store.preview.add(uid, "denoise", 4, 4, b"\x89PNG four")
    r = c.get(f"/api/v1/jobs/{uid}/preview")
    assert r.status_code == 200 and r["Content-Type"] == "image/png" and r.content == b"\x89PNG four"
    assert (r["OnePiece-Preview-Step"], r["OnePiece-Preview-Total"], r["OnePiece-Preview-Stage"]) == ("4", "4", "denoise")
    assert bob[1].get(f"/api/v1/jobs/{uid}/preview").status_code == 404  # another user's job: as if missing


def test_preview_is_off_by_default(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    assert wm.decode(store.r.get(keys.input_key(uid))).header.options == {}  # a plain request's
    assert c.get(f"/api/v1/jobs/{uid}/preview").status_code == 204
    assert store.r.keys(keys.preview_key("*")) == []


def test_openai_routes_take_preview_every_through_extra_body(oa, workers) -> None:
    client, _ = oa
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a cat", size="64x64", extra_body={"preview_every": -1, "num_inference_steps": 2})
    assert e.value.body["param"] == "preview_every"
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                             extra_body={"preview_every": 1000, "num_inference_steps": 2})
    assert e.value.body["param"] == "preview_every"
    v = client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                             extra_body={"preview_every": 1, "num_inference_steps": 2})
    assert Job.objects.get(uid=v.id).options["preview_every"] == 1
    client.images.generate(prompt="a cat", size="64x64", extra_body={"preview_every": 2, "num_inference_steps": 2})
    assert Job.objects.filter(workflow="sd-t2i").get().options["preview_every"] == 2


def _session(user: Any) -> str:
    c = Client()
    c.force_login(user)
    return c.cookies["sessionid"].value


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_websocket_sends_previews_in_step_order(alice, store) -> None:
    from channels.testing import WebsocketCommunicator

    from onepiece_platform.asgi import application

    uid = await database_sync_to_async(lambda: alice[1].post("/api/v1/jobs", _sd(preview_every=1),
                                                             format="json").json()["uid"])()
    session = await database_sync_to_async(_session)(alice[0])
    store.preview.add(uid, "denoise", 1, 3, b"\x89PNG one")  # written before the socket: sent first
    ws = WebsocketCommunicator(application, f"/ws/jobs/{uid}", headers=[
        (b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", f"sessionid={session}".encode())])
    assert (await ws.connect(timeout=10))[0]
    steps = []
    pending = [2, 3]
    while len(steps) < 3:
        msg = await ws.receive_json_from(timeout=10)
        if msg["type"] != "preview":
            continue
        p = msg["preview"]
        assert p["image"].startswith("data:image/png;base64,") and p["stage"] == "denoise" and p["total"] == 3
        steps.append(p["step"])
        if pending:  # the next one is written while the socket is open: the tail sees it
            await database_sync_to_async(store.preview.add)(uid, "denoise", pending.pop(0), 3, b"\x89PNG next")
    assert steps == [1, 2, 3]
    await ws.disconnect()


def test_dashboard_job_view_shows_the_live_preview(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", _sd(preview_every=1), format="json").json()["uid"]
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    assert staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]["preview"] is None
    store.preview.add(uid, "denoise", 3, 4, b"\x89PNG three")
    preview = staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]["preview"]
    assert (preview["step"], preview["total"], preview["stage"]) == (3, 4, "denoise")
    r = staff.get(preview["url"])
    assert r.status_code == 200 and r.content == b"\x89PNG three"
    owner = Client()
    owner.force_login(alice[0])
    assert owner.get(preview["url"]).status_code == 403  # the dashboard's endpoints are staff's


def test_the_watch_page_is_the_owners(alice, bob) -> None:
    uid = alice[1].post("/api/v1/jobs", _sd(preview_every=1), format="json").json()["uid"]
    owner, other = Client(), Client()
    owner.force_login(alice[0])
    other.force_login(bob[0])
    r = owner.get(f"/jobs/{uid}/watch")
    assert r.status_code == 200 and uid in r.content.decode() and b"onepiece/watch.js" in r.content
    assert other.get(f"/jobs/{uid}/watch").status_code == 404
