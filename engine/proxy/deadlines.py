"""Read deadlines of the Proxy's HTTP server: a request's head and its body must arrive in time.

aiohttp's server reads a request's head under its keep-alive timer only (``keepalive_timeout``, 3630 s
unless set; it is not restarted by incoming bytes): a caller trickling headers, or connecting and sending
nothing, held a connection for an hour. :func:`runner` sets it to ``ONEPIECE_HEADER_TIMEOUT_S``, so a
head must be complete that long after the connection opened or the previous response was sent, else the
connection is closed. Nothing bounded a body either: :func:`body_deadline` fails the handler's read of a
body still incomplete ``ONEPIECE_BODY_TIMEOUT_S`` after its head, and answers 408 (connection closed).
The handlers are unchanged: they read with ``request.read()``, which raises the deadline's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine import envs

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyTimedOut(Exception):
    """The request's body did not arrive within the deadline."""


def runner(app: web.Application) -> web.AppRunner:
    """The Proxy's server: no access log (the Proxy logs what it decides), the head deadline."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=float(envs.HEADER_TIMEOUT_S))


def body_deadline(timeout: float | None = None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Middleware: a body must arrive within ``timeout`` s (default ``ONEPIECE_BODY_TIMEOUT_S``) of the head."""
    limit = float(envs.BODY_TIMEOUT_S if timeout is None else timeout)

    def expire(request: web.Request) -> None:
        if not request.content.is_eof():
            request.content.set_exception(BodyTimedOut())  # wakes the handler's pending read with it

    @web.middleware
    async def deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists or request.content.is_eof():
            return await handler(request)
        timer = asyncio.get_running_loop().call_later(limit, expire, request)
        try:
            return await handler(request)
        except BodyTimedOut:
            resp = web.json_response({"error": f"the request body did not arrive within {limit:g} s",
                                      "field": "body"}, status=408)
            resp.force_close()
            return resp
        finally:
            timer.cancel()

    return deadline
