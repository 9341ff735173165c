"""The Proxy's streamed result (``GET /v1/requests/{uid}/result?stream=true``) while its Redis is stopped (a
real redis-server of the test's own): a 503 with Retry-After before the response starts, never a 500 (issue
39, finding 3); once Redis is back, the route answers again."""

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

TOKEN = "test-proxy-stream-outage-" + "0" * 16
SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}


def test_the_streamed_result_is_a_503_while_redis_is_down(tmp_path: Path, etcd_server: Any, etcd_root: str) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    redis = RedisServer("redis-server", tmp_path / "redis").start()
    store = JobStore.from_url(redis.url, ttl=60)
    etcd = etcd_client(etcd_server.url)
    address = f"shm://test-{os.getpid()}-proxy-stream-outage"
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
                r = await client.get(f"/v1/requests/{uid}/result", params={"stream": "true"})
                assert r.status == 503, (r.status, await r.text())
                assert int(r.headers["Retry-After"]) > 0 and "unavailable" in (await r.json())["error"]
                restarted = RedisServer("redis-server", redis.data_dir, port=redis.port).start()
                try:  # Redis came back empty: the Proxy no longer knows the request
                    r = await client.get(f"/v1/requests/{uid}/result", params={"stream": "true"})
                    assert r.status == 404, (r.status, await r.text())
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
