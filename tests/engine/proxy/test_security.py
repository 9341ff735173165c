"""The Proxy's doors (issue 16): callers must hold the shared secret, and every bad input is a 4xx naming
the field with nothing accepted, queued or counted in flight. In-process against real Redis, etcd and a
real ring (fixtures of test_app)."""

from __future__ import annotations

import base64
import io
import json
import uuid
import zlib
from typing import Any

import pytest

from engine.coord.routes import RouteTable
from engine.proxy.app import Limits, make_app
from engine.proxy.injector import Injector
from engine.proxy.monitor import RequestMonitor
from engine.proxy.recovery import OrphanSweeper
from engine.store import keys
from tests.engine.proxy.test_app import SD, TOKEN, _serve, env  # noqa: F401 - the env fixture

WAN = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2}


def _nothing_accepted(env: dict[str, Any]) -> None:  # noqa: F811
    assert env["store"].events() == []
    assert env["ring"].recv(timeout=0.05) is None
    assert env["store"].inflight("sd-t2i") == (0, 0.0) and env["store"].inflight("wan2.1-i2v") == (0, 0.0)


def _png(w: int, h: int, noise: bool = False) -> bytes:
    from PIL import Image

    if noise:
        import numpy as np

        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    else:
        img = Image.new("RGB", (w, h), (10, 200, 10))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(w: int, h: int) -> bytes:
    """A valid greyscale PNG of w x h zero pixels: a few kilobytes that decode to w*h bytes."""
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = zlib.compressobj(9)
    row = b"\x00" * (w + 1)
    idat = b"".join(raw.compress(row) for _ in range(h)) + raw.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_every_route_but_health_needs_the_shared_secret(env: dict[str, Any]) -> None:  # noqa: F811
    uid = uuid.uuid4().hex
    env["store"].accept(uid, "sd-t2i", 1.0)  # someone's job: an anonymous caller may not touch it
    env["store"].finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"secret png")

    async def body(client: Any) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong-" + TOKEN}, {"Authorization": TOKEN},
                        {"Authorization": "Basic " + TOKEN}):
            calls = [client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD}, headers=headers),
                     client.get(f"/v1/requests/{uid}", headers=headers),
                     client.get(f"/v1/requests/{uid}/result", headers=headers),
                     client.delete(f"/v1/requests/{uid}", headers=headers),
                     client.delete(f"/v1/requests/{uid}/result", headers=headers)]
            for call in calls:
                r = await call
                assert r.status == 401, (headers, await r.text())
                assert "secret png" not in await r.text()
        for path in ("/livez", "/readyz"):  # probes stay open
            assert (await client.get(path)).status == 200

    _serve(env, 10, body, headers={})
    assert not env["store"].cancel_requested(uid) and env["store"].result(uid) == b"secret png"
    assert [e["type"] for e in env["store"].events()] == ["accepted", "completed"]  # nothing new
    assert env["ring"].recv(timeout=0.05) is None


def test_a_weak_or_missing_secret_is_refused_at_start(env: dict[str, Any]) -> None:  # noqa: F811
    injector = Injector(RouteTable(env["etcd"], refresh_s=0.0), "round-robin", 1.0)
    try:
        for token in ("", "short"):
            with pytest.raises(ValueError, match="ONEPIECE_PROXY_TOKEN"):
                make_app(env["store"], RouteTable(env["etcd"], refresh_s=0.0), injector, RequestMonitor(2),
                         token=token)
    finally:
        injector.close()


