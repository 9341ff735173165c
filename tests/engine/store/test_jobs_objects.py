"""The result store with an object store behind it: real redis-server, real S3 server (Swift s3api)."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator

import pytest

from engine.store import JobStore, keys
from engine.store.objects import ObjectRef, ObjectStore, ObjectStoreError, result_prefix

PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(50_000)


@pytest.fixture
def stored(redis_server, object_store: ObjectStore) -> Iterator[JobStore]:
    """The engine's result store on the session's Redis (emptied) with a fresh bucket behind it."""
    s = JobStore.from_url(redis_server.url, ttl=60, objects=ObjectStore(object_store.config))
    s.r.flushdb()
    yield s
    s.close()


def _completed(store: JobStore, data: bytes = PNG) -> str:
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    assert store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=data)
    return uid


def _listed(store: ObjectStore, uid: str) -> list[str]:
    got = store.client.list_objects_v2(Bucket=store.config.bucket, Prefix=result_prefix(uid))
    return [o["Key"] for o in got.get("Contents", [])]


def test_completed_result_goes_to_the_store_and_redis_keeps_its_reference(stored: JobStore) -> None:
    uid = _completed(stored)
    assert stored.r.get(keys.result_key(uid)) is None  # no bytes in Redis
    ref = ObjectRef.from_json(stored.r.get(keys.result_ref_key(uid)))
    assert (ref.size, ref.sha256, ref.content_type) == (len(PNG), hashlib.sha256(PNG).hexdigest(), "image/png")
    assert ref.key.startswith(result_prefix(uid))
    assert stored.r.memory_usage(keys.result_ref_key(uid)) < 1000
    assert stored.result(uid) == PNG
    assert stored.result_ref(uid) == ref
    assert 0 < stored.r.ttl(keys.result_ref_key(uid)) <= 60


def test_result_outlives_redis_forgetting_the_job(stored: JobStore) -> None:
    uid = _completed(stored)
    stored.r.flushdb()  # what a restarted Redis (no persistence) knows
    assert stored.status(uid) is None
    assert stored.result(uid) == PNG
    ref = stored.result_ref(uid)
    assert ref is not None and ref.sha256 == hashlib.sha256(PNG).hexdigest()
    assert stored.result(uuid.uuid4().hex) is None  # a UID never completed has none


def test_a_finished_job_uploads_nothing(stored: JobStore) -> None:
    uid = _completed(stored)
    assert not stored.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"\x89PNG\r\n\x1a\nother")
    assert len(_listed(stored.objects, uid)) == 1 and stored.result(uid) == PNG


def test_the_attempt_that_loses_the_race_deletes_only_its_own_object(stored: JobStore, monkeypatch) -> None:
    uid = _completed(stored)
    winner = stored.result_ref(uid)
    # a redelivered attempt that read the job's state before the winner's transition, then uploaded
    monkeypatch.setattr(stored, "_field", lambda u, name: "" if name == "state" else "0")
    assert not stored.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"\x89PNG\r\n\x1a\nlate")
    assert _listed(stored.objects, uid) == [winner.key]
    assert stored.result(uid) == PNG


def test_failed_upload_does_not_complete_the_job(redis_server) -> None:
    from engine.embedded import free_port

    nowhere = ObjectStore.from_url(f"http://k:s@127.0.0.1:{free_port()}/b", connect_timeout=0.5)
    nowhere.client.meta.config.retries = {"max_attempts": 1}
    store = JobStore.from_url(redis_server.url, ttl=60, objects=nowhere)
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    with pytest.raises(ObjectStoreError):
        store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
    st = store.status(uid)
    assert st is not None and not st.terminal  # never completed without its bytes
    assert store.finish(uid, "sd-t2i", keys.FAILED, "image_encode", detail="upload failed")
    store.close()


def test_drop_results_deletes_the_object(stored: JobStore) -> None:
    uid = _completed(stored)
    assert stored.drop_results([uid]) == 1
    assert _listed(stored.objects, uid) == []
    assert stored.r.get(keys.result_ref_key(uid)) is None and stored.result(uid) is None
    assert stored.drop_results([uid]) == 0  # nothing left


def test_drop_results_finds_the_objects_by_uid(stored: JobStore) -> None:
    """Also once Redis forgot the reference, and an attempt's orphan (killed after its upload) goes too."""
    uid, other = _completed(stored), _completed(stored)
    stored.objects.put(f"{result_prefix(uid)}orphan", b"an attempt killed before it completed the job")
    stored.r.flushdb()
    assert stored.drop_results([uid]) == 1
    assert _listed(stored.objects, uid) == [] and stored.result(uid) is None
    assert stored.result(other) == PNG  # only the named jobs' objects


