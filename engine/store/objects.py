"""Outputs in an S3-compatible object store: put (multipart when large), ranged get, delete, presigned URLs.

The client is boto3/botocore, a well-kept library, rather than a SigV4 signer of our own: it signs
requests and presigned URLs, retries, pools connections and speaks to AWS S3, Ceph's RADOS Gateway,
MinIO-compatible servers and Swift's ``s3api`` alike. boto3 is imported when the first client is made,
never by ``import engine``.

Configuration is one URL (``ONEPIECE_OBJECT_STORE``, :func:`parse_url`), bucket included::

    http://127.0.0.1:9000/outputs                 endpoint + bucket (path-style: the default)
    https://s3.example.net/outputs/prod?region=eu-west-1&addressing=virtual
    http://ACCESS:SECRET@127.0.0.1:9000/outputs   credentials in the URL (percent-encoded), as for Redis
    s3://outputs/prod?region=eu-west-1            AWS S3 itself (its endpoint for the region)

Without credentials in the URL they come from botocore's usual chain: the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), the files (``AWS_SHARED_CREDENTIALS_FILE``,
``~/.aws/credentials``), a web-identity token file, an instance role. A path after the bucket is a key
prefix, so deployments can share a bucket.

Every object written through :meth:`ObjectStore.put` carries its SHA-256 in its metadata
(``x-amz-meta-sha256``) and :class:`ObjectRef` records key, size and digest, so a result can be checked
and found again from the store alone (Redis may have lost what it knew).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

MAX_PUT_BYTES = 5 << 30  # S3's largest object in one PUT; above it, parts are the only way
PART_SIZE = 8 << 20  # S3's minimum is 5 MiB for every part but the last
MIN_PART_SIZE = 5 << 20  # that minimum (AWS S3, Ceph, MinIO; Swift's s3api ``min_segment_size`` by default)
STREAM_QUEUE_PARTS = 2  # parts a PartWriter holds waiting for its upload threads before write() waits
PART_CONCURRENCY = 4  # parts in flight at once (boto3's upload_fileobj sends 10); benchmarks/object_delivery.md
MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4's ceiling for a presigned URL


log = logging.getLogger("onepiece.store.objects")


class ObjectStoreError(RuntimeError):
    """The object store refused or failed an operation; the message names the operation and the key."""


@dataclass(frozen=True)
class ObjectRef:
    """Where an output is and what it is: its key in the bucket, its size in bytes, its SHA-256 (hex)."""

    key: str
    size: int
    sha256: str
    content_type: str = "application/octet-stream"

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "size": self.size, "sha256": self.sha256,
                           "content_type": self.content_type}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ObjectRef:
        d = json.loads(raw)
        return cls(str(d["key"]), int(d["size"]), str(d["sha256"]),
                   str(d.get("content_type") or "application/octet-stream"))


@dataclass(frozen=True)
class Presigned:
    """A presigned URL, the method it is good for, and the Unix time it stops working."""

    url: str
    method: str
    expires_at: int


@dataclass(frozen=True)
class Opened:
    """An object being read: ``body`` (``read()``, ``iter_chunks(n)``, ``close()``), the bytes it will
    give (``length``), the whole object's size (``total``), its content type and recorded sha256."""

    body: Any
    length: int
    total: int
    content_type: str
    sha256: str


@dataclass(frozen=True)
class StoreConfig:
    """A parsed ``ONEPIECE_OBJECT_STORE`` URL (see the module's docstring)."""

    endpoint: str | None  # None: AWS S3's endpoint for the region
    bucket: str
    prefix: str = ""
    region: str = "us-east-1"
    addressing: str = "path"  # path | virtual
    access_key: str | None = None
    secret_key: str | None = None

    def redacted(self) -> str:
        """The configuration for logs: no secret."""
        where = self.endpoint or "s3"
        return f"{where}/{self.bucket}/{self.prefix}".rstrip("/") + f" ({self.addressing}-style, {self.region})"


