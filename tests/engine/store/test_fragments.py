"""A job's fragment stream on a real Redis: each (uid, seq) written once and in order, a repeat with other
bytes or a gap refused, and readers that end on the end marker or report how the job ended."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from engine.store import JobStore, keys
from engine.store.fragments import FragmentMismatch, Fragments, StreamFailed


@pytest.fixture
def store(redis_server: Any) -> Any:
    s = JobStore.from_url(redis_server.url, ttl=60)
    yield s
    s.close()


def test_each_fragment_is_written_once_and_in_order(store: JobStore) -> None:
    f, uid = Fragments(store), uuid.uuid4().hex
    assert f.append(uid, 0, b"init") and f.append(uid, 1, b"frag1")
    assert not f.append(uid, 1, b"frag1")  # a restarted encoder's repeat: a no-op
    with pytest.raises(FragmentMismatch, match="another fragment"):
        f.append(uid, 1, b"other")
    with pytest.raises(FragmentMismatch, match="missing"):
        f.append(uid, 5, b"gap")
    assert f.count(uid) == 2 and 0 < store.r.ttl(keys.fragments_key(uid)) <= 60
    store.drop_results([uid])  # a dropped result takes its stream with it
    assert f.count(uid) == 0


def test_a_reader_gets_fragments_as_they_come_and_ends_on_the_marker(store: JobStore) -> None:
    f, uid = Fragments(store), uuid.uuid4().hex
    store.accept(uid, "wan2.1-t2v", 1.0)
    f.append(uid, 0, b"init")
    got: list[bytes] = []
    first = threading.Event()

    def read() -> None:
        for piece in f.iter(uid, wait_s=0.1):
            got.append(piece)
            first.set()

    t = threading.Thread(target=read)
    t.start()
    assert first.wait(10)
    assert store.state(uid) == keys.QUEUED  # read while the job is still running
    f.append(uid, 1, b"frag")
    f.end(uid, 2)
    store.finish(uid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=b"initfrag")
    t.join(10)
    assert not t.is_alive() and got == [b"init", b"frag"]


def test_a_job_that_ends_without_its_stream_is_a_clean_error(store: JobStore) -> None:
    f, uid = Fragments(store), uuid.uuid4().hex
    store.accept(uid, "wan2.1-t2v", 1.0)
    f.append(uid, 0, b"init")
    store.finish(uid, "wan2.1-t2v", keys.FAILED, "vae_decode", detail="stage_failed: boom")
    pieces = f.iter(uid, wait_s=0.05)
    assert next(pieces) == b"init"
    with pytest.raises(StreamFailed) as err:
        next(pieces)
    assert err.value.state == keys.FAILED and "boom" in err.value.detail
    with pytest.raises(StreamFailed) as err:
        next(f.iter(uuid.uuid4().hex, wait_s=0.05))
    assert err.value.state == "not_found"


def test_a_completed_job_without_a_stream_yields_its_result(store: JobStore) -> None:
    f, uid = Fragments(store), uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"\x89PNG")
    assert list(f.iter(uid, wait_s=0.05)) == [b"\x89PNG"]
