"""Workflow specs: graphs, parameter validation, tensor rules, cost estimates (torch-free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.workflow import InvalidRequest, InvalidTensor, get_workflow, workflows
from engine.workflow.specs.common import fit_linear


def test_both_workflows_are_registered_with_their_stage_chains() -> None:
    assert set(workflows()) >= {"wan2.1-i2v", "sd-t2i"}
    assert get_workflow("wan2.1-i2v").route() == [
        "text_encode", "image_encode", "vae_encode", "denoise", "vae_decode", "video_encode"]
    assert get_workflow("sd-t2i").route() == ["text_encode", "denoise", "vae_decode", "image_encode"]
    with pytest.raises(KeyError, match="known"):
        get_workflow("nope")


def test_specs_import_without_torch() -> None:
    code = ("import sys; import engine.workflow, engine.workflow.message, engine.stages.base, engine.stages.layout;"
            "engine.workflow.workflows(); print([m for m in ('torch','numpy','diffusers') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_carried_values_follow_the_dag() -> None:
    w = get_workflow("wan2.1-i2v")
    # The image skips image_encode's output list but vae_encode still needs it.
    assert w.carried_after("text_encode") == ["image", "negative_prompt_embeds", "prompt_embeds"]
    assert w.carried_after("vae_encode") == [
        "condition", "image_embeds", "latents", "negative_prompt_embeds", "prompt_embeds"]
    assert w.carried_after("vae_decode") == ["frames"]
    assert w.carried_after("video_encode") == ["video"]


def test_defaults_are_filled_and_types_coerced() -> None:
    p = get_workflow("wan2.1-i2v").resolve_params({"prompt": "a cat", "guidance_scale": 4})
    assert p["num_frames"] == 81 and p["height"] == 480 and p["guidance_scale"] == 4.0


WAN_BAD = [
    ({"num_frames": 0}, "num_frames", ">= 1"),
    ({"num_frames": -5}, "num_frames", ">= 1"),
    ({"num_frames": 10}, "num_frames", "divisible by 4"),
    ({"num_frames": 1001}, "num_frames", "<= 129"),
    ({"num_inference_steps": 0}, "num_inference_steps", ">= 1"),
    ({"num_inference_steps": 1000}, "num_inference_steps", "<= 100"),
    ({"height": 2048}, "height", "<= 1280"),
    ({"height": 1280, "width": 1280}, "size", "pixels"),
    ({"width": 100}, "width", "multiple of 16"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({"prompt": None}, "prompt", "must not be empty"),
    ({"num_frames": "9"}, "num_frames", "integer"),
    ({"frames": 9}, "frames", "unknown parameter"),
]


@pytest.mark.parametrize(("change", "field", "text"), WAN_BAD)
def test_wan_rejects_bad_parameters(change: dict[str, object], field: str, text: str) -> None:
    with pytest.raises(InvalidRequest, match=text) as exc:
        get_workflow("wan2.1-i2v").resolve_params({"prompt": "a cat", **change})
    assert exc.value.field == field


@pytest.mark.parametrize(("change", "field"), [
    ({"prompt": ""}, "prompt"), ({"num_inference_steps": 151}, "num_inference_steps"),
    ({"height": 2048}, "height"), ({"width": 60}, "width"), ({"height": 100}, "height"),
])
def test_sd_rejects_bad_parameters(change: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        get_workflow("sd-t2i").resolve_params({"prompt": "a cat", **change})
    assert exc.value.field == field


def test_tensor_rules_check_dtype_rank_derived_and_bound_dims() -> None:
    w = get_workflow("wan2.1-i2v")
    p = w.resolve_params({"prompt": "a", "height": 32, "width": 32, "num_frames": 5})
    w.check_tensor("latents", "float32", (1, 16, 2, 4, 4), p, "float32")
    w.check_tensor("frames", "uint8", (5, 32, 32, 3), p, "float32")
    with pytest.raises(InvalidTensor, match="T_lat"):
        w.check_tensor("latents", "float32", (1, 16, 3, 4, 4), p, "float32")
    with pytest.raises(InvalidTensor, match="dtype"):
        w.check_tensor("prompt_embeds", "float32", (1, 512, 32), p, "bfloat16")
    bound: dict[str, int] = {}
    w.check_tensor("prompt_embeds", "float32", (1, 512, 32), p, "float32", bound)
    with pytest.raises(InvalidTensor, match="D_text"):
        w.check_tensor("negative_prompt_embeds", "float32", (1, 512, 64), p, "float32", bound)
    with pytest.raises(InvalidTensor, match="rank"):
        w.check_tensor("frames", "uint8", (5, 32, 32), p, "float32")


def test_cost_grows_with_resolution_frames_and_steps() -> None:
    w = get_workflow("wan2.1-i2v")
    base = w.resolve_params({"prompt": "a"})
    cost = w.estimate_gpu_seconds(base)
    assert 500 < cost < 3000  # the 480p/81-frame/50-step prior: ~20 GPU-minutes
    assert w.estimate_gpu_seconds({**base, "num_inference_steps": 25}) < cost
    assert w.estimate_gpu_seconds({**base, "num_frames": 41}) < cost
    assert w.estimate_gpu_seconds({**base, "height": 240, "width": 416}) < cost
    sd = get_workflow("sd-t2i")
    p = sd.resolve_params({"prompt": "a"})
    assert sd.estimate_cost(p).keys() == {"text_encode", "denoise", "vae_decode", "image_encode"}
    assert sd.estimate_gpu_seconds({**p, "num_inference_steps": 100}) > sd.estimate_gpu_seconds(p)


def test_fit_linear_recovers_a_line() -> None:
    fixed, slope = fit_linear([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)])
    assert fixed == pytest.approx(1.0) and slope == pytest.approx(2.0)


def test_clip_rules_belong_to_the_video_specs() -> None:
    wan = get_workflow("wan2.1-t2v")
    assert wan.frame_step == 4
    assert [wan.frames_for(s) for s in (0, 1, 2, 5)] == [1, 17, 33, 81]  # 16 fps: 4k + 1 frames
    assert wan.frames_for(1, fps=8) == 9
    assert wan.clip_seconds({"num_frames": 81, "fps": 16}) == 5.0 and wan.clip_seconds({"num_frames": 17}) == 1.0
    with pytest.raises(ValueError):
        get_workflow("sd-t2i").frames_for(1)


def test_every_workflow_has_a_valid_warm_up_request() -> None:
    for name, spec in workflows().items():
        params, inputs = spec.warm_up_request()
        assert params, name
        resolved = spec.validate_request(params, inputs)
        assert resolved["num_inference_steps"] == 1
    assert list(get_workflow("wan2.1-i2v").warm_up_request()[1]) == ["image"]


def test_extra_and_unreadable_inputs_are_refused_by_the_spec() -> None:
    wan = get_workflow("wan2.1-i2v")
    params = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5}
    with pytest.raises(InvalidRequest, match="takes no input") as exc:
        wan.validate_request(params, {"image": b"", "mask": b""})
    assert exc.value.field == "mask"
    with pytest.raises(InvalidRequest, match="not a readable image"):
        wan.validate_request(params, {"image": b"GIF89a..."})
