"""Other servers' fields on the OpenAI-compatible routes: vLLM-Omni's and SGLang's video fields, OpenAI's
image options, and the small refusals a schema-driven client meets (issue 25)."""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import openai
import pytest
import requests
from PIL import Image

from onepiece_platform.jobs.models import Job
from tests.fixtures.web import png

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
STEPS = {"num_inference_steps": 2}


class _Raw(requests.Session):
    """Requests as other servers' clients send them (form fields, JSON), at the client's base URL."""

    def __init__(self, client: openai.OpenAI) -> None:
        super().__init__()
        self.base = str(client.base_url).rstrip("/")
        self.headers["Authorization"] = f"Bearer {client.api_key}"

    def request(self, method: str, url: str, *args, **kwargs):  # type: ignore[override]
        return super().request(method, self.base + url, *args, timeout=30, **kwargs)


def test_vllm_omni_and_sglang_video_fields_json_and_multipart(oa, workers) -> None:
    client, _ = oa
    # as their clients send them: width/height/num_frames/fps/guidance_scale/seed/negative_prompt, no size
    v = client.videos.create(prompt="a cat", model="wan2.1-t2v", extra_body={
        "width": 96, "height": 64, "num_frames": 17, "fps": 8, "guidance_scale": 3.5, "seed": 7,
        "negative_prompt": "blur", **STEPS})
    assert client.videos.poll(v.id, poll_interval_ms=50).status == "completed"
    p = Job.objects.get(uid=v.id).params
    assert (p["width"], p["height"], p["num_frames"], p["fps"], p["guidance_scale"], p["seed"]) == (96, 64, 17, 8, 3.5, 7)
    assert v.size == "96x64" and v.seconds == "2"
    # multipart, every value a string field, with the first frame as a file (image-to-video)
    with _Raw(client) as http:
        r = http.post("/videos", data={"prompt": "a dog", "width": "64", "height": "64", "num_frames": "9",
                                       "fps": "16", "num_inference_steps": "2"},
                      files={"input_reference": ("first.png", png(), "image/png")})
        assert r.status_code == 200, r.text
        job = Job.objects.get(uid=r.json()["id"])
        assert job.workflow == "wan2.1-i2v" and (job.params["width"], job.params["num_frames"]) == (64, 9)
        # both forms given: they must agree
        bad = http.post("/videos", json={"prompt": "x", "size": "64x64", "width": 96, "height": 64})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"
        bad = http.post("/videos", json={"prompt": "x", "seconds": 2, "num_frames": 9})  # 2 s at 16 fps: 33
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_frames"
        bad = http.post("/videos", json={"prompt": "x", "width": 96})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "height"
        # seconds at the client's fps
        ok = http.post("/videos", json={"prompt": "x", "seconds": 2, "fps": 8, "size": "64x64", **STEPS})
        assert ok.status_code == 200 and Job.objects.get(uid=ok.json()["id"]).params["num_frames"] == 17


def test_image_output_formats_and_openai_no_op_fields(oa, workers) -> None:
    client, _ = oa
    r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", output_format="jpeg",
                               output_compression=80, quality="high", moderation="low", background="opaque",
                               extra_body={"style": "vivid", "stream": False, "partial_images": 0, **STEPS})
    jpeg = base64.b64decode(r.data[0].b64_json)
    assert jpeg[:3] == b"\xff\xd8\xff" and Image.open(io.BytesIO(jpeg)).size == (64, 64)
    assert r.output_format == "jpeg" and r.size == "64x64"
    r = client.images.generate(prompt="a cat", size="64x64", output_format="webp", extra_body=STEPS)
    with urllib.request.urlopen(r.data[0].url, timeout=10) as resp:  # the signed url serves the same format
        body = resp.read()
        assert resp.headers["Content-Type"] == "image/webp" and body[:4] == b"RIFF" and body[8:12] == b"WEBP"
    for field, value in (("background", "transparent"), ("stream", True), ("partial_images", 2)):
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt="a cat", size="64x64", extra_body={field: value, **STEPS})
        assert e.value.body["param"] == field, e.value.body


def test_the_small_refusals(oa, workers) -> None:
    client, _ = oa
    v = client.videos.create(prompt="a cat", size="64x64", seconds="1", extra_body=STEPS)
    assert client.videos.list(limit=0).data == [] and client.videos.list(limit=0).has_more  # 0 is allowed
    with _Raw(client) as http:
        r = http.get("/videos", params={"order": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "order"
        r = http.post("/videos", json={"prompt": 42, "size": "64x64"})  # a number is not text
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/videos", json={"prompt": "a cat", "size": "\uff16\uff14x64"})  # full-width digits
        assert r.status_code == 400 and r.json()["error"]["param"] == "size"
        r = http.post("/videos", json={"prompt": "a cat", "num_frames": "\uff19"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames"
        r = http.post("/videos", data={"prompt": "a cat", "": "x"})  # an empty field name is still named
        assert r.status_code == 400 and r.json()["error"]["param"] == "(empty name)"
        r = http.get("/videos/" + "0" * 32)
        assert r.status_code == 404 and "Job" not in r.json()["error"]["message"]
    # every size the schema offers is one the default quota allows
    schema = json.loads(urllib.request.urlopen(str(client.base_url).replace("/v1/", "/api/schema/?format=json"),
                                               timeout=10).read())
    schemas = schema["components"]["schemas"]
    ref = schemas["ImageGenerate"]["properties"]["size"]["allOf"][0]["$ref"].rsplit("/", 1)[1]
    offered = schemas[ref]["enum"]
    assert "1024x1024" not in offered and "512x512" in offered and "auto" in offered
    assert v.id
