"""sd-t2i denoise: initial noise from the request's seed, then the guided UNet loop.

The noise is drawn here, not in an earlier stage, because EulerDiscreteScheduler
draws fresh noise from the same generator at every step: one generator must see
the initial draw and every step's draws in the pipeline's order.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.stages.base import StageContext
from engine.stages.components import TorchStage, load_component, read_config


class SDDenoise(TorchStage):
    """``prompt_embeds`` + ``negative_prompt_embeds`` -> ``denoised`` latents."""

    components: ClassVar[tuple[str, ...]] = ("unet", "scheduler")

    def _load(self, model_dir: Path) -> None:
        from diffusers import StableDiffusionPipeline

        unet = load_component(model_dir, "unet", ("diffusers", "UNet2DConditionModel"), self.dtype, self.device)
        scheduler = load_component(model_dir, "scheduler", ("diffusers", "EulerDiscreteScheduler"))
        # The pipeline constructor patches outdated scheduler/unet configs; go
        # through it so this stage sees the configs the one-call pipeline sees.
        self.pipe = StableDiffusionPipeline(
            vae=None, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        # Without a VAE the pipeline would assume 8x; read the real factor.
        vae_config = read_config(model_dir, "vae")
        self.pipe.vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        pipe, unet = self.pipe, self.pipe.unet
        # A fresh scheduler per request: schedulers keep per-run state (step
        # index, history), and a long-lived stage serves many requests.
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        guidance = float(params["guidance_scale"])
        cfg = guidance > 1.0
        pos = inputs["prompt_embeds"].to(self.device)
        embeds = torch.cat([inputs["negative_prompt_embeds"].to(self.device), pos]) if cfg else pos
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))

        timesteps, steps = retrieve_timesteps(scheduler, params["num_inference_steps"], self.device)
        pipe.scheduler = scheduler  # prepare_latents reads init_noise_sigma from it
        latents = pipe.prepare_latents(
            1, unet.config.in_channels, params["height"], params["width"], pos.dtype, self.device, generator
        )
        step_params = set(inspect.signature(scheduler.step).parameters)
        extra: dict[str, Any] = {}
        if "eta" in step_params:
            extra["eta"] = 0.0
        if "generator" in step_params:
            extra["generator"] = generator
        timestep_cond = None
        if unet.config.time_cond_proj_dim is not None:
            scale = torch.tensor(guidance - 1).repeat(1)
            timestep_cond = pipe.get_guidance_scale_embedding(
                scale, embedding_dim=unet.config.time_cond_proj_dim).to(device=self.device, dtype=latents.dtype)

        for i, t in enumerate(timesteps):
            ctx.check()
            model_input = torch.cat([latents] * 2) if cfg else latents
            model_input = scheduler.scale_model_input(model_input, t)
            noise_pred = unet(model_input, t, encoder_hidden_states=embeds, timestep_cond=timestep_cond,
                              return_dict=False)[0]
            if cfg:
                uncond, text = noise_pred.chunk(2)
                noise_pred = uncond + guidance * (text - uncond)
            latents = scheduler.step(noise_pred, t, latents, **extra, return_dict=False)[0]
            ctx.step_done(i + 1, steps)
        return {"denoised": latents}
