"""On CUDA (bf16 experts, float32 VAE), the two-expert staged run still equals the one-call pipeline loaded the
same way: UniPC's history stays float32 when the experts predict in bf16, so the state crosses unchanged.

Skipped without a GPU (as tests/engine/stages/test_bit_identical_cuda.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_wan22_a14b_on_cuda_matches_the_bf16_pipeline(tiny_models: dict[str, Path]) -> None:
    from diffusers import AutoencoderKLWan, WanPipeline

    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    name = "wan2.2-t2v-a14b"
    params = dict(prompt="a cat on the moon", height=64, width=64, num_frames=9, num_inference_steps=4)
    runner = LocalRunner(name, tiny_models[name], "cuda")
    captured: dict[str, np.ndarray] = {}
    original = runner.executors["vae_decode"].run

    def spy(inputs: Any, p: Any, ctx: Any) -> Any:
        out = original(inputs, p, ctx)
        captured["frames"] = out["frames"].cpu().numpy().copy()
        return out

    runner.executors["vae_decode"].run = spy  # type: ignore[method-assign]
    runner.run(get_workflow(name).resolve_params({**params, "seed": 5}), {})
    folder = tiny_models[name]
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch.bfloat16).to("cuda")
    frames = pipe(generator=torch.Generator().manual_seed(5), output_type="pil", **params).frames[0]
    np.testing.assert_array_equal(captured["frames"], np.stack([np.asarray(f) for f in frames]))
