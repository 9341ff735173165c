"""Websockets: the Origin must be the very site the socket is opened on (scheme-agnostic host and port).

Channels' ``AllowedHostsOriginValidator`` compares the Origin's host name with
``ALLOWED_HOSTS`` and ignores its port, so a page served by anything else on
an allowed host (another port of localhost, say) could open a socket with the
user's session cookie. Here the Origin's host and port must equal the
request's ``Host`` header as well (default ports 80/443 ignored); a missing
or different Origin is refused at the handshake (HTTP 403: nothing to tell a
foreign page).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

App = Callable[[dict[str, Any], Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


def _netloc(host: str) -> str:
    host = host.strip().lower()
    for default in (":80", ":443"):
        if host.endswith(default):
            return host[: -len(default)]
    return host


class SameOriginValidator:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            headers = dict(scope.get("headers") or [])
            origin = headers.get(b"origin", b"").decode("latin-1")
            host = headers.get(b"host", b"").decode("latin-1")
            parts = urlsplit(origin)
            if not origin or not host or parts.scheme not in ("http", "https") or \
                    _netloc(parts.netloc) != _netloc(host):
                await send({"type": "websocket.close"})  # before accept: the handshake is refused
                return
        await self.app(scope, receive, send)
