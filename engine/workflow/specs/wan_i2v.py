"""Wan2.1 image-to-video (diffusers ``WanImageToVideoPipeline``) cut into six stages.

text_encode (umT5) and image_encode (CLIP vision) -> vae_encode (first-frame
condition + initial noise) -> denoise (transformer, flow-matching UniPC) ->
vae_decode (uint8 frames) -> video_encode (mp4 bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.workflow.spec import CostModel, InvalidRequest, ParamSpec, StageSpec, TensorSpec, WorkflowSpec
from engine.workflow.specs.common import MAX_PROMPT_CHARS, require_multiple, require_pixels, require_prompt

# Wan2.1's VAE compresses 4x in time and 8x in space; its transformer patches
# 2x2 latent pixels, so pixel sizes must be multiples of 16.
TEMPORAL = 4
SPATIAL = 8
SIZE_MULTIPLE = 16
MAX_PIXELS = 1280 * 720
MAX_FRAMES = 129
MAX_STEPS = 100
_P = "engine.stages.wan"


def _derive(p: Mapping[str, Any]) -> dict[str, int]:
    return {
        "F": p["num_frames"], "H": p["height"], "W": p["width"], "L_text": p["max_sequence_length"],
        "T_lat": (p["num_frames"] - 1) // TEMPORAL + 1, "H_lat": p["height"] // SPATIAL,
        "W_lat": p["width"] // SPATIAL, "S": p["num_inference_steps"],
    }


def _check(p: Mapping[str, Any]) -> None:
    require_prompt(p)
    if (p["num_frames"] - 1) % TEMPORAL:
        raise InvalidRequest(
            "num_frames", f"num_frames - 1 must be divisible by {TEMPORAL} (e.g. 5, 9, ..., 81), got {p['num_frames']}"
        )
    require_multiple(p, "height", SIZE_MULTIPLE)
    require_multiple(p, "width", SIZE_MULTIPLE)
    require_pixels(p, MAX_PIXELS, "wan2.1-i2v")


def _tokens(d: Mapping[str, int]) -> float:
    # Latent tokens after 2x2 patching; attention makes cost superlinear, but
    # within the supported sizes a linear fit is within the measurement noise.
    return d["T_lat"] * (d["H_lat"] // 2) * (d["W_lat"] // 2)


_LATENT = (1, "C_lat", "T_lat", "H_lat", "W_lat")

SPEC = WorkflowSpec(
    name="wan2.1-i2v",
    description="Wan2.1 image-to-video: an image and a prompt to an mp4",
    request_inputs=(TensorSpec("image", kind="blob", doc="the first frame: PNG/JPEG/... bytes"),),
    stages=(
        StageSpec(
            "text_encode", f"{_P}.encoders.WanTextEncode", inputs=(),
            outputs=(TensorSpec("prompt_embeds", shape=(1, "L_text", "D_text")),
                     TensorSpec("negative_prompt_embeds", shape=(1, "L_text", "D_text"))),
            components=("tokenizer", "text_encoder"), doc="umT5 prompt and negative-prompt embeddings",
        ),
        StageSpec(
            "image_encode", f"{_P}.encoders.WanImageEncode", inputs=("image",),
            outputs=(TensorSpec("image_embeds", shape=(1, "N_img", "D_img")),),
            components=("image_processor", "image_encoder"), doc="CLIP vision penultimate hidden states",
        ),
        StageSpec(
            "vae_encode", f"{_P}.vae.WanVaeEncode", inputs=("image",),
            outputs=(TensorSpec("latents", "float32", _LATENT),
                     TensorSpec("condition", "float32", (1, "C_cond", "T_lat", "H_lat", "W_lat"))),
            components=("vae",), doc="first-frame condition (mask + VAE latents) and the initial noise",
        ),
        StageSpec(
            "denoise", f"{_P}.denoise.WanDenoise",
            inputs=("prompt_embeds", "negative_prompt_embeds", "image_embeds", "latents", "condition"),
            outputs=(TensorSpec("denoised", "float32", _LATENT),),
            components=("transformer", "scheduler"), doc="classifier-free-guided flow-matching denoising",
            cfg_parallel=True,
        ),
        StageSpec(
            "vae_decode", f"{_P}.decoders.WanVaeDecode", inputs=("denoised",),
            outputs=(TensorSpec("frames", "uint8", ("F", "H", "W", 3)),),
            components=("vae",), doc="de-normalised VAE decode to uint8 RGB frames",
        ),
        StageSpec(
            "video_encode", f"{_P}.video.WanVideoEncode", inputs=("frames",),
            outputs=(TensorSpec("video", kind="blob", doc="mp4 (H.264) bytes"),), doc="frames to mp4",
        ),
    ),
    params=(
        ParamSpec("prompt", str, None, doc="what the video shows", max_length=MAX_PROMPT_CHARS),
        ParamSpec("negative_prompt", str, "", doc="what it should not show", max_length=MAX_PROMPT_CHARS),
        ParamSpec("height", int, 480, SIZE_MULTIPLE, 1280),
        ParamSpec("width", int, 832, SIZE_MULTIPLE, 1280),
        ParamSpec("num_frames", int, 81, 1, MAX_FRAMES, doc="frames; num_frames - 1 divisible by 4"),
        ParamSpec("num_inference_steps", int, 50, 1, MAX_STEPS),
        ParamSpec("guidance_scale", float, 5.0, 0.0, 50.0),
        ParamSpec("seed", int, 0, 0, 2**63 - 1),
        ParamSpec("fps", int, 16, 1, 60),
        ParamSpec("max_sequence_length", int, 512, 1, 512),
    ),
    derive=_derive,
    check=_check,
    # Prior for Wan2.1-I2V-14B in bf16 on one H100-class GPU (480x832, 81
    # frames, 50 steps: ~26 s per guided step over 32,760 latent tokens, ~1,300
    # GPU-s in total, almost all of it denoise);
    # refit per deployment with engine.workflow.specs.common.fit_linear on
    # benchmarks/stages_profile.py measurements.
    costs={
        "text_encode": CostModel(0.3, 0.0, lambda d: 0.0),
        "image_encode": CostModel(0.1, 0.0, lambda d: 0.0),
        "vae_encode": CostModel(0.5, 2.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"]),
        "denoise": CostModel(1.0, 7.9e-4, lambda d: _tokens(d) * d["S"]),
        "vae_decode": CostModel(0.5, 4.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"]),
        "video_encode": CostModel(0.05, 0.0, lambda d: 0.0),
    },
    final_output="video",
)

