"""Wan2.2 denoise: the two experts of the A14B models as two stages, and the 5B model's one transformer.

``WanPipeline`` / ``WanImageToVideoPipeline`` with ``transformer_2`` and ``boundary_ratio`` run the high-noise
expert (``transformer``) for the timesteps ``t >= boundary_ratio * num_train_timesteps`` and the low-noise
expert (``transformer_2``) for the rest, each with its own guidance scale (``guidance_scale``,
``guidance_scale_2``; the second defaults to the first). Here ``denoise_high`` loads only ``transformer`` and
runs the steps before that boundary; ``denoise_low`` loads only ``transformer_2`` and runs the rest.

UniPC is a multistep solver: each step uses the model outputs of the steps before it. So what crosses the
boundary is the latents *and* the scheduler's state (its model-output history, the timesteps of that history,
the last sample, the warm-up counters and the step index): :func:`scheduler_state` packs it into tensors of
the message, :func:`restore_scheduler` unpacks it into the low stage's scheduler after its own
``set_timesteps`` (the timesteps and sigmas are a pure function of the config and the step count). The result is
byte-identical to the one-call pipeline.

Wan2.2-TI2V-5B (``expand_timesteps``): one transformer; the first frame's latents replace the first latent
frame at every step (``first_frame_mask``), and the timestep is given per latent token (0 on the first frame).
Without an image (``WanPipeline`` over the same folder) the condition is empty and every token is at the step's
timestep.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import StageContext
from engine.stages.components import decode_image, load_component, model_index, no_grad
from engine.stages.wan.denoise import WanDenoise, WanT2VDenoise, _SteppedWan, _WanStep
from engine.stages.wan.vae import WanVaeEncode, check_wan_size
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")

TRANSFORMER = ("diffusers", "WanTransformer3DModel")
SCHEDULER = ("diffusers", "UniPCMultistepScheduler")
# UniPC's counters, carried as ``scheduler_counters`` (-1: None) followed by the boundary step and the step count
COUNTERS = ("_step_index", "lower_order_nums", "this_order", "_begin_index")


class ExpertMismatch(RuntimeError):
    """The low-noise stage's scheduler does not continue the high-noise stage's (other model folders)."""


def boundary_step(timesteps: torch.Tensor, boundary_ratio: float | None, num_train_timesteps: int) -> int:
    """How many of ``timesteps`` the high-noise expert runs: those ``>= boundary_ratio * num_train_timesteps``,
    the pipeline's own test (all of them without a boundary). They lead, as timesteps only decrease."""
    if boundary_ratio is None:
        return len(timesteps)
    high = [bool(t >= boundary_ratio * num_train_timesteps) for t in timesteps]
    k = sum(high)
    if high != [True] * k + [False] * (len(high) - k):
        raise ExpertMismatch(f"timesteps do not decrease across the boundary: {timesteps.tolist()}")
    return k


def scheduler_state(scheduler: Any, boundary: int) -> dict[str, torch.Tensor]:
    """The state a UniPC scheduler carries from one step to the next, as four tensors."""
    filled = [m for m in scheduler.model_outputs if m is not None]
    if not filled:
        raise ExpertMismatch("the high-noise stage ran no step: nothing to hand on")
    like = filled[0]
    if any(m.dtype != torch.float32 for m in filled) or scheduler.last_sample.dtype != torch.float32:
        raise ExpertMismatch("UniPC's history is not float32: the message declares float32")
    outputs = torch.stack([torch.zeros_like(like) if m is None else m for m in scheduler.model_outputs])
    timesteps = torch.tensor([-1 if t is None else int(t) for t in scheduler.timestep_list], dtype=torch.int64)
    counters = [getattr(scheduler, c, None) for c in COUNTERS]
    counters = [-1 if v is None else int(v) for v in counters] + [boundary, len(scheduler.timesteps)]
    return {"scheduler_outputs": outputs, "scheduler_timesteps": timesteps,
            "scheduler_last_sample": scheduler.last_sample,
            "scheduler_counters": torch.tensor(counters, dtype=torch.int64)}


