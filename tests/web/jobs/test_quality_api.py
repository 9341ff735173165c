"""``quality`` through the platform's doors: the native API and both OpenAI routes (``extra_body``) take it
where the workflow serves it, refuse it naming the field where it does not or with an unknown level (before
anything is written or sent), hand it on to the stages and record it on the job; lossless when not sent."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine.store import keys
from engine.workflow import message as wm
from engine.workflow.options import Options
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _flux(**params: Any) -> dict[str, Any]:
    return {"workflow": "flux.1-dev", "params": {"prompt": "a cat", "height": 64, "width": 64,
                                                 "num_inference_steps": 2, **params}}


def test_native_api_takes_records_and_bounds_quality(alice, store) -> None:
    _, c, _ = alice
    for body in (_flux(quality="ultra"), _flux(quality=3), sd_body(quality="high")):
        r = c.post("/api/v1/jobs", body, format="json")
        assert r.status_code == 400 and r.json()["field"] == "quality", r.json()
    assert not Job.objects.exists()  # refused before anything was written or sent
    r = c.post("/api/v1/jobs", _flux(quality="high"), format="json")
    assert r.status_code == 202, r.content
    uid = r.json()["uid"]
    assert wm.decode(store.r.get(keys.input_key(uid))).header.options["quality"] == "high"  # on to the stages, whole
    doc = c.get(f"/api/v1/jobs/{uid}").json()
    assert doc["quality"] == "high" and doc["params"]["quality"] == "high"
    plain = c.post("/api/v1/jobs", _flux(), format="json").json()["uid"]
    assert c.get(f"/api/v1/jobs/{plain}").json()["quality"] == "lossless"  # the default
    sd = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    assert c.get(f"/api/v1/jobs/{sd}").json()["quality"] == "lossless"  # a workflow without the parameter


def test_openai_routes_take_quality_through_extra_body(oa, workers) -> None:
    client, _ = oa
    for model, level in (("flux.1-dev", "ultra"), ("sd-t2i", "extra-high")):
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt="a cat", size="64x64", model=model,
                                   extra_body={"quality": level, "num_inference_steps": 2})
        assert e.value.body["param"] == "quality", e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # a level no model serves: refused, named
        client.videos.create(prompt="a cat", size="64x64", model="wan2.2-t2v-a14b",
                             extra_body={"quality": "ultra", "num_inference_steps": 2})
    assert e.value.body["param"] == "quality", e.value.body
    assert not Job.objects.exists()
    client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                         extra_body={"quality": "high", "num_inference_steps": 2})
    assert Job.objects.get(workflow="wan2.1-t2v").options["quality"] == "high"
    client.images.generate(prompt="a cat", size="64x64", model="flux.1-dev",
                           extra_body={"quality": "extra-high", "num_inference_steps": 2})
    assert Job.objects.get(workflow="flux.1-dev").options["quality"] == "extra-high"
    # OpenAI's own "high" (and "hd", "auto"...) on a model without levels: the no-op it always was
    client.images.generate(prompt="a cat", size="64x64", model="sd-t2i", quality="high",
                           extra_body={"num_inference_steps": 2})
    assert "quality" not in Job.objects.get(workflow="sd-t2i").params
    client.images.generate(prompt="a cat", size="64x64", model="flux.1-dev", quality="high",
                           extra_body={"num_inference_steps": 2})
    assert Job.objects.filter(workflow="flux.1-dev", options__quality="high").count() == 1


def test_a_request_whose_options_are_bad_is_refused_before_its_row_is_written(alice, store) -> None:
    """The options are checked as one Options before the job's row exists (a deadline the engine would
    refuse, e.g. the images route's IMAGE_WAIT_S set out of range): a 400 naming the field, no row, no
    reservation, and so no row whose options cannot be read back (Job.request_options)."""
    from onepiece_platform.jobs import services

    user, _, _ = alice
    small = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}
    for deadline in (0.0, 30 * 86400.0):
        with pytest.raises(services.Invalid) as err:
            services.submit(user, "flux.1-dev", {**small, "quality": "high"}, {}, deadline_s=deadline)
        assert (err.value.field, err.value.status) == ("deadline_s", 400)
    assert not Job.objects.exists()
    job = services.submit(user, "flux.1-dev", {**small, "quality": "high"}, {}, deadline_s=60.0).job
    assert job.options == {"quality": "high"} and job.deadline_s == 60.0  # the deadline: the row's column
    assert job.request_options() == Options(deadline_s=60.0, quality="high")
