"""The Proxy while its Redis is stopped (a real redis-server of the test's own): the status, cancel, result
and drop-result routes answer 503 with Retry-After, never a 500, and serve again once Redis is back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from engine.coord import etcd_client
from engine.coord.routes import Route, RouteTable, publish_route
from engine.embedded import RedisServer
from engine.proxy.app import make_app
from engine.proxy.auth import auth_headers
from engine.proxy.injector import Injector
from engine.proxy.monitor import RequestMonitor
from engine.store import JobStore
from engine.transport.ring import RingConfig, RingConsumer

TOKEN = "test-proxy-outage-" + "0" * 16
SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}


def test_status_routes_answer_503_while_redis_is_down(tmp_path: Path, etcd_server: Any, etcd_root: str) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    redis = RedisServer("redis-server", tmp_path / "redis").start()
    store = JobStore.from_url(redis.url, ttl=60)
    etcd = etcd_client(etcd_server.url)
    address = f"shm://test-{os.getpid()}-proxy-outage"
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
                redis.stop()
                for method, path in (("GET", ""), ("GET", "?wait=1"), ("DELETE", ""), ("GET", "/result"),
                                     ("DELETE", "/result")):
                    r = await client.request(method, f"/v1/requests/{uid}{path}")
                    assert r.status == 503, (method, path, r.status, await r.text())
                    assert int(r.headers["Retry-After"]) > 0 and "unavailable" in (await r.json())["error"]
                restarted = RedisServer("redis-server", redis.data_dir, port=redis.port).start()
                try:
                    r = await client.get(f"/v1/requests/{uid}")
                    assert r.status == 404  # Redis came back empty: the Proxy no longer knows the request
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
