"""What a new user meets in the first minute, against a live ``onepiece up`` (issue 25): every client's
default request completes, a request over the loaded model's limits is refused at intake naming the field,
vLLM-Omni's and SGLang's video fields and AIPerf-style image options work, and a synchronous image request
too large for its wait is refused at once instead of answered 504 after it."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from PIL import Image


def _proxy_workflows(lines: dict[str, str], state: Path) -> dict[str, Any]:
    token = (state / "secrets" / "proxy-token").read_text().strip()
    req = urllib.request.Request(lines["proxy"] + "/v1/workflows", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["workflows"]


def check_defaults_and_limits(lines: dict[str, str], client: openai.OpenAI, state: Path) -> None:
    # the limits the Proxy applies are the loaded model's (published with its routes)
    wfs = _proxy_workflows(lines, state)
    t2v = wfs["wan2.1-t2v"]["params"]
    assert t2v["width"]["maximum"] == 512 and "rope_max_seq_len" in t2v["width"]["why"], t2v["width"]
    assert (t2v["width"]["default"], t2v["height"]["default"], t2v["num_frames"]["default"]) == (224, 128, 81)
    # the openai client's default video request: no size, no seconds, no steps
    video = client.videos.create_and_poll(prompt="a cat walks on the beach", poll_interval_ms=250)
    assert video.status == "completed", video
    assert video.size == "224x128" and video.seconds == "5" and video.model == "wan2.1-t2v", video
    assert client.videos.download_content(video.id).content[4:8] == b"ftyp"
    # its default image request: the tiny model's own size (its UNet's sample_size in pixels), 50 steps
    image = client.images.generate(prompt="a lighthouse at dusk", response_format="b64_json")
    assert image.size == "64x64" and image.data[0].b64_json
    # over the loaded model's limits: refused at intake naming the field the client sent, with the reason
    for kwargs, param in (({"size": "832x480"}, "size"), ({"seconds": "8", "size": "64x64"}, "seconds")):
        with pytest.raises(openai.BadRequestError) as e:
            client.videos.create(prompt="a cat", **kwargs)
        assert e.value.body["param"] == param and "rope_max_seq_len" in e.value.body["message"], e.value.body
    # within the model's limits, but its hops outgrow the 8 MiB rings here: the denoised latents handed to
    # vae_decode (16 channels x 32 latent frames x 64 x 64, float32: 8 MiB and a header, now that the model's
    # dimensions are bound from its folder) and the decoded frames (94 MiB) handed to the mp4 stage. Refused at
    # intake naming the first hop that does not fit, not denoised for minutes and failed at a later hop
    with pytest.raises(openai.APIStatusError) as e:
        client.videos.create(prompt="a cat", size="512x512", extra_body={"num_frames": 125})
    assert e.value.status_code == 413 and e.value.body["param"] == "num_frames", e.value.body
    assert "what vae_decode is handed" in e.value.body["message"], e.value.body


def check_other_clients(lines: dict[str, str], client: openai.OpenAI, png: bytes) -> None:
    """The requests vLLM-Omni's diffusion benchmark (t2v, i2v) and AIPerf's image endpoint send."""
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {client.api_key}"
    api = lines["api"].rstrip("/")
    t2v = http.post(api + "/videos", timeout=30, json={
        "prompt": "a cat", "model": "wan2.1-t2v", "width": 64, "height": 64, "num_frames": 9, "fps": 8,
        "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 3, "negative_prompt": "blurry"})
    i2v = http.post(api + "/videos", timeout=30, files={"input_reference": ("first.png", png, "image/png")}, data={
        "prompt": "a dog", "width": "64", "height": "64", "num_frames": "9", "fps": "8", "num_inference_steps": "2"})
    for r in (t2v, i2v):
        assert r.status_code == 200, r.text
        done = client.videos.poll(r.json()["id"], poll_interval_ms=250)
        assert done.status == "completed" and done.size == "64x64" and done.seconds == "1", done
    assert client.videos.retrieve(i2v.json()["id"]).model == "wan2.1-i2v"
    img = http.post(api + "/images/generations", timeout=120, json={
        "prompt": "a boat", "model": "sd-t2i", "size": "64x64", "n": 1, "response_format": "b64_json",
        "output_format": "jpeg", "output_compression": 90, "quality": "standard", "style": "natural",
        "background": "auto", "moderation": "auto", "stream": False, "num_inference_steps": 3})
    assert img.status_code == 200, img.text
    decoded = Image.open(io.BytesIO(base64.b64decode(img.json()["data"][0]["b64_json"])))
    assert decoded.format == "JPEG" and decoded.size == (64, 64)


def check_priced_admission(lines: dict[str, str], client: openai.OpenAI, state: Path) -> float:
    """Beside a queue of small image jobs, a 512x512 50-step request (about 15 minutes of one CPU core with
    the tiny model: attention over 65,536 latent pixels) on the 120 s synchronous wait is refused by the
    Proxy's admission at once, priced from the stage times measured here (the workers' warm-up calibration and
    the small ones); returns the refusal's latency (seconds, for the note; not asserted)."""
    auth = {"Authorization": f"Bearer {lines['api key']}", "Content-Type": "application/json"}
    small = {"workflow": "sd-t2i", "params": {"prompt": "a small one", "height": 64, "width": 64,
                                              "num_inference_steps": 3}}
    uids = []
    for _ in range(3):  # the demo user's quota runs 4 jobs at once: 3 queued small ones and the large one
        req = urllib.request.Request(lines["web"] + "api/v1/jobs", data=json.dumps(small).encode(), headers=auth,
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            uids.append(json.loads(r.read())["uid"])
    deadline = time.monotonic() + 120
    while "denoise" not in _proxy_workflows(lines, state)["sd-t2i"]["priced_stages"]:
        assert time.monotonic() < deadline, "the denoise stage never published its measured times"
        time.sleep(0.2)
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        client.images.generate(prompt="a large one", size="512x512", extra_body={"num_inference_steps": 50})
    took = time.perf_counter() - t0
    # it can never fit the wait: a 400 the SDK does not retry, not a 503 it would send three more times
    assert e.value.status_code == 400 and "retry-after" not in e.value.response.headers, e.value.body
    assert "of stage work here" in e.value.body["message"], e.value.body
    return took
