"""Wan2.2 text-image-to-video 5B cut into five stages: text_encode (umT5) and vae_encode (the first frame's
latents through the Wan2.2 VAE + the initial noise) -> denoise (one transformer; the first latent frame held to
the image at every step, per-token timesteps) -> vae_decode -> video_encode.

The image is optional. With one, the stages are diffusers' ``WanImageToVideoPipeline`` with
``expand_timesteps`` over the Wan2.2-TI2V-5B folder; without one, ``WanPipeline`` over the same folder (text
to video: vae_encode only draws the noise, as ``WanPipeline.prepare_latents`` does, and hands on an empty
``condition``; denoise's mask is all ones, every token at the step's timestep).

The Wan2.2 VAE compresses 16x in space (4x in time); with the transformer's 2x2 patches, sides are multiples of
32. The release samples 1280x704, 121 frames at 24 fps."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from engine.workflow.spec import CostModel, ParamSpec, StageSpec, TensorSpec
from engine.workflow.specs import wan22_common as w22
from engine.workflow.specs import wan_common as wan
from engine.workflow.specs.common import MAX_PROMPT_CHARS

SPATIAL = 16
SIZE_MULTIPLE = 32
MAX_PIXELS = 1280 * 704

PARAMS = (
    ParamSpec("prompt", str, None, doc="what the video shows", max_length=MAX_PROMPT_CHARS),
    ParamSpec("negative_prompt", str, "", doc="what it should not show", max_length=MAX_PROMPT_CHARS),
    ParamSpec("height", int, 704, SIZE_MULTIPLE, 1280),
    ParamSpec("width", int, 1280, SIZE_MULTIPLE, 1280),
    ParamSpec("num_frames", int, 121, 1, wan.MAX_FRAMES, doc="frames; num_frames - 1 divisible by 4"),
    ParamSpec("num_inference_steps", int, 50, 1, wan.MAX_STEPS),
    ParamSpec("guidance_scale", float, 5.0, 0.0, 50.0),
    ParamSpec("seed", int, 0, 0, 2**63 - 1),
    ParamSpec("fps", int, 24, 1, 60),
    ParamSpec("max_sequence_length", int, 512, 1, 512),
)


def derive(p: Mapping[str, Any]) -> dict[str, int]:
    return wan.derive(p, SPATIAL)


SPEC = wan.wan_workflow(
    "wan2.2-ti2v-5b", "Wan2.2 TI2V 5B: a prompt, and optionally a first frame, to an mp4 (one transformer, "
    "the Wan2.2 VAE)",
    request_inputs=(TensorSpec("image", kind="blob", media="image", optional=True,
                               doc="the first frame: PNG/JPEG/... bytes; without it, text to video"),),
    middle=(
        StageSpec(
            "vae_encode", "engine.stages.wan.experts.Wan22VaeEncode", inputs=("image",),
            outputs=(TensorSpec("latents", "float32", wan.LATENT),
                     TensorSpec("condition", "float32", (1, "C_lat", 1, "H_lat", "W_lat"), optional=True,
                                doc="empty without an image")),
            doc="the first frame's normalised Wan2.2-VAE latents (if any) and the initial noise",
        ),
        StageSpec(
            "denoise", "engine.stages.wan.experts.Wan22TI2VDenoise",
            inputs=("prompt_embeds", "negative_prompt_embeds", "latents", "condition"),
            outputs=(TensorSpec("denoised", "float32", wan.LATENT),),
            doc="classifier-free-guided flow matching, the first latent frame held to the image",
            # step-level batches, with and without an image in one call: each item its solo bytes
            # (tests/engine/stages/test_wan22_batching.py); default from benchmarks/wan22_batching.py
            max_batch=w22.MAX_BATCH,
        ),
    ),
    # Prior for Wan2.2-TI2V-5B in bf16 on one H100-class GPU: about a third of a 14B step per token (5B
    # parameters) over 16x-compressed latents; refit per deployment as for wan2.1-i2v.
    costs={"vae_encode": CostModel(0.5, 2.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"], growth=2.0),
           "denoise": CostModel(1.0, 2.8e-4, wan.tokens, steps=lambda d: d["S"], growth=2.0)},
    params=PARAMS, derive=derive, check=wan.checker("wan2.2-ti2v-5b", SIZE_MULTIPLE, MAX_PIXELS),
    model_limits=partial(wan.model_limits, params=PARAMS, multiple=SIZE_MULTIPLE),
)
