"""FLUX.1 text-to-image (diffusers ``FluxPipeline``) in four stages, shared by schnell and dev.

text_encode (CLIP pooled + T5 sequence) -> denoise (Flux transformer; the noise is drawn here from the
request's seed) -> vae_decode (uint8 pixels) -> image_encode (png). The three model stages run diffusers'
Modular Diffusers Flux blocks (engine/stages/flux/stages.py); image_encode is sd-t2i's.

Limits and defaults from the loaded folder (:func:`model_limits`):

* size: the default is the pipeline's, ``default_sample_size`` (128) latent pixels times the VAE's scale
  (``2 ** (len(vae.block_out_channels) - 1)``): 1024 for FLUX.1 (8x VAE), 256 for the tiny model (2x);
* ``max_sequence_length``: at most the T5 tokenizer's ``model_max_length`` (512 for FLUX.1, which is also
  the pipeline's own bound);
* ``num_inference_steps``: at most the scheduler's ``num_train_timesteps``;
* ``guidance_scale`` (dev only): a transformer without ``guidance_embeds`` takes no guidance, so on such a
  folder its maximum is 0 (a request that sets it is refused, naming the field).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.workflow import limits
from engine.workflow.spec import CostModel, ParamSpec, StageSpec, TensorSpec, WorkflowSpec
from engine.workflow.specs.common import (
    MAX_PROMPT_CHARS,
    require_multiple,
    require_prompt,
)

# The latent is packed 2x2 on top of the VAE's 8x: sides are multiples of 16 (FluxPipeline otherwise resizes
# the request down, silently); the tiny model's 2x VAE needs multiples of 4, which 16 satisfies.
SIZE_MULTIPLE = 16
MAX_SIDE = 2048
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size (latent pixels a side)
T5_MAX = 512  # FluxPipeline.check_inputs refuses more
_P = "engine.stages.flux.stages"


def _derive(p: Mapping[str, Any]) -> dict[str, int]:
    return {"H": p["height"], "W": p["width"], "S": p["num_inference_steps"], "P": p["height"] * p["width"],
            "L_text": p["max_sequence_length"]}


def _check(name: str) -> Any:
    def check(p: Mapping[str, Any]) -> None:
        require_prompt(p)
        require_multiple(p, "height", SIZE_MULTIPLE)
        require_multiple(p, "width", SIZE_MULTIPLE)

    return check


def model_limits(configs: limits.Configs) -> limits.Overrides:
    """The loaded FLUX.1 folder's defaults and maxima (see the module docstring)."""
    out: limits.Overrides = {}
    vae = configs.get("vae") or {}
    blocks = vae.get("block_out_channels")
    if isinstance(blocks, list) and blocks:
        side = limits.fit_default(DEFAULT_SAMPLE_SIZE * 2 ** (len(blocks) - 1), MAX_SIDE, SIZE_MULTIPLE)
        out["height"] = {"default": side}
        out["width"] = {"default": side}
    t5 = (configs.get("tokenizer_2") or {}).get("model_max_length")
    if isinstance(t5, int) and 0 < t5 < 10**9:
        limits.tighten(out, "max_sequence_length", t5, f"the T5 tokenizer reads at most {t5} tokens")
    trained = (configs.get("scheduler") or {}).get("num_train_timesteps")
    if isinstance(trained, int) and trained > 0:
        limits.tighten(out, "num_inference_steps", trained, f"the scheduler has {trained} training timesteps")
    transformer = configs.get("transformer") or {}
    if "guidance_embeds" in transformer and not transformer["guidance_embeds"]:
        limits.tighten(out, "guidance_scale", 0, "the loaded transformer has no guidance embedding")
    return out


