"""A completed job's output is still downloadable from the Proxy after its Redis is SIGKILLed and restarted
empty, when an object store holds outputs (real redis-server, real Swift s3api); without one it is gone."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.routes import Route, RouteTable, publish_route
from engine.embedded import RedisServer
from engine.proxy.app import make_app
from engine.proxy.auth import auth_headers
from engine.proxy.injector import Injector
from engine.proxy.monitor import RequestMonitor
from engine.store import JobStore, keys
from engine.store.objects import ObjectStore
from engine.transport.ring import RingConfig, RingConsumer

TOKEN = "test-proxy-objects-" + "0" * 16
SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}
PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(70_000)


def _fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """A plain HTTP GET, as a browser or a client's own code fetches a presigned URL (no credentials)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("with_store", [True, False], ids=["object-store", "redis-only"])
def test_result_survives_a_redis_kill(tmp_path: Path, etcd_server: Any, etcd_root: str, object_store: ObjectStore,
                                      with_store: bool) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    redis = RedisServer("redis-server", tmp_path / "redis").start()
    objects = ObjectStore(object_store.config) if with_store else None
    store = JobStore.from_url(redis.url, ttl=60, objects=objects)
    etcd = etcd_client(etcd_server.url)
    address = f"shm://test-{os.getpid()}-proxy-objects"
    ring = RingConsumer.create(address, RingConfig(slots=4, buffer_bytes=1 << 20))
    publish_route(etcd, Route("sd-t2i", "text_encode", "sd-t2i.text_encode.0", address))

    async def main() -> None:
        injector = Injector(RouteTable(etcd, refresh_s=0.0), "round-robin", 1.0)
        app = make_app(store, RouteTable(etcd, refresh_s=0.0), injector, RequestMonitor(4), token=TOKEN)
        try:
            async with TestClient(TestServer(app), headers=auth_headers(TOKEN)) as client:
                r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
                assert r.status == 202, await r.text()
                uid = (await r.json())["uid"]
                # the last stage's worker completing the job, as engine.worker.taskworker does
                assert store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
                r = await client.get(f"/v1/requests/{uid}/result")
                assert (r.status, await r.read()) == (200, PNG)
                assert (store.r.get(keys.result_key(uid)) is None) == with_store  # no bytes in Redis

                redis.proc.kill()  # SIGKILL: nothing saved (and it persists nothing anyway)
                redis.proc.wait()
                restarted = RedisServer("redis-server", redis.data_dir, port=redis.port).start()
                try:
                    r = await client.get(f"/v1/requests/{uid}")
                    assert r.status == 404  # Redis came back empty: it no longer knows the job ...
                    r = await client.get(f"/v1/requests/{uid}/result")
                    if with_store:  # ... but the output is where the worker put it
                        assert (r.status, await r.read()) == (200, PNG)
                        assert r.headers["Content-Type"] == "image/png"
                        r = await client.get(f"/v1/requests/{uid}/result/url")  # and a URL to it is issued
                        assert r.status == 200 and _fetch((await r.json())["url"]) == (200, PNG)
                    else:
                        assert r.status == 404
                    r = await client.get(f"/v1/requests/{'0' * 32}/result")
                    assert r.status == 404  # a UID that never completed has no output anywhere
                finally:
                    restarted.stop()
        finally:
            injector.close()

    try:
        asyncio.run(main())
    finally:
        ring.close()
        store.close()
        redis.stop()


@pytest.mark.parametrize("with_store", [True, False], ids=["object-store", "redis-only"])
def test_presigned_result_url(tmp_path: Path, redis_server: Any, etcd_server: Any, etcd_root: str, object_store: ObjectStore,
                              with_store: bool) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    store = JobStore.from_url(redis_server.url, ttl=60, objects=ObjectStore(object_store.config) if with_store
                              else None)
    etcd = etcd_client(etcd_server.url)
    address = f"shm://test-{os.getpid()}-proxy-result-url"
    ring = RingConsumer.create(address, RingConfig(slots=4, buffer_bytes=1 << 20))
    publish_route(etcd, Route("sd-t2i", "text_encode", "sd-t2i.text_encode.0", address))

    async def main() -> None:
        injector = Injector(RouteTable(etcd, refresh_s=0.0), "round-robin", 1.0)
        app = make_app(store, RouteTable(etcd, refresh_s=0.0), injector, RequestMonitor(4), token=TOKEN)
        try:
            async with TestClient(TestServer(app), headers=auth_headers(TOKEN)) as client:
                r = await client.post("/v1/requests", json={"workflow": "sd-t2i", "params": SD})
                uid = (await r.json())["uid"]
                r = await client.get(f"/v1/requests/{uid}/result/url")
                assert r.status == 409, await r.text()  # queued, or no store at all: nothing to sign
                if not with_store:
                    assert "no object store" in (await r.json())["error"]
                    return
                assert (await r.json())["state"] == keys.QUEUED
                store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
                before = int(time.time())
                r = await client.get(f"/v1/requests/{uid}/result/url", params={"expires_s": "120"})
                got = await r.json()
                assert r.status == 200 and r.headers["Cache-Control"] == "no-store", got
                assert before + 120 <= got["expires_at"] <= int(time.time()) + 120
                assert (got["size"], got["content_type"]) == (len(PNG), "image/png")
                # the bytes come from the store itself: no credential, no Proxy; Range works (seek in a video)
                assert _fetch(got["url"]) == (200, PNG)
                assert _fetch(got["url"], {"Range": "bytes=100-199"}) == (206, PNG[100:200])
                assert _fetch(got["url"].replace("X-Amz-Expires=120", "X-Amz-Expires=600"))[0] == 403
                for bad in ("0", "604801", "soon"):
                    r = await client.get(f"/v1/requests/{uid}/result/url", params={"expires_s": bad})
                    assert r.status == 400 and (await r.json())["field"] == "expires_s"
                r = await client.get(f"/v1/requests/{'0' * 32}/result/url")
                assert r.status == 404
        finally:
            injector.close()

    try:
        asyncio.run(main())
    finally:
        ring.close()
        store.close()
