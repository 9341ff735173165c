"""Hands accepted requests to an instance of the workflow's first stage.

Ring producers are not thread-safe, and ring sends may wait for space, so one
dedicated thread owns every producer and does every send; the event loop only
awaits its futures (a blocking call never runs on the loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.coord.routes import Route, RouteTable
from engine.dispatch.deliver import Outstanding, Producers, make_deliver
from engine.transport.errors import TransportError


class NoRoute(RuntimeError):
    """No instance of the stage is published."""


class Injector:
    def __init__(self, routes: RouteTable, deliver: str, send_timeout: float) -> None:
        self.routes = routes
        self.send_timeout = send_timeout
        self.producers = Producers(send_timeout)  # owned by the one thread of _pool
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="onepiece-proxy-inject")
        self.outstanding = Outstanding(self.producers.poll)
        self.deliver = make_deliver(deliver, self.outstanding)
        # (workflow, stage) -> (the rings it was measured on, the smallest record limit among them)
        self._limits: dict[tuple[str, str], tuple[frozenset[str], int]] = {}

    async def inject(self, workflow: str, stage: str, data: bytes, cost: float,
                     nodes: set[str] | None = None, after: Callable[[Route], Any] | None = None) -> Route:
        """Send an encoded Workflow Message to an instance of ``stage`` (on one of ``nodes``, when given);
        returns its route. ``after(route)`` runs on the sending thread once the message is in the ring (the
        store's record of where it went: no second trip off the event loop). Raises ``NoRoute`` or a
        transport error (or what ``after`` raises)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._send, workflow, stage, data, cost, nodes, after)

    async def max_message(self, workflow: str, stage: str) -> int | None:
        """The largest message every published instance of ``stage`` can take (its ring's record limit);
        None when none is published or none can be reached (the send then says why). Known without leaving
        the event loop while the same rings serve the stage (the limit is the ring's, fixed when it is made)."""
        rings = frozenset(r.ring_id for r in self.routes.candidates(workflow, stage))
        known = self._limits.get((workflow, stage))
        if rings and known is not None and known[0] == rings:
            return known[1]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._max_message, workflow, stage)

    def _max_message(self, workflow: str, stage: str) -> int | None:
        limits, rings, reached = [], [], True
        for route in self.routes.candidates(workflow, stage):
            rings.append(route.ring_id)
            try:
                limits.append(int(self.producers.get(route).max_message))
            except TransportError:
                self.producers.drop(route.instance)
                reached = False
        if limits and reached:
            self._limits[workflow, stage] = (frozenset(rings), min(limits))
        return min(limits) if limits else None

    async def poll(self) -> None:
        """Let producers retransmit what a recovering consumer dropped (called periodically)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._poll)

    def _poll(self) -> None:
        self.producers.poll_all()

    def _send(self, workflow: str, stage: str, data: bytes, cost: float, nodes: set[str] | None = None,
              after: Callable[[Route], Any] | None = None) -> Route:
        candidates = self.routes.candidates(workflow, stage)
        if nodes is not None:  # e.g. a restart after a node was lost: the route cache may still list it
            candidates = [r for r in candidates if r.node in nodes]
        if not candidates:
            raise NoRoute(f"no instance of {workflow}/{stage} is published")
        route = self.deliver.choose(candidates, cost)
        try:
            self.producers.get(route).send(data, timeout=self.send_timeout)
        except TransportError:
            self.producers.drop(route.instance)
            raise
        self.outstanding.sent(route.instance, cost)
        if after is not None:
            after(route)
        return route

    def close(self) -> None:
        self._pool.submit(self.producers.close).result()
        self._pool.shutdown(wait=True)
