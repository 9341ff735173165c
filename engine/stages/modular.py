"""A stage that runs a named subset of a Modular Diffusers pipeline's blocks (diffusers.modular_pipelines).

Modular Diffusers cuts a pipeline into blocks that declare their inputs and outputs and pass one
``PipelineState`` along. A stage here is a list of those blocks by name (``blocks``: name -> class), run in
order on a state built from the message's values and the request's parameters; what it hands on is the
state values the workflow spec declares as its outputs (``outputs``), nothing else. Checked bit for bit
against the one-call pipelines (FluxPipeline, QwenImagePipeline) by tests/engine/stages/test_flux_qwen.py.

Two things the blocks do not do for a stage, done here:

* A block pipeline holding no VAE assumes an 8x VAE (``vae_scale_factor``, the pitfall in MODELS.md): the
  denoise stage of a model with another VAE would draw latents of the wrong size. The pipeline class is
  subclassed once per stage with the factor read from the folder's ``vae/config.json``.
* A denoise loop block (``LoopSequentialPipelineBlocks``) runs every step in one call. A denoise stage is a
  :class:`SteppedModularStage`: it runs the loop block's sub-blocks one step at a time itself (the
  request's checks before each step and its progress after come from ``SteppedStage.run`` or the batcher),
  so an instance's requests can share a step. A plain :class:`ModularStage` that holds a loop block wraps
  its ``loop_step`` for the run instead (:meth:`ModularStage._loop`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages import caching, invariant
from engine.stages.base import BatchedCallStage, StageContext, SteppedStage
from engine.stages.components import TorchStage, no_grad, read_config
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")

_MODULAR = "diffusers.modular_pipelines"


def _block(path: str) -> Any:
    """``"flux.encoders.FluxTextEncoderStep"`` (under diffusers.modular_pipelines) -> a block instance."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(f"{_MODULAR}.{module}"), name)()


_CLASSES: dict[tuple[type, int], type] = {}


def _staged_class(base: type, vae_scale_factor: int) -> type:
    """``base`` whose ``vae_scale_factor`` is the model's, whether or not this stage holds the VAE."""
    key = (base, vae_scale_factor)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Staged{base.__name__}", (base,), {"vae_scale_factor": property(lambda self: vae_scale_factor)})
    return _CLASSES[key]


class ModularStage(TorchStage):
    """Runs ``blocks`` (name -> block class path under ``diffusers.modular_pipelines``) over the components in
    ``classes``. Subclasses say how the request fills the state (:meth:`block_inputs`) and which state values
    are the stage's outputs (``outputs``: output name -> state name)."""

    pipeline: ClassVar[str] = ""  # the ModularPipeline class, e.g. "flux.FluxModularPipeline"
    blocks: ClassVar[dict[str, str]] = {}
    outputs: ClassVar[dict[str, str]] = {}
    #: the folder's VAE config -> the pipeline's vae_scale_factor
    vae_scale: ClassVar[Callable[[dict[str, Any]], int]]
    reads: ClassVar[tuple[str, ...]] = ("vae",)  # for vae_scale, whether or not the stage loads the VAE

    def _load(self, model_dir: Path) -> None:
        from diffusers.modular_pipelines import SequentialPipelineBlocks

        self.block_seq = SequentialPipelineBlocks.from_blocks_dict({n: _block(p) for n, p in self.blocks.items()})
        module, _, name = self.pipeline.rpartition(".")
        base = getattr(importlib.import_module(f"{_MODULAR}.{module}"), name)
        cls = _staged_class(base, type(self).vae_scale(read_config(model_dir, "vae")))
        self.pipe = cls(blocks=self.block_seq, pretrained_model_name_or_path=str(model_dir))
        # only this stage's components: every other one stays None in the block pipeline
        self.pipe.update_components(**self.load_components(model_dir))
        self.latent_scale = type(self).vae_scale(read_config(model_dir, "vae"))

    def preview_grid(self, params: Mapping[str, Any]) -> tuple[int, int]:
        """The latent rows and columns of a request's packed 2x2 tokens (engine.stages.preview.unpack)."""
        k = 2 * self.latent_scale
        return 2 * (int(params["height"]) // k), 2 * (int(params["width"]) // k)

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The state the blocks start from: message values and request parameters, by block input name."""
        raise NotImplementedError

    def prepare(self, params: Mapping[str, Any]) -> None:
        """Per-request settings of the pipeline's configurable components (a guider's scale)."""

    def before_step(self, block_state: Any) -> None:
        """Called before each step of a loop block with the loop's state: where the model must be given
        what the one-call pipeline gives it (Qwen-Image: no mask where every token counts)."""

    def _state(self, kwargs: Mapping[str, Any]) -> Any:
        """A PipelineState as ``ModularPipeline.__call__`` builds it: every block input, given or default."""
        from diffusers.modular_pipelines import PipelineState

        state, given = PipelineState(), dict(kwargs)
        for param in self.block_seq.inputs:
            if param.name in given:
                state.set(param.name, given.pop(param.name), param.kwargs_type)
            elif param.name is not None and param.name not in state.values:
                state.set(param.name, param.default, param.kwargs_type)
        if given:
            raise TypeError(f"{type(self).__name__}: its blocks take no input {sorted(given)}")
        return state

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        from diffusers.modular_pipelines import LoopSequentialPipelineBlocks

        self.prepare(params)
        state = self._state(self.block_inputs(inputs, params))
        for block in self.block_seq.sub_blocks.values():
            if isinstance(block, LoopSequentialPipelineBlocks):
                state = self._loop(block, state, ctx)
            else:
                _, state = block(self.pipe, state)
        return {out: state.get(name) for out, name in self.outputs.items()}

    def _loop(self, loop: Any, state: Any, ctx: StageContext) -> Any:
        """The loop block's own ``__call__`` (its setup, then its sub-blocks once per timestep), with the
        request's checks before each step and its progress after: its ``loop_step`` wrapped for this run."""
        step, total = loop.loop_step, len(state.get("timesteps"))

        def checked(components: Any, block_state: Any, **kwargs: Any) -> Any:
            ctx.check()
            self.before_step(block_state)
            out = step(components, block_state, **kwargs)
            ctx.step_done(int(kwargs["i"]) + 1, total, getattr(out[1], "latents", None))
            return out

        loop.loop_step = checked
        try:
            return loop(self.pipe, state)[1]
        finally:
            del loop.loop_step


