"""Streamed video through the Proxy and real worker processes: ``GET /v1/requests/{uid}/result?stream=true``
gives the fragmented mp4 while the VAE is still decoding, the bytes equal the finished result, and a SIGKILL
of the decoder or of the mp4 worker mid-stream neither loses nor repeats a fragment."""

from __future__ import annotations

import http.client
import io
import os
import signal
import threading
import time
import urllib.parse
from typing import Any

import numpy as np
import pytest

from engine.proxy.auth import auth_headers
from engine.stages.wan.video import split_boxes
from tests.fixtures.runtime import Cluster

pytestmark = [pytest.mark.models, pytest.mark.integration, pytest.mark.timeout(600)]

# a default-length clip (81 frames) at a size the test rings (4 MiB) hold: its decode takes seconds, a window to
# stream in and to kill
CLIP = dict(prompt="a boat on a lake", height=96, width=128, num_inference_steps=2, seed=4)
ENDED = {"completed", "failed", "cancelled", "expired"}


class Reader(threading.Thread):
    """Reads a streamed result; records each playable piece and the job's events when the first fragment
    (a ``moof``) arrived."""

    def __init__(self, one_node: Cluster, uid: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.uid = one_node, uid
        self.data = bytearray()
        self.pieces: list[bytes] = []
        self.events_at_first: list[dict[str, str]] | None = None
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        url = urllib.parse.urlsplit(self.cluster.proxy)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        try:
            conn.request("GET", f"/v1/requests/{self.uid}/result?stream=true",
                         headers=auth_headers(os.environ["ONEPIECE_PROXY_TOKEN"]))
            resp = conn.getresponse()
            assert resp.status == 200 and resp.headers["Content-Type"] == "video/mp4", resp.status
            buf = bytearray()
            while chunk := resp.read1(1 << 16):
                self.data += chunk
                buf += chunk
                got, used = split_boxes(buf)
                del buf[:used]
                self.pieces += got
                if self.events_at_first is None and any(b"moof" in p[4:8] for p in got):
                    self.events_at_first = self.cluster.events(self.uid)
                    self.first.set()
        except BaseException as exc:  # reported to the test
            self.error = exc
        finally:
            conn.close()
            self.first.set()


def _frames(mp4: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(mp4)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def _stream(one_node: Cluster, params: dict[str, Any]) -> tuple[str, Reader]:
    uid = one_node.submit("wan2.1-t2v", params)
    reader = Reader(one_node, uid)
    reader.start()
    return uid, reader


def _finished(one_node: Cluster, uid: str, reader: Reader) -> bytes:
    done = one_node.wait(uid, ENDED, timeout=300)
    assert done["state"] == "completed", done
    reader.join(60)
    assert not reader.is_alive() and reader.error is None, reader.error
    status, mp4, _ = one_node.call("GET", f"/v1/requests/{uid}/result")
    assert status == 200
    return mp4


def test_the_stream_starts_before_the_job_ends_and_equals_the_result(one_node: Cluster) -> None:
    uid, reader = _stream(one_node, CLIP)
    mp4 = _finished(one_node, uid, reader)
    # the first fragment came while the VAE was still decoding: no completion, no end of vae_decode yet
    at_first = reader.events_at_first
    assert at_first is not None
    assert not any(e["type"] == "completed" for e in at_first)
    assert not any(e["type"] == "stage_finished" and e["stage"] == "vae_decode" for e in at_first), at_first
    assert bytes(reader.data) == mp4  # the streamed bytes concatenated are the finished file
    frames = _frames(bytes(reader.data))
    assert frames.shape[0] == 81 and frames.std() > 1.0
    np.testing.assert_array_equal(frames, _frames(mp4))
    # one fragment per frame after the init segment, each stored once
    assert len(reader.pieces) == 1 + 81 and one_node.store.r.xlen(f"onepiece:fragments:{uid}") == 1 + 81 + 1


def test_an_unknown_or_failed_job_is_a_clean_error(one_node: Cluster) -> None:
    status, body, _ = one_node.call("GET", f"/v1/requests/{'0' * 32}/result?stream=true")
    assert status == 404
    uid = one_node.submit("wan2.1-t2v", {**CLIP, "num_inference_steps": 40})
    one_node.call("DELETE", f"/v1/requests/{uid}")
    one_node.wait(uid, ENDED, timeout=120)
    status, body, _ = one_node.call("GET", f"/v1/requests/{uid}/result?stream=true")
    assert status == 409 and body["state"] == "cancelled", body


@pytest.mark.parametrize("stage", ["vae_decode", "video_encode"])
def test_a_sigkill_mid_stream_loses_and_repeats_no_fragment(one_node: Cluster, stage: str) -> None:
    instance = f"wan2.1-i2v.{stage}.0"  # the Wan pair's shared pool
    victim = one_node.node_report()["instances"][instance]
    uid, reader = _stream(one_node, {**CLIP, "seed": 9})
    assert reader.first.wait(300) and reader.error is None, reader.error
    assert not any(e["type"] == "stage_finished" and e["stage"] == "vae_decode" for e in reader.events_at_first)
    os.kill(victim["pid"], signal.SIGKILL)
    mp4 = _finished(one_node, uid, reader)
    assert bytes(reader.data) == mp4  # continuous: nothing lost, nothing twice
    assert len(reader.pieces) == 1 + 81 and len(set(reader.pieces)) == len(reader.pieces)
    assert _frames(mp4).shape[0] == 81
    events = one_node.events(uid)
    assert [e["type"] for e in events].count("completed") == 1
    assert [e["stage"] for e in events if e["type"] == "stage_started"].count(stage) == 2  # ran again
    deadline = time.monotonic() + 30
    while one_node.node_report()["instances"][instance]["restarts"] <= victim["restarts"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_bench_measures_the_first_fragment_against_completion(one_node: Cluster) -> None:
    from engine.bench import stream

    r = stream.figure(one_node.proxy, runs=1, params={**CLIP, "seed": 12})
    assert 0 < r["first_fragment_s"] < r["stream_complete_s"] and 0 < r["first_fragment_vs_complete"] < 1
