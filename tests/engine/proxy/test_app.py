"""The Proxy's HTTP intake in-process, against real Redis and etcd and a real ring (no models)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.routes import Route, RouteTable, publish_route, withdraw_route
from engine.proxy.app import make_app
from engine.proxy.auth import auth_headers
from engine.proxy.injector import Injector
from engine.proxy.monitor import RequestMonitor
from engine.store import JobStore, keys
from engine.transport.ring import RingConfig, RingConsumer
from engine.workflow import message as wm

SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}


@pytest.fixture
def env(redis_server: Any, etcd_server: Any, etcd_root: str) -> Iterator[dict[str, Any]]:
    store = JobStore.from_url(redis_server.url, ttl=60)
    store.r.flushdb()
    etcd = etcd_client(etcd_server.url)
    address = f"shm://test-{os.getpid()}-proxy"
    ring = RingConsumer.create(address, RingConfig(slots=16, buffer_bytes=1 << 20))
    routes = [Route(wf, "text_encode", f"{wf}.text_encode.0", address) for wf in ("sd-t2i", "wan2.1-i2v")]
    for r in routes:
        publish_route(etcd, r)
    yield {"store": store, "etcd": etcd, "ring": ring, "routes": routes}
    ring.close()
    store.close()


TOKEN = "test-proxy-secret-" + "0" * 16


def _serve(env: dict[str, Any], max_queue: int, body: Callable[[Any], Awaitable[None]],
           headers: dict[str, str] | None = None, **app_kwargs: Any) -> None:
    """The Proxy in-process; its client sends the shared secret unless ``headers`` say otherwise."""
    from aiohttp.test_utils import TestClient, TestServer

    async def main() -> None:
        injector = Injector(RouteTable(env["etcd"], refresh_s=0.0), "round-robin", 1.0)
        app = make_app(env["store"], RouteTable(env["etcd"], refresh_s=0.0), injector, RequestMonitor(max_queue),
                       token=TOKEN, **app_kwargs)
        try:
            async with TestClient(TestServer(app), headers=auth_headers(TOKEN) if headers is None else headers) as client:
                await body(client)
        finally:
            injector.close()

    asyncio.run(main())


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_accepted_requests_enter_the_first_ring(env: dict[str, Any]) -> None:
    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD, "deadline_s": 60})
        assert r.status == 202, await r.text()
        doc = await r.json()
        uid = doc["uid"]
        assert len(uid) == 32 and doc["state"] == "queued" and doc["cost_gpu_s"] > 0
        d = env["ring"].recv(timeout=5)
        assert d is not None
        with d:
            msg = wm.decode(d.view)
            h = msg.header
            assert (h.uid, h.workflow, h.stage) == (uid, "sd-t2i", "text_encode")
            assert h.route == ["text_encode", "denoise", "vae_decode", "image_encode"]
            assert h.params["guidance_scale"] == 7.5 and h.deadline is not None  # resolved, with defaults
        events = env["store"].events(uid)
        assert [e["type"] for e in events] == ["accepted"]
        r = await client.get(f"/v1/requests/{uid}")
        assert (await r.json())["state"] == "queued"
        r = await client.delete(f"/v1/requests/{uid}")
        assert r.status == 202 and env["store"].cancel_requested(uid)
        r = await client.get(f"/v1/requests/{uid}/result")
        assert r.status == 409

        # multipart: a JSON part plus the image file
        from aiohttp import FormData

        form = FormData()
        form.add_field("request", json.dumps({"workflow": "wan2.1-i2v",
                                             "params": {"prompt": "a cat", "height": 32, "width": 32,
                                                        "num_frames": 5, "num_inference_steps": 2}}))
        form.add_field("image", _png(), filename="first.png", content_type="image/png")
        r = await client.post("/v1/requests", data=form)
        assert r.status == 202, await r.text()
        d = env["ring"].recv(timeout=5)
        assert d is not None
        with d:
            assert bytes(wm.decode(d.view).blobs["image"]) == _png()

    _serve(env, 10, body)


def test_invalid_requests_are_refused_with_the_field(env: dict[str, Any]) -> None:
    cases = [
        ({"workflow": "sd-t2i", "params": {**SD, "height": 65}}, "height"),
        ({"workflow": "sd-t2i", "params": {**SD, "stepz": 3}}, "stepz"),
        ({"workflow": "sd-t2i", "params": {"height": 64}}, "prompt"),
        ({"workflow": "video", "params": {}}, "workflow"),
        ({"workflow": "wan2.1-i2v", "params": {"prompt": "a cat"}}, "image"),
        ({"workflow": "wan2.1-i2v", "params": {"prompt": "a cat"},
          "inputs": {"image": base64.b64encode(b"not an image").decode()}}, "image"),
        ({"workflow": "wan2.1-i2v", "params": {"prompt": "a cat"}, "inputs": {"image": "%%%"}}, "image"),
        ({"workflow": "sd-t2i", "params": SD, "deadline_s": -1}, "deadline_s"),
        ({"workflow": "sd-t2i", "params": SD, "inputs": {"mask": "AAAA"}}, "mask"),
    ]

    async def body(client: Any) -> None:
        for doc, field in cases:
            r = await client.post("/v1/requests", json=doc)
            assert r.status == 400, (doc, await r.text())
            assert (await r.json())["field"] == field, doc
        r = await client.post("/v1/requests", data=b"{nope", headers={"Content-Type": "application/json"})
        assert r.status == 400
        for path in ("/v1/requests/xyz", "/v1/requests/" + "a" * 32):
            assert (await client.get(path)).status == 404
            assert (await client.delete(path)).status == 404

    _serve(env, 10, body)
    assert env["store"].events() == []  # nothing was accepted
    assert env["ring"].recv(timeout=0.05) is None  # nothing was queued


def test_overload_is_refused_at_once_with_retry_after(env: dict[str, Any]) -> None:
    async def body(client: Any) -> None:
        for _ in range(2):
            assert (await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})).status == 202
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert "queue full" in (await r.json())["error"]
        # a finished request frees its place
        uid = env["store"].events()[0]["uid"]
        env["store"].finish(uid, "sd-t2i", keys.FAILED, detail="test")
        assert (await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})).status == 202
        # without an instance for the first stage, nothing is accepted
        withdraw_route(env["etcd"], env["routes"][0])
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
        assert r.status == 503 and "no instance" in (await r.json())["error"]
        r = await client.get("/readyz")
        checks = (await r.json())["checks"]
        from engine.workflow import workflows

        # every workflow the engine knows is checked; only the one served here has routes
        assert checks == {"redis": "ok", **{f"routes:{w}": "ok" if w == "wan2.1-i2v" else "none" for w in workflows()}}

    _serve(env, 2, body)
    while (d := env["ring"].recv(timeout=0.05)) is not None:
        d.release()


def test_an_unreachable_store_is_an_overload_answer(env: dict[str, Any]) -> None:
    dead = JobStore.from_url("redis://127.0.0.1:1/0")

    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
        assert r.status == 503 and r.headers["Retry-After"] == "5", await r.text()
        r = await client.get("/readyz")
        assert r.status == 503 and (await r.json())["checks"]["redis"].startswith("error")

    try:
        _serve({**env, "store": dead}, 10, body)
    finally:
        dead.close()
    assert env["ring"].recv(timeout=0.05) is None


def test_status_long_poll_answers_when_the_request_ends(env: dict[str, Any]) -> None:
    import threading

    async def body(client: Any) -> None:
        r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
        uid = (await r.json())["uid"]
        t0 = time.monotonic()
        r = await client.get(f"/v1/requests/{uid}?wait=0.3")  # nothing runs it: answered after the wait
        assert r.status == 200 and (await r.json())["state"] == "queued" and time.monotonic() - t0 >= 0.3
        for bad in ("-1", "61", "soon"):
            r = await client.get(f"/v1/requests/{uid}?wait={bad}")
            assert r.status == 400 and (await r.json())["field"] == "wait"
        # a waiter's own status reads (the safety net for a missed end) back off: after 1 s, 2 s, 4 s...
        reads: list[float] = []
        status = env["store"].status
        env["store"].status = lambda u: reads.append(time.monotonic()) or status(u)
        try:
            t0 = time.monotonic()
            r = await client.get(f"/v1/requests/{uid}?wait=6")
        finally:
            del env["store"].status
        assert (await r.json())["state"] == "queued"
        # the route's read, then at about 1, 3 and 6 s (the end of the wait); a read every second would
        # make 8. None before the wait: a job that ends later wakes it, and one whose end was already read is
        # in the Proxy's recent ends
        assert 3 <= len(reads) <= 4 and reads[1] - reads[0] > 0.5, [round(t - t0, 2) for t in reads]
        finisher = threading.Timer(0.2, env["store"].finish, (uid, "sd-t2i", keys.COMPLETED, "image_encode"),
                                   {"result": b"png"})
        finisher.start()
        t0 = time.monotonic()
        r = await client.get(f"/v1/requests/{uid}?wait=30")  # answered as soon as it completes
        assert (await r.json())["state"] == "completed" and time.monotonic() - t0 < 10
        finisher.join()

    _serve(env, 10, body)


def test_a_burst_is_admitted_on_the_count_each_decision_sees(env: dict[str, Any]) -> None:
    """Twelve submits with deadlines at once, one instance and no measured rate yet: admission allows
    fewer than twice the instances in flight, so exactly two are accepted, however the twelve interleave
    (without one decision at a time per workflow, each read the same empty count and all got in)."""
    async def body(client: Any) -> None:
        async def one() -> int:
            r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD, "deadline_s": 60})
            return r.status

        statuses = await asyncio.gather(*(one() for _ in range(12)))
        assert sorted(statuses) == [202] * 2 + [503] * 10, statuses
        assert env["store"].inflight("sd-t2i")[0] == 2

    _serve(env, 64, body)
    while (d := env["ring"].recv(timeout=0.05)) is not None:
        d.release()


def test_an_accepted_submit_takes_three_trips_off_the_event_loop(env: dict[str, Any], monkeypatch: Any) -> None:
    """With the Proxy's caches warm (the ring's limit, the drain meter's sample), an accepted submit leaves
    the event loop three times: the parse, the admission's one store round trip (claim check, load,
    decision, acceptance) and the injector's send; the background loops' own trips are not counted."""
    import functools

    from engine.proxy.app import STATE

    trips: list[str] = []
    real_to_thread = asyncio.to_thread

    def name(fn: Any) -> str:
        return fn.func.__name__ if isinstance(fn, functools.partial) else getattr(fn, "__name__", repr(fn))

    async def counted(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        in_loop = task is not None and task.get_coro().cr_code.co_filename.endswith("loops.py")
        if not in_loop:
            trips.append(name(fn))
        return await real_to_thread(fn, *args, **kwargs)

    for pooled in ("_send", "_max_message"):  # what the injector's own thread runs
        real = getattr(Injector, pooled)
        monkeypatch.setattr(Injector, pooled, functools.partialmethod(
            lambda self, *a, _real=real, _name=pooled, **k: (trips.append(_name), _real(self, *a, **k))[1]))
    monkeypatch.setattr(asyncio, "to_thread", counted)

    async def body(client: Any) -> None:
        doc = {"workflow": "sd-t2i", "params": SD}
        assert (await client.post("/v1/requests", json=doc)).status == 202  # warms the ring's limit
        state = client.server.app[STATE]
        deadline = time.monotonic() + 10
        while "sd-t2i" not in state.drain.latest and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the drain meter's first sample: refusals are decided on it
        trips.clear()
        r = await client.post("/v1/requests", json=doc)
        assert r.status == 202, await r.text()
        assert sorted(trips) == sorted(["_parsed_ticket", "_decide_and_accept", "_send"]), trips

    _serve(env, 10, body)
    while (d := env["ring"].recv(timeout=0.05)) is not None:
        d.release()
