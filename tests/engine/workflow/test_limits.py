"""Limits and defaults come from the loaded model folder (engine.workflow.limits), not from the spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.workflow import InvalidRequest, get_workflow
from engine.workflow import limits as lim


def test_the_tiny_wan_transformer_bounds_sides_and_frames(tiny_models: dict[str, Path]) -> None:
    for name in ("wan2.1-t2v", "wan2.1-i2v"):
        spec = get_workflow(name)
        cfg = json.loads((tiny_models[name] / "transformer" / "config.json").read_text())
        rope = cfg["rope_max_seq_len"]
        found = spec.limits_of(str(tiny_models[name]))
        # rope_max_seq_len patches of 2x2 latent pixels of 8x8 pixels per side; 4 frames per latent frame
        assert found["width"]["maximum"] == found["height"]["maximum"] == rope * 2 * 8
        assert found["num_frames"]["maximum"] == (rope - 1) * 4 + 1
        bound = spec.bound(found)
        # the static spec would accept what the model cannot run (the default 832x480 did, then failed in
        # the transformer with "shape '[1, 1, 52, -1]' is invalid")
        spec.resolve_params({"prompt": "x", "width": 832, "height": 480})
        with pytest.raises(InvalidRequest, match="rope_max_seq_len") as e:
            bound.resolve_params({"prompt": "x", "width": 832, "height": 480})
        assert e.value.field == "width"
        with pytest.raises(InvalidRequest) as e:
            bound.resolve_params({"prompt": "x", "num_frames": found["num_frames"]["maximum"] + 4})
        assert e.value.field == "num_frames"
        # the largest the model takes is accepted, and the default request is one the model runs
        bound.resolve_params({"prompt": "x", "width": rope * 16, "height": rope * 16,
                              "num_frames": (rope - 1) * 4 + 1})
        d = bound.resolve_params({"prompt": "x"})
        assert (d["width"], d["height"], d["num_frames"]) == (224, 128, 81)  # the folder's serving.json


def test_a_folder_without_serving_defaults_shrinks_the_pipeline_default_to_fit(tiny_models: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "wan"
    shutil.copytree(tiny_models["wan2.1-t2v"], folder)
    (folder / lim.SERVING_FILE).unlink()
    spec = get_workflow("wan2.1-t2v")
    d = spec.bound(spec.limits_of(str(folder))).resolve_params({"prompt": "x"})
    # 832x480 scaled to the 512 px the transformer allows, kept a multiple of 16 and of the same shape
    assert (d["width"], d["height"], d["num_frames"]) == (512, 288, 81)
    # a full-size transformer (rope 1024) allows the spec's own bounds: nothing tightened, defaults kept
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**cfg, "rope_max_seq_len": 1024}))
    assert spec.bound(spec.limits_of(str(folder))).resolve_params({"prompt": "x"})["width"] == 832
    with pytest.raises(InvalidRequest) as e:
        spec.bound(spec.limits_of(str(folder))).resolve_params({"prompt": "x", "width": 1296})
    assert e.value.field == "width"


def test_sd_default_size_is_the_unet_sample_size_in_pixels(tiny_models: dict[str, Path]) -> None:
    spec = get_workflow("sd-t2i")
    found = spec.limits_of(str(tiny_models["sd-t2i"]))
    unet = json.loads((tiny_models["sd-t2i"] / "unet" / "config.json").read_text())
    vae = json.loads((tiny_models["sd-t2i"] / "vae" / "config.json").read_text())
    side = unet["sample_size"] * 2 ** (len(vae["block_out_channels"]) - 1)
    assert side == 64 and found["width"]["default"] == found["height"]["default"] == side
    assert spec.resolve_params({"prompt": "x"})["width"] == 512  # the spec alone: SD 1.5's size


def test_published_limits_never_widen_and_merge_to_the_strictest() -> None:
    assert lim.parse({"width": {"maximum": "9999"}}) == {}  # a malformed bound is dropped, never applied wide
    assert lim.parse(["width"]) is None
    a = {"width": {"maximum": 512, "default": 224, "why": "a"}}
    b = {"width": {"maximum": 256, "default": 256, "why": "b"}, "num_frames": {"maximum": 41, "why": "b"}}
    merged = lim.merge(a, b)
    assert merged == {"width": {"maximum": 256, "default": 224, "why": "b"}, "num_frames": {"maximum": 41, "why": "b"}}
    spec = get_workflow("wan2.1-t2v")
    # a published maximum above the spec's is ignored: the spec's bound stays
    assert spec.bound({"width": {"maximum": 5000}}).param("width").maximum == spec.param("width").maximum


def test_every_hop_must_fit_the_ring_of_the_stage_it_enters() -> None:
    from engine.proxy.intake import Intake
    from engine.proxy.parsing import BadRequest

    spec = get_workflow("wan2.1-t2v")
    params = spec.resolve_params({"prompt": "x", "width": 224, "height": 128, "num_frames": 81})
    hops = spec.hop_bytes(params)
    assert hops["video_encode"] == 81 * 128 * 224 * 3  # uint8 frames, every dimension from the request
    assert 0 < hops["denoise"] < hops["video_encode"]
    intake = Intake()
    ticket = intake.ticket(intake.submission("wan2.1-t2v", {"prompt": "x", "width": 224, "height": 128}, {}))
    intake.check_fits(ticket, 1 << 20, lambda wf, stage: 8 << 20)  # 7 MiB of frames into an 8 MiB ring
    with pytest.raises(BadRequest) as e:
        intake.check_fits(ticket, 1 << 20, lambda wf, stage: (4 << 20) if stage == "video_encode" else None)
    assert e.value.status == 413 and e.value.field == "num_frames" and "video_encode" in str(e.value)


def test_bound_defaults_stay_within_the_bounds_and_whole_floats_parse() -> None:
    spec = get_workflow("wan2.1-t2v")
    # a published default above the model's maximum is brought within it: never a 400 on an unsent field
    bound = spec.bound({"num_frames": {"maximum": 41, "default": 81}})
    assert bound.resolve_params({"prompt": "x"})["num_frames"] == 41
    assert lim.parse({"width": {"maximum": 512.0, "default": 224.0}}) == {"width": {"maximum": 512, "default": 224,
                                                                                    "why": ""}}
    assert lim.parse({"width": {"maximum": 512.5}}) == {}
