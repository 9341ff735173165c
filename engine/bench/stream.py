"""``bench e2e``'s streamed-video figure: time to the first playable fragment of a wan2.1-t2v video (the
Proxy's ``GET /v1/requests/{uid}/result?stream=true``) against time to the job's completion, both from submit.

``first_fragment_vs_complete``: their ratio, the median over the runs (the goal: at most 0.5 for a
default-length video on the tiny models under ``onepiece up``). A fragment is playable once its ``moof`` and
``mdat`` are both in (engine.stages.wan.video.split_boxes).
"""

from __future__ import annotations

import http.client
import statistics
import time
import urllib.parse
from typing import Any

from engine.bench.harness import Client, _call, auth_headers

WORKFLOW = "wan2.1-t2v"
# the model's default size and length (81 frames) and steps: what a client that sets nothing gets
PARAMS: dict[str, Any] = {"prompt": "a boat on a lake at dawn", "seed": 1}


def one(proxy: str, params: dict[str, Any], timeout: float = 600) -> tuple[float, float, int]:
    """(seconds to the first playable fragment, seconds to completion, bytes streamed) of one video."""
    from engine.stages.wan.video import split_boxes

    t0 = time.perf_counter()
    status, doc = _call(f"{proxy}/v1/requests", "POST", {"workflow": WORKFLOW, "params": params})
    if status != 202:
        raise RuntimeError(f"the Proxy refused the streamed-video request ({status}): {doc}")
    uid = doc["uid"]
    url = urllib.parse.urlsplit(proxy)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    first, size, buf = None, 0, bytearray()
    try:
        conn.request("GET", f"/v1/requests/{uid}/result?stream=true", headers=auth_headers())
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"the stream of {uid} answered {resp.status}: {resp.read()[:200]!r}")
        while chunk := resp.read1(1 << 16):
            size += len(chunk)
            buf += chunk
            pieces, used = split_boxes(buf)
            del buf[:used]
            if first is None and any(p[4:8] == b"moof" for p in pieces):
                first = time.perf_counter() - t0
    finally:
        conn.close()
    state = Client(proxy).wait(uid, timeout)
    complete = time.perf_counter() - t0
    if state != "completed" or first is None:
        raise RuntimeError(f"the streamed video {uid} ended {state} (first fragment: {first})")
    return first, complete, size


def figure(proxy: str, runs: int = 3, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figure's fields for ``bench e2e`` (runs one after the other, on an otherwise idle engine)."""
    params = dict(PARAMS if params is None else params)
    got = [one(proxy.rstrip("/"), params) for _ in range(runs)]
    return {"stream_workflow": WORKFLOW, "stream_params": params, "stream_runs": runs,
            "first_fragment_s": statistics.median(g[0] for g in got),
            "stream_complete_s": statistics.median(g[1] for g in got),
            "first_fragment_vs_complete": statistics.median(g[0] / g[1] for g in got),
            "stream_bytes": got[-1][2]}
