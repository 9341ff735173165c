"""Result URLs that work from any replica, and result bytes with Range.

A URL for a completed job's output (``response_format=url`` on ``/v1/images/generations``,
``/v1/videos/{id}/content?response_format=url``) is one of two kinds, each with its ``expires_at``:

* a presigned GET from the object store, when clients can reach the store: ``OBJECT_STORE_PUBLIC_URL``
  (``ONEPIECE_OBJECT_STORE_PUBLIC_URL``) names the endpoint they reach it at (``onepiece up`` sets it to its
  embedded store on loopback: reachable on that machine). The URL is signed for that endpoint with the
  store's credentials (SigV4: the store checks it; the bytes never pass through a web process), and the
  store answers Range requests itself;
* else the platform's own signed URL (``/v1/images/content/{token}``, ``/v1/videos/content/{token}``): the
  token names the job's kind and UID under Django's signing (``SECRET_KEY``) with its time, so any replica
  with the same ``SECRET_KEY`` and ledger serves it, streaming the object from the store (or the bytes from
  Redis for an output kept inline), Range included. Tampered, expired or future-dated tokens are refused
  (404: nothing to learn from it).

Range: one ``bytes=first-last``, ``bytes=first-`` or ``bytes=-suffix`` range gets a 206 with exactly those
bytes, one past the end a 416 with ``Content-Range: bytes */size``; other forms (several ranges, other units,
a malformed header) are ignored as RFC 9110 allows, and the whole output is sent (200).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse, StreamingHttpResponse

from onepiece_platform import conf
from onepiece_platform.keyed import Keyed

URL_MAX_AGE_S = 3600
# The token names the route's job kind ("image", "video") with the UID, so a token only ever opens a job of
# that kind (never one signed or forged for another route), and its timestamp must be in the past: a token
# dated ahead (forged, or by a skewed clock) would otherwise stay valid for as long as it claims. The salt
# changed with the format, so tokens of the old form are refused.
URL_SALT = "onepiece.result-url.v2"
URL_CLOCK_SKEW_S = 5
CHUNK = 256 << 10  # bytes per read when streaming an object to the client
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")  # ASCII digits only


class Unsatisfiable(ValueError):
    """A Range that starts at or past the end of the output (416)."""


# -- the platform's own signed URLs ------------------------------------------------------------------------
def sign_result_url(kind: str, uid: str, fmt: str = "png", quality: int = 100) -> str:
    """A signed grant to ``kind``'s result ``uid``; an image's in ``fmt`` at ``quality``."""
    suffix = "" if fmt == "png" else f".{fmt}.{int(quality)}"
    return signing.TimestampSigner(salt=URL_SALT).sign(f"{kind}:{uid}{suffix}")


def token_expires_at(token: str) -> int:
    """The Unix time a token made by :func:`sign_result_url` stops being accepted."""
    return signing.b62_decode(token.rsplit(":", 2)[1]) + URL_MAX_AGE_S


def unsign_result_url(token: str, kind: str) -> str | None:
    """The grant (``uid``, or ``uid.fmt.quality``) a valid, unexpired, not future-dated token of ``kind``
    holds; None otherwise."""
    signer = signing.TimestampSigner(salt=URL_SALT)
    try:
        inner = signing.Signer.unsign(signer, token)  # "kind:uid:timestamp", signature checked
        value, stamp = inner.rsplit(signer.sep, 1)
        age = time.time() - signing.b62_decode(stamp)
    except (signing.BadSignature, ValueError):
        return None
    if not -URL_CLOCK_SKEW_S <= age <= URL_MAX_AGE_S:
        return None
    got_kind, _, uid = value.partition(":")
    return uid if got_kind == kind and uid else None


# -- the store as clients reach it -------------------------------------------------------------------------
def public_endpoint(url: str) -> str:
    """``OBJECT_STORE_PUBLIC_URL`` checked: ``http(s)://host[:port]``, nothing else; ImproperlyConfigured
    saying what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImproperlyConfigured(f"OBJECT_STORE_PUBLIC_URL must be http(s)://host[:port], not {url!r}")
    if parts.username or parts.password or parts.path.strip("/") or parts.query or parts.fragment:
        raise ImproperlyConfigured("OBJECT_STORE_PUBLIC_URL names only the endpoint (no credentials, path or "
                                   f"query: the bucket and keys come from OBJECT_STORE), not {url!r}")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def _make_public(key: Any) -> Any:
    from engine.store.objects import ObjectStore, parse_url

    internal, public = key
    return ObjectStore(dataclasses.replace(parse_url(internal), endpoint=public_endpoint(public)))


_public: Keyed[Any] = Keyed(_make_public, lambda store: store.close())


def public_store() -> Any:
    """An :class:`engine.store.objects.ObjectStore` that signs for the endpoint clients reach, or None when
    there is none (no store, or no ``OBJECT_STORE_PUBLIC_URL``: the platform's own URLs instead)."""
    internal, public = conf.get("OBJECT_STORE") or "", conf.get("OBJECT_STORE_PUBLIC_URL") or ""
    if not public or not internal or internal.strip().lower() == "none":
        return None
    return _public.get((internal.strip(), public.strip()))


