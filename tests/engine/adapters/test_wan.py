"""Wan2.1 with LoRA adapters: the staged frames equal the one-call pipeline's after ``load_lora_weights`` +
``set_adapters`` (text-to-video with one and two adapters, image-to-video with one), same seed, same threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.stages.staged import staged_frames

pytestmark = pytest.mark.models

WAN = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=2, seed=5)


def _staged(runner: Any, lora: list[dict[str, Any]] | None, inputs: dict[str, bytes]) -> np.ndarray:
    return staged_frames(runner, {**WAN, **({"lora": lora} if lora else {})}, inputs)[0]


def _frames(pipe: Any, **kw: Any) -> np.ndarray:
    import torch

    args = {k: v for k, v in WAN.items() if k != "seed"}
    out = pipe(generator=torch.Generator().manual_seed(WAN["seed"]), output_type="pil", **args, **kw).frames[0]
    return np.stack([np.asarray(f) for f in out])


@pytest.mark.parametrize("workflow", ["wan2.1-t2v", "wan2.1-i2v"])
def test_wan_staged_frames_with_adapters_equal_the_pipeline(workflow: str, tiny_models: dict[str, Path],
                                                            adapters: Any, input_png: bytes) -> None:
    import diffusers

    from engine.stages.components import decode_image
    from engine.stages.runner import LocalRunner

    runner = LocalRunner(workflow, tiny_models[workflow], "cpu")
    pipe = getattr(diffusers, "WanPipeline" if workflow == "wan2.1-t2v" else "WanImageToVideoPipeline") \
        .from_pretrained(tiny_models[workflow])
    inputs, kw = ({}, {}) if workflow == "wan2.1-t2v" else ({"image": input_png}, {"image": decode_image(input_png)})
    names = ["wave", "swell"] if workflow == "wan2.1-t2v" else ["still"]
    try:
        base = _frames(pipe, **kw)
        for n in names:
            pipe.load_lora_weights(str(adapters.file(adapters.get(n))), adapter_name=n)
        pipe.set_adapters(names[:1], [0.9])
        refs = {1: _frames(pipe, **kw)}
        if len(names) == 2:
            pipe.set_adapters(names, [0.9, -0.6])
            refs[2] = _frames(pipe, **kw)
        assert not np.array_equal(refs[1], base)
        got1 = _staged(runner, [{"name": names[0], "scale": 0.9}], inputs)
        np.testing.assert_array_equal(got1, refs[1])
        if 2 in refs:
            assert not np.array_equal(refs[2], refs[1])
            got2 = _staged(runner, [{"name": names[0], "scale": 0.9}, {"name": names[1], "scale": -0.6}], inputs)
            np.testing.assert_array_equal(got2, refs[2])
        np.testing.assert_array_equal(_staged(runner, None, inputs), base)  # adapters loaded, none asked for
    finally:
        hot = runner.executors["denoise"].hot
        if hot is not None:
            hot.close()
