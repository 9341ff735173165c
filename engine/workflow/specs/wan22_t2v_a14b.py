"""Wan2.2 text-to-video A14B (diffusers ``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``) cut into
five stages: text_encode (umT5) -> denoise_high (the initial noise from the seed, the high-noise expert) ->
denoise_low (the low-noise expert) -> vae_decode -> video_encode. Each expert's instances hold one 14B
transformer; a request crosses from one pool to the other at the boundary step the pipeline computes."""

from __future__ import annotations

from engine.workflow.specs import wan22_common as w22
from engine.workflow.specs import wan_common as wan

SPEC = wan.wan_workflow(
    "wan2.2-t2v-a14b", "Wan2.2 text-to-video A14B: a prompt to an mp4, two experts as two stages",
    middle=w22.experts("Wan22T2VHigh", ()),
    # Priors: Wan2.1-14B's cost per guided step and token for each expert; at boundary 0.875 and flow shift
    # 12, 40 steps switch after 25 (t >= 875): the high-noise expert runs ~63% of the steps.
    costs=w22.expert_costs(0.63, 7.9e-4),
    params=w22.A14B_PARAMS, model_limits=w22.a14b_limits, limit_components=("transformer", "transformer_2", "vae"),
)
