"""ASGI middleware: a request body over the limit is 413, counted as it streams.

Django checks ``DATA_UPLOAD_MAX_MEMORY_SIZE`` against the declared
Content-Length only, and its ASGI handler spools whatever arrives to disk
first: a chunked body (no Content-Length) of any size was read in full, and
multipart file parts are not counted at all. Here every HTTP body is counted
as its chunks arrive; the request is answered 413 (the native or OpenAI error
shape, by path) the moment it is over, before Django sees any of it. Bodies
within the limit are handed on unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, send, f"request body of {declared.decode(errors='replace')} bytes is over "
                                            f"the limit of {self.limit}")
            return
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            messages.append(message)
            total += len(message.get("body", b""))
            if total > self.limit:
                await self._refuse(scope, send, f"request body is over the limit of {self.limit} bytes")
                return
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay() -> Message:
            for message in pending:
                return message
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, send: Send, detail: str) -> None:
        if str(scope.get("path", "")).startswith("/v1/"):
            doc: dict[str, Any] = {"error": {"message": detail, "type": "invalid_request_error", "param": "body",
                                             "code": None}}
        else:
            doc = {"detail": detail, "field": "body"}
        body = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
