"""sd-t2i denoise: initial noise from the request's seed, then the guided UNet loop.

The noise is drawn here, not in an earlier stage, because EulerDiscreteScheduler
draws fresh noise from the same generator at every step: one generator must see
the initial draw and every step's draws in the pipeline's order.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine import envs
from engine.adapters.request import adapter_set
from engine.lazy import lazy
from engine.stages import invariant
from engine.stages.base import SteppedStage
from engine.stages.components import TorchStage, load_component, no_grad, read_config
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")

#: how long a step with no request ready (each waits for its own adapter's read) blocks on the loader
ADAPTER_WAIT_S = 0.05


class SDDenoise(TorchStage, SteppedStage):
    """``prompt_embeds`` + ``negative_prompt_embeds`` -> ``denoised`` latents."""

    components: ClassVar[tuple[str, ...]] = ("unet", "scheduler")
    reads: ClassVar[tuple[str, ...]] = ("vae",)  # its scale factor: the pipeline's is 8x without a VAE
    adapts: ClassVar[tuple[str, str] | None] = ("unet", "StableDiffusionPipeline")
    #: at most this many LoRA adapters stay loaded (None: ONEPIECE_MAX_ADAPTERS; onepiece node --max-adapters)
    max_adapters: int | None = None
    hot: Any = None  # engine.adapters.hot.HotAdapters, made on the first request with adapters
    #: requests of different single adapters share one UNet call (PEFT's per-sample adapter_names) instead of
    #: one call per adapter set; measured faster (benchmarks/adapters.md) and byte-identical (the tests)
    mixed_batches: bool = True
    #: how engine.stages.preview turns this stage's latents into a picture
    preview_family: ClassVar[str] = "sd"

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

    def adapters(self) -> Any:
        """The instance's hot adapters (engine.adapters.hot), made on first use."""
        if self.hot is None:
            from engine.adapters.hot import HotAdapters

            assert self.adapts is not None, f"{type(self).__name__} declares no adapters"
            self.hot = HotAdapters(self.pipe.unet, self.served_workflow or "",
                                   self.max_adapters if self.max_adapters is not None else envs.MAX_ADAPTERS,
                                   adapts=self.adapts)
        return self.hot

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        # Requests share a step only as guided pairs (negative, positive) of the same latent shape: the UNet
        # gives a pair the same bytes in a batch of 2N as alone (measured at 8-64 latent pixels a side, with
        # each pair's 2-D linears run apart: engine.stages.invariant),
        # while an unguided request's batch of one differs from a batch of two in the last bits; a
        # guidance-embedding model (time_cond_proj_dim) runs alone. Requests with different LoRA adapter sets
        # share the batch: :meth:`step` gives each row its own adapters (one call, or one call per set).
        if float(params["guidance_scale"]) <= 1.0 or self.pipe.unet.config.time_cond_proj_dim is not None:
            return None
        return (int(params["height"]), int(params["width"]))

    @no_grad
    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> _State:
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        pipe, unet = self.pipe, self.pipe.unet
        # A fresh scheduler per request: schedulers keep per-run state (step
        # index, history), and a long-lived stage serves many requests.
        scheduler = self.fresh_scheduler(pipe.scheduler)
        guidance = float(params["guidance_scale"])
        cfg = guidance > 1.0
        pos = inputs["prompt_embeds"].to(self.device)
        embeds = torch.cat([inputs["negative_prompt_embeds"].to(self.device), pos]) if cfg else pos
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))

        timesteps, _steps = retrieve_timesteps(scheduler, params["num_inference_steps"], self.device)
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
        lora = adapter_set(options.lora)
        if lora:
            self.adapters().request(lora)  # read off the request path; its first step waits for it alone
        return _State(scheduler, list(timesteps), latents, embeds, guidance, cfg, extra, timestep_cond, lora)

    @no_grad
    def step(self, states: list[_State]) -> None:
        """One step of every state whose adapters are loaded: one UNet call for them all where PEFT's
        per-sample adapters can serve them (each request at most one adapter, one scale per adapter:
        :meth:`engine.adapters.hot.HotAdapters.mixed`), else one UNet call per adapter set (in order of first
        appearance), with that set active. A state whose adapter is still being read does not step
        (it keeps its place); when none can, this waits up to :data:`ADAPTER_WAIT_S` for a read."""
        if self.hot is None:
            self._step_group(states)
            return
        groups: dict[Any, list[_State]] = {}
        for st in states:
            groups.setdefault(st.lora, []).append(st)
        from engine.adapters.hot import slot

        needed = {slot(d) for st in states for _n, _s, d in st.lora}
        ready = [(k, g) for k, g in groups.items() if self.hot.ready(k, needed)]
        if not ready:
            self.hot.wait_any(ADAPTER_WAIT_S)
            return
        if len(ready) > 1 and self.mixed_batches and self.hot.mixable([k for k, _g in ready]):
            together = [st for _k, g in ready for st in g]
            with self.hot.mixed([st.lora for st in together], 2 if together[0].cfg else 1):
                self._step_group(together)
            return
        for key, group in ready:
            self.hot.activate(key)
            self._step_group(group)

    def _step_group(self, states: list[_State]) -> None:
        unet = self.pipe.unet
        inputs = []
        for st in states:
            t = st.timesteps[st.i]
            inputs.append(st.scheduler.scale_model_input(torch.cat([st.latents] * 2) if st.cfg else st.latents, t))
        if len(states) == 1:  # alone: exactly the one-call pipeline's call
            st = states[0]
            model_input, t_in, embeds, cond = inputs[0], st.timesteps[st.i], st.embeds, st.timestep_cond
        else:  # guided pairs side by side, each with its own timestep (requests may be at different steps)
            model_input, embeds, cond = torch.cat(inputs), torch.cat([st.embeds for st in states]), None
            t_in = torch.stack([st.timesteps[st.i] for st in states for _ in (0, 1)])
        width = 2 if states[0].cfg else 1
        # a batch: each request's rows through the 2-D linears alone (engine.stages.invariant), as solo
        with invariant.rows_per_request(width if len(states) > 1 else 0):
            noise = unet(model_input, t_in, encoder_hidden_states=embeds, timestep_cond=cond, return_dict=False)[0]
        for k, st in enumerate(states):
            pred = noise if len(states) == 1 else noise[width * k: width * (k + 1)]
            if st.cfg:
                uncond, text = pred.chunk(2)
                pred = uncond + st.guidance * (text - uncond)
            st.latents = st.scheduler.step(pred, st.timesteps[st.i], st.latents, **st.extra, return_dict=False)[0]
            st.i += 1

    def progress(self, state: _State) -> tuple[int, int]:
        return state.i, len(state.timesteps)

    def estimate(self, state: _State) -> Any:
        return state.latents

    def end(self, state: _State) -> dict[str, Any]:
        return {"denoised": state.latents}


@dataclass
class _State:
    """One request inside the denoise loop: its own scheduler, generator (in ``extra``) and latents."""

    scheduler: Any
    timesteps: list[Any]
    latents: Any
    embeds: Any
    guidance: float
    cfg: bool
    extra: dict[str, Any]
    timestep_cond: Any
    lora: tuple[tuple[str, float, str], ...] = ()  # the request's adapter set (engine.adapters.request)
    i: int = 0
