"""Qwen-Image text-to-image (diffusers ``QwenImagePipeline``) in four stages.

text_encode (Qwen2.5-VL: the prompt in the pipeline's chat template, the system prefix dropped) -> denoise
(QwenImage transformer; the noise is drawn here from the request's seed; true classifier-free guidance when
the request has a ``negative_prompt`` and ``true_cfg_scale`` > 1, as the pipeline) -> vae_decode (uint8
pixels) -> image_encode (png). The model stages run diffusers' Modular Diffusers QwenImage blocks
(engine/stages/qwen/stages.py).

Limits and defaults from the loaded folder (:func:`_model_limits`):

* size: the default is the pipeline's ``default_sample_size`` (128) latent pixels times the VAE's scale
  (``2 ** len(vae.temperal_downsample)``): 1024 for Qwen-Image (8x), 512 for the tiny model (4x);
* ``max_sequence_length``: at most the tokenizer's ``model_max_length`` (and the pipeline's 1024);
* ``num_inference_steps``: at most the scheduler's ``num_train_timesteps``.

The transformer's RoPE table (4096 positions, fixed in diffusers' code, not in the config) holds
``max(h, w) / 2 + text tokens`` positions: 1024 text tokens leave 6144 latent patches a side, far beyond
the 2048 px bound here, so it adds no limit.
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

SIZE_MULTIPLE = 16  # the 8x VAE, then 2x2 patches (QwenImagePipeline warns and resizes otherwise)
MAX_SIDE = 2048
DEFAULT_SAMPLE_SIZE = 128  # QwenImagePipeline.default_sample_size
MAX_SEQUENCE = 1024  # QwenImagePipeline.check_inputs refuses more
_P = "engine.stages.qwen.stages"


def _derive(p: Mapping[str, Any]) -> dict[str, int]:
    return {"H": p["height"], "W": p["width"], "S": p["num_inference_steps"], "P": p["height"] * p["width"],
            # the denoise runs a second (unconditional) pass per step when guided
            "G": 2 if p.get("negative_prompt") is not None and p["true_cfg_scale"] > 1.0 else 1}


def _check(p: Mapping[str, Any]) -> None:
    require_prompt(p)
    require_multiple(p, "height", SIZE_MULTIPLE)
    require_multiple(p, "width", SIZE_MULTIPLE)


def _model_limits(configs: limits.Configs) -> limits.Overrides:
    out: limits.Overrides = {}
    down = (configs.get("vae") or {}).get("temperal_downsample")
    if isinstance(down, list):
        side = limits.fit_default(DEFAULT_SAMPLE_SIZE * 2 ** len(down), MAX_SIDE, SIZE_MULTIPLE)
        out["height"] = {"default": side}
        out["width"] = {"default": side}
    tokens = (configs.get("tokenizer") or {}).get("model_max_length")
    if isinstance(tokens, int) and 0 < tokens < 10**9:
        limits.tighten(out, "max_sequence_length", tokens, f"the tokenizer reads at most {tokens} tokens")
    trained = (configs.get("scheduler") or {}).get("num_train_timesteps")
    if isinstance(trained, int) and trained > 0:
        limits.tighten(out, "num_inference_steps", trained, f"the scheduler has {trained} training timesteps")
    return out


SPEC = WorkflowSpec(
    name="qwen-image",
    description="Qwen-Image text-to-image: a prompt to a png",
    stages=(
        StageSpec("text_encode", f"{_P}.QwenTextEncode", inputs=(),
                  outputs=(TensorSpec("prompt_embeds", shape=(1, "L_text", "D_text")),
                           TensorSpec("prompt_embeds_mask", "int64", (1, "L_text")),
                           TensorSpec("negative_prompt_embeds", shape=(1, "L_neg", "D_text")),
                           TensorSpec("negative_prompt_embeds_mask", "int64", (1, "L_neg"))),
                  doc="Qwen2.5-VL last hidden states of prompt and negative prompt, with their masks",
                  # requests whose prompts have equal token counts encode together, each item its solo
                  # bytes (tests/engine/stages/test_light_batching.py; gain: benchmarks/light_batching.md)
                  max_batch=8),
        StageSpec("denoise", f"{_P}.QwenDenoise",
                  inputs=("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"),
                  outputs=(TensorSpec("denoised", shape=(1, "C_lat", 1, "H_lat", "W_lat")),),
                  doc="noise from the seed, the QwenImage transformer's loop (true CFG when guided)",
                  # step-level batches of one latent size, guided and unguided together: each step runs the
                  # cond and uncond passes whose texts have one length in one transformer call, each request
                  # keeping its own guider scale; each item's solo bytes (2-D linears and SiLUs per request:
                  # engine.stages.invariant), tested with up to 4 at once, guided and unguided
                  # (tests/engine/stages/test_modular_batching.py), and 8 unguided in the benchmark. The tiny
                  # model, one thread, 8 steps (benchmarks/stepped_batching.md, the record): 1.23x the
                  # requests/s at 2, 1.72x at 4, 2.02x at 8 (one prompt length), 0.93-0.99x of
                  # QwenImagePipeline's own requests/s batched at the same sizes
                  max_batch=8),
        StageSpec("vae_decode", f"{_P}.QwenVaeDecode", inputs=("denoised",),
                  outputs=(TensorSpec("pixels", "uint8", (1, "H", "W", 3)),),
                  doc="VAE decode to uint8 RGB pixels"),
        StageSpec("image_encode", "engine.stages.sd.image.SDImageEncode", inputs=("pixels",),
                  outputs=(TensorSpec("image", kind="blob", doc="png bytes"),), doc="pixels to png"),
    ),
    params=(
        ParamSpec("prompt", str, None, doc="what the image shows", max_length=MAX_PROMPT_CHARS),
        ParamSpec("negative_prompt", str, None, doc="what it should not show (turns on true CFG)",
                  max_length=MAX_PROMPT_CHARS),
        ParamSpec("height", int, 1024, 64, MAX_SIDE),
        ParamSpec("width", int, 1024, 64, MAX_SIDE),
        ParamSpec("num_inference_steps", int, 50, 1, 150),
        ParamSpec("true_cfg_scale", float, 4.0, 0.0, 20.0, doc="classifier-free guidance, with a negative_prompt"),
        ParamSpec("max_sequence_length", int, 512, 1, MAX_SEQUENCE, doc="prompt tokens kept after the template"),
        ParamSpec("seed", int, 0, 0, 2**63 - 1),
    ),
    derive=_derive, check=_check,
    # Priors for the 20B transformer in bf16 on one H100-class GPU: ~1 s a guided-half step at 1024x1024;
    # refit from benchmarks/stages_profile.py measurements.
    costs={
        "text_encode": CostModel(0.05, 0.0, lambda d: 0.0),
        "denoise": CostModel(0.05, 1.0e-6, lambda d: d["P"] * d["G"], steps=lambda d: d["S"], growth=2.0),
        "vae_decode": CostModel(0.02, 2.0e-7, lambda d: d["P"], growth=2.0),
        "image_encode": CostModel(0.005, 2.0e-8, lambda d: d["P"]),
    },
    final_output="image",
    warm_up={"prompt": "warm-up", "height": 64, "width": 64, "num_inference_steps": 1},
    model_limits=_model_limits, limit_components=("vae", "tokenizer", "scheduler"),
    step_cache=True,  # engine.stages.caching: TaylorSeer lite, a cache per guidance pass
)