def stored_ref(job: Any) -> Any:
    """The :class:`engine.store.objects.ObjectRef` of a completed job's output in the store: from the ledger
    (``output_key``), else from Redis's reference or the store's listing by UID; None when the output is kept
    inline in Redis, or the web process has no store configured."""
    from engine.store.objects import ObjectRef
    from onepiece_platform.engine_link.objects import get_object_store, job_store

    if get_object_store() is None or not job.uid:
        return None
    if job.output_key:
        return ObjectRef(job.output_key, int(job.output_size or 0), job.output_sha256,
                         job.output_content_type or "application/octet-stream")
    if job.output_sha256:
        return None  # recorded as inline
    return job_store().result_ref(job.uid)


def issue_url(job: Any, request: Any, kind: str, fmt: str = "png", quality: int = 100) -> dict[str, Any]:
    """``{url, expires_at}`` for a completed job's output: a presigned GET from the store when clients reach
    it and the stored bytes are what is asked for (``fmt`` png: an image in another format is converted by
    the platform), else the platform's own signed URL (module docstring)."""
    from django.urls import reverse

    from onepiece_platform.api_errors import ApiError

    if job.output_gone():
        raise ApiError(410, job.output_gone())
    # never later than the output's retention: the object is deleted then (a signed URL is refused from then on)
    until = job.retain_until
    max_age = URL_MAX_AGE_S if until is None else max(1, min(URL_MAX_AGE_S, int(until.timestamp() - time.time())))
    store = public_store() if fmt == "png" else None
    ref = stored_ref(job) if store is not None else None
    if ref is not None:
        signed = store.presign_get(ref, max_age)
        return {"url": signed.url, "expires_at": signed.expires_at}
    token = sign_result_url(kind, job.uid or "", fmt, quality)
    route = "openai-image-content" if kind == "image" else "openai-video-signed-content"
    expires_at = token_expires_at(token) if until is None else min(token_expires_at(token), int(until.timestamp()))
    return {"url": request.build_absolute_uri(reverse(route, args=[token])), "expires_at": expires_at}


# -- bytes with Range ----------------------------------------------------------------------------------------
def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last), inclusive, of a single-range ``Range`` header against an output of ``size`` bytes; None
    for the whole output (no header, or a form served whole); :class:`Unsatisfiable` past the end."""
    m = _RANGE.fullmatch((header or "").strip())
    if m is None or m.groups() == ("", ""):
        return None
    first, last = m.groups()
    if not first:  # the last N bytes
        if int(last) == 0 or size == 0:
            raise Unsatisfiable(f"bytes=-{last} of {size}")
        return max(0, size - int(last)), size - 1
    if last and int(last) < int(first):
        return None  # invalid: ignored (RFC 9110 14.2)
    if int(first) >= size:
        raise Unsatisfiable(f"bytes={first}- of {size}")
    return int(first), min(size - 1, int(last)) if last else size - 1


def _headers(resp: HttpResponse | StreamingHttpResponse, span: tuple[int, int] | None, size: int,
             filename: str) -> Any:
    resp["Accept-Ranges"] = "bytes"
    resp["Content-Length"] = str(size if span is None else span[1] - span[0] + 1)
    if span is not None:
        resp["Content-Range"] = f"bytes {span[0]}-{span[1]}/{size}"
    if filename:
        resp["Content-Disposition"] = f'attachment; filename="{filename}"'
    resp["X-Content-Type-Options"] = "nosniff"
    return resp


def unsatisfiable(size: int) -> HttpResponse:
    resp = HttpResponse(status=416)
    resp["Content-Range"] = f"bytes */{size}"
    resp["Accept-Ranges"] = "bytes"
    return resp


def bytes_response(data: bytes, range_header: str | None, content_type: str, filename: str = "") -> HttpResponse:
    """``data`` (an output held in memory: from Redis, or converted) as a 200, or the asked range as a 206."""
    try:
        span = parse_range(range_header, len(data))
    except Unsatisfiable:
        return unsatisfiable(len(data))
    body = data if span is None else data[span[0]:span[1] + 1]
    return _headers(HttpResponse(body, content_type=content_type, status=200 if span is None else 206),
                    span, len(data), filename)


def _sync_chunks(body: Any) -> Iterator[bytes]:
    try:
        while chunk := body.read(CHUNK):
            yield chunk
    finally:
        body.close()


async def _async_chunks(body: Any) -> AsyncIterator[bytes]:
    from asgiref.sync import sync_to_async

    read = sync_to_async(body.read, thread_sensitive=False)  # the store's read blocks: off the event loop
    try:
        while chunk := await read(CHUNK):
            yield chunk
    finally:
        body.close()


def object_response(ref: Any, range_header: str | None, content_type: str, filename: str = "",
                    asgi: bool = False) -> HttpResponse | StreamingHttpResponse | None:
    """The stored object (or the asked range of it) streamed from the store through this process; None when
    the store no longer has it."""
    from onepiece_platform.engine_link.objects import get_object_store

    size = ref.size
    try:
        span = parse_range(range_header, size)
    except Unsatisfiable:
        return unsatisfiable(size)
    opened = get_object_store().open(ref, *(span if span is not None else (None, None)))
    if opened is None:
        return None
    body = _async_chunks(opened.body) if asgi else _sync_chunks(opened.body)
    resp = StreamingHttpResponse(body, content_type=content_type, status=200 if span is None else 206)
    return _headers(resp, span, opened.total, filename)