def test_an_over_long_prompt_is_refused_at_intake_with_nothing_queued(env: dict[str, Any]) -> None:  # noqa: F811
    async def body(client: Any) -> None:
        for prompt in ("x" * 1_100_000, "é" * 200_000):
            for field in ("prompt", "negative_prompt"):
                params = {**SD, field: prompt}
                r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": params})
                assert r.status == 400 and (await r.json())["field"] == field, await r.text()
        r = await client.post("/v1/requests", data=b'{"workflow": "sd-t2i", "params": {"prompt": "\\ud800"}}',
                              headers={"Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["field"] == "prompt"  # not encodable text

    _serve(env, 10, body)
    _nothing_accepted(env)


def test_nan_infinity_and_strange_json_are_400(env: dict[str, Any]) -> None:  # noqa: F811
    sd = json.dumps(SD)[1:-1]
    bodies = [
        (f'{{"workflow": "sd-t2i", "params": {{{sd}, "guidance_scale": NaN}}}}', None),
        (f'{{"workflow": "sd-t2i", "params": {{{sd}, "guidance_scale": Infinity}}}}', None),
        (f'{{"workflow": "sd-t2i", "params": {{{sd}}}, "deadline_s": -Infinity}}', None),
        (f'{{"workflow": "sd-t2i", "params": {{{sd}}}, "deadline_s": 1e400}}', "deadline_s"),  # inf
        (f'{{"workflow": "sd-t2i", "params": {{{sd}}}, "colour": "red"}}', "colour"),  # unknown field
        (f'{{"workflow": "sd-t2i", "params": {{{sd}}}, "uid": "not-hex"}}', "uid"),
        (f'{{"workflow": "sd-t2i", "params": {{{sd}}}, "priority": 10000000000}}', "priority"),
        ("[" * 100_000 + "]" * 100_000, "body"),  # nested deeper than any parser's stack
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "body"),
    ]

    async def body(client: Any) -> None:
        for raw, field in bodies:
            r = await client.post("/v1/requests", data=raw.encode(), headers={"Content-Type": "application/json"})
            assert r.status == 400, (raw[:80], await r.text())
            if field:
                assert (await r.json())["field"] == field, raw[:80]
        r = await client.post("/v1/requests", data=b'{"workflow": "sd-t2i", "params": {"prompt": "\xff\xfe"}}',
                              headers={"Content-Type": "application/json"})
        assert r.status == 400  # not UTF-8

    _serve(env, 10, body)
    _nothing_accepted(env)


def test_bombs_huge_and_broken_images_are_refused(env: dict[str, Any]) -> None:  # noqa: F811
    images = [
        _bomb_png(20_000, 20_000),  # 400 megapixels in a few hundred kilobytes (a decompression bomb)
        _bomb_png(9_000, 9_000),  # 81 megapixels, under PIL's own bomb limit
        _png(64, 64)[:60],  # truncated
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # a format no client sends (EPS runs Ghostscript)
    ]

    async def body(client: Any) -> None:
        for img in images:
            doc = {"workflow": "wan2.1-i2v", "params": WAN, "inputs": {"image": base64.b64encode(img).decode()}}
            r = await client.post("/v1/requests", json=doc)
            assert r.status == 400 and (await r.json())["field"] == "image", await r.text()

    _serve(env, 10, body)
    _nothing_accepted(env)


def test_bodies_over_the_limit_are_413_even_when_chunked(env: dict[str, Any]) -> None:  # noqa: F811
    limit = 64 << 10
    big = json.dumps({"workflow": "sd-t2i", "params": {**SD, "prompt": "x" * (2 * limit)}}).encode()

    async def chunks() -> Any:
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", data=big, headers={"Content-Type": "application/json"})
        assert r.status == 413 and (await r.json())["field"] == "body"  # declared length, nothing read
        r = await client.post("/v1/requests", data=chunks(), headers={"Content-Type": "application/json"})
        assert r.status == 413 and (await r.json())["field"] == "body", await r.text()  # counted as it streamed

    _serve(env, 10, body, limits=Limits(max_body=limit))
    _nothing_accepted(env)


def test_a_message_larger_than_the_ring_is_413_naming_the_input(env: dict[str, Any]) -> None:  # noqa: F811
    img = _png(700, 700, noise=True)  # ~1.5 MB: over the 1 MiB ring of the env fixture
    assert len(img) > 1 << 20

    async def body(client: Any) -> None:
        doc = {"workflow": "wan2.1-i2v", "params": WAN, "inputs": {"image": base64.b64encode(img).decode()}}
        r = await client.post("/v1/requests", json=doc)
        assert r.status == 413 and (await r.json())["field"] == "image", await r.text()

    _serve(env, 10, body)
    _nothing_accepted(env)


def test_an_overloaded_workflow_is_refused_before_its_body_is_read(env: dict[str, Any]) -> None:  # noqa: F811
    """?workflow= names the workflow: with its queue full the answer is 503 + Retry-After, decided from the
    queue state alone (a body that would be a 400 is never parsed); a caller-chosen uid is kept."""
    async def body(client: Any) -> None:
        mine = uuid.uuid4().hex
        r = await client.post("/v1/requests?workflow=sd-t2i", json={"workflow": "sd-t2i", "params": SD, "uid": mine})
        assert r.status == 202 and (await r.json())["uid"] == mine, await r.text()
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD, "uid": mine})
        assert r.status == 409 and (await r.json())["field"] == "uid"  # that uid is taken
        r = await client.post("/v1/requests?workflow=sd-t2i", data=b"{not json",
                              headers={"Content-Type": "application/json"})
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1, await r.text()
        r = await client.post("/v1/requests?workflow=wan2.1-i2v", data=b"{not json",
                              headers={"Content-Type": "application/json"})
        assert r.status == 400  # another workflow still has room: its body is read

    _serve(env, 1, body)
    while (d := env["ring"].recv(timeout=0.05)) is not None:
        d.release()


def test_the_sweep_drops_in_flight_entries_of_jobs_that_are_gone(env: dict[str, Any]) -> None:  # noqa: F811
    import asyncio

    store = env["store"]
    live, gone, done = (uuid.uuid4().hex for _ in range(3))
    for uid in (live, gone, done):
        store.accept(uid, "sd-t2i", 2.0)
    store.r.delete(keys.job_key(gone))  # its status hash expired (or Redis lost it)
    store.r.zadd(keys.inflight_key("sd-t2i"), {done: 2.0})
    store.r.hset(keys.job_key(done), "state", keys.FAILED)  # finished, entry left behind
    assert store.inflight("sd-t2i") == (3, 6.0)
    injector = Injector(RouteTable(env["etcd"], refresh_s=0.0), "round-robin", 1.0)
    try:
        asyncio.run(OrphanSweeper(store, env["etcd"], injector).sweep())
    finally:
        injector.close()
    assert store.inflight("sd-t2i") == (1, 2.0)
    assert [u.decode() for u in store.r.zrange(keys.inflight_key("sd-t2i"), 0, -1)] == [live]
