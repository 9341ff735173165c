"""``GET /v1/videos/{id}/content?stream=true`` with the official openai client: the fragmented mp4 arrives
while the job is still running (the writer waits for the client's first bytes before it goes on), equals the
finished video, and a job that ended without a video is a 409 naming its state."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.stages.wan.video import Mp4Stream
from engine.store import keys
from engine.store.fragments import Fragments

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
STREAM = {"stream": "true"}


def _write(store, uid: str, got_first: threading.Event, seen: dict) -> None:
    """What the mp4 stage does: fragments as the frames come, the end marker, then the result."""
    frames = np.stack([np.full((32, 32, 3), 20 * i, dtype=np.uint8) for i in range(9)])
    fragments, mp4, seq = Fragments(store), Mp4Stream(16), 0
    pieces = mp4.feed(frames[:5])
    for piece in pieces:
        fragments.append(uid, seq, piece)
        seq += 1
    seen["before"] = got_first.wait(30)  # the client has bytes while the job is still running
    seen["state"] = store.state(uid)
    rest = mp4.feed(frames[5:]) + mp4.close()
    for piece in rest:
        fragments.append(uid, seq, piece)
        seq += 1
    fragments.end(uid, seq)
    store.finish(uid, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=b"".join(pieces + rest))


def test_the_streamed_video_arrives_while_the_job_runs_and_equals_the_result(oa, workers) -> None:
    client, _user = oa
    workers.hold = True  # this test plays the mp4 stage
    v = client.videos.create(prompt="a cat on the moon", size="32x32", seconds="1",
                             extra_body={"num_inference_steps": 2})
    got_first, seen = threading.Event(), {}
    writer = threading.Thread(target=_write, args=(workers.store, v.id, got_first, seen))
    writer.start()
    data = bytearray()
    with client.videos.with_streaming_response.download_content(v.id, extra_query=STREAM) as r:
        assert r.headers["content-type"] == "video/mp4"
        for chunk in r.iter_bytes():
            data += chunk
            got_first.set()
    writer.join(30)
    assert seen == {"before": True, "state": keys.QUEUED}
    assert bytes(data) == workers.store.result(v.id) and data[4:8] == b"ftyp"
    assert client.videos.download_content(v.id).content == bytes(data)  # the finished file is the same video


def test_a_job_that_ended_without_a_video_is_a_409(oa, workers) -> None:
    import openai

    client, _user = oa
    workers.fail = True
    v = client.videos.create_and_poll(prompt="a cat", size="32x32", seconds="1", poll_interval_ms=50,
                                      extra_body={"num_inference_steps": 2})
    assert v.status == "failed"
    with pytest.raises(openai.ConflictError):
        client.videos.download_content(v.id, extra_query=STREAM)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.videos.download_content(v.id, variant="thumbnail", extra_query=STREAM)


def test_the_native_result_route_streams_the_same_bytes(oa, workers) -> None:
    import json
    import urllib.error
    import urllib.request

    client, _user = oa
    workers.hold = True
    v = client.videos.create(prompt="a cat on the moon", size="32x32", seconds="1",
                             extra_body={"num_inference_steps": 2})
    got_first, seen = threading.Event(), {}
    got_first.set()  # this reader starts after the writer (the stream's whole length is already there)
    _write(workers.store, v.id, got_first, seen)
    base = str(client.base_url).rstrip("/").removesuffix("/v1")

    def get(query: str) -> tuple[int, bytes]:
        req = urllib.request.Request(f"{base}/api/v1/jobs/{v.id}/result?{query}",
                                     headers={"Authorization": f"Bearer {client.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    status, data = get("stream=true")
    assert status == 200 and data == workers.store.result(v.id)
    status, body = get("stream=maybe")
    assert status == 400 and json.loads(body)["field"] == "stream"
