"""A streamed video's fragments go to the object store as parts while it decodes (issue 38): the tiny Wan
model's decoded chunks, fed one by one to a real video_encode TaskWorker (engine.worker.chunks) over its inbox
ring, on the real redis and an embedded Swift s3api server whose parts may be small (tests/fixtures/objects.py),
so that a video of a few kB spans several parts as a real one does in 8 MiB ones."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.coord import etcd_client
from engine.coord.routes import RouteTable
from engine.store import JobStore, keys
from engine.store.fragments import Fragments
from engine.store.objects import ObjectRef, ObjectStore, result_prefix
from engine.worker.taskworker import TaskWorker, WorkerConfig
from engine.workflow import get_workflow
from engine.workflow import message as wm
from tests.engine.worker.rig import inbox_ring
from tests.fixtures.objects import SMALL_PART

pytestmark = [pytest.mark.models]

WORKFLOW, STAGE = "wan2.1-t2v", "video_encode"
SPEC = get_workflow(WORKFLOW)


@pytest.fixture(scope="module")
def frame_chunks(tiny_models: dict[str, Path]) -> list[np.ndarray]:
    """The tiny Wan VAE's decode of random latents, chunk by chunk (1 frame, then 4 per latent frame)."""
    import torch

    from engine.stages.base import StageContext
    from engine.stages.wan.decoders import WanVaeDecode

    torch.set_num_threads(1)
    decode = WanVaeDecode()
    decode.load(tiny_models["wan2.1-t2v"])
    z = torch.randn(1, decode.pipe.vae.config.z_dim, 5, 4, 6, generator=torch.Generator().manual_seed(0))
    return [c["frames"].numpy().copy() for c in decode.run_chunks({"denoised": z}, {}, StageContext())]


@pytest.fixture
def rig(redis_server: Any, etcd_server: Any, small_parts_store: ObjectStore) -> Iterator[tuple[Any, ...]]:
    """(the video_encode TaskWorker, a producer to its inbox, its job store with the small-parts store)."""
    from engine.stages.wan.video import WanVideoEncode

    store = JobStore.from_url(redis_server.url, ttl=60, objects=small_parts_store)
    cfg = WorkerConfig(instance=f"{WORKFLOW}.{STAGE}.0", workflow=WORKFLOW, stage=STAGE, model_dir="/",
                       address="shm://unused", redis_url="", etcd_url=etcd_server.url)
    encode = WanVideoEncode()
    encode.load("/")
    with inbox_ring() as (consumer, producer):
        yield TaskWorker(cfg, store, RouteTable(etcd_client(etcd_server.url)), encode, consumer), producer, store
    store.r.close()  # the object store is the fixture's to close


def _send(producer: Any, uid: str, frames: np.ndarray, chunk: int, final: bool) -> None:
    h = wm.Header(uid=uid, workflow=WORKFLOW, stage=STAGE, route=SPEC.route(), params=PARAMS, chunk=chunk,
                  final=final)
    producer.send(wm.encode(h, {"frames": wm.from_numpy(frames)}))


PARAMS = SPEC.resolve_params({"prompt": "a cat", "num_frames": 17, "height": 32, "width": 48})


def _uploads(objects: ObjectStore, uid: str) -> list[dict[str, Any]]:
    """The multipart uploads in progress for the job's results."""
    got = objects.client.list_multipart_uploads(Bucket=objects.config.bucket, Prefix=objects.key(result_prefix(uid)))
    return list(got.get("Uploads", []))


def _feed_until(worker: TaskWorker, uid: str, chunks_taken: int) -> None:
    """Serve until the worker has taken ``chunks_taken`` of the request's chunks off its ring."""
    worker.serve(lambda: uid in worker.chunks.open and worker.chunks.open[uid].next >= chunks_taken)