def parse_url(url: str) -> StoreConfig:
    """``ONEPIECE_OBJECT_STORE``'s URL as a :class:`StoreConfig`; ValueError says what is wrong with it."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"region", "addressing"}
    if unknown:
        raise ValueError(f"object store URL: unknown parameter(s) {sorted(unknown)} (known: region, addressing)")
    addressing = query.get("addressing", "path")
    if addressing not in ("path", "virtual"):
        raise ValueError(f"object store URL: addressing must be path or virtual, not {addressing!r}")
    if parts.scheme == "s3":
        bucket, _, prefix = (parts.netloc + parts.path).partition("/")
        endpoint = None
    elif parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"object store URL has no host: {url!r}")
        bucket, _, prefix = parts.path.lstrip("/").partition("/")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        endpoint = f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
    else:
        raise ValueError(f"object store URL must be http://, https:// or s3://, not {url!r}")
    if not bucket:
        raise ValueError(f"object store URL names no bucket: {url!r} (e.g. http://127.0.0.1:9000/outputs)")
    prefix = prefix.strip("/")
    access = unquote(parts.username) if parts.username else None
    secret = unquote(parts.password) if parts.password else None
    if (access is None) != (secret is None):
        raise ValueError("object store URL: give both the access key and the secret (ACCESS:SECRET@host), or neither")
    return StoreConfig(endpoint, bucket, prefix + "/" if prefix else "", query.get("region", "us-east-1"),
                       addressing, access, secret)


def _recorded_sha256(response: dict[str, Any]) -> str:
    """The sha256 :meth:`ObjectStore.put` recorded, from a HEAD or GET response (servers differ in the case
    they give metadata names: Swift answers ``Sha256``)."""
    return next((v for k, v in response.get("Metadata", {}).items() if k.lower() == "sha256"), "")


def result_prefix(uid: str) -> str:
    """The names (under the store's prefix) of a job's final outputs start with this: the UID alone finds
    them again after Redis lost the job's metadata (:meth:`ObjectStore.newest`)."""
    return f"results/{uid}/"


def result_key(uid: str, attempt: str) -> str:
    """The name of one attempt's final output. Each attempt writes its own object, so a worker that loses
    the race to complete a job (a redelivered request) deletes its own and never the winner's."""
    return result_prefix(uid) + attempt


def sniff_content_type(data: bytes | bytearray | memoryview) -> str:
    """The content type of an output from its first bytes (the stages write PNG images and MP4 videos)."""
    head = bytes(memoryview(data)[:12])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head[4:8] == b"ftyp":
        return "video/mp4"
    if head.startswith(b"\x1aE\xdf\xa3"):
        return "video/webm"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    return "application/octet-stream"


class ObjectStore:
    """One bucket of an S3-compatible store. Thread-safe: boto3's clients are, and the client is made once."""

    def __init__(self, config: StoreConfig, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 multipart_threshold: int | None = None, part_size: int = PART_SIZE,
                 part_concurrency: int = PART_CONCURRENCY, min_part_size: int = MIN_PART_SIZE) -> None:
        """``multipart_threshold``: objects up to this many bytes go up in one PUT, larger ones in parts (None:
        ``ONEPIECE_OBJECT_MULTIPART_BYTES``, 256 MiB by default; at most :data:`MAX_PUT_BYTES`). ``part_size``:
        at least ``min_part_size``, the store's smallest part but the last (S3's 5 MiB; lowered only for a test
        store whose server accepts smaller parts, tests/fixtures/objects.py)."""
        from engine import envs

        self.config = config
        threshold = envs.OBJECT_MULTIPART_BYTES if multipart_threshold is None else int(multipart_threshold)
        if not 0 <= threshold <= MAX_PUT_BYTES:
            raise ValueError(f"the multipart threshold is 0 to {MAX_PUT_BYTES} bytes (S3's largest single PUT), "
                             f"not {threshold} (ONEPIECE_OBJECT_MULTIPART_BYTES)")
        if int(part_size) < int(min_part_size):
            raise ValueError(f"a part is at least {min_part_size} bytes (the store's minimum for every part but "
                             f"the last), not {part_size}")
        self.multipart_threshold, self.part_size = threshold, int(part_size)
        self.part_concurrency = max(1, int(part_concurrency))
        self._timeouts = (connect_timeout, read_timeout)
        self._client: Any = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ObjectStore:
        return cls(parse_url(url), **kwargs)

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            c = self.config
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=c.endpoint, region_name=c.region,
                aws_access_key_id=c.access_key, aws_secret_access_key=c.secret_key,
                config=Config(
                    signature_version="s3v4", s3={"addressing_style": c.addressing},
                    connect_timeout=self._timeouts[0], read_timeout=self._timeouts[1],
                    retries={"max_attempts": 4, "mode": "standard"}, max_pool_connections=16,
                    # integrity is ours (Content-MD5 on every put, the sha256 in the metadata); the newer
                    # default checksums (CRC32 trailers) are refused by some S3-compatible servers
                    request_checksum_calculation="when_required", response_checksum_validation="when_required",
                ))
        return self._client

    def key(self, name: str | ObjectRef) -> str:
        """The bucket key of ``name`` (under the store's prefix), or an :class:`ObjectRef`'s own key."""
        return name.key if isinstance(name, ObjectRef) else self.config.prefix + name

    def _fail(self, op: str, key: str, exc: Exception) -> ObjectStoreError:
        return ObjectStoreError(f"object store {self.config.redacted()}: {op} {key!r} failed: {exc}")

    # -- bucket ---------------------------------------------------------------------------------
    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (an embedded or new store); fine when it does."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.config.bucket)
            return
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise self._fail("head bucket", self.config.bucket, exc) from exc
        except BotoCoreError as exc:  # unreachable, no credentials, ...
            raise self._fail("head bucket", self.config.bucket, exc) from exc
        try:
            self.client.create_bucket(Bucket=self.config.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._fail("create bucket", self.config.bucket, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("create bucket", self.config.bucket, exc) from exc

    # -- objects --------------------------------------------------------------------------------
    def put(self, name: str, data: bytes | bytearray | memoryview,
            content_type: str = "application/octet-stream") -> ObjectRef:
        """Store ``data`` under ``name`` (the prefix added): in one request up to ``multipart_threshold``
        bytes, else in parts of ``part_size``, ``part_concurrency`` of them in flight at once. The object
        appears whole or not at all: a failed multipart upload is aborted. Returns its :class:`ObjectRef`."""
        import base64

        from botocore.exceptions import BotoCoreError, ClientError

        view = memoryview(data).cast("B")
        key = self.key(name)
        ref = ObjectRef(key, view.nbytes, hashlib.sha256(view).hexdigest(), content_type)
        meta = {"sha256": ref.sha256}
        try:
            if view.nbytes <= self.multipart_threshold:
                md5 = base64.b64encode(hashlib.md5(view, usedforsecurity=False).digest()).decode()
                body = data if isinstance(data, bytes) else bytes(view)  # no copy of what is bytes already
                self.client.put_object(Bucket=self.config.bucket, Key=key, Body=body, ContentMD5=md5,
                                       ContentType=content_type, Metadata=meta)
            else:
                self._put_parts(key, view, content_type, meta)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("put", key, exc) from exc
        return ref

    def _put_parts(self, key: str, view: memoryview, content_type: str, meta: dict[str, str]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        bucket = self.config.bucket
        upload = self.client.create_multipart_upload(Bucket=bucket, Key=key, ContentType=content_type,
                                                     Metadata=meta)["UploadId"]
        starts = list(range(0, view.nbytes, self.part_size))
        pool = ThreadPoolExecutor(min(self.part_concurrency, len(starts)), thread_name_prefix="s3-part")
        try:
            futures = [pool.submit(self._put_part, key, upload, n, view[start:start + self.part_size])
                       for n, start in enumerate(starts, start=1)]
            parts = [{"PartNumber": n, "ETag": f.result()} for n, f in enumerate(futures, start=1)]
            self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # no part may land after the abort
            try:
                self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            except Exception:  # the original failure is the one to report; the store expires stale uploads
                pass
            raise
        finally:
            pool.shutdown(wait=False)

    def _put_part(self, key: str, upload: str, number: int, chunk: memoryview) -> str:
        """Upload one part (its Content-MD5 checked by the store); its ETag."""
        import base64

        md5 = base64.b64encode(hashlib.md5(chunk, usedforsecurity=False).digest()).decode()
        got = self.client.upload_part(Bucket=self.config.bucket, Key=key, UploadId=upload, PartNumber=number,
                                      Body=bytes(chunk), ContentMD5=md5)
        return str(got["ETag"])

    def stream(self, name: str, content_type: str | None = None) -> PartWriter:
        """A writer that stores what is written to it under ``name`` in parts of ``part_size`` as the bytes
        come (a video's fragments while it decodes), not all at the end: :class:`PartWriter`."""
        return PartWriter(self, self.key(name), content_type, self.part_size)

    def head(self, name: str | ObjectRef) -> ObjectRef | None:
        """The object's :class:`ObjectRef` as the store has it (size, the recorded sha256), or None."""
        key = self.key(name)
        h = self._unless_missing("head", key, lambda: self.client.head_object(Bucket=self.config.bucket, Key=key))
        if h is None:
            return None
        return ObjectRef(key, int(h["ContentLength"]), _recorded_sha256(h),
                         h.get("ContentType") or "application/octet-stream")

    def newest(self, prefix: str) -> ObjectRef | None:
        """The most recently written object whose name starts with ``prefix`` (under the store's prefix), as
        :meth:`head` gives it, or None: how an output is found from its UID alone."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key(prefix)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.config.bucket, Prefix=key)
            found = [o for page in pages for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("list", key, exc) from exc
        if not found:
            return None
        latest = max(found, key=lambda o: (o["LastModified"], o["Key"]))
        return self.head(ObjectRef(latest["Key"], int(latest["Size"]), ""))

    def _unless_missing(self, op: str, key: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``call()``'s response, None when the object does not exist, :class:`ObjectStoreError` otherwise."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._fail(op, key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail(op, key, exc) from exc

    def get(self, name: str | ObjectRef, start: int | None = None, end: int | None = None) -> bytes | None:
        """The object's bytes, or bytes ``start`` to ``end`` inclusive (HTTP's Range; ``end`` None: to the
        end); None when there is no such object."""
        opened = self.open(name, start, end)
        if opened is None:
            return None
        try:
            return opened.body.read()
        finally:
            opened.body.close()

    def open(self, name: str | ObjectRef, start: int | None = None, end: int | None = None) -> Opened | None:
        """The object (or a range of it, as :meth:`get`) as a stream to read and close, or None when there
        is no such object: what a download that must not hold the whole object in memory reads."""
        key = self.key(name)
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Key": key}
        if start is not None or end is not None:
            kwargs["Range"] = f"bytes={start or 0}-{'' if end is None else end}"
        got = self._unless_missing("get", key, lambda: self.client.get_object(**kwargs))
        if got is None:
            return None
        length = int(got["ContentLength"])
        content_range = got.get("ContentRange") or ""  # "bytes 5-15/11000" for a range
        total = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else length
        return Opened(got["Body"], length, total, got.get("ContentType") or "application/octet-stream",
                      _recorded_sha256(got))

    def delete(self, name: str | ObjectRef) -> None:
        """Delete the object (no error when it is already gone)."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key(name)
        try:
            self.client.delete_object(Bucket=self.config.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("delete", key, exc) from exc

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose name starts with ``prefix`` (under the store's prefix); how many."""
        return self.purge(prefix)[0]

    def purge(self, prefix: str) -> tuple[int, int]:
        """Delete every object whose name starts with ``prefix`` (under the store's prefix); (how many, their
        bytes as the listing gave them): what a clean-up reports it freed."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key(prefix)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.config.bucket, Prefix=key)
            found = [(o["Key"], int(o.get("Size") or 0)) for page in pages for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("list", key, exc) from exc
        for k, _ in found:
            self.delete(ObjectRef(k, 0, ""))
        return len(found), sum(size for _, size in found)

    # -- presigned URLs -------------------------------------------------------------------------
    def presign_get(self, name: str | ObjectRef, expires_s: int = 3600) -> Presigned:
        """A URL anyone holding it can GET the object with (Range included) until ``expires_at``."""
        return self._presign("get_object", "GET", name, expires_s, {})

    def presign_put(self, name: str | ObjectRef, expires_s: int = 3600, content_type: str | None = None) -> Presigned:
        """A URL to PUT the object with until ``expires_at`` (with ``content_type``, the PUT must send it)."""
        extra = {"ContentType": content_type} if content_type else {}
        return self._presign("put_object", "PUT", name, expires_s, extra)

    def _presign(self, op: str, method: str, name: str | ObjectRef, expires_s: int, extra: dict[str, Any]) -> Presigned:
        if not 1 <= int(expires_s) <= MAX_PRESIGN_S:
            raise ValueError(f"a presigned URL lasts 1 s to 7 days, not {expires_s} s")
        now = int(time.time())
        url = self.client.generate_presigned_url(
            op, Params={"Bucket": self.config.bucket, "Key": self.key(name), **extra}, ExpiresIn=int(expires_s))
        return Presigned(url, method, now + int(expires_s))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class PartWriter:
    """An object written as its bytes come: :meth:`write` buffers them and, once more than a part is held,
    starts a multipart upload (lazily: its first part) and hands each full part to upload threads of its own
    (``part_concurrency`` of them, the store's: parts in flight together, as :meth:`ObjectStore.put` sends
    them; at most :data:`STREAM_QUEUE_PARTS` waiting, so the writer's loop waits on the network only when the
    store is slower than it); :meth:`finish` uploads the rest as the last part and completes the upload.

    The SHA-256 is computed as the bytes are written; the object's metadata cannot carry it (a multipart
    upload's metadata is fixed when it starts), the returned :class:`ObjectRef` does. An object that never
    reached more than one part is not uploaded at all: :meth:`finish` returns None and the caller takes the
    ordinary path (:meth:`ObjectStore.put`, or Redis for a small result). On any failure the upload is
    aborted (no object, whole or half, appears) and :class:`ObjectStoreError` raised; :meth:`abort` does the
    same for a writer whose bytes are not wanted. One a process dies with is left incomplete: invisible,
    and removed by the bucket's lifecycle rule (docs/operations.md, "Object storage for outputs")."""

    def __init__(self, store: ObjectStore, key: str, content_type: str | None, part_size: int) -> None:
        self.store, self.key, self.content_type, self.part_size = store, key, content_type, int(part_size)
        self.size = 0
        self.upload_id: str | None = None  # set when the first part is cut (the upload exists from then)
        self._sha = hashlib.sha256()
        self._buf = bytearray()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(STREAM_QUEUE_PARTS)
        self._threads: list[threading.Thread] = []
        self._sent = 0  # parts handed to the threads
        self._parts: list[dict[str, Any]] = []
        self._error: BaseException | None = None
        self._done = False  # finished or aborted

    @property
    def started(self) -> bool:
        """Whether the multipart upload exists (a part's worth was written)."""
        return self.upload_id is not None

    @property
    def pending(self) -> int:
        """Parts handed to the upload threads and not uploaded yet (how far the store is behind the writer)."""
        return self._sent - len(self._parts)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data``; every full part but the one held back goes to the upload thread."""
        if self._done:
            raise ObjectStoreError(f"write to {self.key!r} after its upload ended")
        self._raise_failed()
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.size += view.nbytes
        self._buf += view
        while len(self._buf) > self.part_size:  # more than a part: the last part is never empty
            part = bytes(self._buf[:self.part_size])
            del self._buf[:self.part_size]
            self._send(part)

    def _send(self, part: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        if self.upload_id is None:  # the first part: the upload starts now (one short request, here)
            self.content_type = self.content_type or sniff_content_type(part)
            try:
                self.upload_id = str(self.store.client.create_multipart_upload(
                    Bucket=self.store.config.bucket, Key=self.key, ContentType=self.content_type)["UploadId"])
            except (ClientError, BotoCoreError) as exc:
                self._done = True
                raise self.store._fail("start upload", self.key, exc) from exc
            self._threads = [threading.Thread(target=self._upload_parts, name="onepiece-s3-stream", daemon=True)
                             for _ in range(self.store.part_concurrency)]
            for t in self._threads:
                t.start()
        self._sent += 1
        self._queue.put((self._sent, part))  # the threads drain the queue even after a failure: never hangs

    def _upload_parts(self) -> None:
        """An upload thread: queued parts until None; after a failure (or the abort), parts are dropped."""
        while (item := self._queue.get()) is not None:
            if self._error is not None or self._done:
                continue
            number, part = item
            try:
                etag = self.store._put_part(self.key, str(self.upload_id), number, memoryview(part))
                self._parts.append({"PartNumber": number, "ETag": etag})  # list.append: atomic
            except Exception as exc:  # reported by the writer's next call
                self._error = exc

    def _raise_failed(self) -> None:
        if self._error is not None:
            exc = self._error
            self.abort()
            raise self.store._fail("upload part of", self.key, exc) from exc

    def _stop_threads(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def finish(self) -> ObjectRef | None:
        """Upload the rest as the last part and complete the object: its :class:`ObjectRef`; None when no
        upload was started (under one part: nothing was sent, the caller stores the bytes its usual way)."""
        if self._done:
            raise ObjectStoreError(f"finish of {self.key!r} after its upload ended")
        if self.upload_id is None:
            self._done = True
            return None
        from botocore.exceptions import BotoCoreError, ClientError

        self._send(bytes(self._buf))
        self._buf = bytearray()
        self._stop_threads()
        self._raise_failed()
        parts = sorted(self._parts, key=lambda p: p["PartNumber"])
        try:
            self.store.client.complete_multipart_upload(
                Bucket=self.store.config.bucket, Key=self.key, UploadId=self.upload_id,
                MultipartUpload={"Parts": parts})
        except (ClientError, BotoCoreError) as exc:
            self.abort()
            raise self.store._fail("complete upload", self.key, exc) from exc
        self._done = True
        return ObjectRef(self.key, self.size, self._sha.hexdigest(), self.content_type or "application/octet-stream")

    def abort(self) -> None:
        """Drop what was written: the upload thread stopped (no part lands after this), the multipart upload
        aborted. Idempotent; a no-op after :meth:`finish` completed the object."""
        if self._done and not self._threads:
            return
        self._done = True
        self._stop_threads()
        self._buf = bytearray()
        if self.upload_id is not None:
            try:
                self.store.client.abort_multipart_upload(Bucket=self.store.config.bucket, Key=self.key,
                                                         UploadId=self.upload_id)
            except Exception as exc:  # the lifecycle rule removes what an abort could not
                log.warning("could not abort the upload of %s: %s", self.key, exc)


def from_config(url: str | None) -> ObjectStore | None:
    """The store ``url`` names, or None for Redis-only mode (``None``, empty, or ``none``)."""
    if not url or url.strip().lower() == "none":
        return None
    return ObjectStore.from_url(url.strip())
