"""Requests through the Proxy and separate worker processes equal the one-call pipeline bit for bit."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.runtime import Cluster, logs

# the first test also starts the deployment (10 worker processes): allow for a loaded CI host
pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

SD = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3, seed=5)
WAN = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=2, seed=5)


def test_sd_request_equals_the_pipeline(one_node: Cluster, tiny_models: dict[str, Path]) -> None:
    import torch
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    uid = one_node.submit("sd-t2i", SD)
    assert len(uid) == 32 and int(uid, 16) >= 0
    done = one_node.wait(uid, {"completed", "failed"})
    assert done["state"] == "completed", (done, logs(one_node, "sd-t2i.denoise.0"))
    assert done["progress"] == 100
    status, png, headers = one_node.call("GET", f"/v1/requests/{uid}/result")
    assert status == 200 and headers["Content-Type"] == "image/png"
    served = np.asarray(Image.open(io.BytesIO(png)))

    pipe = StableDiffusionPipeline.from_pretrained(tiny_models["sd-t2i"])
    kwargs = {k: v for k, v in SD.items() if k != "seed"}
    image = pipe(generator=torch.Generator().manual_seed(SD["seed"]), output_type="pil", **kwargs).images[0]
    reference = np.asarray(image)
    assert served.shape == reference.shape == (64, 64, 3) and served.std() > 1.0
    np.testing.assert_array_equal(served, reference)

    types = [e["type"] for e in one_node.events(uid)]
    assert types[0] == "accepted" and types[-1] == "completed" and types.count("completed") == 1
    started = [e["stage"] for e in one_node.events(uid) if e["type"] == "stage_started"]
    assert started == ["text_encode", "denoise", "vae_decode", "image_encode"]
    assert any(e["type"] == "progress" and e["stage"] == "denoise" for e in one_node.events(uid))


def test_wan_request_equals_the_one_call_run(one_node: Cluster, tiny_models: dict[str, Path],
                                            input_png: bytes) -> None:
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    uid = one_node.submit("wan2.1-i2v", WAN, {"image": input_png})
    done = one_node.wait(uid, {"completed", "failed"})
    assert done["state"] == "completed", done
    status, mp4, headers = one_node.call("GET", f"/v1/requests/{uid}/result")
    assert status == 200 and headers["Content-Type"] == "video/mp4" and mp4[4:8] == b"ftyp"
    # LocalRunner is the one-call pipeline whose frames tests/engine/stages proves equal to diffusers'.
    runner = LocalRunner("wan2.1-i2v", tiny_models["wan2.1-i2v"], "cpu")
    reference = runner.run(get_workflow("wan2.1-i2v").resolve_params(WAN), {"image": input_png})
    assert mp4 == bytes(reference.outputs["video"])
    started = [e["stage"] for e in one_node.events(uid) if e["type"] == "stage_started"]
    assert started == get_workflow("wan2.1-i2v").route()


def test_bad_requests_are_refused_before_anything_runs(one_node: Cluster) -> None:
    status, doc, _ = one_node.call("POST", "/v1/requests", {"workflow": "sd-t2i", "params": {"height": 65}})
    assert status == 400 and doc["field"] in {"prompt", "height"}
    status, doc, _ = one_node.call("POST", "/v1/requests", {"workflow": "nope", "params": {}})
    assert status == 400 and doc["field"] == "workflow"
    status, doc, _ = one_node.call("POST", "/v1/requests",
                                  {"workflow": "wan2.1-i2v", "params": {"prompt": "a cat"},
                                   "inputs": {"image": "bm90IGFuIGltYWdl"}})
    assert status == 400 and doc["field"] == "image"
    status, doc, _ = one_node.call("GET", "/v1/requests/" + "0" * 32)
    assert status == 404
    status, doc, _ = one_node.call("GET", "/livez")
    assert status == 200


