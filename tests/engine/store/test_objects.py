"""The object-store client against a real S3 server (the embedded Swift with s3api; tests/fixtures/objects.py)."""

from __future__ import annotations

import datetime
import hashlib
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from engine.store.objects import (
    ObjectRef,
    ObjectStore,
    ObjectStoreError,
    from_config,
    parse_url,
    result_key,
    result_prefix,
    sniff_content_type,
)
from tests.fixtures import REPO_ROOT

MiB = 1 << 20


def _http(url: str, method: str = "GET", data: bytes | None = None, headers: dict[str, str] | None = None
          ) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    q = dict(parse_qsl(parts.query, keep_blank_values=True))
    q.update(changes)
    return urlunsplit(parts._replace(query=urlencode(q)))


# -- configuration (no server) ------------------------------------------------------------------------
def test_parse_url_forms() -> None:
    c = parse_url("http://127.0.0.1:9000/outputs")
    assert (c.endpoint, c.bucket, c.prefix, c.addressing, c.access_key) == \
        ("http://127.0.0.1:9000", "outputs", "", "path", None)
    c = parse_url("https://onepiece%3Aengine:s%2Fecret@s3.example.net/outs/prod/a/?region=eu-west-1&addressing=virtual")
    assert (c.endpoint, c.bucket, c.prefix, c.region, c.addressing) == \
        ("https://s3.example.net", "outs", "prod/a/", "eu-west-1", "virtual")
    assert (c.access_key, c.secret_key) == ("onepiece:engine", "s/ecret")
    assert "s/ecret" not in c.redacted()
    c = parse_url("s3://outs/p?region=eu-central-1")
    assert (c.endpoint, c.bucket, c.prefix, c.region) == (None, "outs", "p/", "eu-central-1")


@pytest.mark.parametrize("url", ["ftp://h/b", "http://h:9000/", "s3://", "http://h/b?addressing=sideways",
                                 "http://h/b?bucket=x", "http://onlykey@h/b"])
def test_parse_url_refuses(url: str) -> None:
    with pytest.raises(ValueError):
        parse_url(url)


def test_none_means_redis_only() -> None:
    assert from_config(None) is None and from_config("") is None and from_config("none") is None
    assert isinstance(from_config("http://127.0.0.1:1/b"), ObjectStore)


def test_ref_round_trips_as_json() -> None:
    ref = ObjectRef("results/u1", 12, "ab" * 32, "image/png")
    assert ObjectRef.from_json(ref.to_json()) == ref
    assert result_key("u1", "a1") == "results/u1/a1" and result_key("u1", "a1").startswith(result_prefix("u1"))
    assert sniff_content_type(b"\x89PNG\r\n\x1a\n...") == "image/png"
    assert sniff_content_type(b"\x00\x00\x00\x18ftypisom") == "video/mp4"
    assert sniff_content_type(b"plain") == "application/octet-stream"


