"""A benchmark-only workflow: sd-t2i served as ONE stage (diffusers' one-call pipeline, prompt to png).

``onepiece bench e2e`` compares the staged engine with the same engine serving the whole pipeline in one
stage instance (``staged_vs_single_stage_capacity``: what staging itself adds or costs), behind the same
Proxy, ring, store and control plane. No user deployment offers this workflow: it is registered only in
processes started with ``ONEPIECE_BENCH_WORKFLOWS=engine.bench.single_stage`` (the bench's own engine,
:mod:`engine.bench.private`), and is not in :mod:`engine.workflow.specs`.

Its output is the staged workflow's, byte for byte (``tests/engine/bench/test_e2e_variants.py``): the same
parameters, the seed's generator on the CPU, the pipeline's pixels encoded to png as ``image_encode`` does.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.stages.base import StageContext, StageExecutor, compute_dtype_name, resolve_device
from engine.workflow.spec import CostModel, StageSpec, TensorSpec
from engine.workflow.specs import sd_t2i

NAME = "bench-sd-t2i-single-stage"
MODULE = __name__  # what ONEPIECE_BENCH_WORKFLOWS names
STAGE = "pipeline"


class SDOneCall(StageExecutor):
    """The whole of sd-t2i in one call of ``StableDiffusionPipeline``: prompt -> png bytes."""

    components = ("tokenizer", "text_encoder", "unet", "scheduler", "vae")

    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        import torch
        from diffusers import DiffusionPipeline

        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        dtype = getattr(torch, compute_dtype_name(self.device))
        self.pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        import torch

        steps = int(params["num_inference_steps"])

        def on_step(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            ctx.step_done(i + 1, steps)
            if i + 1 < steps:
                ctx.check()  # cancel and deadline between steps, as the staged denoise checks them
            return {}

        ctx.check()
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        with torch.no_grad():
            image = self.pipe(prompt=params["prompt"], negative_prompt=params.get("negative_prompt"),
                              height=params["height"], width=params["width"], num_inference_steps=steps,
                              guidance_scale=params["guidance_scale"], generator=generator, output_type="pil",
                              callback_on_step_end=on_step).images[0]
        buf = io.BytesIO()
        image.save(buf, format="PNG")  # what SDImageEncode does with the same pixels
        return {"image": buf.getvalue()}


def _cost() -> CostModel:
    """The sum of sd-t2i's stage priors (the denoise's per-pixel-step term and every fixed part)."""
    costs = sd_t2i.SPEC.costs
    fixed = sum(c.fixed for c in costs.values())
    den = costs["denoise"]
    return CostModel(fixed, den.per_unit, den.units, steps=den.steps, growth=den.growth)


SPEC = dataclasses.replace(
    sd_t2i.SPEC,
    name=NAME,
    description="benchmark only: sd-t2i as one stage (the one-call pipeline), for bench e2e's single-stage baseline",
    stages=(StageSpec(STAGE, f"{__name__}.SDOneCall", inputs=(),
                      outputs=(TensorSpec("image", kind="blob", doc="png bytes"),),
                      doc="diffusers' one-call StableDiffusionPipeline"),),
    costs={STAGE: _cost()},
    default=False,  # sd-t2i stays the images route's default
)