def test_without_a_store_the_bytes_stay_in_redis(job_store: JobStore) -> None:
    assert job_store.objects is None
    uid = uuid.uuid4().hex
    job_store.accept(uid, "sd-t2i", 1.0)
    assert job_store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
    assert job_store.r.get(keys.result_key(uid)) == PNG and job_store.r.get(keys.result_ref_key(uid)) is None
    assert job_store.result(uid) == PNG and job_store.result_ref(uid) is None


def test_results_under_the_inline_threshold_stay_in_redis(redis_server, object_store: ObjectStore) -> None:
    """ONEPIECE_OBJECT_INLINE_BYTES: an output under it is kept in Redis (as without a store), one at or over
    it goes to the store. The inline one is lost with Redis; the stored one is not."""
    store = JobStore.from_url(redis_server.url, ttl=60, objects=ObjectStore(object_store.config),
                              inline_bytes=len(PNG))
    store.r.flushdb()
    small, at = PNG[:-1], PNG
    inline, stored_uid = _completed(store, small), _completed(store, at)
    assert store.r.get(keys.result_key(inline)) == small and store.r.get(keys.result_ref_key(inline)) is None
    assert _listed(store.objects, inline) == [] and store.result_ref(inline) is None
    assert store.r.get(keys.result_key(stored_uid)) is None and len(_listed(store.objects, stored_uid)) == 1
    assert store.result(inline) == small and store.result(stored_uid) == at
    store.r.flushdb()  # Redis restarted empty
    assert store.result(inline) is None  # went with Redis: reported lost, never served wrong
    assert store.result(stored_uid) == at
    store.close()


def test_inline_threshold_setting(monkeypatch) -> None:
    from engine import envs

    monkeypatch.delenv("ONEPIECE_OBJECT_INLINE_BYTES", raising=False)
    assert envs.OBJECT_INLINE_BYTES == 256 << 10  # the knee measured by benchmarks/object_inline.py
    monkeypatch.setenv("ONEPIECE_OBJECT_INLINE_BYTES", "0")
    assert envs.OBJECT_INLINE_BYTES == 0
    for bad in ("-1", "1e6", "lots", "", "１２"):
        monkeypatch.setenv("ONEPIECE_OBJECT_INLINE_BYTES", bad)
        with pytest.raises(ValueError, match="ONEPIECE_OBJECT_INLINE_BYTES must be a byte count"):
            _ = envs.OBJECT_INLINE_BYTES
    with pytest.raises(ValueError, match="inline_bytes"):
        JobStore(object(), inline_bytes=-1)


def _streamed(store: JobStore, uid: str, data: bytes) -> ObjectRef:
    """``data`` written to the job's result object as a stage streams it (JobStore.result_writer)."""
    writer = store.result_writer(uid)
    assert writer is not None
    for i in range(0, len(data), 1 << 20):
        writer.write(data[i:i + (1 << 20)])
    ref = writer.finish()
    assert ref is not None
    return ref


VIDEO = b"\x00\x00\x00\x20ftypisom" + os.urandom(6 << 20)  # over one 5 MiB part


def test_a_streamed_result_is_recorded_without_a_second_upload(redis_server, object_store: ObjectStore) -> None:
    store = JobStore.from_url(redis_server.url, ttl=60, objects=ObjectStore(object_store.config, part_size=5 << 20))
    uid = uuid.uuid4().hex
    store.accept(uid, "wan2.1-t2v", 1.0)
    ref = _streamed(store, uid, VIDEO)
    assert store.finish(uid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=VIDEO, uploaded=ref)
    assert store.result_ref(uid) == ref and ref.content_type == "video/mp4"
    assert _listed(store.objects, uid) == [ref.key]  # the streamed object is the result, no other
    assert store.result(uid) == VIDEO
    store.close()


def test_a_streamed_result_that_differs_is_replaced_by_the_result(redis_server, object_store: ObjectStore,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = JobStore.from_url(redis_server.url, ttl=60, objects=ObjectStore(object_store.config, part_size=5 << 20))
    uid = uuid.uuid4().hex
    store.accept(uid, "wan2.1-t2v", 1.0)
    ref = _streamed(store, uid, VIDEO)
    other = VIDEO[:-1] + bytes([VIDEO[-1] ^ 1])  # same size, one bit off
    assert store.finish(uid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=other, uploaded=ref)
    # the stream was wrong, not the result: the job completes with the result's own bytes, in one object
    kept = store.result_ref(uid)
    assert kept is not None and kept.key != ref.key and _listed(store.objects, uid) == [kept.key]
    assert store.result(uid) == other and "is not its result" in caplog.text
    store.close()
