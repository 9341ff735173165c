"""Workflow specs: graphs of named stages with typed inputs, outputs and parameters.

A spec is pure data plus small pure functions, importable without torch: the
Proxy validates requests and estimates their cost with it, the Node Manager
reads its stage list, and workers look up their executor class by dotted path
(imported lazily by :mod:`engine.stages.registry`).

Shapes are tuples of dimensions: an ``int`` is fixed, a ``str`` names either a
dimension derived from the request's parameters (``WorkflowSpec.dims``) or, if
it is not derived, a model-dependent dimension (``"D_text"``): bound from the
loaded model folder where the spec says how (``WorkflowSpec.model_dims``, so
hop sizes are exact), otherwise it only has to be positive and consistent
within one message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.adapters.request import LoraRefused, resolve_lora
from engine.workflow import images, limits
from engine.workflow.errors import InvalidRequest, InvalidTensor
from engine.workflow.message import DTYPE_SIZES
from engine.workflow.options import params_for
from engine.workflow.params import ParamSpec, check_text

__all__ = ["CostModel", "Dim", "InvalidRequest", "InvalidTensor", "ParamSpec", "StageSpec", "TensorSpec",
           "WorkflowSpec"]

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    """A named value that crosses a stage boundary.

    ``dtype`` is a dtype name (see ``engine.workflow.message.DTYPE_SIZES``) or
    ``"compute"``: the executor's compute dtype (float32 on CPU, bfloat16 on
    CUDA). ``kind="blob"`` values are opaque bytes (an input image, an mp4);
    ``media="image"`` marks a request input that must be an image file (checked
    where requests enter, :meth:`WorkflowSpec.validate_request`).

    ``optional=True``: a request input the request may leave out, or a stage output that is empty (no
    elements) when it does. An absent value still travels, as an empty blob or tensor
    (:meth:`WorkflowSpec.message_inputs`), so every stage is handed every value it names and reads
    emptiness as absence (wan2.2-ti2v-5b without an image: text to video).
    """

    name: str
    dtype: str = "compute"
    shape: tuple[Dim, ...] = ()
    kind: str = "tensor"
    doc: str = ""
    media: str = ""
    optional: bool = False


@dataclass(frozen=True)
class StageSpec:
    """One stage: what it consumes, what it produces, and the executor that computes it.

    ``executor`` is the dotted path of its :class:`engine.stages.base.StageExecutor`, which declares the
    sub-folders of the model folder it loads (``components``) and those whose config it reads (``reads``):
    :mod:`engine.stages.registry` reads them off the class (without torch), so the spec does not repeat them.
    """

    name: str
    executor: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorSpec, ...]
    doc: str = ""
    #: Collaboration mode: two instances compute the conditional and unconditional predictions of each
    #: step in parallel (classifier-free-guidance parallelism). Only where the split is bit-identical to
    #: one instance: a stage whose model makes the two predictions in separate calls (Wan2.1), not one
    #: that batches them into one call (SD's UNet: batch 2 and two batch-1 calls differ in the last bits).
    cfg_parallel: bool = False
    #: Step-level batching (engine.worker.batching): how many requests share a step by default, for a stage
    #: whose executor steps (engine.stages.base.SteppedStage) and gives batched requests their solo bytes;
    #: 1: one at a time. Chosen by measurement (benchmarks/e2e.md); ``onepiece node --max-batch`` overrides.
    max_batch: int = 1


def _one_step(d: Mapping[str, int]) -> float:
    return 1.0


@dataclass(frozen=True)
class CostModel:
    """GPU-seconds of one request, per stage: ``fixed + per_unit * units(dims) * steps(dims)``.

    ``units`` turns the derived dimensions into the stage's work per step (e.g.
    pixels for denoise), ``steps`` counts the steps (1 for a one-pass stage); the
    coefficients come from measured stage times (see ``benchmarks/stages_profile.py``)
    on the reference GPU. ``growth`` is how fast a step's time can grow with its
    units beyond the sizes measured (2 for attention over the latent tokens, 1
    for convolutions and encoders): :mod:`engine.workflow.pricing` extrapolates
    with it, so a request larger than any measured one is never priced low.
    """

    fixed: float
    per_unit: float
    units: Callable[[Mapping[str, int]], float]
    steps: Callable[[Mapping[str, int]], float] = _one_step
    growth: float = 1.0


@dataclass(frozen=True)
class WorkflowSpec:
    """A workflow: stages in a DAG, request inputs and parameters, validation, cost."""

    name: str
    description: str
    stages: tuple[StageSpec, ...]
    params: tuple[ParamSpec, ...]
    request_inputs: tuple[TensorSpec, ...] = ()
    derive: Callable[[Mapping[str, Any]], dict[str, int]] = field(default=lambda p: {})
    check: Callable[[Mapping[str, Any]], None] = field(default=lambda p: None)
    costs: Mapping[str, CostModel] = field(default_factory=dict)
    final_output: str = ""
    #: Video workflows: ``num_frames - 1`` must be a multiple of this (0: not a clip of frames).
    frame_step: int = 0
    #: The smallest request worth sending to load the models and compile the kernels of every stage.
    warm_up: Mapping[str, Any] = field(default_factory=dict)
    #: The loaded model's limits and defaults from its components' configs (engine.workflow.limits):
    #: ``configs`` ({component: config.json}) -> overrides of parameters' ``default`` / ``maximum``.
    model_limits: Callable[[Mapping[str, Mapping[str, Any]]], dict[str, dict[str, Any]]] | None = None
    #: The components whose configs :attr:`model_limits` reads.
    limit_components: tuple[str, ...] = ()
    #: The model dimensions of the value shapes (``C_lat``, ``D_text``...) from the same configs
    #: (engine.workflow.limits.DIM_KEY entries of the overrides): what makes :meth:`hop_bytes` exact.
    model_dims: Callable[[Mapping[str, Mapping[str, Any]]], dict[str, int]] | None = None
    #: The model dimensions of the loaded model (set by :meth:`bound`); a dimension not here counts as 1.
    dim_values: Mapping[str, int] = field(default_factory=dict)
    #: Whether the denoise stages cache steps (engine.stages.caching): the workflow then takes ``quality``.
    step_cache: bool = False
    #: The workflow a request for its ``final_output`` gets when it names none (``/v1/images/generations``,
    #: ``/v1/videos``): one per output and, for a request input that is an image, one with it and one without
    #: (:func:`engine.workflow.registry.default_workflow`).
    default: bool = False

    def __post_init__(self) -> None:
        """The request options the workflow serves join its parameters (engine.workflow.options): the spec
        files declare only the model's."""
        names = {p.name for p in self.params}
        steps = next((p.maximum for p in self.params if p.name == "num_inference_steps"), None)
        extra = tuple(p for p in params_for(steps, self.step_cache) if p.name not in names)
        if extra:
            object.__setattr__(self, "params", (*self.params, *extra))

    # -- graph -------------------------------------------------------------
    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"workflow {self.name!r} has no stage {name!r}")

    def producers(self) -> dict[str, str]:
        """Value name -> the stage producing it ("request" for request inputs)."""
        out = {t.name: "request" for t in self.request_inputs}
        for s in self.stages:
            for t in s.outputs:
                out[t.name] = s.name
        return out

    def route(self) -> list[str]:
        """A topological order of the stages: the chain a message travels.

        Stages are listed in declaration order, which must already respect the
        dependencies (checked by :meth:`validate_graph`), so routes are stable.
        """
        return [s.name for s in self.stages]

    def validate_graph(self) -> None:
        """Raise ``ValueError`` if an input has no producer before its consumer."""
        available = {t.name for t in self.request_inputs}
        seen: set[str] = set()
        for s in self.stages:
            if s.name in seen:
                raise ValueError(f"{self.name}: duplicate stage {s.name!r}")
            seen.add(s.name)
            missing = [i for i in s.inputs if i not in available]
            if missing:
                raise ValueError(f"{self.name}: stage {s.name!r} needs {missing} before it runs")
            available |= {t.name for t in s.outputs}
        if self.final_output and self.final_output not in available:
            raise ValueError(f"{self.name}: final output {self.final_output!r} is never produced")

    def carried_after(self, stage: str) -> list[str]:
        """Values a message must carry when it leaves ``stage``.

        A chain route forwards what later stages still need, produced by this
        stage or earlier (DAG edges that skip a stage ride along), plus the
        final output once produced.
        """
        order = self.route()
        i = order.index(stage)
        later_needs = {n for s in self.stages[i + 1:] for n in s.inputs}
        produced = {t.name for t in self.request_inputs} | {t.name for s in self.stages[:i + 1] for t in s.outputs}
        keep = later_needs & produced
        if self.final_output in produced and i == len(order) - 1:
            keep.add(self.final_output)
        return sorted(keep)

    def value_spec(self, name: str) -> TensorSpec:
        for t in self.request_inputs:
            if t.name == name:
                return t
        for s in self.stages:
            for t in s.outputs:
                if t.name == name:
                    return t
        raise KeyError(f"workflow {self.name!r} has no value {name!r}")

    def image_inputs(self) -> list[str]:
        """The request inputs that must be image files (where given)."""
        return [t.name for t in self.request_inputs if t.media == "image"]

    def required_inputs(self) -> list[str]:
        """The request inputs a request must give (the others are :attr:`TensorSpec.optional`)."""
        return [t.name for t in self.request_inputs if not t.optional]

    def message_inputs(self, inputs: Mapping[str, bytes]) -> dict[str, bytes]:
        """The blobs of a request's first message: its inputs, and an empty blob for each optional input it
        leaves out (stages are handed every value they name; an executor reads ``b""`` as absent)."""
        return {**{t.name: b"" for t in self.request_inputs if t.optional}, **inputs}

    # -- the loaded model -----------------------------------------------------
    def limits_of(self, folder: str) -> dict[str, dict[str, Any]]:
        """The overrides the model in ``folder`` imposes on this spec's parameters (JSON reads only)."""
        configs = limits.read_configs(folder, list(self.limit_components))
        found = {} if self.model_limits is None else self.model_limits(configs)
        names = {p.name for p in self.params}
        declared = {k: v for k, v in limits.serving_defaults(folder).items() if k in names}
        dims = {} if self.model_dims is None else self.model_dims(configs)
        return {**limits.with_defaults(found, declared), **limits.dim_entries(dims)}

    def bound(self, overrides: Mapping[str, Mapping[str, Any]] | None) -> WorkflowSpec:
        """This spec with the loaded model's defaults and (never wider) maxima: what a request is checked
        against where the model's limits are known. Cached per distinct overrides."""
        if not overrides:
            return self
        key = json.dumps(overrides, sort_keys=True, default=str)
        cache = _BOUND.setdefault(self.name, {})
        if key in cache and cache[key][0] is self:
            return cache[key][1]
        params = []
        for p in self.params:
            o = overrides.get(p.name) or {}
            maximum = p.maximum
            if "maximum" in o:
                maximum = o["maximum"] if p.maximum is None else min(p.maximum, o["maximum"])
            why = str(o.get("why", "")) if maximum != p.maximum else p.why
            default = o.get("default", p.default)
            if isinstance(default, (int, float)) and not isinstance(default, bool) and p.type in (int, float):
                # a default is always one the bounds take: never a 400 on a field the client did not send
                default = max(p.minimum if p.minimum is not None else default,
                              min(maximum if maximum is not None else default, default))
            params.append(replace(p, maximum=maximum, default=default, why=why))
        out = replace(self, params=tuple(params), dim_values=limits.dims_of(overrides))
        cache[key] = (self, out)
        return out

    # -- parameters --------------------------------------------------------
    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"workflow {self.name!r} has no parameter {name!r}")

    def resolve_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill defaults, coerce types, enforce limits and the workflow's rules.

        Returns the complete parameter dict; raises :class:`InvalidRequest`
        naming the first bad parameter. Unknown parameters are refused so a
        typo never silently falls back to a default.
        """
        known = {p.name: p for p in self.params}
        adapters = None
        if "lora" in params:  # LoRA adapters per request: names of the operators' registry (engine.adapters)
            try:
                adapters = resolve_lora(self.name, params["lora"])
            except LoraRefused as exc:
                raise InvalidRequest(exc.field, str(exc)) from None
            params = {k: v for k, v in params.items() if k != "lora"}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise InvalidRequest(unknown[0], f"unknown parameter(s) for {self.name}: {', '.join(unknown)}")
        out: dict[str, Any] = {}
        for p in self.params:
            value = params.get(p.name, p.default)
            if value is None:
                out[p.name] = None
                continue
            if p.type is int and (isinstance(value, bool) or not isinstance(value, int)):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise InvalidRequest(p.name, f"{p.name} must be an integer, got {value!r}")
            elif p.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InvalidRequest(p.name, f"{p.name} must be a number, got {value!r}")
            elif p.type is str and not isinstance(value, str):
                raise InvalidRequest(p.name, f"{p.name} must be a string, got {type(value).__name__}")
            if p.type is str:
                check_text(p, value)
                if p.choices and value not in p.choices:
                    raise InvalidRequest(p.name, f"{p.name} must be one of {', '.join(p.choices)} for {self.name}, "
                                                 f"got {value!r}")
                out[p.name] = value
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(p.name, f"{p.name} must be a finite number, got {value!r}")
            if p.type is float:
                value = float(value)
            if p.minimum is not None and value < p.minimum:
                raise InvalidRequest(p.name, f"{p.name} must be >= {p.minimum:g}, got {value}")
            if p.maximum is not None and value > p.maximum:
                why = f" ({p.why})" if p.why else ""
                raise InvalidRequest(p.name, f"{p.name} must be <= {p.maximum:g} for {self.name}{why}, got {value}")
            out[p.name] = value
        self.check(out)
        if adapters:
            out["lora"] = adapters
        return out

    def validate_request(self, params: Mapping[str, Any], inputs: Mapping[str, bytes | bytearray | memoryview],
                         max_image_bytes: int | None = None, max_image_pixels: int | None = None) -> dict[str, Any]:
        """The resolved parameters, once they and the request's inputs are valid: no input missing, none
        extra, and every image input a well-formed image within the byte and pixel limits (by default
        :data:`engine.workflow.images.MAX_BYTES` / ``MAX_PIXELS``). The one check of a request's
        content, shared by the Proxy's intake, the platform and ``onepiece run``.

        Raises :class:`InvalidRequest` naming the field
        (:class:`engine.workflow.images.ImageTooLarge` for an image's byte size).
        """
        resolved = self.resolve_params(params)
        wanted = {t.name for t in self.request_inputs}
        for extra in sorted(set(inputs) - wanted):
            raise InvalidRequest(extra, f"{self.name} takes no input {extra!r}")
        for name in self.required_inputs():
            if name not in inputs:
                raise InvalidRequest(name, f"{self.name} needs an input {name!r}")
        for name in (n for n in self.image_inputs() if n in inputs):  # a given one is checked, even empty
            images.check_image(inputs[name], name, images.MAX_BYTES if max_image_bytes is None else max_image_bytes,
                               images.MAX_PIXELS if max_image_pixels is None else max_image_pixels)
        return resolved

    # -- clips -----------------------------------------------------------------
    def frames_for(self, seconds: float, fps: int | None = None) -> int:
        """``num_frames`` of a clip of about ``seconds`` at ``fps`` (the default frame rate when None) that
        the workflow's frame rule accepts: ``frame_step * k + 1``."""
        if not self.frame_step:
            raise ValueError(f"{self.name} does not make clips of frames")
        rate = int(fps or self.param("fps").default)
        return self.frame_step * round(seconds * rate / self.frame_step) + 1

    def clip_seconds(self, params: Mapping[str, Any]) -> float:
        """How long the clip of these parameters plays: ``(num_frames - 1) / fps``, never negative."""
        rate = int(params.get("fps") or self.param("fps").default)
        return max(0.0, (int(params.get("num_frames", 1)) - 1) / rate)

    def warm_up_request(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """(params, inputs) of :attr:`warm_up`: its image inputs are a blank 64x64 PNG."""
        return dict(self.warm_up), {name: images.blank_png(64, 64) for name in self.image_inputs()}

    def dims(self, params: Mapping[str, Any]) -> dict[str, int]:
        """Dimensions derived from resolved parameters (latent sizes, frame counts...)."""
        return self.derive(params)

    # -- tensors -------------------------------------------------------------
    def check_tensor(
        self, name: str, dtype: str, shape: tuple[int, ...], params: Mapping[str, Any], compute_dtype: str,
        bound: dict[str, int] | None = None,
    ) -> None:
        """Raise :class:`InvalidTensor` unless ``name`` matches its dtype and shape rule.

        ``bound`` collects model-dependent dimensions across calls so that, e.g.,
        ``prompt_embeds`` and ``negative_prompt_embeds`` must agree on ``D_text``.
        """
        spec = self.value_spec(name)
        if spec.kind != "tensor":
            raise InvalidTensor(f"{name!r} is a blob, not a tensor")
        want = compute_dtype if spec.dtype == "compute" else spec.dtype
        if dtype != want:
            raise InvalidTensor(f"{name!r}: dtype {dtype}, expected {want}")
        if spec.optional and len(shape) == len(spec.shape) and 0 in shape:
            return  # absent: the request left out the optional input it comes from
        if len(shape) != len(spec.shape):
            raise InvalidTensor(f"{name!r}: rank {len(shape)}, expected shape {spec.shape}")
        derived = self.dims(params)
        bound = {} if bound is None else bound
        for got, rule in zip(shape, spec.shape, strict=True):
            want_dim = rule if isinstance(rule, int) else derived.get(rule, bound.get(rule))
            if want_dim is None:
                if got <= 0:
                    raise InvalidTensor(f"{name!r}: dimension {rule} must be positive, got {got}")
                bound[str(rule)] = got
            elif got != want_dim:
                raise InvalidTensor(f"{name!r}: dimension {rule} is {got}, expected {want_dim} (shape {shape})")

    # -- sizes -----------------------------------------------------------------
    def hop_bytes(self, params: Mapping[str, Any], inputs: Mapping[str, bytes] | None = None,
                  compute_dtype: str = "bfloat16") -> dict[str, int]:
        """stage -> the payload bytes (tensors and blobs) of the message that enters it, after the first:
        exact where the spec is :meth:`bound` to the loaded model (its model dimensions known) and
        ``inputs`` (the request's blobs) are given; a dimension not known counts as 1 and a blob not given
        as 0, so the figure is never over. ``compute_dtype``: the stages' (bfloat16 on CUDA). Without an
        optional input its optional values are empty."""
        dims, out, route = {**self.dim_values, **self.dims(params)}, {}, self.route()
        absent = inputs is None or any(t.optional and not inputs.get(t.name) for t in self.request_inputs)
        for before, stage in zip(route, route[1:], strict=False):
            total = 0
            for name in self.carried_after(before):
                spec = self.value_spec(name)
                if spec.kind != "tensor":
                    total += len(inputs.get(name, b"")) if inputs is not None else 0
                    continue
                if spec.optional and absent:
                    continue
                n = 1
                for d in spec.shape:
                    n *= d if isinstance(d, int) else dims.get(d, 1)
                total += n * DTYPE_SIZES.get(compute_dtype if spec.dtype == "compute" else spec.dtype, 1)
            out[stage] = total
        return out

    # -- cost ------------------------------------------------------------------
    def estimate_cost(self, params: Mapping[str, Any]) -> dict[str, float]:
        """GPU-seconds per stage for one request with these (resolved) parameters."""
        d = self.dims(params)
        return {s: c.fixed + c.per_unit * c.units(d) * c.steps(d) for s, c in self.costs.items()}

    def estimate_gpu_seconds(self, params: Mapping[str, Any]) -> float:
        """Total GPU-seconds of one request (the Proxy's admission cost)."""
        return sum(self.estimate_cost(params).values())


# spec name -> {overrides as JSON: (the spec bound, the bound spec)}; a handful of entries per deployment
_BOUND: dict[str, dict[str, tuple[WorkflowSpec, WorkflowSpec]]] = {}
