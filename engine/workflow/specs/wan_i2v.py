"""Wan2.1 image-to-video (diffusers ``WanImageToVideoPipeline``) cut into six stages.

text_encode (umT5) and image_encode (CLIP vision) -> vae_encode (first-frame
condition + initial noise) -> denoise (transformer, flow-matching UniPC) ->
vae_decode (uint8 frames) -> video_encode (mp4 bytes).
"""

from __future__ import annotations

from engine.workflow.spec import CostModel, StageSpec, TensorSpec
from engine.workflow.specs import wan_common as wan

SPEC = wan.wan_workflow(
    "wan2.1-i2v", "Wan2.1 image-to-video: an image and a prompt to an mp4", default=True,  # /v1/videos with an image
    request_inputs=(TensorSpec("image", kind="blob", media="image", doc="the first frame: PNG/JPEG/... bytes"),),
    middle=(
        StageSpec(
            "image_encode", f"{wan.P}.encoders.WanImageEncode", inputs=("image",),
            outputs=(TensorSpec("image_embeds", shape=(1, "N_img", "D_img")),),
            doc="CLIP vision penultimate hidden states",
        ),
        StageSpec(
            "vae_encode", f"{wan.P}.vae.WanVaeEncode", inputs=("image",),
            outputs=(TensorSpec("latents", "float32", wan.LATENT),
                     TensorSpec("condition", "float32", (1, "C_cond", "T_lat", "H_lat", "W_lat"))),
            doc="first-frame condition (mask + VAE latents) and the initial noise",
        ),
        StageSpec(
            "denoise", f"{wan.P}.denoise.WanI2VSteppedDenoise",
            inputs=("prompt_embeds", "negative_prompt_embeds", "image_embeds", "latents", "condition"),
            outputs=(TensorSpec("denoised", "float32", wan.LATENT),),
            doc="classifier-free-guided flow-matching denoising",
            cfg_parallel=True,
            # step-level batches: each item its solo bytes (tests/engine/stages/test_wan_batching.py, each
            # sample's linears, SiLUs and convolutions apart); 4 requests 2.4x the requests/s of one at a
            # time on the tiny model at 32x32x5, 2.2x at 64x64x9 (8: 2.7x, 2.4x)
            max_batch=4,
        ),
    ),
    # Prior for Wan2.1-I2V-14B in bf16 on one H100-class GPU (480x832, 81
    # frames, 50 steps: ~26 s per guided step over 32,760 latent tokens, ~1,300
    # GPU-s in total, almost all of it denoise);
    # refit per deployment with engine.workflow.specs.common.fit_linear on
    # benchmarks/stages_profile.py measurements.
    costs={
        "image_encode": CostModel(0.1, 0.0, lambda d: 0.0),
        "vae_encode": CostModel(0.5, 2.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"], growth=2.0),
        "denoise": CostModel(1.0, 7.9e-4, wan.tokens, steps=lambda d: d["S"], growth=2.0),
    },
)
