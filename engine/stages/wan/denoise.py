"""Wan2.1 denoise: classifier-free-guided flow matching with the Wan transformer.

Mirrors the loop of ``WanImageToVideoPipeline.__call__`` and ``WanPipeline.__call__``
(Wan2.1: one transformer, no expand_timesteps), checking cancellation and the
deadline before every step and reporting progress after it. Image-to-video
receives its initial noise and first-frame condition from vae_encode;
text-to-video (:class:`WanT2VDenoise`) has no condition and draws the noise here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine import envs
from engine.adapters.request import adapter_set
from engine.lazy import lazy
from engine.stages import caching, invariant
from engine.stages.base import StageContext, SteppedStage
from engine.stages.components import TorchStage, load_component, no_grad
from engine.stages.wan.vae import check_wan_size, wan_vae_factors
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


class WanDenoise(TorchStage):
    """Embeddings, ``latents`` and ``condition`` -> ``denoised`` latents (float32)."""

    components: ClassVar[tuple[str, ...]] = ("transformer", "scheduler")
    adapts: ClassVar[tuple[str, str] | None] = ("transformer", "WanImageToVideoPipeline")
    #: at most this many LoRA adapters stay loaded (None: ONEPIECE_MAX_ADAPTERS; onepiece node --max-adapters)
    max_adapters: int | None = None
    hot: Any = None  # engine.adapters.hot.HotAdapters, made on the first request with adapters
    #: how engine.stages.preview turns this stage's latents into a picture (the middle latent frame)
    preview_family: ClassVar[str] = "wan"

    def _load(self, model_dir: Path) -> None:
        self.transformer = load_component(model_dir, "transformer", ("diffusers", "WanTransformer3DModel"),
                                          self.dtype, self.device)
        self.scheduler = load_component(model_dir, "scheduler", ("diffusers", "UniPCMultistepScheduler"))
        # a Collaboration-mode helper thread and the request loop share the model: one prediction at a time
        self._model_lock = threading.Lock()

    def adapters(self) -> Any:
        """The instance's hot adapters (engine.adapters.hot), made on first use."""
        if self.hot is None:
            from engine.adapters.hot import HotAdapters

            assert self.adapts is not None, f"{type(self).__name__} declares no adapters"
            self.hot = HotAdapters(self.transformer, self.served_workflow or "",
                                   self.max_adapters if self.max_adapters is not None else envs.MAX_ADAPTERS,
                                   adapts=self.adapts)
        return self.hot

    def _await_adapters(self, lora: Any, ctx: StageContext) -> None:
        """Until this request's adapters are loaded (read off this thread; installed under the model lock,
        between a helper's predictions); checks cancel and deadline meanwhile."""
        from engine.adapters.hot import slot

        hot = self.adapters()
        hot.request(lora)
        needed = {slot(d) for _n, _s, d in lora}
        while True:
            with self._model_lock:
                if hot.ready(lora, needed):
                    return
            ctx.check()
            hot.wait_any(0.05)

    def _predict(self, name: str, model_input: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor,
                 image_embeds: torch.Tensor | None, lora: Any = (), cache: Any = None) -> torch.Tensor:
        """One transformer prediction. The one code path for both halves of a guided step, here and in a
        Collaboration-mode helper, so the two modes stay bit-identical. ``lora``: the request's adapter set,
        made the model's active set first (a helper's requests have none: a request with adapters computes
        both halves itself). ``cache``: the request's caches (engine.stages.caching.PassCaches) when it asked
        for a quality below lossless: the pass's own cache predicts this step or takes what the model gave,
        as diffusers' hook does in the pipeline's ``cache_context(name)``. The transformer's output is its
        ``proj_out``'s (what the lite hook caches) rearranged into frames, element for element, so caching
        it gives the hook's bytes."""
        step = None if cache is None else cache.of(0 if name == "cond" else 1)
        if step is not None and not step.should_compute():
            return step.predict()
        model = self.transformer
        with self._model_lock, model.cache_context(name):
            if self.hot is not None:
                self.hot.activate(lora)
            out = model(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds,
                        encoder_hidden_states_image=image_embeds, return_dict=False)[0]
        if step is not None:
            step.update(out)
        return out

    @no_grad
    def predict_uncond(self, session: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Collaboration mode, helper side: the unconditional prediction of one step of a peer's request."""
        dtype = self.transformer.dtype
        image = session.get("image_embeds")
        return self._predict("uncond", step["model_input"].to(self.device, dtype), step["timestep"].to(self.device),
                             session["negative_prompt_embeds"].to(self.device, dtype),
                             None if image is None else image.to(self.device, dtype))

    def _initial(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The initial noisy latents and the condition concatenated to them at every step (None: none)."""
        # clone: inputs may be read-only views of a ring slot.
        latents = inputs["latents"].to(self.device, torch.float32).clone()
        return latents, inputs["condition"].to(self.device, torch.float32)

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        import time

        model = self.transformer
        dtype = model.dtype
        # Per-request scheduler: UniPC keeps a history of model outputs.
        scheduler = self.fresh_scheduler(self.scheduler)
        scheduler.set_timesteps(params["num_inference_steps"], device=self.device)
        guidance = float(params["guidance_scale"])
        pos = inputs["prompt_embeds"].to(self.device, dtype)
        neg = inputs["negative_prompt_embeds"].to(self.device, dtype)
        image_embeds = inputs["image_embeds"].to(self.device, dtype) if model.config.image_dim is not None else None
        latents, condition = self._initial(inputs, params)
        timesteps = scheduler.timesteps
        lora = adapter_set(ctx.options.lora)
        if lora:
            self._await_adapters(lora, ctx)
        cache = self._cache(ctx.options)
        # Collaboration mode: a peer computes the unconditional halves (engine.worker.collab); not for a
        # request with adapters (the peer's model has other adapters active), nor for one below lossless
        # (its uncond cache is here: a predicted half costs nothing to send away)
        remote = ctx.cfg_parallel if guidance > 1.0 and not lora and cache is None else None
        if remote is not None:
            fixed = {"negative_prompt_embeds": neg}
            if image_embeds is not None:
                fixed["image_embeds"] = image_embeds
            remote.begin(fixed)
        try:
            for i, t in enumerate(timesteps):
                ctx.check()
                model_input = (latents if condition is None else torch.cat([latents, condition], dim=1)).to(dtype)
                timestep = t.expand(latents.shape[0])
                sent = remote is not None and remote.send_step(i, {"model_input": model_input, "timestep": timestep})
                t0 = time.perf_counter()
                noise_pred = self._predict("cond", model_input, timestep, pos, image_embeds, lora, cache)
                if guidance > 1.0:
                    noise_uncond = None
                    if sent:
                        remote.local_time(time.perf_counter() - t0)
                        noise_uncond = remote.wait_step(i)
                    if noise_uncond is None:
                        noise_uncond = self._predict("uncond", model_input, timestep, neg, image_embeds, lora, cache)
                    else:
                        noise_uncond = noise_uncond.to(self.device)
                    noise_pred = noise_uncond + guidance * (noise_pred - noise_uncond)
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                ctx.step_done(i + 1, len(timesteps), latents)
        finally:
            if remote is not None:
                remote.end()
        if cache is not None:
            ctx.stats["cache_skipped"] = round(cache.skipped_share(), 3)
        return {"denoised": latents}

    def cfg_share(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> float:
        """The share of a step this instance computes itself in Collaboration mode (engine.worker.calibrate):
        half of a guided one, which :meth:`run` sends a peer; all of one it keeps (unguided, adapters, cached)."""
        helped = float(params.get("guidance_scale", 1.0)) > 1.0 and not options.lora and self._cache(options) is None
        return 0.5 if helped else 1.0

    def _cache(self, options: Options) -> Any:
        """The step caches of a request with these ``options``, one per guidance pass (None: lossless)."""
        return caching.for_request(self.served_workflow or "", options, per_pass=True)


class WanT2VDenoise(WanDenoise):
    """Text-to-video: embeddings -> ``denoised``; the initial noise is drawn here from the request's seed.

    ``WanPipeline.prepare_latents`` draws it (float32, from a CPU generator) before the loop, and UniPC
    draws nothing more, so drawing it in this stage keeps the output bit-identical to the one-call pipeline.
    """

    #: the VAE's config only: its compression factors size the initial noise
    reads: ClassVar[tuple[str, ...]] = ("vae",)
    adapts: ClassVar[tuple[str, str] | None] = ("transformer", "WanPipeline")

    def _load(self, model_dir: Path) -> None:
        super()._load(model_dir)
        self.factors = wan_vae_factors(model_dir)
        patch = self.transformer.config.patch_size
        self.multiple = self.factors[1] * patch[1], self.factors[1] * patch[2]

    def _initial(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[torch.Tensor, None]:
        from diffusers.utils.torch_utils import randn_tensor

        temporal, spatial = self.factors
        height, width, frames = params["height"], params["width"], params["num_frames"]
        check_wan_size(height, width, frames, self.multiple, temporal)
        shape = (1, self.transformer.config.in_channels, (frames - 1) // temporal + 1,
                 height // spatial, width // spatial)
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        return randn_tensor(shape, generator=generator, device=torch.device(self.device), dtype=torch.float32), None


@dataclass
class _WanStep:
    """One Wan request stepping in a batch: its scheduler, embeddings, latents and condition, its caches, and
    the steps this stage runs of its timesteps (``first`` to ``end``: all of them, or a Wan2.2 expert's side of
    the boundary). ``guidance`` scales the guided step; ``guided`` (None: ``guidance > 1``) says whether it has
    an unconditional pass (a Wan2.2 low expert's ``guidance_scale_2`` scales, its ``guidance_scale`` decides)."""

    scheduler: Any
    timesteps: list[Any]
    guidance: float
    pos: torch.Tensor
    neg: torch.Tensor
    image_embeds: torch.Tensor | None
    latents: torch.Tensor
    condition: torch.Tensor | None
    cache: Any = None
    i: int = 0
    first: int = 0
    end: int = -1  # -1: the last of ``timesteps``
    guided: bool | None = None

    def __post_init__(self) -> None:
        self.end = len(self.timesteps) if self.end < 0 else self.end
        self.guided = self.guidance > 1.0 if self.guided is None else self.guided
        self.i = max(self.i, self.first)


class _SteppedWan(SteppedStage):
    """Wan's denoise as a stepped stage (engine.worker.batching; the Wan2.2 experts' too, each over its side of
    the boundary: engine.stages.wan.experts): requests of one size, guidance mode and
    kind share one transformer call per step over every request's cond and uncond rows (a timestep each),
    then each request's own guidance and scheduler. Inside the call each sample's linears, SiLUs and
    convolutions run apart and each row's 2-D linears too (engine.stages.invariant), so each item gets its
    solo bytes (tests/engine/stages/test_wan_batching.py). ``run`` stays :meth:`WanDenoise.run`
    (Collaboration mode and LoRA adapters, which do not batch: a request with adapters runs alone)."""

    @no_grad
    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> _WanStep:
        dtype = self.transformer.dtype
        scheduler = self.fresh_scheduler(self.scheduler)
        scheduler.set_timesteps(params["num_inference_steps"], device=self.device)
        image = inputs["image_embeds"].to(self.device, dtype) if self.transformer.config.image_dim is not None else None
        latents, condition = self._initial(inputs, params)
        return _WanStep(scheduler, list(scheduler.timesteps), float(params["guidance_scale"]),
                        inputs["prompt_embeds"].to(self.device, dtype),
                        inputs["negative_prompt_embeds"].to(self.device, dtype), image, latents, condition,
                        self._cache(options))

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        if options.lora:
            return None  # its adapters made the model's active set: alone
        return (int(params["height"]), int(params["width"]), int(params["num_frames"]),
                float(params["guidance_scale"]) > 1.0, int(params["max_sequence_length"]))

    @no_grad
    def step(self, states: list[Any]) -> None:
        import contextlib

        dtype = self.transformer.dtype
        rows: list[tuple[_WanStep, str, Any]] = []  # (request, pass, its cache)
        preds: dict[tuple[int, str], torch.Tensor] = {}
        inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        states = [st for st in states if st.i < st.end]  # one with no step here (an expert's empty side) waits
        for st in states:
            inputs[id(st)] = self._step_input(st, dtype)
            for name in ("cond", "uncond") if st.guided else ("cond",):
                cache = None if st.cache is None else st.cache.of(0 if name == "cond" else 1)
                if cache is not None and not cache.should_compute():
                    preds[id(st), name] = cache.predict()
                else:
                    rows.append((st, name, cache))
        if rows:
            batched = len(rows) > 1
            with contextlib.ExitStack() as stack:
                if batched:
                    stack.enter_context(invariant.rows_per_request(1))
                    stack.enter_context(invariant.per_sample())
                out = self._rows(rows, inputs)
            for k, (st, name, cache) in enumerate(rows):
                preds[id(st), name] = out[k:k + 1] if batched else out
                if cache is not None:
                    cache.update(preds[id(st), name])
        for st in states:
            noise = preds[id(st), "cond"]
            if st.guided:
                uncond = preds[id(st), "uncond"]
                noise = uncond + st.guidance * (noise - uncond)
            st.latents = st.scheduler.step(noise, st.timesteps[st.i], st.latents, return_dict=False)[0]
            st.i += 1

    def _step_input(self, st: _WanStep, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the transformer's input, its timestep) of the request's current step, as WanDenoise.run makes them."""
        model_input = (st.latents if st.condition is None else torch.cat([st.latents, st.condition], dim=1))
        return model_input.to(dtype), st.timesteps[st.i].expand(st.latents.shape[0])

    def _rows(self, rows: list[tuple[_WanStep, str, Any]], inputs: dict[int, tuple[Any, Any]]) -> torch.Tensor:
        """One transformer call over the rows (alone: exactly the call WanDenoise.run makes)."""
        if len(rows) == 1:
            st, name, _ = rows[0]
            x, t = inputs[id(st)]
            return self._predict(name, x, t, st.pos if name == "cond" else st.neg, st.image_embeds)
        images = [st.image_embeds for st, _, _ in rows]
        with self._model_lock:
            return self.transformer(
                hidden_states=torch.cat([inputs[id(st)][0] for st, _, _ in rows]),
                timestep=torch.cat([inputs[id(st)][1] for st, _, _ in rows]),
                encoder_hidden_states=torch.cat([st.pos if n == "cond" else st.neg for st, n, _ in rows]),
                encoder_hidden_states_image=None if images[0] is None else torch.cat(images),
                return_dict=False)[0]

    def progress(self, state: Any) -> tuple[int, int]:
        return state.i - state.first, state.end - state.first

    def estimate(self, state: Any) -> Any:
        return state.latents

    def end(self, state: Any) -> dict[str, Any]:
        return {"denoised": state.latents}

    def stats(self, state: Any) -> dict[str, Any]:
        return {} if state.cache is None else {"cache_skipped": round(state.cache.skipped_share(), 3)}


class WanI2VSteppedDenoise(WanDenoise, _SteppedWan):
    """Wan2.1 image-to-video denoise, batching its steps (_SteppedWan); alone, WanDenoise.run."""

    run = WanDenoise.run


class WanT2VSteppedDenoise(WanT2VDenoise, _SteppedWan):
    """Wan2.1 text-to-video denoise, batching its steps (_SteppedWan); alone, WanDenoise.run."""

    run = WanDenoise.run
