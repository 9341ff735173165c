"""The Proxy's streamed result: ``GET /v1/requests/{uid}/result?stream=true`` answers with chunked transfer of
the job's fragments (engine.store.fragments) as they are written, from the first one on, ending when the job
ends.

A job that fails before its first fragment is a 409 naming its state (as the plain result route); one that
fails mid-stream has its connection closed without the chunked transfer's last chunk, so no client takes the
bytes it got for a complete file (HTTP clients raise an incomplete-read error). A job with no stream (an image
workflow) gets its result in one piece once it completes. Redis away before the first byte is a 503 with
Retry-After (as every other route of the Proxy), never a 500; away mid-stream, the connection is closed as for
a failed job. Installed by :func:`install` (one line in
engine/proxy/app.py): a middleware in front of the plain result route, which answers everything else.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from engine.proxy.answers import CONTENT_TYPES, store_down
from engine.store import outage
from engine.store.fragments import Fragments, StreamFailed
from engine.workflow import get_workflow

log = logging.getLogger("onepiece.proxy.stream")

_PATH = re.compile(r"^/v1/requests/([0-9a-f]{32})/result$")
_TRUE = {"1", "true", "yes"}
_END = object()


def wants_stream(request: web.Request) -> str | None:
    """The uid of a streamed-result request (GET, ``stream=true``), else None."""
    m = _PATH.match(request.path)
    if request.method != "GET" or m is None or request.query.get("stream", "").lower() not in _TRUE:
        return None
    return m.group(1)


def install(app: web.Application, store: Any) -> None:
    """Serve ``?stream=true`` on the result route of ``app`` from ``store`` (a :class:`engine.store.JobStore`)."""
    fragments = Fragments(store)

    @web.middleware
    async def streamed(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        uid = wants_stream(request)
        if uid is None:
            return await handler(request)
        return await stream_response(request, fragments, uid)

    app.middlewares.append(streamed)


async def stream_response(request: web.Request, fragments: Fragments, uid: str) -> web.StreamResponse:
    """The job's fragments as a chunked response (see the module's docstring for how it ends)."""
    pieces = fragments.iter(uid)
    try:
        st = await asyncio.to_thread(fragments.store.status, uid)
        if st is None:
            return web.json_response({"error": {"message": "unknown or expired request"}}, status=404)
        first = await _next(pieces)
    except StreamFailed as exc:
        return web.json_response({"uid": uid, "state": exc.state, "error": exc.detail}, status=409)
    except outage.UNAVAILABLE as exc:  # nothing sent yet: a moment's overload, never a 500
        pieces.close()
        return store_down(exc)
    ctype = CONTENT_TYPES.get(get_workflow(st.workflow).final_output, "application/octet-stream")
    resp = web.StreamResponse(headers={"Content-Type": ctype, "Cache-Control": "no-store",
                                       "X-Content-Type-Options": "nosniff"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    piece = first
    try:
        while piece is not _END:
            await resp.write(piece)
            piece = await _next(pieces)
    except (StreamFailed, *outage.UNAVAILABLE) as exc:
        # mid-stream (the job failed, or Redis went away): no last chunk, so the client sees an incomplete transfer
        log.info("stream of %s ended early: %s", uid, exc)
        if request.transport is not None:
            request.transport.close()
        return resp
    finally:
        pieces.close()
    await resp.write_eof()
    return resp


async def _next(pieces: Iterator[bytes]) -> Any:
    """The next piece (read in a thread: the store's read blocks), or :data:`_END`."""
    return await asyncio.to_thread(next, pieces, _END)
