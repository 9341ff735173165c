"""Hands accepted requests to an instance of the workflow's first stage.

Ring producers are not thread-safe, and ring sends may wait for space, so one
dedicated thread owns every producer and does every send; the event loop only
awaits its futures (a blocking call never runs on the loop).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.worker.deliver import Outstanding, make_deliver
from engine.worker.routes import RouteTable
from engine.workflow import message as wm


class NoRoute(RuntimeError):
    """No instance of the stage is published."""


class Injector:
    def __init__(self, routes: RouteTable, deliver: str, send_timeout: float) -> None:
        self.routes = routes
        self.send_timeout = send_timeout
        self._producers: dict[str, tuple[str, Any]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="onepiece-proxy-inject")
        self.outstanding = Outstanding(lambda i: self._producers[i][1].poll() if i in self._producers else 0)
        self.deliver = make_deliver(deliver, self.outstanding)

    async def inject(self, header: wm.Header, blobs: dict[str, bytes], cost: float) -> str:
        """Encode and send; returns the chosen instance. Raises ``NoRoute`` or a transport error."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._send, header, blobs, cost)

    async def poll(self) -> None:
        """Let producers retransmit what a recovering consumer dropped (called periodically)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._poll)

    def _poll(self) -> None:
        for _, p in self._producers.values():
            p.poll()

    def _send(self, header: wm.Header, blobs: dict[str, bytes], cost: float) -> str:
        from engine.transport.errors import TransportError
        from engine.transport.ring import attach_producer

        candidates = self.routes.candidates(header.workflow, header.stage)
        if not candidates:
            raise NoRoute(f"no instance of {header.workflow}/{header.stage} is published")
        route = self.deliver.choose(candidates, cost)
        got = self._producers.get(route.instance)
        if got is None or got[0] != route.ring_id:
            if got is not None:
                got[1].close()  # the ring behind the address is a new one
            # id None: a fresh producer entry; see TaskWorker._producer for why
            self._producers[route.instance] = (route.ring_id, attach_producer(route.address, None))
        header.timestamps["proxy"] = time.time()
        data = wm.encode(header, {}, blobs)
        try:
            self._producers[route.instance][1].send(data, timeout=self.send_timeout)
        except TransportError:
            self._producers.pop(route.instance, None)
            raise
        self.outstanding.sent(route.instance, cost)
        return route.instance

    def close(self) -> None:
        def _close() -> None:
            for _, p in self._producers.values():
                p.close()
            self._producers.clear()

        self._pool.submit(_close).result()
        self._pool.shutdown(wait=True)
