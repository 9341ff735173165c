"""The Proxy's presigned result URL: ``GET /v1/requests/{uid}/result/url?expires_s=S``.

With an object store (``ONEPIECE_OBJECT_STORE``), a completed job's output is an object there, and this
route answers a presigned GET for it: the bytes then never pass through the Proxy or the web platform,
the URL works from any replica and from wherever the store is reachable, and Range requests work (seek in
a video). JSON: ``url``, ``expires_at`` (Unix seconds), ``size``, ``sha256``, ``content_type``.

Answers: 200; 404 for a job neither Redis nor the store knows; 409 while the job is not completed, or when
there is no object store (the caller serves ``/result`` itself); 400 for ``expires_s`` outside 1 s .. 7 days;
503 with Retry-After while Redis or the store is away. A job Redis forgot (restart, TTL) but whose output is
in the store still gets its URL. Installed by :func:`install` (one line in engine/proxy/app.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from engine.store import keys, outage
from engine.store.objects import MAX_PRESIGN_S, ObjectStoreError

DEFAULT_EXPIRES_S = 3600


def _json(body: dict[str, Any], status: int = 200, retry_after: int | None = None) -> web.Response:
    headers = {"Cache-Control": "no-store"}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(body, status=status, headers=headers)


def install(app: web.Application, store: Any) -> None:
    """Serve the route on ``app`` from ``store`` (an :class:`engine.store.JobStore`)."""

    def find(uid: str) -> tuple[str | None, Any]:
        """(the job's state, or None when Redis does not know it; its output's reference or None)."""
        st = store.status(uid)
        if st is not None and st.state != keys.COMPLETED:
            return st.state, None
        return (st.state if st is not None else None), store.result_ref(uid)

    async def result_url(request: web.Request) -> web.Response:
        uid = request.match_info["uid"]
        if len(uid) != 32 or any(c not in "0123456789abcdef" for c in uid):
            return _json({"error": "unknown or expired request"}, 404)
        try:
            expires_s = int(request.query.get("expires_s", DEFAULT_EXPIRES_S))
            if not 1 <= expires_s <= MAX_PRESIGN_S:
                raise ValueError
        except ValueError:
            return _json({"error": f"expires_s must be whole seconds in [1, {MAX_PRESIGN_S}]", "field": "expires_s"},
                         400)
        if store.objects is None:
            return _json({"uid": uid, "error": "no object store: the result is served by /result"}, 409)
        try:
            state, ref = await asyncio.to_thread(find, uid)
            signed = store.objects.presign_get(ref, expires_s) if ref is not None else None
        except outage.UNAVAILABLE as exc:
            return _json({"error": f"the result store is unavailable: {exc}"}, 503, outage.RETRY_AFTER_S)
        except ObjectStoreError as exc:
            return _json({"error": f"the object store is unavailable: {exc}"}, 503, outage.RETRY_AFTER_S)
        if state is not None and state != keys.COMPLETED:
            return _json({"uid": uid, "state": state, "error": "no result"}, 409)
        if ref is None or signed is None:
            return _json({"error": "unknown or expired request"}, 404)
        return _json({"uid": uid, "url": signed.url, "expires_at": signed.expires_at, "size": ref.size,
                      "sha256": ref.sha256, "content_type": ref.content_type})

    app.router.add_get("/v1/requests/{uid}/result/url", result_url)
