"""On CUDA (bf16), the staged run still equals the one-call pipeline loaded the same way.

Skipped without a GPU. The pipeline is loaded as the Wan model card runs it:
bf16 everywhere except Wan's VAE, which stays float32 (as the stages load it).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_wan_on_cuda_matches_the_bf16_pipeline(tiny_models: dict[str, Path], input_png: bytes) -> None:
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    from engine.stages.components import decode_image
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    params = dict(prompt="a cat on the moon", height=64, width=64, num_frames=9, num_inference_steps=3)
    runner = LocalRunner("wan2.1-i2v", tiny_models["wan2.1-i2v"], "cuda")
    captured: dict[str, np.ndarray] = {}
    original = runner.executors["vae_decode"].run

    def spy(inputs, p, ctx):  # type: ignore[no-untyped-def]
        out = original(inputs, p, ctx)
        captured["frames"] = out["frames"].cpu().numpy().copy()
        return out

    runner.executors["vae_decode"].run = spy  # type: ignore[method-assign]
    result = runner.run(get_workflow("wan2.1-i2v").resolve_params({**params, "seed": 5}), {"image": input_png})
    assert result.stats["text_encode"].payload_bytes < 2 * 512 * 32 * 4  # embeddings travel as bf16
    folder = tiny_models["wan2.1-i2v"]
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch.bfloat16).to("cuda")
    frames = pipe(image=decode_image(input_png), generator=torch.Generator().manual_seed(5), output_type="pil",
                  **params).frames[0]
    np.testing.assert_array_equal(captured["frames"], np.stack([np.asarray(f) for f in frames]))


def test_sd_on_cuda_matches_the_bf16_pipeline(tiny_models: dict[str, Path]) -> None:
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    params = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3)
    runner = LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cuda")
    result = runner.run(get_workflow("sd-t2i").resolve_params({**params, "seed": 5}), {})
    staged = np.asarray(Image.open(io.BytesIO(bytes(result.outputs["image"]))))
    pipe = StableDiffusionPipeline.from_pretrained(tiny_models["sd-t2i"], torch_dtype=torch.bfloat16).to("cuda")
    image = pipe(generator=torch.Generator().manual_seed(5), output_type="pil", **params).images[0]
    np.testing.assert_array_equal(staged, np.asarray(image))
