"""``GET /v1/videos/{id}/content?stream=true``: the video's fragmented mp4 as the engine writes it.

Chunked transfer from the first fragment on, ending when the job ends (engine.store.fragments, read through
the engine's public reader). A job that already ended without a video is a 409 naming its state, and Redis
away when the stream is asked for is a 503 with Retry-After (the store is read once before the response
starts: never a 200 whose body is cut at once); one that fails mid-stream has its response broken off (an
exception in the body: the server closes the connection without the chunked transfer's last chunk), so no
client takes a truncated file for a whole one. Under ASGI the body is an async iterator and under WSGI a
plain one: each server sends the other kind only once it is read to its end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

_END = object()


class StreamBroken(RuntimeError):
    """The job ended without completing its stream (the response is broken off)."""


def _pieces(uid: str) -> Iterator[bytes]:
    from engine.store.fragments import Fragments
    from onepiece_platform.engine_link.objects import job_store

    # with an object store, a result that was not streamed (or whose fragments expired) is read from it
    return Fragments(job_store()).iter(uid)


async def _body(uid: str) -> AsyncIterator[bytes]:
    from asgiref.sync import sync_to_async

    from engine.store.fragments import StreamFailed

    pieces = await sync_to_async(_pieces, thread_sensitive=False)(uid)
    step = sync_to_async(next, thread_sensitive=False)  # the store's read blocks: off the event loop
    try:
        while True:
            try:
                piece = await step(pieces, _END)
            except StreamFailed as exc:
                raise StreamBroken(f"the job ended before its video did: {exc}") from exc
            if piece is _END:
                return
            yield piece
    finally:
        pieces.close()


def _sync_body(uid: str) -> Iterator[bytes]:
    """The same for a WSGI server (an async body would be read to its end there first)."""
    from engine.store.fragments import StreamFailed

    try:
        yield from _pieces(uid)
    except StreamFailed as exc:
        raise StreamBroken(f"the job ended before its video did: {exc}") from exc


def _store_answers(uid: str) -> None:
    """One read of the job's fragment stream, as the body's first read will do: raises what a Redis that is
    away raises (``engine.store.outage.UNAVAILABLE``)."""
    from engine.store import JobStore
    from engine.store.fragments import Fragments
    from onepiece_platform.redis_conn import get_redis

    Fragments(JobStore(get_redis())).count(uid)


def stream_video(uid: str, state: str, asgi: bool, content_type: str = "video/mp4") -> Any:
    """The streamed response for the engine job ``uid`` in ``state`` (the ledger's, just refreshed): a
    :class:`StreamingHttpResponse` whose body waits for the fragments (under ASGI in the event loop, never in
    the view's thread), the 409 of a job that already ended without a video, or a 503 while Redis is away."""
    from django.http import StreamingHttpResponse

    from engine.store import outage
    from onepiece_platform.api_errors import error

    if state in ("failed", "cancelled", "expired"):
        return error(409, f"the job is {state}; there is no video to stream", state=state)
    try:
        _store_answers(uid)
    except outage.UNAVAILABLE:
        return error(503, "the service's store is unavailable; retry shortly", retry_after=outage.RETRY_AFTER_S)
    resp = StreamingHttpResponse(_body(uid) if asgi else _sync_body(uid), content_type=content_type)
    resp["Cache-Control"] = "no-store"
    resp["X-Content-Type-Options"] = "nosniff"
    return resp


def stream_query(value: str | None) -> bool | None:
    """The native API's ``stream`` query value as a bool (absent: False); None when it is not one."""
    if value is None or value.lower() in ("", "0", "false", "no"):
        return False
    return True if value.lower() in ("1", "true", "yes") else None
