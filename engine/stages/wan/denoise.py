"""wan2.1-i2v denoise: classifier-free-guided flow matching with the Wan transformer.

Mirrors the loop of ``WanImageToVideoPipeline.__call__`` (Wan2.1: one
transformer, no expand_timesteps), checking cancellation and the deadline
before every step and reporting progress after it.
"""

from __future__ import annotations

import threading
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
        # a Collaboration-mode helper thread and the request loop share the model: one prediction at a time
        self._model_lock = threading.Lock()

    def _predict(self, name: str, model_input: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor,
                 image_embeds: torch.Tensor | None) -> torch.Tensor:
        """One transformer prediction. The one code path for both halves of a guided step, here and in a
        Collaboration-mode helper, so the two modes stay bit-identical."""
        model = self.transformer
        with self._model_lock, model.cache_context(name):
            return model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds,
                         encoder_hidden_states_image=image_embeds, return_dict=False)[0]

    @torch.no_grad()
    def predict_uncond(self, session: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Collaboration mode, helper side: the unconditional prediction of one step of a peer's request."""
        dtype = self.transformer.dtype
        image = session.get("image_embeds")
        return self._predict("uncond", step["model_input"].to(self.device, dtype), step["timestep"].to(self.device),
                             session["negative_prompt_embeds"].to(self.device, dtype),
                             None if image is None else image.to(self.device, dtype))

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        import time

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
        # Collaboration mode: a peer computes the unconditional halves (engine.worker.collab)
        remote = ctx.cfg_parallel if guidance > 1.0 else None
        if remote is not None:
            fixed = {"negative_prompt_embeds": neg}
            if image_embeds is not None:
                fixed["image_embeds"] = image_embeds
            remote.begin(fixed)
        try:
            for i, t in enumerate(timesteps):
                ctx.check()
                model_input = torch.cat([latents, condition], dim=1).to(dtype)
                timestep = t.expand(latents.shape[0])
                sent = remote is not None and remote.send_step(i, {"model_input": model_input, "timestep": timestep})
                t0 = time.perf_counter()
                noise_pred = self._predict("cond", model_input, timestep, pos, image_embeds)
                if guidance > 1.0:
                    noise_uncond = None
                    if sent:
                        remote.local_time(time.perf_counter() - t0)
                        noise_uncond = remote.wait_step(i)
                    if noise_uncond is None:
                        noise_uncond = self._predict("uncond", model_input, timestep, neg, image_embeds)
                    else:
                        noise_uncond = noise_uncond.to(self.device)
                    noise_pred = noise_uncond + guidance * (noise_pred - noise_uncond)
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                ctx.step_done(i + 1, len(timesteps))
        finally:
            if remote is not None:
                remote.end()
        return {"denoised": latents}