def flux_spec(name: str, description: str, steps: int, max_steps: int, sequence: int,
              guidance: float | None) -> WorkflowSpec:
    """A FLUX.1 spec: ``steps``/``sequence`` are the model card's defaults; ``guidance`` None for a model
    without guidance (schnell: no ``guidance_scale`` parameter at all)."""
    params = [
        ParamSpec("prompt", str, None, doc="what the image shows", max_length=MAX_PROMPT_CHARS),
        ParamSpec("height", int, 1024, 64, MAX_SIDE),
        ParamSpec("width", int, 1024, 64, MAX_SIDE),
        ParamSpec("num_inference_steps", int, steps, 1, max_steps),
        ParamSpec("max_sequence_length", int, sequence, 1, T5_MAX, doc="T5 tokens of the prompt (padded)"),
        ParamSpec("seed", int, 0, 0, 2**63 - 1),
    ]
    if guidance is not None:
        params.insert(4, ParamSpec("guidance_scale", float, guidance, 0.0, 20.0,
                                   doc="embedded guidance of a guidance-distilled model (no negative pass)"))
    return WorkflowSpec(
        name=name, description=description, step_cache=True,  # engine.stages.caching: TaylorSeer lite
        stages=(
            StageSpec("text_encode", f"{_P}.FluxTextEncode", inputs=(),
                      outputs=(TensorSpec("prompt_embeds", shape=(1, "L_text", "D_text")),
                               TensorSpec("pooled_prompt_embeds", shape=(1, "D_pool"))),
                      doc="CLIP pooled embedding and T5 sequence of the prompt",
                      # requests of one max_sequence_length encode together, each item its solo bytes
                      # (tests/engine/stages/test_light_batching.py; gain: benchmarks/light_batching.md)
                      max_batch=8),
            StageSpec("denoise", f"{_P}.FluxDenoise", inputs=("prompt_embeds", "pooled_prompt_embeds"),
                      outputs=(TensorSpec("denoised", shape=(1, "C_lat", "H_lat", "W_lat")),),
                      doc="noise from the seed, the Flux transformer's loop",
                      # step-level batches: each item's solo bytes up to 8 requests at 64x64 on one and two
                      # threads, with each request's 2-D linears run apart (engine.stages.invariant; without it
                      # they differ by 5e-7) (tests/engine/stages/test_modular_batching.py). Tiny models, one
                      # thread, Intel Xeon (benchmarks/stepped_batching.md, the record): schnell 1.29x the
                      # requests/s at 2, 1.42x at 4, 1.40x at 8; dev 1.19x, 1.29x, 1.21x; at 4, 0.89x (schnell)
                      # and 0.95x (dev) of FluxPipeline's own batched gain. 4: past it neither gains here
                      max_batch=4),
            StageSpec("vae_decode", f"{_P}.FluxVaeDecode", inputs=("denoised",),
                      outputs=(TensorSpec("pixels", "uint8", (1, "H", "W", 3)),),
                      doc="VAE decode to uint8 RGB pixels"),
            StageSpec("image_encode", "engine.stages.sd.image.SDImageEncode", inputs=("pixels",),
                      outputs=(TensorSpec("image", kind="blob", doc="png bytes"),), doc="pixels to png"),
        ),
        params=tuple(params),
        derive=_derive, check=_check(name),
        # Priors for the 12B transformer in bf16 on one H100-class GPU: ~0.5 s a step at 1024x1024 (attention
        # over 4096 image + 512 text tokens); refit from benchmarks/stages_profile.py measurements.
        costs={
            "text_encode": CostModel(0.03, 0.0, lambda d: 0.0),
            "denoise": CostModel(0.05, 5.0e-7, lambda d: d["P"], steps=lambda d: d["S"], growth=2.0),
            "vae_decode": CostModel(0.02, 1.5e-7, lambda d: d["P"], growth=2.0),
            "image_encode": CostModel(0.005, 2.0e-8, lambda d: d["P"]),
        },
        final_output="image",
        warm_up={"prompt": "warm-up", "height": 64, "width": 64, "num_inference_steps": 1},
        model_limits=model_limits,
        limit_components=("vae", "tokenizer_2", "scheduler", "transformer"),
    )
