"""The real Proxy (engine/proxy) served over TCP from a thread, on the web tests' Redis; no workers.

Accepted requests land in a real first-stage ring that nobody consumes, so
status and cancel behave as in production while nothing ever runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def proxy_url(web_redis: str, etcd_server: Any, settings: Any) -> Iterator[str]:
    from aiohttp import web

    from engine.coord import etcd_client
    from engine.embedded import free_port
    from engine.proxy.app import make_app
    from engine.proxy.injector import Injector
    from engine.proxy.monitor import RequestMonitor
    from engine.store import JobStore
    from engine.transport.ring import RingConfig, RingConsumer
    from engine.worker.routes import Route, RouteTable, publish_route

    etcd = etcd_client(etcd_server.url)
    etcd.delete_prefix("/onepiece/")
    address = f"shm://test-{os.getpid()}-web-proxy"
    ring = RingConsumer.create(address, RingConfig(slots=16, buffer_bytes=1 << 20))
    for wf in ("sd-t2i", "wan2.1-i2v"):
        publish_route(etcd, Route(wf, "text_encode", f"{wf}.text_encode.0", address))
    store = JobStore.from_url(web_redis, ttl=60)
    injector = Injector(RouteTable(etcd, refresh_s=0.0), "round-robin", 1.0)
    app = make_app(store, RouteTable(etcd, refresh_s=0.0), injector, RequestMonitor(2),
                   token=os.environ["ONEPIECE_PROXY_TOKEN"])
    port = free_port("127.0.0.1")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=serve, name="web-test-proxy")
    t.start()
    assert started.wait(10)
    url = f"http://127.0.0.1:{port}"
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
                         "PROXY_URL": url, "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        injector.close()
        ring.close()
        store.close()
        etcd.delete_prefix("/onepiece/")
