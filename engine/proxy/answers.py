"""The Proxy's answers that several of its modules give: a JSON error, a 503 with Retry-After, the result
store being away, and the content type of a workflow's final output.

:mod:`engine.proxy.app` (the routes) and :mod:`engine.proxy.stream` (the streamed result) both answer with
them; neither imports the other for them.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine.store import outage

CONTENT_TYPES = {"image": "image/png", "video": "video/mp4"}
KEEP_ALIVE_BODY = 64 << 10  # a refused body at most this large is drained to keep the connection alive


def error(status: int, message: str, field: str = "", headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


def busy(reason: str, retry_after: int, request: web.Request | None = None) -> web.Response:
    """503 with Retry-After. A refused body is not read: a large or undeclared one closes the connection
    (never drained), while a small declared one keeps it alive, so a client retrying on its
    connection does not pay a new handshake for every refusal."""
    resp = error(503, reason, headers={"Retry-After": str(max(1, retry_after))})
    length = request.content_length if request is not None else None
    if length is None or length > KEEP_ALIVE_BODY:
        resp.force_close()  # a Connection header alone would still have aiohttp read the body to its end
    return resp


def store_down(exc: BaseException) -> web.Response:
    """The 503 of the result store (Redis) being away: a moment's overload, never a 500."""
    return busy(f"the result store is unavailable: {exc}", outage.RETRY_AFTER_S)
