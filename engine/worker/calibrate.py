"""Calibration: a stage's cost measured when its worker starts, at a spread of sizes, so that the first request
at a size nothing has run yet is priced from measurements (engine.workflow.pricing), not from the worst-case
growth of one small size.

What is measured, per (workflow, stage) the instance serves: the spec bound to the loaded model (its default
size is the model's: 512x512 for SD 1.5, 64x64 for the tiny test model), then one step of the stage (one call
for a stage that does not step) at pixel counts of 1/4, 1/2, 1, 2, 4, 8, 16... times the default's, same aspect,
within the parameter's bounds, on synthetic inputs of the shapes the spec declares (the model's dimensions read
from its components' configs, :func:`model_dims`). The smallest size runs once more first, untimed: the
process's one-off costs (lazy initialisation, kernel selection) are paid there, as the first real request would
otherwise pay them. Each measurement is one ``(units, steps, seconds)`` sample for
:meth:`engine.workflow.pricing.Samples.calibrated`; the completed runs join them as they come.

The budget (``onepiece node --calibrate-s``, :class:`engine.worker.config.Calibration`): the seconds a stage's
calibration may spend in all. The next size is measured only while the fit so far predicts it fits in what is
left, so the sizes stop growing once a step is a sizeable part of the budget: on a GPU that is at or past the
default, on one CPU core with the tiny models somewhere past 4x the default. 0 turns it off.

When: the worker is ready (its route published, its ready file written) before any of it runs. The TaskWorker's
loop runs one measurement at a time while it is idle (nothing handled for :data:`IDLE_S`) and checks its ring
between them, so a request that arrives waits at most for the measurement in hand, never for the calibration.

Order: the smallest size first, untimed (the warm-up), then the default size, then the others from the smallest
up. A heavy stage (a video decoder on CPU) may have budget for one timed point only, and that point is then the
default request's, the size most requests come at, priced from its own measurement rather than extrapolated
from a quarter of its pixels.

An instance that can collaborate (a CFG-parallel pair, engine.worker.collab) is calibrated too: its step is
timed alone, as it runs in Individual mode (the default); while the workflow is in Collaboration mode the
measurement is scaled by the share of a step the leader computes itself (the executor's ``cfg_share``: half a
guided step), which is what a helped request's steps cost. The runs that follow correct either.

Not calibrated: a stage whose inputs cannot be made here (a dimension no config names: it learns from its runs,
as before), and a stage stretched to a floor time per run (a test hook: a floor per run is not a cost per step).
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.workflow import InvalidRequest, WorkflowSpec, get_workflow, images, limits
from engine.workflow.options import Options

log = logging.getLogger("onepiece.worker")

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # pixel counts tried, times the default's
MULTIPLES = (16, 32, 64)  # sides are rounded to the first of these the spec's rules take
IDLE_S = 0.3  # the worker handled nothing for this long: a measurement may run
MAX_TEXT = 512  # a tokenizer's model_max_length is sometimes a sentinel (1e30)

# model dimensions a stage's input shapes name that neither the request nor the spec's bound model gives:
# (component, config key) in the order tried
CONFIG_DIMS: dict[str, tuple[tuple[str, str], ...]] = {
    "D_text": (("unet", "cross_attention_dim"), ("transformer", "joint_attention_dim"), ("transformer", "text_dim"),
               ("text_encoder", "d_model"), ("text_encoder", "hidden_size")),
    "D_pool": (("transformer", "pooled_projection_dim"), ("text_encoder", "projection_dim")),
    "C_lat": (("vae", "latent_channels"), ("vae", "z_dim")),
    "L_text": (("tokenizer", "model_max_length"),),
    "D_img": (("image_encoder", "hidden_size"),),
}


@functools.lru_cache(maxsize=8)
def _configs(folder: str) -> dict[str, dict[str, Any]]:
    return limits.read_configs(folder, sorted({c for keys in CONFIG_DIMS.values() for c, _ in keys}))


def model_dims(spec: WorkflowSpec, folder: str | Path, params: Mapping[str, Any]) -> dict[str, int]:
    """The dimensions of the values a request with ``params`` hands between stages: the request's own
    (:meth:`WorkflowSpec.dims`), the bound model's (:attr:`WorkflowSpec.dim_values`), and those the
    components' configs give (:data:`CONFIG_DIMS`; the latent sides from the VAE's depth)."""
    configs = _configs(str(folder))
    out: dict[str, int] = {}
    for name, keys in CONFIG_DIMS.items():
        for component, key in keys:
            value = (configs.get(component) or {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                out[name] = min(value, MAX_TEXT) if name == "L_text" else value
                break
    out.setdefault("L_text", 77)
    out["L_neg"] = out["L_text"]
    vae = configs.get("vae") or {}
    blocks, down = vae.get("block_out_channels"), vae.get("temperal_downsample")
    # the VAE's spatial factor: its config's own where it gives one (Wan2.2-TI2V-5B's 16); else AutoencoderKL
    # halves the sides between its blocks, and the Wan and Qwen-Image VAEs once per entry of
    # temperal_downsample (their pipelines' vae_scale_factor; engine.stages.wan.vae.wan_vae_factors)
    scale = vae.get("scale_factor_spatial") if isinstance(vae.get("scale_factor_spatial"), int) else \
        2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else \
        2 ** len(down) if isinstance(down, list) and down else None
    if scale is not None and "height" in params:
        out["H_lat"], out["W_lat"] = int(params["height"]) // scale, int(params["width"]) // scale
    vision = configs.get("image_encoder") or {}
    if isinstance(vision.get("image_size"), int) and isinstance(vision.get("patch_size"), int):
        out["N_img"] = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    return {**out, **spec.dim_values, **spec.dims(params)}


def synthetic_inputs(spec: WorkflowSpec, stage: str, dims: Mapping[str, int], params: Mapping[str, Any],
                     compute_dtype: str) -> dict[str, Any]:
    """The stage's declared inputs, made up at the shapes ``dims`` give them (torch tensors, png bytes for an
    image input); KeyError naming a dimension or value it cannot make."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for name in spec.stage(stage).inputs:
        t = spec.value_spec(name)
        if t.kind == "blob":
            if t.media == "image":
                out[name] = images.blank_png(int(params.get("width", 64)), int(params.get("height", 64)))
            elif t.optional:
                out[name] = b""
            else:
                raise KeyError(f"value {name} (an opaque blob)")
            continue
        shape = [d if isinstance(d, int) else dims[d] for d in t.shape]
        dtype = getattr(torch, compute_dtype if t.dtype == "compute" else t.dtype)
        if dtype.is_floating_point:
            out[name] = (0.5 * torch.randn(shape, generator=gen)).to(dtype)
        elif dtype == torch.uint8:  # pixels: varied, as a decoder's are (a flat picture costs an encoder nothing)
            out[name] = torch.randint(0, 256, shape, generator=gen, dtype=dtype)
        else:
            out[name] = torch.full(shape, 1, dtype=dtype)
    return out


