"""The staged run equals diffusers' one-call pipeline bit for bit on the same folder and seed."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.stages.staged import staged_frames

pytestmark = pytest.mark.models

WAN = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=2, seed=5)
SD = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3, seed=5)


@pytest.fixture(scope="module")
def wan_runner(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner("wan2.1-i2v", tiny_models["wan2.1-i2v"], "cpu")


@pytest.fixture(scope="module")
def sd_runner(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")


@pytest.fixture(scope="module")
def t2v_runner(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner("wan2.1-t2v", tiny_models["wan2.1-t2v"], "cpu")


def _staged_frames(runner: Any, params: dict[str, Any], png: bytes | None) -> np.ndarray:
    frames, result = staged_frames(runner, params, {} if png is None else {"image": png})
    assert bytes(result.outputs["video"])[4:8] == b"ftyp"  # the final stage really wrote an mp4
    return frames


def test_wan_staged_frames_equal_the_pipeline(
    wan_runner: Any, tiny_models: dict[str, Path], input_png: bytes
) -> None:
    import torch
    from diffusers import WanImageToVideoPipeline

    from engine.stages.components import decode_image

    staged = _staged_frames(wan_runner, WAN, input_png)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_models["wan2.1-i2v"])
    kwargs = {k: v for k, v in WAN.items() if k != "seed"}
    frames = pipe(image=decode_image(input_png), generator=torch.Generator().manual_seed(WAN["seed"]),
                  output_type="pil", **kwargs).frames[0]
    reference = np.stack([np.asarray(f) for f in frames])
    assert staged.dtype == np.uint8 and staged.shape == reference.shape == (5, 32, 32, 3)
    assert staged.std() > 1.0  # not a blank video that would match anything
    np.testing.assert_array_equal(staged, reference)
    # The seed matters: a different one changes the frames.
    assert not np.array_equal(_staged_frames(wan_runner, {**WAN, "seed": 6}, input_png), reference)


def test_wan_t2v_staged_frames_equal_the_pipeline(t2v_runner: Any, tiny_models: dict[str, Path]) -> None:
    import torch
    from diffusers import WanPipeline

    staged = _staged_frames(t2v_runner, WAN, None)
    pipe = WanPipeline.from_pretrained(tiny_models["wan2.1-t2v"])
    kwargs = {k: v for k, v in WAN.items() if k != "seed"}
    frames = pipe(generator=torch.Generator().manual_seed(WAN["seed"]), output_type="pil", **kwargs).frames[0]
    reference = np.stack([np.asarray(f) for f in frames])
    assert staged.dtype == np.uint8 and staged.shape == reference.shape == (5, 32, 32, 3)
    assert staged.std() > 1.0
    np.testing.assert_array_equal(staged, reference)
    assert not np.array_equal(_staged_frames(t2v_runner, {**WAN, "seed": 6}, None), reference)
    # The prompt reaches the video: another prompt, other frames.
    assert not np.array_equal(_staged_frames(t2v_runner, {**WAN, "prompt": "a red car in the snow"}, None), reference)


def _staged_png(runner: Any, params: dict[str, Any]) -> np.ndarray:
    from PIL import Image

    from engine.workflow import get_workflow

    result = runner.run(get_workflow("sd-t2i").resolve_params(params), {})
    return np.asarray(Image.open(io.BytesIO(bytes(result.outputs["image"]))))


def test_sd_staged_pixels_equal_the_pipeline(sd_runner: Any, tiny_models: dict[str, Path]) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    staged = _staged_png(sd_runner, SD)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_models["sd-t2i"])
    kwargs = {k: v for k, v in SD.items() if k != "seed"}
    image = pipe(generator=torch.Generator().manual_seed(SD["seed"]), output_type="pil", **kwargs).images[0]
    reference = np.asarray(image)
    assert staged.shape == reference.shape == (64, 64, 3)
    assert staged.std() > 1.0
    np.testing.assert_array_equal(staged, reference)
    assert not np.array_equal(_staged_png(sd_runner, {**SD, "seed": 6}), reference)


def test_stages_hand_on_only_what_later_stages_need(wan_runner: Any, input_png: bytes) -> None:
    from engine.workflow import get_workflow

    result = wan_runner.run(get_workflow("wan2.1-i2v").resolve_params(WAN), {"image": input_png})
    s = result.stats
    # uint8 frames, not float32: 5 x 32 x 32 x 3 bytes plus framing.
    assert 15360 <= s["vae_decode"].out_bytes < 15360 + 2048
    assert s["video_encode"].out_bytes < s["vae_decode"].out_bytes
    assert set(result.header.timestamps) == set(get_workflow("wan2.1-i2v").route())
