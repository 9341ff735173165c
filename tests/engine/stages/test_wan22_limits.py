"""Wan2.2's limits and defaults come from the model folder; every request over a limit is a 400 at intake
naming the field, before anything runs (engine.proxy.intake.Intake, the Proxy's and the platform's one
intake)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

A14B = ("wan2.2-t2v-a14b", "wan2.2-i2v-a14b")
ALL = (*A14B, "wan2.2-ti2v-5b")


def _intake(tiny_models: dict[str, Path], bound: bool = True) -> Any:
    from engine.proxy.intake import Intake
    from engine.workflow import get_workflow

    if not bound:
        return Intake()
    return Intake(limits=lambda wf: get_workflow(wf).limits_of(str(tiny_models[wf])))


def _refused(intake: Any, workflow: str, params: dict[str, Any], inputs: dict[str, bytes]) -> str:
    from engine.proxy.parsing import BadRequest

    with pytest.raises(BadRequest) as e:
        intake.submission(workflow, {"prompt": "a cat", **params}, inputs)
    assert e.value.status == 400, e.value
    return str(e.value.field)


def test_limits_come_from_the_folders_configs(tiny_models: dict[str, Path]) -> None:
    from engine.workflow import get_workflow

    for name in ALL:
        folder = tiny_models[name]
        rope = json.loads((folder / "transformer" / "config.json").read_text())["rope_max_seq_len"]
        vae = json.loads((folder / "vae" / "config.json").read_text())
        spatial = vae.get("scale_factor_spatial", 8)
        assert spatial == (16 if name.endswith("5b") else 8)  # the Wan2.2 VAE: 16x in space; A14B: Wan2.1's
        found = get_workflow(name).limits_of(str(folder))
        assert found["width"]["maximum"] == found["height"]["maximum"] == rope * 2 * spatial
        assert found["num_frames"]["maximum"] == (rope - 1) * 4 + 1
        assert "rope_max_seq_len" in found["width"]["why"]
        # the default request is the folder's serving.json, within those limits
        d = get_workflow(name).bound(found).resolve_params({"prompt": "x"})
        assert (d["width"], d["height"], d["num_frames"], d["num_inference_steps"]) == (
            (160, 96, 25, 8) if name.endswith("5b") else (112, 64, 17, 8))
        assert d["fps"] == (24 if name.endswith("5b") else 16)


def test_the_low_experts_config_bounds_the_request_too(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A14B: both transformers must run the size; the stricter one's rope_max_seq_len applies."""
    import shutil

    from engine.workflow import get_workflow

    folder = tmp_path / "a14b"
    shutil.copytree(tiny_models["wan2.2-t2v-a14b"], folder)
    cfg = folder / "transformer_2" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "rope_max_seq_len": 16}))
    found = get_workflow("wan2.2-t2v-a14b").limits_of(str(folder))
    assert found["width"]["maximum"] == 16 * 2 * 8 and found["num_frames"]["maximum"] == 15 * 4 + 1


@pytest.mark.parametrize("name", ALL)
def test_every_limit_is_a_400_at_intake_naming_the_field(name: str, tiny_models: dict[str, Path],
                                                        input_png: bytes) -> None:
    intake = _intake(tiny_models)
    image = {"image": input_png} if name != "wan2.2-t2v-a14b" else {}
    ti2v = name.endswith("5b")
    side = 1024 if ti2v else 512  # rope_max_seq_len 32 x 2x2 patches x the VAE's 16 (8) px
    multiple = 32 if ti2v else 16
    cases: list[tuple[dict[str, Any], str]] = [
        ({"width": side + multiple}, "width"),  # the loaded transformer's rope_max_seq_len
        ({"height": side + multiple}, "height"),
        ({"num_frames": 129}, "num_frames"),  # over (32 - 1) x 4 + 1 latent frames
        ({"num_frames": 6}, "num_frames"),  # num_frames - 1 divisible by 4
        ({"width": multiple + 8}, "width"),  # sides: multiples of the VAE factor x the patch
        ({"height": multiple + 8}, "height"),
        ({"width": 0}, "width"),
        ({"num_inference_steps": 101}, "num_inference_steps"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"guidance_scale": 50.5}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"fps": 61}, "fps"),
        ({"max_sequence_length": 513}, "max_sequence_length"),
        ({"seed": -1}, "seed"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x" * 4097}, "prompt"),
        ({"negative_prompt": "x" * 4097}, "negative_prompt"),
        ({"no_such_param": 1}, "no_such_param"),
    ]
    if name in A14B:
        cases += [({"guidance_scale_2": 50.5}, "guidance_scale_2"), ({"guidance_scale_2": -1.0}, "guidance_scale_2")]
    else:  # one transformer: no second guidance
        cases += [({"guidance_scale_2": 2.0}, "guidance_scale_2")]
    for params, field in cases:
        assert _refused(intake, name, params, image) == field, params
    if image:
        if name == "wan2.2-i2v-a14b":  # the 5B model's image is optional: without one it is text to video
            assert _refused(intake, name, {}, {}) == "image"
        else:
            intake.submission(name, {"prompt": "a cat"}, {})
        assert _refused(intake, name, {}, {"image": b"not an image"}) == "image"
    else:
        assert _refused(intake, name, {}, {"image": input_png}) == "image"
    # the published model's own limits (no folder known): frames of at most 1280x720 (the 5B: 1280x704)
    static = _intake(tiny_models, bound=False)
    assert _refused(static, name, {"width": 1280, "height": 736}, image) == "size"
    # the largest the tiny model runs is accepted (the 5B's square 1024 px is over its pixel limit), and so is
    # the default request
    intake.submission(name, {"prompt": "a cat", "width": side, "height": 512, "num_frames": 125}, image)
    intake.submission(name, {"prompt": "a cat", "width": 512, "height": side if not ti2v else 864}, image)
    intake.submission(name, {"prompt": "a cat"}, image)


def test_warm_up_fits_every_loaded_model(tiny_models: dict[str, Path]) -> None:
    from engine.workflow import get_workflow

    for name in ALL:
        spec = get_workflow(name).bound(get_workflow(name).limits_of(str(tiny_models[name])))
        params, inputs = spec.warm_up_request()
        spec.validate_request(params, inputs)