class BatchedModularStage(ModularStage, BatchedCallStage):
    """A modular stage without a loop (a text encoder) whose requests of one :meth:`batch_key` run its blocks
    once: the block inputs named in ``batched_inputs`` go in as lists, one item per request, the others are
    the first request's (equal within a batch key); each output is cut back to its request's row. A request
    alone runs them with one-item lists, the same calls."""

    #: the block inputs that differ per request (the prompt); the rest must be equal within a batch key
    batched_inputs: ClassVar[tuple[str, ...]] = ("prompt",)
    #: run each sample's linears apart (engine.stages.invariant.per_sample), where a batch's would not give
    #: each its solo bytes
    per_sample: ClassVar[bool] = False

    run = SteppedStage.run  # begin, one step, end: alone as in a batch

    @no_grad
    def call(self, items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> list[dict[str, Any]]:
        each = [self.block_inputs(inputs, params) for inputs, params in items]
        kwargs = dict(each[0])
        for name in self.batched_inputs:
            kwargs[name] = [e[name] for e in each]
        self.prepare(items[0][1])
        state = self._state(kwargs)
        with invariant.per_sample() if self.per_sample and len(items) > 1 else contextlib.nullcontext():
            for block in self.block_seq.sub_blocks.values():
                _, state = block(self.pipe, state)
        values = {out: state.get(name) for out, name in self.outputs.items()}
        for out, v in values.items():
            if not isinstance(v, torch.Tensor) or v.shape[0] != len(items):
                raise RuntimeError(f"{type(self).__name__}: output {out} is not one row per request")
        return [{out: v[k:k + 1] for out, v in values.items()} for k in range(len(items))]


class _Own:
    """The block pipeline's components as one request's blocks see them: its own scheduler (a scheduler keeps
    the run's step index) and guider (its scale is the request's), everything else the pipeline's."""

    def __init__(self, pipe: Any, **own: Any) -> None:
        self._pipe = pipe
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


@dataclass
class _Stepping:
    """One request inside a stepped modular stage: its pipeline state, its denoise loop's block state, its
    own components (scheduler) and how far it is."""

    state: Any
    block_state: Any
    components: _Own
    timesteps: list[Any]
    i: int = 0
    cache: Any = None  # engine.stages.caching.StepCache of a request that asked for a quality below lossless


class SteppedModularStage(ModularStage, SteppedStage):
    """A modular stage whose denoise loop block (``loop``, by name) advances one step at a time, so that an
    instance's requests can share one transformer call per step (engine.worker.batching).

    ``begin`` runs the blocks before the loop with the request's own scheduler, ``step`` runs the loop's
    sub-blocks once, exactly as the loop block's ``__call__`` would (alone: the same calls, the same bytes as
    the one-call pipeline), ``end`` the blocks after it. Several requests at once: :meth:`step_batch` (a
    model's own, since what a denoiser stacks differs), each request's 2-D linears run apart
    (engine.stages.invariant) so that its rows get the bytes they get alone; the tests check every item
    against its solo run on the host.
    """

    loop: ClassVar[str] = "denoise"
    #: the loop's sub-block that calls the transformer (its output: ``block_state.noise_pred``). A stage that
    #: sets it serves ``quality`` below lossless (engine.stages.caching): on a step a request's cache predicts,
    #: this sub-block is skipped and the others run on the predicted ``noise_pred``.
    denoiser: ClassVar[str | None] = None
    #: the transformer runs once per guidance pass and each pass keeps its own cache (caching.PassCaches):
    #: the model's :meth:`step_batch` asks each pass's cache, so a cached request always steps through it
    cache_per_pass: ClassVar[bool] = False

    run = SteppedStage.run  # begin, step, end: a request alone takes the path it takes in a batch of one

    def _loop_block(self) -> Any:
        return self.block_seq.sub_blocks[self.loop]

    @no_grad
    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> _Stepping:
        self.prepare(params)
        state = self._state(self.block_inputs(inputs, params))
        mine: dict[str, Any] = {"scheduler": self.fresh_scheduler(self.pipe.scheduler)}
        if getattr(self.pipe, "guider", None) is not None:  # prepare() set its scale for this request
            mine["guider"] = copy.deepcopy(self.pipe.guider)
        own = _Own(self.pipe, **mine)
        for name, block in self.block_seq.sub_blocks.items():
            if name == self.loop:
                break
            _, state = block(own, state)
        block_state = self._loop_block().get_block_state(state)
        self.setup_loop(own, block_state)
        cache = None
        if self.denoiser is not None:
            cache = caching.for_request(self.served_workflow or "", options, per_pass=self.cache_per_pass)
        return _Stepping(state, block_state, own, list(block_state.timesteps), cache=cache)

    def setup_loop(self, components: Any, block_state: Any) -> None:
        """What the loop block's ``__call__`` sets on its block state before its first step (the wrappers'
        lines, which no method of theirs exposes; a model whose wrapper sets more overrides this, and the
        solo-equals-pipeline tests catch a wrapper that changed)."""
        block_state.num_warmup_steps = max(
            len(block_state.timesteps) - block_state.num_inference_steps * components.scheduler.order, 0)

    @no_grad
    def step(self, states: list[_Stepping]) -> None:
        """One step of every state: those whose cache predicts this step skip the transformer (each from its
        own factors); the rest compute, alone or in one batched call, and their caches take the output."""
        if self.cache_per_pass:
            self._compute(states)  # step_batch asks each pass's cache
            return
        predicted = [st for st in states if st.cache is not None and not st.cache.should_compute()]
        if predicted:
            loop = self._loop_block()
            for st in predicted:
                self.before_step(st.block_state)
                st.block_state.noise_pred = st.cache.predict()
                for name, block in loop.sub_blocks.items():
                    if name != self.denoiser:
                        block(st.components, st.block_state, i=st.i, t=st.timesteps[st.i])
                st.i += 1
            skipped = {id(st) for st in predicted}
            states = [st for st in states if id(st) not in skipped]
            if not states:
                return
        self._compute(states)
        for st in states:
            if st.cache is not None:
                st.cache.update(st.block_state.noise_pred)

    def _compute(self, states: list[_Stepping]) -> None:
        if len(states) == 1 and states[0].cache is None:
            st = states[0]
            self.before_step(st.block_state)
            # the loop block's loop_step: its sub-blocks in order, as its __call__ runs them
            self._loop_block().loop_step(st.components, st.block_state, i=st.i, t=st.timesteps[st.i])
            st.i += 1
            return
        for st in states:
            self.before_step(st.block_state)
        with invariant.rows_per_request(1):
            self.step_batch(states)
        for st in states:
            st.i += 1

    def step_batch(self, states: list[_Stepping]) -> None:
        """One step of several requests of one batch key (their ``i`` not yet moved on)."""
        raise NotImplementedError(f"{type(self).__name__} steps one request at a time")

    def progress(self, state: _Stepping) -> tuple[int, int]:
        return state.i, len(state.timesteps)

    def stats(self, state: _Stepping) -> dict[str, Any]:
        return {} if state.cache is None else {"cache_skipped": round(state.cache.skipped_share(), 3)}

    def estimate(self, state: _Stepping) -> Any:
        return getattr(state.block_state, "latents", None)

    @no_grad
    def end(self, st: _Stepping) -> dict[str, Any]:
        blocks = list(self.block_seq.sub_blocks.items())
        at = [n for n, _ in blocks].index(self.loop)
        self._loop_block().set_block_state(st.state, st.block_state)
        state = st.state
        for _, block in blocks[at + 1:]:
            _, state = block(st.components, state)
        return {out: state.get(name) for out, name in self.outputs.items()}


def seeded(params: Mapping[str, Any]) -> torch.Generator:
    """The request's generator, on the CPU as the one-call pipeline's tests make it."""
    return torch.Generator(device="cpu").manual_seed(int(params["seed"]))
