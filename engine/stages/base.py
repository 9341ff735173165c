"""The stage executor interface, its run context and its typed errors (torch-free).

A :class:`StageExecutor` is long-lived: a worker builds it once, calls
:meth:`~StageExecutor.load` once, then :meth:`~StageExecutor.run` for every
request of its stage. ``run`` takes and returns named values: torch tensors
for tensors, ``bytes``/``memoryview`` for blobs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine import envs
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options


class StageError(RuntimeError):
    """Base class of errors a stage raises while serving a request."""


class Cancelled(StageError):
    """The request was cancelled; raised between denoising steps."""


class DeadlineExceeded(StageError):
    """The request's deadline passed; raised between denoising steps."""


class InvalidInput(ValueError):
    """A request input (an image file, ...) cannot be used; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class MissingComponent(FileNotFoundError):
    """A model folder lacks a component a stage needs; names it and the path."""

    def __init__(self, component: str, path: Path, detail: str) -> None:
        super().__init__(f"model folder is missing component {component!r}: {path} ({detail})")
        self.component = component
        self.path = path


@dataclass
class StageContext:
    """Per-request context a stage receives.

    ``progress(step, total)`` is called after every denoising step;
    ``cancelled()`` is polled between steps; ``deadline`` is unix seconds.
    ``clock`` is injectable so tests need not sleep.
    """

    progress: Callable[[int, int], None] | None = None
    cancelled: Callable[[], bool] | None = None
    deadline: float | None = None
    clock: Callable[[], float] = time.time
    stats: dict[str, Any] = field(default_factory=dict)
    #: Collaboration mode: a handle on a peer instance that computes the unconditional half of each
    #: guided step (engine.worker.collab.CfgRemote); None in Individual mode.
    cfg_parallel: Any = None
    #: Live previews (engine.stages.preview): ``preview(step, total, estimate)`` is offered the current
    #: latents every ``preview_every`` steps (0: never); it must return at once (it hands them to a thread).
    preview: Callable[[int, int, Any], None] | None = None
    preview_every: int = 0
    #: the request's options (engine.workflow.options), as its message's header carries them: where a stage
    #: reads the ones it serves (its step cache's ``quality``, its denoise model's ``lora``)
    options: Options = DEFAULT_OPTIONS

    def check(self) -> None:
        """Raise :class:`Cancelled` or :class:`DeadlineExceeded` if the request must stop."""
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("request cancelled")
        if self.deadline is not None and self.clock() > self.deadline:
            raise DeadlineExceeded(f"deadline {self.deadline:.3f} passed")

    def step_done(self, step: int, total: int, estimate: Any = None) -> None:
        """Step ``step`` of ``total`` is done; ``estimate``: the latents after it (for a preview)."""
        if self.progress is not None:
            self.progress(step, total)
        self.offer_preview(step, total, estimate)

    def offer_preview(self, step: int, total: int, estimate: Any) -> None:
        """Hand ``estimate`` to the preview hook when ``step`` is one of every ``preview_every``; a stage
        whose steps are a part of the workflow's (a Wan2.2 expert) calls this with the whole run's numbers."""
        if self.preview is not None and estimate is not None and self.preview_every > 0 \
                and step % self.preview_every == 0:
            self.preview(step, total, estimate)


class StageExecutor(ABC):
    """One stage of one workflow, served by a long-lived worker.

    Contract:
      * ``load(model_dir, device)`` loads only this stage's components (the
        sub-folders in ``components``) from a folder in the published
        weights' layout, once. Raises :class:`MissingComponent` if one is absent.
      * ``run(inputs, params, ctx)`` computes the stage's declared outputs from
        its declared inputs and the request's resolved params. It must not keep
        references to ``inputs`` after returning (they may be views into a ring
        slot that is reused). It may raise :class:`Cancelled` /
        :class:`DeadlineExceeded` between steps.
    """

    #: model sub-folders this stage loads (the stage pools digest their bytes: engine.workflow.pools)
    components: ClassVar[tuple[str, ...]] = ()
    #: model sub-folders whose config this stage reads without loading them (a VAE's compression factors)
    reads: ClassVar[tuple[str, ...]] = ()
    #: (the component a LoRA adapter targets, the diffusers pipeline whose LoRA loader reads its files) where
    #: this stage applies a request's ``lora``; None: it takes none (engine.stages.registry.adaptable)
    adapts: ClassVar[tuple[str, str] | None] = None

    def __init__(self) -> None:
        self.device: str = "cpu"
        self.model_dir: Path | None = None
        #: the workflow this instance serves (set by whoever makes it: the worker process, the LocalRunner);
        #: where a stage's settings are per workflow (engine.stages.caching)
        self.served_workflow: str | None = None

    @abstractmethod
    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        """Load the components from ``model_dir`` onto ``device`` (None: auto)."""

    @abstractmethod
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        """Serve one request; see the class docstring."""

    def calibration_inputs(self, made: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The warm-up calibration's inputs (engine.worker.calibrate: random values at the shapes the spec
        declares) made into inputs this stage serves, where it needs more than their shapes; as they are by
        default."""
        return made