def sized(spec: WorkflowSpec, base: Mapping[str, Any], scale: float, inputs: Callable[[int, int], dict[str, bytes]]
          ) -> dict[str, Any] | None:
    """``base`` (resolved params) at ``scale`` times its pixel count, same aspect, within the bounds and on a
    side multiple the spec takes, as a plain request's model parameters (its options are the defaults:
    lossless, no previews, no adapters); None where none does."""
    if "height" not in base or "width" not in base:
        return Options.split(base)[0] if scale == 1.0 else None
    h0, w0 = int(base["height"]), int(base["width"])
    hp, wp = spec.param("height"), spec.param("width")
    for m in MULTIPLES:
        h = max(m, round(h0 * math.sqrt(scale) / m) * m)
        w = max(m, round(w0 * math.sqrt(scale) / m) * m)
        h = int(min(max(h, hp.minimum or h), hp.maximum or h))
        w = int(min(max(w, wp.minimum or w), wp.maximum or w))
        try:
            return Options.split(spec.validate_request({**base, "height": h, "width": w}, inputs(w, h)))[0]
        except InvalidRequest:
            continue
    return None


@dataclass
class Target:
    """One (workflow, stage) to calibrate: its bound spec, the sizes planned (smallest first) and what was done."""

    spec: WorkflowSpec
    stage: str
    plan: list[dict[str, Any]]  # in the order measured: the default size first (see plan)
    budget_s: float
    spent_s: float = 0.0
    points: int = 0
    warmed: bool = False
    done: bool = False
    notes: list[str] = field(default_factory=list)