def test_fragments_go_up_as_parts_while_the_video_decodes(rig: tuple[Any, ...], frame_chunks: list[np.ndarray],
                                                         small_parts_store: ObjectStore) -> None:
    worker, producer, store = rig
    objects = small_parts_store
    uid = uuid.uuid4().hex
    store.accept(uid, WORKFLOW, 1.0)
    *early, last = frame_chunks
    for i, frames in enumerate(early):
        _send(producer, uid, frames, i, False)
    _feed_until(worker, uid, len(early))
    # every chunk but the final one taken: the result object's upload is under way already, parts in it
    open_ = _uploads(objects, uid)
    assert len(open_) == 1, open_
    assert objects.head(result_prefix(uid)) is None and objects.newest(result_prefix(uid)) is None  # nothing visible
    written = worker.chunks.open[uid].writer.size
    assert written > 2 * SMALL_PART

    _send(producer, uid, last, len(early), True)
    worker.serve(lambda: store.state(uid) in keys.TERMINAL)
    assert store.state(uid) == keys.COMPLETED, store.status(uid)
    video = store.result(uid)
    assert video is not None and video[4:8] == b"ftyp"
    ref = store.result_ref(uid)
    assert ref is not None and ref.key == open_[0]["Key"]  # the object the upload under way became
    assert (ref.size, ref.sha256) == (len(video), hashlib.sha256(video).hexdigest())
    assert ref.content_type == "video/mp4"
    etag = objects.client.head_object(Bucket=objects.config.bucket, Key=ref.key)["ETag"].strip('"')
    assert int(etag.rsplit("-", 1)[1]) == -(-len(video) // SMALL_PART) >= 3  # multipart, every part
    assert objects.get(ref) == video == b"".join(Fragments(store).iter(uid))  # the fragments, byte for byte
    completed = [e for e in store.events(uid) if e["type"] == keys.COMPLETED]
    assert len(completed) == 1 and ObjectRef.from_json(completed[0]["output"]) == ref  # for the ledger
    assert _uploads(objects, uid) == []


def test_a_job_that_fails_mid_stream_leaves_no_object_and_no_upload(rig: tuple[Any, ...],
                                                                   frame_chunks: list[np.ndarray],
                                                                   small_parts_store: ObjectStore) -> None:
    worker, producer, store = rig
    objects = small_parts_store
    uid = uuid.uuid4().hex
    store.accept(uid, WORKFLOW, 1.0)
    for i, frames in enumerate(frame_chunks[:3]):
        _send(producer, uid, frames, i, False)
    _feed_until(worker, uid, 3)
    assert len(_uploads(objects, uid)) == 1  # under way
    _send(producer, uid, frame_chunks[4], 4, True)  # chunk 3 lost: the request fails here
    worker.serve(lambda: store.state(uid) in keys.TERMINAL)
    assert store.state(uid) == keys.FAILED
    assert uid not in worker.chunks.open
    assert _uploads(objects, uid) == [] and objects.newest(result_prefix(uid)) is None


def test_a_cancelled_job_aborts_its_upload(rig: tuple[Any, ...], frame_chunks: list[np.ndarray],
                                           small_parts_store: ObjectStore) -> None:
    worker, producer, store = rig
    objects = small_parts_store
    uid = uuid.uuid4().hex
    store.accept(uid, WORKFLOW, 1.0)
    for i, frames in enumerate(frame_chunks[:3]):
        _send(producer, uid, frames, i, False)
    _feed_until(worker, uid, 3)
    assert len(_uploads(objects, uid)) == 1
    # a cancel seen by the sender between chunks ends the job there (engine.worker.chunks.run_chunked)
    store.finish(uid, WORKFLOW, keys.CANCELLED, "vae_decode", detail="stopped at step 3 of 5: cancelled")
    worker.serve(lambda: uid not in worker.chunks.open)  # the receiver's sweep sees the job ended
    assert _uploads(objects, uid) == [] and objects.newest(result_prefix(uid)) is None
    assert store.result(uid) is None


def test_a_failed_stream_falls_back_to_the_upload_at_the_end(rig: tuple[Any, ...], frame_chunks: list[np.ndarray],
                                                             small_parts_store: ObjectStore, monkeypatch) -> None:
    """The stream is an optimisation: its upload failing (aborted, logged) leaves the result to the ordinary
    upload at the final chunk, never a failed job."""
    worker, producer, store = rig
    objects = small_parts_store

    def refused(**kwargs: Any) -> Any:
        raise ConnectionResetError("the store dropped the part")

    monkeypatch.setattr(objects.client, "upload_part", refused)
    uid = uuid.uuid4().hex
    store.accept(uid, WORKFLOW, 1.0)
    for i, frames in enumerate(frame_chunks):
        _send(producer, uid, frames, i, i == len(frame_chunks) - 1)
    worker.serve(lambda: store.state(uid) in keys.TERMINAL)
    assert store.state(uid) == keys.COMPLETED
    video, ref = store.result(uid), store.result_ref(uid)
    assert video is not None and ref is not None and ref.sha256 == hashlib.sha256(video).hexdigest()
    etag = objects.client.head_object(Bucket=objects.config.bucket, Key=ref.key)["ETag"].strip('"')
    assert "-" not in etag  # one PUT at the end
    assert _uploads(objects, uid) == []