class ModelFreeStage(StageExecutor):
    """A stage without model components (pixels to png, frames to mp4): nothing to load, runs on the CPU."""

    components: ClassVar[tuple[str, ...]] = ()

    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        self.model_dir = Path(model_dir)

    @staticmethod
    def array(value: Any) -> Any:
        """A numpy array of a uint8 tensor (or the array itself): what image and video encoders take."""
        return value.numpy() if hasattr(value, "numpy") else value


def resolve_device(device: str | None = None) -> str:
    """``cuda`` if asked for or (auto) if available, else ``cpu``; honours ONEPIECE_DEVICE."""
    want = (device or envs.DEVICE or "auto").lower()
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {want!r}")
    if want == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if want == "cuda":
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    return "cpu"


def compute_dtype_name(device: str) -> str:
    """bf16 on CUDA (the published weights' serving precision), float32 on CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


class SteppedStage(StageExecutor):
    """A stage whose requests advance one step at a time, so that the requests an instance holds can share
    one model call per step (step-level batching, :mod:`engine.worker.batching`): a request joins at a step
    boundary and leaves when its own steps are done, whatever the others' step counts.

    ``run`` is ``begin``, ``step`` until ``progress`` says every step is done, then ``end``: a request served alone takes
    exactly the code path it takes in a batch of one. Contract: ``step(states)`` advances every state by
    one step and gives each the same bytes it would get stepped alone (checked per stage by the tests;
    ``batch_key`` returns None for requests where that does not hold, and those run alone).
    """

    #: whether a step is worth a progress event (a denoise loop's are; a one-call stage's single "step" is
    #: its end, which stage_finished reports)
    reports_steps: ClassVar[bool] = True

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        """What must be equal for two requests to share a step (shapes, guidance mode...); None: alone.
        ``options``: the request's (its adapters may keep it alone); never its ``quality``, which each
        request's own cache serves inside any batch."""
        return None

    @abstractmethod
    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> Any:
        """The request's state before its first step (it may keep ``inputs`` until :meth:`end`): from its
        inputs, its model parameters and its ``options`` (engine.workflow.options)."""

    @abstractmethod
    def step(self, states: list[Any]) -> None:
        """One step of every state, in one batched model call where they are compatible."""

    @abstractmethod
    def progress(self, state: Any) -> tuple[int, int]:
        """(steps done, steps in all) of a state."""

    def estimate(self, state: Any) -> Any:
        """The state's current latents, for a live preview (None: this stage has none to show)."""
        return None

    def preview(self, state: Any) -> tuple[int, int, Any]:
        """(the step, the steps in all, the latents) a live preview of this state shows: this stage's own
        progress and :meth:`estimate`; a stage whose steps are a part of the run's (a Wan2.2 expert) numbers
        them as the whole run's."""
        done, total = self.progress(state)
        return done, total, self.estimate(state)

    @abstractmethod
    def end(self, state: Any) -> dict[str, Any]:
        """The stage's outputs once every step is done."""

    def stats(self, state: Any) -> dict[str, Any]:
        """What the request's run reports beside its time (``StageContext.stats``), e.g. the share of its
        transformer calls its step cache skipped (``cache_skipped``)."""
        return {}

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        state = self.begin(inputs, params, ctx.options)
        done, total = self.progress(state)
        while done < total:
            ctx.check()
            self.step([state])
            done, total = self.progress(state)
            if self.reports_steps:
                ctx.step_done(done, total)
                if ctx.preview is not None:
                    ctx.offer_preview(*self.preview(state))
        out = self.end(state)
        ctx.stats.update(self.stats(state))
        return out


@dataclass
class _Call:
    """One request in a :class:`BatchedCallStage`: what it brought, and its outputs once the call ran."""

    inputs: Mapping[str, Any]
    params: Mapping[str, Any]
    out: dict[str, Any] | None = None


class BatchedCallStage(SteppedStage):
    """A stage of one model call per request (a text encoder, an image encoder) whose compatible requests
    (the same :meth:`batch_key`) run as one call: a one-step :class:`SteppedStage`, so the instance's step
    batcher (engine.worker.batching) gathers them as it gathers denoise steps, with the same cancel,
    deadline, priority and error handling. A request alone takes the same path, a batch of one.

    :meth:`call` gets several requests and returns each one's outputs, each the bytes it gets alone (the
    stage's tests check every item against its solo run on the host; a model where that does not hold
    returns None from ``batch_key``).
    """

    reports_steps: ClassVar[bool] = False

    def begin(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
              options: Options = DEFAULT_OPTIONS) -> _Call:
        return _Call(inputs, params)

    def step(self, states: list[Any]) -> None:
        outs = self.call([(s.inputs, s.params) for s in states])
        if len(outs) != len(states):
            raise RuntimeError(f"{type(self).__name__}.call returned {len(outs)} outputs for {len(states)} requests")
        for s, out in zip(states, outs, strict=True):
            s.out = out

    def progress(self, state: Any) -> tuple[int, int]:
        return (0 if state.out is None else 1), 1

    def end(self, state: Any) -> dict[str, Any]:
        assert state.out is not None, "ended before its call ran"
        return state.out

    @abstractmethod
    def call(self, items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """The outputs of each (inputs, params), in order, from one call where the model allows."""
