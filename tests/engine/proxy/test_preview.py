"""The Proxy's live-preview route (GET /v1/requests/{uid}/preview) and preview_every at its intake, against
real Redis and etcd and a real ring (no models: the previews are written as a denoise worker writes them)."""

from __future__ import annotations

from typing import Any

from engine.store import keys
from engine.workflow import message as wm
from tests.engine.proxy.test_app import SD, _serve, env  # noqa: F401  (env: the fixture)


def test_preview_every_is_refused_at_intake_naming_it(env: dict[str, Any]) -> None:  # noqa: F811
    async def body(client: Any) -> None:
        for bad in (-1, 2.5, "5", 10_000):
            r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": {**SD, "preview_every": bad}})
            assert r.status == 400, bad
            assert (await r.json())["field"] == "preview_every"

    _serve(env, 10, body)
    assert env["ring"].recv(timeout=0.05) is None  # nothing was queued


def test_get_preview_answers_the_latest_image(env: dict[str, Any]) -> None:  # noqa: F811
    store = env["store"]

    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": {**SD, "preview_every": 1}})
        assert r.status == 202
        uid = (await r.json())["uid"]
        assert (await client.get(f"/v1/requests/{uid}/preview")).status == 204  # none yet
        store.preview.add(uid, "denoise", 1, 2, b"\x89PNG first")
        store.preview.add(uid, "denoise", 2, 2, b"\x89PNG second")
        r = await client.get(f"/v1/requests/{uid}/preview")
        assert r.status == 200 and r.content_type == "image/png"
        assert await r.read() == b"\x89PNG second"
        assert (r.headers["OnePiece-Preview-Step"], r.headers["OnePiece-Preview-Total"],
                r.headers["OnePiece-Preview-Stage"]) == ("2", "2", "denoise")
        assert (await client.get(f"/v1/requests/{'a' * 32}/preview")).status == 404

    _serve(env, 10, body)
    d = env["ring"].recv(timeout=5.0)
    assert d is not None
    with d:  # the accepted request reached the first stage with its preview_every, among its options
        h = wm.decode(d.view).header
        assert h.options == {"preview_every": 1} and "preview_every" not in h.params


def test_no_preview_key_for_a_request_without_preview_every(env: dict[str, Any]) -> None:  # noqa: F811
    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
        assert r.status == 202

    _serve(env, 10, body)
    assert env["store"].r.keys(keys.preview_key("*")) == []