def plan(spec: WorkflowSpec, stage: str, folder: str | Path) -> list[dict[str, Any]]:
    """The sizes to measure ``stage`` at, in the order measured: the default request (the bound spec's
    defaults, the warm-up's prompt) first, then the others it scaled by :data:`SCALES`, smallest first, each
    at the least steps that give the stage one; one size only for a stage whose work does not grow with it
    (a text encoder)."""
    model = spec.costs.get(stage)
    warm, blobs = spec.warm_up_request()
    base = spec.resolve_params({k: v for k, v in warm.items() if isinstance(v, str)})  # the prompt; defaults else

    def inputs(w: int, h: int) -> dict[str, bytes]:
        return {k: images.blank_png(w, h) for k in blobs}

    out, seen = [], set()
    for scale in (1.0, *(s for s in SCALES if s != 1.0)):  # the default first: it wins a tie of equal units
        p = sized(spec, base, scale, inputs)
        units = model.units(spec.dims(p)) if p is not None and model is not None else None
        if p is None or units in seen:  # a size already planned, or one the stage's work does not grow with
            continue
        seen.add(units)
        if "num_inference_steps" in p and model is not None:
            for s in (1, 2, 4, 8):
                if model.steps(spec.dims({**p, "num_inference_steps": s})) >= 1:
                    p["num_inference_steps"] = s
                    break
        out.append(p)
    return out


def pixels(params: Mapping[str, Any]) -> int:
    """A planned size's pixel count, frames included (the warm-up runs on the least)."""
    return int(params.get("height", 1)) * int(params.get("width", 1)) * int(params.get("num_frames", 1))


def bound_spec(workflow: str, folder: str | Path) -> WorkflowSpec:
    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder)))


def _sync(device: str) -> None:
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        torch.cuda.synchronize()


def _threads() -> int:
    if "torch" in sys.modules:
        import torch

        return max(1, torch.get_num_threads())
    return 1


