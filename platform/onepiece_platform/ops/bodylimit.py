"""ASGI middleware: a request body over the limit is 413, counted as it streams.

Django checks ``DATA_UPLOAD_MAX_MEMORY_SIZE`` against the declared
Content-Length only, and its ASGI handler spools whatever arrives to disk
first: a chunked body (no Content-Length) of any size was read in full, and
multipart file parts are not counted at all. Here every HTTP body is counted
as its chunks arrive; the request is answered 413 (the native or OpenAI error
shape, by path) the moment it is over, before Django sees any of it. Bodies
within the limit are handed on unchanged.

The body also has a deadline (``timeout``: ``ONEPIECE_BODY_TIMEOUT_S`` from the end of the request's
head): a client trickling its body is answered 408 and the connection closed, instead of holding it,
and the body read so far, for as long as it likes. The head's deadline is the HTTP protocol's
(onepiece_platform.ops.httpguard).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int,
                 timeout: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, send, f"request body of {declared.decode(errors='replace')} bytes is over "
                                            f"the limit of {self.limit}")
            return
        try:
            messages = await asyncio.wait_for(self._read(receive), self.timeout)
        except TimeoutError:
            await self._refuse(scope, send, f"the request body did not arrive within {self.timeout:g} s", 408)
            return
        except _TooLarge:
            await self._refuse(scope, send, f"request body is over the limit of {self.limit} bytes")
            return
        if messages is None:  # the client went away
            return
        pending = iter(messages)

        async def replay() -> Message:
            for message in pending:
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            messages.append(message)
            total += len(message.get("body", b""))
            if total > self.limit:
                raise _TooLarge
            if not message.get("more_body", False):
                return messages

    @staticmethod
    async def _refuse(scope: Scope, send: Send, detail: str, status: int = 413) -> None:
        if str(scope.get("path", "")).startswith("/v1/"):
            doc: dict[str, Any] = {"error": {"message": detail, "type": "invalid_request_error", "param": "body",
                                             "code": None}}
        else:
            doc = {"detail": detail, "field": "body"}
        body = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
