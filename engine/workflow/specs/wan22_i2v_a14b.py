"""Wan2.2 image-to-video A14B (diffusers ``WanImageToVideoPipeline`` with ``transformer_2`` and
``boundary_ratio``; no CLIP image encoder: the first frame enters only through the VAE) cut into six stages:
text_encode (umT5) and vae_encode (first-frame condition + initial noise, Wan2.1's) -> denoise_high ->
denoise_low -> vae_decode -> video_encode."""

from __future__ import annotations

from engine.workflow.spec import CostModel, StageSpec, TensorSpec
from engine.workflow.specs import wan22_common as w22
from engine.workflow.specs import wan_common as wan

VAE_ENCODE = StageSpec(
    "vae_encode", f"{wan.P}.vae.WanVaeEncode", inputs=("image",),
    outputs=(TensorSpec("latents", "float32", wan.LATENT),
             TensorSpec("condition", "float32", (1, "C_cond", "T_lat", "H_lat", "W_lat"))),
    doc="first-frame condition (mask + VAE latents) and the initial noise",
)

SPEC = wan.wan_workflow(
    "wan2.2-i2v-a14b", "Wan2.2 image-to-video A14B: an image and a prompt to an mp4, two experts as two stages",
    request_inputs=(TensorSpec("image", kind="blob", media="image", doc="the first frame: PNG/JPEG/... bytes"),),
    middle=(VAE_ENCODE, *w22.experts("Wan22I2VHigh", ("latents", "condition"), ("condition",))),
    # Priors: Wan2.1-14B's; at boundary 0.9 and flow shift 5, 40 steps switch after 14 (t >= 900): the
    # high-noise expert runs ~36% of the steps.
    costs={"vae_encode": CostModel(0.5, 2.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"], growth=2.0),
           **w22.expert_costs(0.36, 7.9e-4)},
    params=w22.A14B_PARAMS, model_limits=w22.a14b_limits, limit_components=("transformer", "transformer_2", "vae"),
)
