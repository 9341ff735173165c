"""Locust load for the OpenAI-compatible API of ``onepiece up``: images and videos as clients send them.

Run headless (the load test does; so can an operator against any deployment)::

    ONEPIECE_API_KEY=op_... locust -f tests/load/locustfile.py --headless -u 8 -r 4 -t 60s \
        --host http://127.0.0.1:8000 --csv out/locust

Image users call ``POST /v1/images/generations`` (synchronous: the answer carries the image); video users
``POST /v1/videos`` with a first frame, poll ``GET /v1/videos/{id}`` until it ends, then download it.
What counts as a failure is what a client must never see: a 5xx other than 503 with Retry-After (the
engine's "busy", like 429 for a user over quota, is a legitimate answer and is recorded as a refusal), or
an answer that is not the documented shape. With ``ONEPIECE_LOCUST_LOG`` set, every answer is also
written there as one JSON line (kind, status, Retry-After, job id, state), for the test to check that
every accepted job ended.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import threading
import time
from typing import Any

from locust import HttpUser, between, task

API_KEY = os.environ.get("ONEPIECE_API_KEY", "")
LOG = os.environ.get("ONEPIECE_LOCUST_LOG")
STEPS = int(os.environ.get("ONEPIECE_LOCUST_STEPS", "2"))
_lock = threading.Lock()


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 120, 40)).save(buf, format="PNG")
    return buf.getvalue()


FIRST_FRAME = _png()


def record(**fields: Any) -> None:
    if LOG:
        with _lock, open(LOG, "a") as f:
            f.write(json.dumps({"t": time.time(), **fields}) + "\n")


def judge(resp: Any, kind: str, ok: tuple[int, ...]) -> bool:
    """Mark the answer; True when it is one of ``ok`` (the caller goes on with it)."""
    status = resp.status_code
    retry_after = resp.headers.get("Retry-After")
    record(kind=kind, status=status, retry_after=retry_after)
    if status in ok:
        resp.success()
        return True
    if status in (429, 503) and retry_after:
        resp.success()  # a refusal with Retry-After: the documented answer to overload
    elif status >= 500:
        resp.failure(f"{status} without Retry-After: {resp.text[:200]}")
    else:
        resp.failure(f"unexpected {status}: {resp.text[:200]}")
    return False


class ImageUser(HttpUser):
    weight = 3
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    @task
    def generate(self) -> None:
        body = {"model": "sd-t2i", "prompt": random.choice(["a cat", "a lighthouse at dusk", "two red apples"]),
                "size": "64x64", "num_inference_steps": STEPS, "seed": random.randrange(1 << 30),
                "response_format": "b64_json"}
        with self.client.post("/v1/images/generations", json=body, catch_response=True,
                              name="POST /v1/images/generations") as r:
            if judge(r, "image", (200,)):
                try:
                    png = base64.b64decode(r.json()["data"][0]["b64_json"])
                except (ValueError, KeyError, IndexError, TypeError):
                    r.failure("200 without an image")
                    return
                if not png.startswith(b"\x89PNG"):
                    r.failure("200 whose image is not a PNG")


class VideoUser(HttpUser):
    weight = 1
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    @task
    def video(self) -> None:
        data = {"model": "wan2.1-i2v", "prompt": "a boat on a lake", "seconds": "1", "size": "64x64",
                "num_inference_steps": str(STEPS), "seed": str(random.randrange(1 << 30))}
        with self.client.post("/v1/videos", data=data, files={"input_reference": ("first.png", FIRST_FRAME,
                                                                                  "image/png")},
                              catch_response=True, name="POST /v1/videos") as r:
            if not judge(r, "video", (200, 201, 202)):
                return
            vid = r.json().get("id")
        record(kind="video-accepted", id=vid)
        deadline = time.monotonic() + 180
        state = "queued"
        while time.monotonic() < deadline:
            after = 0.5
            with self.client.get(f"/v1/videos/{vid}", catch_response=True, name="GET /v1/videos/{id}") as r:
                if judge(r, "video-status", (200,)):
                    state = r.json().get("status", "")
                    after = int(r.headers.get("openai-poll-after-ms", 500)) / 1000
            if state in ("completed", "failed"):
                break
            time.sleep(min(2.0, max(0.2, after)))
        record(kind="video-ended", id=vid, state=state)
        if state == "completed":
            with self.client.get(f"/v1/videos/{vid}/content", catch_response=True,
                                 name="GET /v1/videos/{id}/content") as r:
                if judge(r, "video-content", (200,)) and not r.content[4:8] == b"ftyp":
                    r.failure("content is not an mp4")
