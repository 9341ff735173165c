"""The Proxy's live preview route: ``GET /v1/requests/{uid}/preview``, the job's latest preview image.

A request submitted with ``preview_every`` gets a small JPEG of its current latents every N denoising steps
(engine.stages.preview, written to the job store's preview stream). This route answers the newest one in
its stored type (``image/jpeg``) with where it was made in headers (``OnePiece-Preview-Step``, ``-Total``,
``-Stage``); 404 for an unknown or expired request, 204 while there is none yet (previews off, or the first is still to come), so
a client polling it can tell "not yet" from "no such job". Installed by :func:`install` (one line in
engine/proxy/app.py), behind the Proxy's credential like every other route.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from engine.store import outage

STEP, TOTAL, STAGE = "OnePiece-Preview-Step", "OnePiece-Preview-Total", "OnePiece-Preview-Stage"


def headers(preview: Any) -> dict[str, str]:
    """Where a preview was made, as response headers (the platform's route sends the same)."""
    return {STEP: str(preview.step), TOTAL: str(preview.total), STAGE: preview.stage, "Cache-Control": "no-store"}


def install(app: web.Application, store: Any) -> None:
    """Serve ``GET /v1/requests/{uid}/preview`` on ``app`` from ``store`` (an :class:`engine.store.JobStore`)."""

    async def latest(request: web.Request) -> web.Response:
        uid = request.match_info["uid"]
        try:
            st = await asyncio.to_thread(store.status, uid)
            found = await asyncio.to_thread(store.preview.latest, uid) if st is not None else None
        except outage.UNAVAILABLE as exc:  # a moment's overload, never a 500 (as the other routes)
            return web.json_response({"error": f"the result store is unavailable: {exc}"},
                                     status=503, headers={"Retry-After": str(outage.RETRY_AFTER_S)})
        if st is None:
            return web.json_response({"error": "unknown or expired request"}, status=404)
        if found is None:
            return web.Response(status=204, headers={"Cache-Control": "no-store"})
        return web.Response(body=found.image, content_type=found.mime, headers=headers(found))

    app.router.add_get("/v1/requests/{uid}/preview", latest)
