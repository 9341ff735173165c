"""What the Wan2.2 workflows share: the two-expert denoise stages of the A14B models (``denoise_high``,
``denoise_low``) and the values that cross between them, the extra parameter ``guidance_scale_2``, and the
limits of a model folder with two transformers. Every other stage is Wan2.1's (engine.workflow.specs.wan_common):
the A14B releases ship Wan2.1's umT5 and VAE."""

from __future__ import annotations

from engine.workflow import limits
from engine.workflow.spec import CostModel, ParamSpec, StageSpec, TensorSpec
from engine.workflow.specs import wan_common as wan

GUIDANCE_2 = ParamSpec("guidance_scale_2", float, None, 0.0, 50.0,
                       doc="guidance of the low-noise expert (transformer_2); default: guidance_scale")
#: Wan2.1's parameters and guidance_scale_2 (``quality``, a Wan workflow's option, caches a guidance pass in
#: each expert stage apart, each starting at its first step as diffusers' hook on each transformer does)
A14B_PARAMS = (*wan.PARAMS, GUIDANCE_2)
P = f"{wan.P}.experts"

# UniPC's state after the high-noise expert's last step (engine.stages.wan.experts.scheduler_state)
STATE = (
    TensorSpec("scheduler_outputs", "float32", ("N_order", *wan.LATENT), doc="UniPC's model-output history"),
    TensorSpec("scheduler_timesteps", "int64", ("N_order",), doc="the timesteps of that history (-1: none)"),
    TensorSpec("scheduler_last_sample", "float32", wan.LATENT, doc="the sample before the last step"),
    TensorSpec("scheduler_counters", "int64", (6,),
               doc="step index, lower_order_nums, this_order, begin index, boundary step, steps"),
)
EXPERT_LATENTS = TensorSpec("expert_latents", "float32", wan.LATENT, doc="the latents at the boundary step")
EMBEDS = ("prompt_embeds", "negative_prompt_embeds")


#: step-level batches of each Wan2.2 denoise stage: each item its solo bytes (tests/engine/stages/
#: test_wan22_batching.py); on the tiny models 4 requests 1.8-2.3x the requests/s of one at a time, 8: 2.0-2.9x
#: (benchmarks/wan22_batching.py, benchmarks/stepped_batching.md)
MAX_BATCH = 4


def experts(high_executor: str, high_inputs: tuple[str, ...], low_inputs: tuple[str, ...] = ()) -> tuple[StageSpec, ...]:
    """``denoise_high`` (its executor loads ``transformer``) then ``denoise_low`` (``transformer_2``), each
    batching up to :data:`MAX_BATCH` requests' steps."""
    high = StageSpec(
        "denoise_high", f"{P}.{high_executor}", inputs=(*EMBEDS, *high_inputs),
        outputs=(EXPERT_LATENTS, *STATE),
        doc="the high-noise expert's steps (t >= boundary_ratio x num_train_timesteps); hands on UniPC's state",
        max_batch=MAX_BATCH,
    )
    low = StageSpec(
        "denoise_low", f"{P}.Wan22Low", inputs=(*EMBEDS, *low_inputs, EXPERT_LATENTS.name, *(t.name for t in STATE)),
        outputs=(TensorSpec("denoised", "float32", wan.LATENT),),
        doc="the low-noise expert's steps, continuing the high-noise stage's UniPC state",
        max_batch=MAX_BATCH,
    )
    return high, low


def a14b_limits(configs: limits.Configs) -> limits.Overrides:
    """Both experts bound the request (each must run every size): the stricter of their limits."""
    first = wan.model_limits(configs)
    second = wan.model_limits({**configs, "transformer": configs.get("transformer_2") or {}})
    return limits.merge(first, second) or {}


def expert_costs(high_share: float, per_unit: float) -> dict[str, CostModel]:
    """Priors of the two experts: each a 14B transformer (Wan2.1-14B's cost per step and token), the high one
    for ``high_share`` of the steps (the boundary's share at the release's flow shift and 40 steps)."""
    return {
        "denoise_high": CostModel(0.5, per_unit, wan.tokens, steps=lambda d: d["S"] * high_share, growth=2.0),
        "denoise_low": CostModel(0.5, per_unit, wan.tokens, steps=lambda d: d["S"] * (1 - high_share), growth=2.0),
    }
