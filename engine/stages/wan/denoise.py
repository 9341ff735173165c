"""wan2.1-i2v denoise: classifier-free-guided flow matching with the Wan transformer.

Mirrors the loop of ``WanImageToVideoPipeline.__call__`` (Wan2.1: one
transformer, no expand_timesteps), checking cancellation and the deadline
before every step and reporting progress after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.stages.base import StageContext
from engine.stages.components import TorchStage, load_component


class WanDenoise(TorchStage):
    """Embeddings, ``latents`` and ``condition`` -> ``denoised`` latents (float32)."""

    components: ClassVar[tuple[str, ...]] = ("transformer", "scheduler")

    def _load(self, model_dir: Path) -> None:
        self.transformer = load_component(model_dir, "transformer", ("diffusers", "WanTransformer3DModel"),
                                          self.dtype, self.device)
        self.scheduler = load_component(model_dir, "scheduler", ("diffusers", "UniPCMultistepScheduler"))

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        model = self.transformer
        dtype = model.dtype
        # Per-request scheduler: UniPC keeps a history of model outputs.
        scheduler = type(self.scheduler).from_config(self.scheduler.config)
        scheduler.set_timesteps(params["num_inference_steps"], device=self.device)
        guidance = float(params["guidance_scale"])
        pos = inputs["prompt_embeds"].to(self.device, dtype)
        neg = inputs["negative_prompt_embeds"].to(self.device, dtype)
        image_embeds = inputs["image_embeds"].to(self.device, dtype) if model.config.image_dim is not None else None
        # clone: inputs may be read-only views of a ring slot.
        latents = inputs["latents"].to(self.device, torch.float32).clone()
        condition = inputs["condition"].to(self.device, torch.float32)
        timesteps = scheduler.timesteps
        for i, t in enumerate(timesteps):
            ctx.check()
            model_input = torch.cat([latents, condition], dim=1).to(dtype)
            timestep = t.expand(latents.shape[0])
            with model.cache_context("cond"):
                noise_pred = model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=pos,
                                   encoder_hidden_states_image=image_embeds, return_dict=False)[0]
            if guidance > 1.0:
                with model.cache_context("uncond"):
                    noise_uncond = model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=neg,
                                         encoder_hidden_states_image=image_embeds, return_dict=False)[0]
                    noise_pred = noise_uncond + guidance * (noise_pred - noise_uncond)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            ctx.step_done(i + 1, len(timesteps))
        return {"denoised": latents}