def test_importing_the_store_loads_no_client() -> None:
    """boto3 is imported by the first client, never by ``import engine.store`` (nor the embedded server's
    module, which must not pull in eventlet)."""
    code = ("import sys; import engine.store, engine.store.objects, engine.embedded.s3;"
            "print([m for m in ('boto3', 'botocore', 'eventlet', 'swift') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# -- against the server -------------------------------------------------------------------------------
def test_put_get_round_trip_records_size_and_digest(object_store: ObjectStore) -> None:
    data = os.urandom(300_001)
    ref = object_store.put("results/a", data, content_type="image/png")
    assert ref == ObjectRef("results/a", len(data), hashlib.sha256(data).hexdigest(), "image/png")
    assert object_store.get("results/a") == data
    assert object_store.head("results/a") == ref  # the digest is in the object's metadata, not only ours
    assert object_store.get("results/missing") is None and object_store.head("results/missing") is None
    assert object_store.get(ref) == data  # by its reference too
    object_store.put("results/a-later", b"newer")
    newest = object_store.newest("results/a")
    assert newest is not None and newest.key == "results/a-later" and newest.size == 5


def test_multipart_put_is_byte_exact(s3_server, object_store: ObjectStore) -> None:
    store = ObjectStore(object_store.config, multipart_threshold=6 * MiB, part_size=5 * MiB)
    data = os.urandom(12 * MiB + 123)
    ref = store.put("big", data)
    assert ref.size == len(data) and ref.sha256 == hashlib.sha256(data).hexdigest()
    etag = store.client.head_object(Bucket=store.config.bucket, Key="big")["ETag"]
    assert etag.strip('"').endswith("-3")  # really three parts, not one PUT
    got = store.get("big")
    assert got is not None and hashlib.sha256(got).hexdigest() == ref.sha256
    assert store.client.list_multipart_uploads(Bucket=store.config.bucket).get("Uploads", []) == []


def _parts(store: ObjectStore, key: str) -> int:
    """How many parts the object went up in (0: one PUT): an S3 multipart ETag ends in ``-<parts>``."""
    etag = store.client.head_object(Bucket=store.config.bucket, Key=store.key(key))["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 0


def test_the_multipart_threshold_is_honoured(object_store: ObjectStore, monkeypatch) -> None:
    """Outputs up to ONEPIECE_OBJECT_MULTIPART_BYTES (256 MiB by default) go up in one PUT, larger ones in parts:
    on Swift one PUT is about twice the throughput of parts (benchmarks/object_delivery.md)."""
    monkeypatch.delenv("ONEPIECE_OBJECT_MULTIPART_BYTES", raising=False)
    store = ObjectStore(object_store.config)
    assert store.multipart_threshold == 256 * MiB
    data = os.urandom(24 * MiB)  # three 8 MiB parts under the old 16 MiB threshold
    assert store.put("default", data).size == len(data)
    assert _parts(store, "default") == 0 and store.get("default") == data

    monkeypatch.setenv("ONEPIECE_OBJECT_MULTIPART_BYTES", str(6 * MiB))
    store = ObjectStore(object_store.config, part_size=5 * MiB)  # what from_config makes, read anew
    assert from_config(f"http://127.0.0.1:1/{store.config.bucket}").multipart_threshold == 6 * MiB
    at, over = os.urandom(6 * MiB), os.urandom(6 * MiB + 1)
    store.put("at", at)
    store.put("over", over)
    assert (_parts(store, "at"), _parts(store, "over")) == (0, 2)
    assert store.get("at") == at and store.get("over") == over

    for bad in ("6MiB", "-1", str((5 << 30) + 1)):  # not a byte count; over S3's largest single PUT
        monkeypatch.setenv("ONEPIECE_OBJECT_MULTIPART_BYTES", bad)
        with pytest.raises(ValueError, match="ONEPIECE_OBJECT_MULTIPART_BYTES"):
            ObjectStore(object_store.config)


def test_failed_multipart_upload_leaves_no_object(object_store: ObjectStore, monkeypatch) -> None:
    store = ObjectStore(object_store.config, multipart_threshold=6 * MiB, part_size=5 * MiB)

    def broken(**kwargs):
        raise ConnectionResetError("the network went away before the upload completed")

    monkeypatch.setattr(store.client, "complete_multipart_upload", broken)
    with pytest.raises(ConnectionResetError):
        store.put("half", os.urandom(11 * MiB))
    assert store.head("half") is None
    assert store.client.list_multipart_uploads(Bucket=store.config.bucket).get("Uploads", []) == []


def test_multipart_parts_go_up_concurrently(object_store: ObjectStore, monkeypatch) -> None:
    """Parts are in flight together, as boto3's upload_fileobj sends them: one after another, a part's
    fixed cost on the store is paid once per part (benchmarks/object_delivery.md)."""
    store = ObjectStore(object_store.config, multipart_threshold=6 * MiB, part_size=5 * MiB, part_concurrency=3)
    together = threading.Barrier(3, timeout=10)  # serial uploads never get three parts here at once
    real = store.client.upload_part

    def gated(**kwargs):
        together.wait()
        return real(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", gated)
    data = os.urandom(15 * MiB)
    ref = store.put("together", data)
    assert store.get("together") == data and ref.sha256 == hashlib.sha256(data).hexdigest()


def test_a_failed_part_aborts_the_whole_upload(object_store: ObjectStore, monkeypatch) -> None:
    store = ObjectStore(object_store.config, multipart_threshold=6 * MiB, part_size=5 * MiB)
    real = store.client.upload_part

    def second_fails(**kwargs):
        if kwargs["PartNumber"] == 2:
            raise ConnectionResetError("part 2 lost its connection")
        return real(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", second_fails)
    with pytest.raises(ConnectionResetError):
        store.put("half", os.urandom(16 * MiB))
    assert store.head("half") is None
    assert store.client.list_multipart_uploads(Bucket=store.config.bucket).get("Uploads", []) == []


def test_range_get_returns_exactly_those_bytes(object_store: ObjectStore) -> None:
    store = ObjectStore(object_store.config, multipart_threshold=6 * MiB, part_size=5 * MiB)
    data = os.urandom(11 * MiB)
    store.put("ranged", data)
    for start, end in [(0, 0), (5, 15), (5 * MiB - 3, 5 * MiB + 3), (len(data) - 10, len(data) - 1)]:
        assert store.get("ranged", start, end) == data[start:end + 1], (start, end)
    assert store.get("ranged", 10 * MiB) == data[10 * MiB:]
    opened = store.open("ranged", 100, 199)
    assert opened is not None and (opened.length, opened.total) == (100, len(data))
    assert opened.body.read() == data[100:200]
    opened.body.close()
    # and through a presigned URL, as a browser seeking in a video asks
    url = store.presign_get("ranged", 60).url
    status, body = _http(url, headers={"Range": "bytes=1000-1999"})
    assert (status, body) == (206, data[1000:2000])


def test_presigned_get_works_and_tampering_is_refused(object_store: ObjectStore) -> None:
    object_store.put("p/one", b"first object")
    object_store.put("p/two", b"second object")
    signed = object_store.presign_get("p/one", 120)
    assert signed.method == "GET" and signed.expires_at > 0
    assert _http(signed.url) == (200, b"first object")
    # another key under the same signature, a longer life, a changed signature: each refused
    assert _http(signed.url.replace("/p/one?", "/p/two?"))[0] == 403
    assert _http(_with_query(signed.url, **{"X-Amz-Expires": "604800"}))[0] == 403
    sig = dict(parse_qsl(urlsplit(signed.url).query))["X-Amz-Signature"]
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    assert _http(_with_query(signed.url, **{"X-Amz-Signature": flipped}))[0] == 403


def test_expired_presigned_url_is_refused(object_store: ObjectStore, monkeypatch) -> None:
    object_store.put("old", b"gone by now")
    fresh = object_store.presign_get("old", 60)
    import botocore.auth

    real = botocore.auth.get_current_datetime
    # the client's clock two hours back: a 60 s URL signed then expired long ago (the server's clock decides)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: real() - datetime.timedelta(hours=2))
    expired = object_store.presign_get("old", 60)
    assert _http(expired.url)[0] == 403
    assert _http(fresh.url) == (200, b"gone by now")  # the same request signed now is accepted


def test_presigned_put_from_plain_http(object_store: ObjectStore) -> None:
    signed = object_store.presign_put("uploads/x.png", 60, content_type="image/png")
    assert _http(signed.url, "PUT", b"\x89PNG...", {"Content-Type": "image/png"})[0] == 200
    assert object_store.get("uploads/x.png") == b"\x89PNG..."
    assert _http(signed.url.replace("uploads/x.png", "uploads/y.png"), "PUT", b"evil",
                 {"Content-Type": "image/png"})[0] == 403
    assert object_store.head("uploads/y.png") is None


def test_wrong_secret_is_refused(object_store: ObjectStore) -> None:
    object_store.put("secret", b"s")
    c = object_store.config
    wrong = ObjectStore(type(c)(c.endpoint, c.bucket, c.prefix, c.region, c.addressing, c.access_key, "not-it"))
    with pytest.raises(ObjectStoreError, match="SignatureDoesNotMatch|AccessDenied|403"):
        wrong.put("secret", b"overwritten")
    assert object_store.get("secret") == b"s"
    wrong.close()


def test_delete(object_store: ObjectStore) -> None:
    object_store.put("d", b"x")
    object_store.delete("d")
    assert object_store.get("d") is None
    object_store.delete("d")  # already gone: fine


def test_prefix_keeps_deployments_apart(s3_server, object_store: ObjectStore) -> None:
    url = s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}/tenant-a"
    scoped = ObjectStore.from_url(url)
    ref = scoped.put("results/u", b"scoped")
    assert ref.key == "tenant-a/results/u"
    assert object_store.get("tenant-a/results/u") == b"scoped" and object_store.get("results/u") is None
    scoped.close()


# -- a stream written as it comes (ObjectStore.stream: a video's fragments while it decodes) ----------------

def _uploads(store: ObjectStore) -> list[dict]:
    return list(store.client.list_multipart_uploads(Bucket=store.config.bucket).get("Uploads", []))


def test_a_stream_goes_up_in_parts_as_it_is_written(object_store: ObjectStore) -> None:
    store = ObjectStore(object_store.config, part_size=5 * MiB)  # S3's smallest part, as on AWS
    writer = store.stream("streamed", content_type="video/mp4")
    data = os.urandom(12 * MiB + 123)
    pieces = [data[i:i + MiB] for i in range(0, len(data), MiB)]
    for piece in pieces[:5]:
        writer.write(piece)
    assert not writer.started and _uploads(store) == []  # one part held: nothing sent yet
    writer.write(pieces[5])  # more than a part: the upload starts, its first part handed to its thread
    assert writer.started and [u["Key"] for u in _uploads(store)] == ["streamed"]
    assert store.head("streamed") is None  # nothing visible before it completes
    for piece in pieces[6:]:
        writer.write(piece)
    ref = writer.finish()
    assert ref == ObjectRef("streamed", len(data), hashlib.sha256(data).hexdigest(), "video/mp4")
    assert _parts(store, "streamed") == 3 and store.get("streamed") == data
    assert store.head("streamed").content_type == "video/mp4"
    assert _uploads(store) == []
    writer.abort()  # a no-op once completed
    assert store.get("streamed") == data


def test_a_stream_under_one_part_is_not_uploaded(object_store: ObjectStore) -> None:
    store = ObjectStore(object_store.config, part_size=5 * MiB)
    writer = store.stream("small")
    writer.write(os.urandom(3 * MiB))
    writer.write(os.urandom(2 * MiB))  # exactly a part: still the last (and only) one, the caller's to store
    assert writer.finish() is None
    assert store.head("small") is None and _uploads(store) == []


def test_an_aborted_stream_leaves_no_object_and_no_upload(object_store: ObjectStore) -> None:
    store = ObjectStore(object_store.config, part_size=5 * MiB)
    writer = store.stream("dropped")
    for _ in range(11):
        writer.write(os.urandom(MiB))
    assert writer.started and len(_uploads(store)) == 1
    writer.abort()
    assert store.head("dropped") is None and _uploads(store) == []
    with pytest.raises(ObjectStoreError):
        writer.write(b"more")


def test_a_failed_part_of_a_stream_aborts_it(object_store: ObjectStore, monkeypatch) -> None:
    store = ObjectStore(object_store.config, part_size=5 * MiB)
    real = store.client.upload_part

    def second_fails(**kwargs):
        if kwargs["PartNumber"] == 2:
            raise ConnectionResetError("part 2 lost its connection")
        return real(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", second_fails)
    writer = store.stream("half")
    with pytest.raises(ObjectStoreError, match="part 2 lost its connection"):
        for _ in range(16):  # the failure is reported by the write after it, or by finish
            writer.write(os.urandom(MiB))
        writer.finish()
    assert store.head("half") is None and _uploads(store) == []


def test_parts_under_the_store_minimum_are_refused(object_store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="at least 5242880 bytes"):
        ObjectStore(object_store.config, part_size=MiB)
