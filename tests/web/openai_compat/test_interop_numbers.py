"""Issue 39's interop findings and its finding 7, on the OpenAI-compatible routes and the native submit:

* ``GET /v1/videos?after=`` (empty) is the first page, as OpenAI's spec allows;
* ``model: "default"`` (vLLM-Omni's client default) is the route's default workflow, recorded by its name;
* an image size that is not served is refused with the sizes that are;
* a number written with other than ASCII digits (full-width ``５``) is a 400 naming its field, floats too.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from onepiece_platform.jobs.models import Job
from tests.fixtures.web import png, sd_body

VIDEO = {"prompt": "a cat", "size": "32x32", "seconds": "1", "num_inference_steps": 2}


def _refused(r: Any, param: str) -> str:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_an_empty_after_is_the_first_page(alice) -> None:
    _, c, _ = alice
    made = c.post("/v1/videos", VIDEO, format="json")
    assert made.status_code == 200, made.content
    r = c.get("/v1/videos", {"after": ""})
    assert r.status_code == 200, r.content
    assert [v["id"] for v in r.json()["data"]] == [made.json()["id"]]
    _refused(c.get("/v1/videos", {"limit": ""}), "limit")  # an empty limit or order is still no value


def test_model_default_is_the_routes_default_workflow(alice, workers) -> None:
    _, c, _ = alice
    t2v = c.post("/v1/videos", {**VIDEO, "model": "default"}, format="json")
    assert t2v.status_code == 200, t2v.content
    assert t2v.json()["model"] == "wan2.1-t2v" and Job.objects.get(uid=t2v.json()["id"]).workflow == "wan2.1-t2v"
    first = {"image_url": "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()}
    i2v = c.post("/v1/videos", {**VIDEO, "model": "default", "input_reference": first}, format="json")
    assert i2v.status_code == 200, i2v.content
    assert Job.objects.get(uid=i2v.json()["id"]).workflow == "wan2.1-i2v"
    img = c.post("/v1/images/generations", {"prompt": "a cat", "model": "default", "size": "64x64",
                                            "num_inference_steps": 2}, format="json")
    assert img.status_code == 200, img.content
    assert Job.objects.filter(owner=alice[0], workflow="sd-t2i").count() == 1
    _refused(c.post("/v1/images/generations", {"prompt": "a cat", "model": "no-such"}, format="json"), "model")


def test_a_size_not_served_is_refused_with_the_sizes_that_are(alice) -> None:
    _, c, _ = alice
    message = _refused(c.post("/v1/images/generations", {"prompt": "a cat", "size": "100x100"}, format="json"),
                       "size")
    assert "100x100" in message and "64x64" in message and "512x512" in message and "auto" in message, message


@pytest.mark.parametrize("field", ["guidance_scale", "guidance_scale_2"])
def test_full_width_digits_in_a_video_float_are_refused(alice, field: str) -> None:
    _, c, _ = alice
    for value in ("５", "３.５", True):  # refused as a number (not by the model, which has no second expert)
        message = _refused(c.post("/v1/videos", {**VIDEO, field: value}, format="json"), field)
        assert "valid number" in message, message
    assert not Job.objects.exists()  # refused before anything was submitted


def test_full_width_digits_in_an_image_float_are_refused(alice) -> None:
    _, c, _ = alice
    message = _refused(c.post("/v1/images/generations", {"prompt": "a cat", "guidance_scale": "５"},
                              format="json"), "guidance_scale")
    assert "valid number" in message, message
    # ASCII digits in a string still read (a form sends every value as one)
    ok = c.post("/v1/videos", {**VIDEO, "guidance_scale": "3.5"}, format="json")
    assert ok.status_code == 200, ok.content
    assert Job.objects.get(uid=ok.json()["id"]).params["guidance_scale"] == 3.5


def test_full_width_digits_in_the_native_deadline_are_refused(alice) -> None:
    _, c, _ = alice
    for value in ("６０", "６0", True):
        r = c.post("/api/v1/jobs", {**sd_body(), "deadline_s": value}, format="json")
        assert r.status_code == 400 and r.json()["field"] == "deadline_s", r.content
    r = c.post("/api/v1/jobs", {**sd_body(guidance_scale="５")}, format="json")  # a workflow parameter
    assert r.status_code == 400 and "guidance_scale" in r.json()["field"], r.content
    assert not Job.objects.exists()
    assert c.post("/api/v1/jobs", {**sd_body(), "deadline_s": "60"}, format="json").status_code == 202
