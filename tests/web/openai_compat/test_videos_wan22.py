"""/v1/videos for the Wan2.2 models: ``guidance_scale_2`` (the low-noise expert's guidance) through the openai
client's ``extra_body``, bounded by the workflow and refused, naming it, by a model without a second expert;
wan2.2-ti2v-5b without ``input_reference`` (text to video) and with a bad one (a 400 naming it)."""

from __future__ import annotations

import openai
import pytest

from onepiece_platform.jobs.models import Job

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
SMALL = {"size": "64x64", "seconds": "1"}


def _refused(client: openai.OpenAI, **kwargs: object) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", **SMALL, **kwargs)
    return e.value.body


def test_guidance_scale_2_through_extra_body(oa) -> None:
    client, _ = oa
    v = client.videos.create(prompt="a cat", model="wan2.2-t2v-a14b", **SMALL, extra_body={"guidance_scale_2": 2.5})
    assert Job.objects.get(uid=v.id).params["guidance_scale_2"] == 2.5  # reaches the workflow's parameters
    for bad in (50.5, -1.0):
        body = _refused(client, model="wan2.2-i2v-a14b", input_reference=("f.png", _png(), "image/png"),
                        extra_body={"guidance_scale_2": bad})
        assert body["param"] == "guidance_scale_2" and body["type"] == "invalid_request_error", body
    body = _refused(client, model="wan2.2-t2v-a14b", extra_body={"guidance_scale_2": "lots"})
    assert body["param"] == "guidance_scale_2", body
    for model in ("wan2.2-ti2v-5b", "wan2.1-t2v"):  # one transformer: no second guidance
        body = _refused(client, model=model, extra_body={"guidance_scale_2": 2.0})
        assert body["param"] == "guidance_scale_2", (model, body)


def test_ti2v_takes_a_prompt_alone_and_refuses_a_bad_image(oa) -> None:
    client, _ = oa
    v = client.videos.create(prompt="a cat", model="wan2.2-ti2v-5b", **SMALL)
    job = Job.objects.get(uid=v.id)
    assert job.workflow == "wan2.2-ti2v-5b" and not job.inputs.exists()  # no image: text to video
    body = _refused(client, model="wan2.2-ti2v-5b", input_reference=("f.png", b"not an image", "image/png"))
    assert body["param"] == "image" and "not a readable image" in body["message"], body  # the workflow's input
    body = _refused(client, model="wan2.2-i2v-a14b")  # the A14B image-to-video model still needs one
    assert body["param"] == "input_reference", body


def _png() -> bytes:
    from tests.fixtures.web import png

    return png(64, 64)


def test_native_api_takes_ti2v_without_an_image(oa, live_server) -> None:
    import json
    import urllib.request

    client, _ = oa
    req = urllib.request.Request(live_server.url + "/api/v1/jobs", method="POST", data=json.dumps(
        {"workflow": "wan2.2-ti2v-5b", "params": {"prompt": "a cat", "width": 64, "height": 64}}).encode(),
        headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 202
        uid = json.loads(r.read())["uid"]
    assert Job.objects.get(uid=uid).workflow == "wan2.2-ti2v-5b"