def restore_scheduler(scheduler: Any, state: Mapping[str, torch.Tensor], boundary: int, device: str) -> None:
    """Continue ``scheduler`` (after ``set_timesteps``) from the state :func:`scheduler_state` packed."""
    counters = [int(v) for v in state["scheduler_counters"].tolist()]
    *values, sent_boundary, steps = counters
    if (sent_boundary, steps) != (boundary, len(scheduler.timesteps)):
        raise ExpertMismatch(f"the high-noise stage stopped at step {sent_boundary} of {steps}; this scheduler "
                             f"switches at step {boundary} of {len(scheduler.timesteps)}")
    if values[0] < 0:  # the high-noise stage took no step: this scheduler starts fresh
        return
    for name, value in zip(COUNTERS, values, strict=True):
        if value >= 0:
            setattr(scheduler, name, value)
    ts = state["scheduler_timesteps"].to(device)
    outputs = state["scheduler_outputs"].to(device, torch.float32)
    # the history as step() left it: tensors of their own (the message's views are read-only, and reused)
    scheduler.model_outputs = [None if int(ts[i]) < 0 else outputs[i].clone() for i in range(len(ts))]
    scheduler.timestep_list = [None if int(ts[i]) < 0 else ts[i].clone() for i in range(len(ts))]
    scheduler.last_sample = state["scheduler_last_sample"].to(device, torch.float32).clone()


@dataclass
class _ExpertStep(_WanStep):
    """One request stepping through a Wan2.2 expert: a Wan request (its steps from ``first`` to ``end``, the
    guidance of this expert) with the boundary its scheduler state is handed on at and the TI2V mask."""

    boundary: int = 0
    mask: torch.Tensor | None = None


