"""Wan2.1 text-to-video (diffusers ``WanPipeline``, the Wan2.1-T2V-1.3B/14B layout) cut into four stages.

text_encode (umT5) -> denoise (initial noise from the seed, transformer,
flow-matching UniPC) -> vae_decode (uint8 frames) -> video_encode (mp4 bytes).
text_encode, vae_decode and video_encode are image-to-video's stages: the same
code on the same components (both releases ship umt5-xxl and the Wan VAE).
"""

from __future__ import annotations

from engine.workflow.spec import CostModel, StageSpec, TensorSpec
from engine.workflow.specs import wan_common as wan

SPEC = wan.wan_workflow(
    "wan2.1-t2v", "Wan2.1 text-to-video: a prompt to an mp4", default=True,  # /v1/videos without an image
    middle=(
        StageSpec(
            "denoise", f"{wan.P}.denoise.WanT2VSteppedDenoise", inputs=("prompt_embeds", "negative_prompt_embeds"),
            outputs=(TensorSpec("denoised", "float32", wan.LATENT),),
            doc="initial noise from the seed, classifier-free-guided flow-matching denoising",
            cfg_parallel=True,
            # step-level batches: each item its solo bytes (tests/engine/stages/test_wan_batching.py, each
            # sample's linears, SiLUs and convolutions apart); 4 requests 2.4x the requests/s of one at a
            # time on the tiny model at 32x32x5, 2.2x at 64x64x9 (8: 2.7x, 2.4x)
            max_batch=4,
        ),
    ),
    # Prior for Wan2.1-T2V-1.3B in bf16 on one H100-class GPU: about a tenth of
    # the 14B model's denoising cost at the same size; refit as for wan2.1-i2v.
    costs={"denoise": CostModel(0.5, 7.9e-5, wan.tokens, steps=lambda d: d["S"], growth=2.0)},
)
