"""The web port's HTTP protocol: uvicorn's httptools protocol with a deadline on each request's head.

uvicorn has no header-read timeout: its keep-alive timer is cancelled by the first byte of a request, so a
client that trickles a request line and headers (or opens a connection and sends nothing) held a
connection for as long as it liked (measured: 45 s, the probe's own limit). Here a request's head must be
complete within ``ONEPIECE_HEADER_TIMEOUT_S`` of its first byte (of the connection, for a new one); if not,
the client gets 408 (a silent close when it sent nothing) and the connection is closed. Between requests
of a kept-alive connection uvicorn's ``--timeout-keep-alive`` still decides. Bodies have their own deadline
in the ASGI entry (onepiece_platform.ops.bodylimit), where the route's error shape is known.

A websocket upgrade whose request line or headers exceed what the websockets library reads
(``websockets.http11.MAX_LINE_LENGTH``, ``MAX_NUM_HEADERS``) is answered 414 or 431 here: handed on, the
library's parser failed inside uvicorn without answering or closing (a path over 8 KB got no answer for
70 s).

Used by every web server: ``uvicorn --http onepiece_platform.ops.httpguard:GuardedHttpToolsProtocol``
(onepiece_launcher.up.WEB_SERVER_FLAGS). Imports no Django: uvicorn loads it before the application.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS

from engine import envs

_REASONS = {408: b"Request Timeout", 414: b"URI Too Long", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = float(envs.HEADER_TIMEOUT_S)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # a byte of the awaited head has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is held no longer than a trickling one

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and not self._serving():
            self._arm()  # the first byte of the next request on a kept-alive connection
        self._head_bytes = True
        super().data_received(data)
        if self._serving():
            self._disarm()  # the head is complete; the body's deadline is the ASGI entry's

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection now belongs to the websocket protocol
        line = len(self.scope["method"]) + len(self.url) + len(b"  HTTP/1.1\r\n")
        if line > MAX_LINE_LENGTH:
            self._refuse(414, f"the request line is over {MAX_LINE_LENGTH} bytes")
            return
        headers = self.scope["headers"]
        if len(headers) > MAX_NUM_HEADERS or any(len(n) + len(v) + 4 > MAX_LINE_LENGTH for n, v in headers):
            self._refuse(431, f"over {MAX_NUM_HEADERS} headers, or a header line over {MAX_LINE_LENGTH} bytes")
            return
        super().handle_websocket_upgrade()

    def _serving(self) -> bool:
        """A request's head has been read and its response is not finished (pipelined ones included)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_bytes = False
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._serving() or self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(408, f"the request's head did not arrive within {self.head_timeout:g} s")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode() + b"\n"
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        self.transport.close()