class _Expert(WanDenoise, _SteppedWan):
    """One Wan2.2 transformer (``expert``) over the steps of its side of the boundary.

    It steps (engine.worker.batching): requests of one size, guidance mode and text length share one
    transformer call per step over their cond and uncond rows, each with its own timesteps (so its own
    boundary), guidance, scheduler (the low expert's restored from the high one's) and caches; each item gets
    its solo bytes (tests/engine/stages/test_wan22_batching.py). ``run`` is the plain loop below, the same ops
    as a batch of one."""

    #: the model sub-folder of this stage's transformer
    expert: ClassVar[str] = "transformer"
    #: True: the steps before the boundary (and the state handed on); False: the steps after it
    high: ClassVar[bool] = True
    components: ClassVar[tuple[str, ...]] = ("transformer", "scheduler")
    adapts: ClassVar[tuple[str, str] | None] = None  # the Wan2.2 workflows take no LoRA adapters

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.components = (cls.expert, "scheduler")

    def _load(self, model_dir: Path) -> None:
        self.transformer = load_component(model_dir, self.expert, TRANSFORMER, self.dtype, self.device)
        self.scheduler = load_component(model_dir, "scheduler", SCHEDULER)
        self._model_lock = threading.Lock()
        index = model_index(model_dir)
        self.boundary_ratio = index.get("boundary_ratio")
        self.expand_timesteps = bool(index.get("expand_timesteps"))

    def steps_of(self, params: Mapping[str, Any]) -> tuple[Any, int, int, int]:
        """(a fresh scheduler with the request's timesteps, the boundary step, first step, end step)."""
        scheduler = self.fresh_scheduler(self.scheduler)
        scheduler.set_timesteps(params["num_inference_steps"], device=self.device)
        scheduler.set_begin_index(0)  # as WanPipeline (the same index _init_step_index finds)
        k = boundary_step(scheduler.timesteps, self.boundary_ratio, scheduler.config.num_train_timesteps)
        return scheduler, k, *((0, k) if self.high else (k, len(scheduler.timesteps)))

    def calibration_inputs(self, made: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """A low-noise expert continues the high one's UniPC state, which random numbers are not (the
        calibration stopped with ``ExpertMismatch``): made-up inputs carry the empty state (the one a high
        stage that took no step hands on) at this request's boundary and step count, so the scheduler is not
        restored and starts afresh. Its numbers are not a served request's, but a step makes the transformer
        calls of a served one, which is what the calibration times."""
        if self.high or self.boundary_ratio is None:
            return made
        scheduler, boundary, _, _ = self.steps_of(params)
        return {**made, **_empty_state(scheduler, made["expert_latents"], boundary)}

    def _guidance(self, params: Mapping[str, Any]) -> float:
        if self.high or self.boundary_ratio is None:
            return float(params["guidance_scale"])
        g2 = params.get("guidance_scale_2")
        return float(params["guidance_scale"] if g2 is None else g2)

    def _start(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
               scheduler: Any, boundary: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The latents this stage starts from, and the condition of every step (None: none)."""
        if self.high:
            return self._initial(inputs, params)
        restore_scheduler(scheduler, inputs, boundary, self.device)
        condition = inputs.get("condition")
        return (inputs["expert_latents"].to(self.device, torch.float32).clone(),
                None if condition is None else condition.to(self.device, torch.float32))

    def _mask(self, latents: torch.Tensor, first_frame: bool) -> torch.Tensor | None:
        """The mask of ``expand_timesteps`` (None without): with a first frame, ``prepare_latents``'s (0 on the
        first latent frame, 1 elsewhere); without one (text only), ``WanPipeline``'s ones."""
        if not self.expand_timesteps:
            return None
        _, _, frames, height, width = latents.shape
        mask = torch.ones(1, 1, frames, height, width, dtype=torch.float32, device=latents.device)
        if first_frame:
            mask[:, :, 0] = 0
        return mask

    @no_grad
    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> _ExpertStep:
        """The request's state at this stage's first step: its scheduler (the low expert's restored), latents,
        condition and mask, this expert's guidance and fresh caches (as :meth:`run` makes them)."""
        dtype = self.transformer.dtype
        scheduler, boundary, first, end = self.steps_of(params)
        latents, condition = self._start(inputs, params, scheduler, boundary)
        # the pipeline guides both experts when guidance_scale > 1 (guidance_scale_2 only scales the low one)
        return _ExpertStep(scheduler, list(scheduler.timesteps), self._guidance(params),
                           inputs["prompt_embeds"].to(self.device, dtype),
                           inputs["negative_prompt_embeds"].to(self.device, dtype), None, latents, condition,
                           self._cache(options), i=first, first=first, end=end,
                           guided=float(params["guidance_scale"]) > 1.0, boundary=boundary,
                           mask=self._mask(latents, condition is not None))

    def _step_input(self, st: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _model_input(st.latents, st.condition, st.mask, st.timesteps[st.i], dtype)

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        dtype = self.transformer.dtype
        scheduler, boundary, first, end = self.steps_of(params)
        latents, condition = self._start(inputs, params, scheduler, boundary)
        # the pipeline guides both experts when guidance_scale > 1 (guidance_scale_2 only scales the low one)
        guided = float(params["guidance_scale"]) > 1.0
        scale = self._guidance(params)
        pos = inputs["prompt_embeds"].to(self.device, dtype)
        neg = inputs["negative_prompt_embeds"].to(self.device, dtype)
        mask = self._mask(latents, condition is not None)
        timesteps = scheduler.timesteps
        # the request's caches, fresh in each expert stage: diffusers' hook keeps a state per transformer, so
        # the low-noise expert's schedule starts at its first step (the boundary), not at the request's
        cache = self._cache(ctx.options)
        for i in range(first, end):
            ctx.check()
            t = timesteps[i]
            model_input, timestep = _model_input(latents, condition, mask, t, dtype)
            noise_pred = self._predict("cond", model_input, timestep, pos, None, (), cache)
            if guided:
                noise_uncond = self._predict("uncond", model_input, timestep, neg, None, (), cache)
                noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            ctx.step_done(i + 1 - first, end - first)
            ctx.offer_preview(i + 1, len(timesteps), latents)  # previews count the whole run's steps
        if cache is not None:
            ctx.stats["cache_skipped"] = round(cache.skipped_share(), 3)
        return self._outputs(scheduler, boundary, end > first, latents, condition, mask)

    def _outputs(self, scheduler: Any, boundary: int, stepped: bool, latents: torch.Tensor,
                 condition: torch.Tensor | None, mask: torch.Tensor | None) -> dict[str, Any]:
        """The high expert's latents and UniPC state at the boundary (``stepped`` False: it took no step), or
        ``denoised`` (the TI2V first frame put back)."""
        if self.high and self.boundary_ratio is not None:
            state = scheduler_state(scheduler, boundary) if stepped else _empty_state(scheduler, latents, boundary)
            return {"expert_latents": latents, **state}
        if mask is not None and condition is not None:
            latents = (1 - mask) * condition + mask * latents
        return {"denoised": latents}

    def end(self, state: Any) -> dict[str, Any]:
        return self._outputs(state.scheduler, state.boundary, state.end > state.first, state.latents,
                             state.condition, state.mask)

    def estimate(self, state: Any) -> Any:
        return state.latents

    def preview(self, state: Any) -> tuple[int, int, Any]:
        """(the whole run's step, its steps in all, the latents): an expert's previews count the whole run's
        steps, as :meth:`run` offers them (``ctx.offer_preview``), while its progress counts its own."""
        return state.i, len(state.timesteps), state.latents


def _model_input(latents: torch.Tensor, condition: torch.Tensor | None, mask: torch.Tensor | None, t: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the transformer's input, its timestep) at step timestep ``t``. TI2V (``mask``): the first frame's latents
    in place of the first noisy frame, a timestep per latent token (0 under the first frame)."""
    if mask is not None:
        model_input = ((1 - mask) * condition + mask * latents if condition is not None else latents)
        timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        return model_input.to(dtype), timestep
    model_input = (latents if condition is None else torch.cat([latents, condition], dim=1)).to(dtype)
    return model_input, t.expand(latents.shape[0])


def _empty_state(scheduler: Any, latents: torch.Tensor, boundary: int) -> dict[str, torch.Tensor]:
    """The state of a scheduler that took no step (a boundary at step 0): nothing to continue from."""
    order = len(scheduler.model_outputs)
    counters = [-1] * len(COUNTERS) + [boundary, len(scheduler.timesteps)]
    return {"scheduler_outputs": torch.zeros((order, *latents.shape), dtype=torch.float32),
            "scheduler_timesteps": torch.full((order,), -1, dtype=torch.int64),
            "scheduler_last_sample": torch.zeros_like(latents),
            "scheduler_counters": torch.tensor(counters, dtype=torch.int64)}


class Wan22T2VHigh(WanT2VDenoise, _Expert):
    """wan2.2-t2v-a14b ``denoise_high``: the initial noise from the seed, then the high-noise expert's steps;
    hands on ``expert_latents`` and UniPC's state."""

    expert = "transformer"
    high = True
    adapts = None  # not WanT2VDenoise's: the Wan2.2 workflows take no LoRA adapters


class Wan22I2VHigh(_Expert):
    """wan2.2-i2v-a14b ``denoise_high``: vae_encode's noise and first-frame condition, the high-noise steps."""

    expert = "transformer"
    high = True


class Wan22Low(_Expert):
    """``denoise_low`` of both A14B workflows: the low-noise expert (``transformer_2``) continues from the
    high-noise stage's latents and UniPC state to ``denoised``."""

    expert = "transformer_2"
    high = False


class Wan22TI2VDenoise(_Expert):
    """wan2.2-ti2v-5b ``denoise``: its one transformer over every step, with the first frame's latents in
    place at every step (``expand_timesteps``)."""

    expert = "transformer"
    high = False

    def steps_of(self, params: Mapping[str, Any]) -> tuple[Any, int, int, int]:
        scheduler = self.fresh_scheduler(self.scheduler)
        scheduler.set_timesteps(params["num_inference_steps"], device=self.device)
        return scheduler, 0, 0, len(scheduler.timesteps)

    def _start(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
               scheduler: Any, boundary: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        latents, condition = self._initial(inputs, params)
        return latents, None if condition.numel() == 0 else condition  # empty: text only (no image)


class Wan22VaeEncode(WanVaeEncode):
    """wan2.2-ti2v-5b ``vae_encode``: the initial noise and the first frame's normalised latents (the
    pipeline's ``prepare_latents`` with ``expand_timesteps``: the condition is the one frame, not a padded clip)."""

    def _load(self, model_dir: Path) -> None:
        super()._load(model_dir)
        self.pipe.register_to_config(expand_timesteps=True)

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        pipe = self.pipe
        height, width, frames = params["height"], params["width"], params["num_frames"]
        check_wan_size(height, width, frames, self.multiple, pipe.vae_scale_factor_temporal)
        if not len(inputs["image"]):  # text only: WanPipeline's noise, and no condition
            return self._noise_only(height, width, frames, int(params["seed"]))
        pixels = pipe.video_processor.preprocess(decode_image(inputs["image"]), height=height, width=width)
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        latents, condition, _mask = pipe.prepare_latents(
            pixels.to(self.device, torch.float32), 1, pipe.vae.config.z_dim, height, width, frames, torch.float32,
            self.device, generator,
        )  # the mask is a function of the shape: denoise makes it again (Wan22TI2VDenoise._mask)
        return {"latents": latents, "condition": condition}

    def _noise_only(self, height: int, width: int, frames: int, seed: int) -> dict[str, Any]:
        """``WanPipeline.prepare_latents``'s draw: float32 noise of the latent shape from a CPU generator (the
        transformer's ``in_channels`` are the VAE's ``z_dim`` in this model: its input is the latents alone),
        and an empty ``condition``."""
        from diffusers.utils.torch_utils import randn_tensor

        pipe = self.pipe
        shape = (1, pipe.vae.config.z_dim, (frames - 1) // pipe.vae_scale_factor_temporal + 1,
                 height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        latents = randn_tensor(shape, generator=generator, device=torch.device(self.device), dtype=torch.float32)
        return {"latents": latents, "condition": latents.new_zeros((*shape[:2], 0, *shape[3:]))}