def time_once(executor: Any, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> float:
    """Seconds of one step (a stage that steps: :class:`engine.stages.base.SteppedStage`) or one call, as
    they would be on a quiet host. On a GPU, the wall time. On CPU, the wall time or the process's CPU time
    over its thread budget, whichever is less: at start every worker of a host calibrates at once, and on
    the 2-core host 11 workers sharing the cores made each measurement 2-3x its time on a quiet host
    (benchmarks/estimates.md); CPU time is what the step itself did."""
    from engine.stages.base import StageContext, SteppedStage

    device = str(getattr(executor, "device", "cpu"))
    state = executor.begin(inputs, params) if isinstance(executor, SteppedStage) else None
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    if state is not None:
        executor.step([state])
    else:
        executor.run(inputs, params, StageContext())
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall if device.startswith("cuda") else min(wall, cpu / _threads())


Record = Callable[[str, float, float, float], Any]  # (workflow, units, steps, seconds) -> the fit after it, or None
Share = Callable[[str, Mapping[str, Any]], float]  # (workflow, params) -> the share of a measured step it costs


class Calibrator:
    """The calibration of every (workflow, stage) one instance serves, one measurement per :meth:`tick`;
    ``record(workflow, units, steps, seconds)`` takes each (the worker's samples: it returns their fit, which
    predicts the next size's time against what is left of the budget)."""

    def __init__(self, executor: Any, folder: str | Path, targets: list[Target], record: Record,
                 share: Share | None = None) -> None:
        from engine.stages.base import compute_dtype_name

        self.executor, self.folder, self.targets, self.record = executor, str(folder), targets, record
        self.share: Share = share or (lambda workflow, params: 1.0)
        self.dtype = compute_dtype_name(str(getattr(executor, "device", "cpu")))
        self.fits: dict[str, Any] = {}

    @classmethod
    def of(cls, executor: Any, folder: str | Path, members: list[tuple[str, str]], budget_s: float,
           record: Record, share: Share | None = None) -> Calibrator | None:
        """The calibration of ``members`` (``(workflow, stage)``) within ``budget_s`` each; None when off or
        there is nothing to measure (see the module docstring). ``share(workflow, params)``: the share of a
        measured step a request of ``params`` costs this instance now (Collaboration mode); 1 when not given."""
        if budget_s <= 0 or getattr(executor, "floor_s", 0.0) > 0:
            return None
        targets = []
        for workflow, stage in members:
            try:
                spec = bound_spec(workflow, folder)
                targets.append(Target(spec, stage, plan(spec, stage, folder), budget_s))
            except Exception as exc:  # a spec this folder's configs do not fit: it learns from its runs
                log.warning("no calibration of %s/%s: %s", workflow, stage, exc)
        return cls(executor, folder, targets, record, share) if targets else None

    @property
    def pending(self) -> bool:
        return any(not t.done for t in self.targets)

    def tick(self) -> Target | None:
        """One measurement (or the decision that a target is done); the target it was for (None: all done)."""
        t = next((t for t in self.targets if not t.done), None)
        if t is None:
            return None
        try:
            self._advance(t)
        except Exception as exc:  # a made-up input this stage does not take, a device out of memory...
            t.done = True
            t.notes.append(f"{type(exc).__name__}: {exc}"[:200])
            log.warning("calibration of %s/%s stopped: %s", t.spec.name, t.stage, exc)
        if t.done:
            log.info("calibrated %s/%s: %d sizes in %.2fs", t.spec.name, t.stage, t.points, t.spent_s)
        return t

    def _advance(self, t: Target) -> None:
        if not t.plan:
            t.done = True
            return
        if not t.warmed:  # the process's one-off costs, paid untimed on the smallest size
            least = min(t.plan, key=pixels)
            time_once(self.executor, self._inputs(t, least), least)
            t.warmed = True
            return
        params = t.plan[0]
        model = t.spec.costs.get(t.stage)
        units = model.units(t.spec.dims(params)) if model is not None else 0.0
        steps = self._steps(t, params)
        fit = self.fits.get(t.spec.name)
        if fit is not None and model is not None and t.points:
            if t.spent_s + steps * fit.per_step(units, model.growth) > t.budget_s:
                t.done = True
                return
        inputs = self._inputs(t, params)
        seconds = time_once(self.executor, inputs, params)
        t.spent_s += seconds
        if t.spent_s + seconds <= t.budget_s:
            # once more where the budget allows, the faster kept: the first call at a new shape pays that
            # shape's one-off costs (oneDNN primitives, allocator growth), which a request's later steps do
            # not; noise is only ever slower
            again = time_once(self.executor, inputs, params)
            t.spent_s += again
            seconds = min(seconds, again)
        self.fits[t.spec.name] = self.record(t.spec.name, units, steps, seconds * self.share(t.spec.name, params))
        t.plan.pop(0)
        t.points += 1
        t.done = not t.plan or t.spent_s >= t.budget_s

    def _inputs(self, t: Target, params: Mapping[str, Any]) -> dict[str, Any]:
        made = synthetic_inputs(t.spec, t.stage, model_dims(t.spec, self.folder, params), params, self.dtype)
        return self.executor.calibration_inputs(made, params)

    def _steps(self, t: Target, params: Mapping[str, Any]) -> float:
        """The steps one measurement times: one for a stage that steps (its own step timed), else the run's."""
        from engine.stages.base import SteppedStage

        if isinstance(self.executor, SteppedStage):
            return 1.0
        model = t.spec.costs.get(t.stage)
        return float(model.steps(t.spec.dims(params))) if model is not None else 1.0

    def report(self, workflow: str) -> dict[str, Any]:
        """What the calibration of ``workflow``'s stage did (published with the instance's counters)."""
        t = next((t for t in self.targets if t.spec.name == workflow), None)
        if t is None:
            return {}
        return {"points": t.points, "spent_s": round(t.spent_s, 3), "done": t.done, "notes": t.notes}
