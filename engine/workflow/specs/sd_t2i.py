"""Stable Diffusion 1.x text-to-image (diffusers ``StableDiffusionPipeline``) in four stages.

text_encode (CLIP text) -> denoise (UNet; the initial noise is drawn here, from
the request's seed, because EulerDiscreteScheduler draws more noise at every
step from the same generator) -> vae_decode (uint8 pixels) -> image_encode (png).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.workflow import limits
from engine.workflow.spec import CostModel, ParamSpec, StageSpec, TensorSpec, WorkflowSpec
from engine.workflow.specs.common import (
    MAX_PROMPT_CHARS,
    require_multiple,
    require_pixels,
    require_prompt,
)

SIZE_MULTIPLE = 8
MAX_PIXELS = 1024 * 1024
MAX_STEPS = 150
_P = "engine.stages.sd"


def _derive(p: Mapping[str, Any]) -> dict[str, int]:
    # Latent sizes are not derived here: they depend on the VAE's depth
    # (8x for SD 1.x, 2x for the tiny test model), so they are model dims.
    return {"H": p["height"], "W": p["width"], "S": p["num_inference_steps"], "P": p["height"] * p["width"]}


def _check(p: Mapping[str, Any]) -> None:
    require_prompt(p)
    require_multiple(p, "height", SIZE_MULTIPLE)
    require_multiple(p, "width", SIZE_MULTIPLE)
    require_pixels(p, MAX_PIXELS, "sd-t2i")


def _model_limits(configs: limits.Configs) -> limits.Overrides:
    """The default size is the UNet's ``sample_size`` in pixels, as diffusers' pipeline picks it
    (``unet.config.sample_size * vae_scale_factor``; the VAE scales by 2 per block after the first):
    512x512 for SD 1.5, 64x64 for the tiny test model."""
    unet, vae = configs.get("unet") or {}, configs.get("vae") or {}
    sample, blocks = unet.get("sample_size"), vae.get("block_out_channels")
    if not isinstance(sample, int) or not isinstance(blocks, list) or not blocks:
        return {}
    side = limits.fit_default(sample * 2 ** (len(blocks) - 1), 1024, SIZE_MULTIPLE)
    return {"height": {"default": side}, "width": {"default": side}}


SPEC = WorkflowSpec(
    name="sd-t2i",
    description="Stable Diffusion 1.x text-to-image: a prompt to a png",
    stages=(
        StageSpec(
            "text_encode", f"{_P}.encoders.SDTextEncode", inputs=(),
            outputs=(TensorSpec("prompt_embeds", shape=(1, "L_text", "D_text")),
                     TensorSpec("negative_prompt_embeds", shape=(1, "L_text", "D_text"))),
            doc="CLIP text embeddings of prompt and negative prompt",
            # requests encode together (engine.stages.base.BatchedCallStage), each item its solo bytes
            # (tests/engine/stages/test_light_batching.py); benchmarks/light_batching.md has the gain
            max_batch=8,
        ),
        StageSpec(
            "denoise", f"{_P}.denoise.SDDenoise", inputs=("prompt_embeds", "negative_prompt_embeds"),
            outputs=(TensorSpec("denoised", shape=(1, "C_lat", "H_lat", "W_lat")),),
            doc="initial noise from the seed, guided UNet denoising",
            # step-level batches of guided requests: their solo bytes (tests/engine/stages/test_step_batching.py)
            # up to 7 requests (14 UNet rows), each request's 2-D linears run alone (engine.stages.invariant:
            # on AVX-512 MKL's sgemm differs from 2 rows on); 8 (16 rows) differ in the last bits on one thread
            # (oneDNN picks another kernel there; equal on two threads), at 64-256 px alike, on the earlier
            # host and an AVX-512 one (benchmarks/batch_equality.py), so 7 is the default. The tiny model at
            # 64x64 on one thread gave 1.18x the requests/s at 2, 1.34x at 4, 1.51x at 8 (the earlier host;
            # 1.45x, 1.86x, 2.27x on the AVX-512 one), and nothing at 128x128 (compute-bound): a bigger batch
            # helps when small requests queue
            max_batch=7,
        ),
        StageSpec(
            "vae_decode", f"{_P}.decoders.SDVaeDecode", inputs=("denoised",),
            outputs=(TensorSpec("pixels", "uint8", (1, "H", "W", 3)),),
            doc="VAE decode to uint8 RGB pixels",
        ),
        StageSpec(
            "image_encode", f"{_P}.image.SDImageEncode", inputs=("pixels",),
            outputs=(TensorSpec("image", kind="blob", doc="png bytes"),), doc="pixels to png",
        ),
    ),
    params=(
        ParamSpec("prompt", str, None, doc="what the image shows", max_length=MAX_PROMPT_CHARS),
        ParamSpec("negative_prompt", str, None, doc="what it should not show", max_length=MAX_PROMPT_CHARS),
        ParamSpec("height", int, 512, 64, 1024),
        ParamSpec("width", int, 512, 64, 1024),
        ParamSpec("num_inference_steps", int, 50, 1, MAX_STEPS),
        ParamSpec("guidance_scale", float, 7.5, 0.0, 50.0),
        ParamSpec("seed", int, 0, 0, 2**63 - 1),
    ),
    derive=_derive,
    check=_check,
    # Prior for SD 1.5 fp16/bf16 on one H100-class GPU: ~25 guided steps/s at
    # 512x512; refit from benchmarks/stages_profile.py measurements.
    costs={
        "text_encode": CostModel(0.01, 0.0, lambda d: 0.0),
        "denoise": CostModel(0.05, 1.5e-7, lambda d: d["P"], steps=lambda d: d["S"], growth=2.0),
        "vae_decode": CostModel(0.01, 1.5e-7, lambda d: d["P"], growth=2.0),  # its mid block attends
        "image_encode": CostModel(0.005, 2.0e-8, lambda d: d["P"]),
    },
    final_output="image",
    default=True,  # /v1/images/generations without a model
    warm_up={"prompt": "warm-up", "height": 64, "width": 64, "num_inference_steps": 1},
    model_limits=_model_limits, limit_components=("unet", "vae"),
)
