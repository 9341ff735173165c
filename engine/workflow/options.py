"""A request's options: how it is served, not what its model computes. Declared once, here.

``priority`` and ``deadline_s`` come as top-level fields of a request; ``preview_every``, ``quality`` and
``lora`` come among its ``params`` (where the API takes them, :data:`PARAM_OPTIONS`). Every workflow takes
the ones its stages serve, bounded from its own spec (:func:`params_for`, which
:class:`engine.workflow.spec.WorkflowSpec` adds to its parameters): no spec file declares them. The edge
checks them once (the Proxy's :class:`engine.proxy.parsing.Parser`, which the platform's in-process engine
shares) and :meth:`Options.split` takes them out of the resolved params into one :class:`Options`. From
there they travel whole and apart from the model's parameters: in the Workflow Message header's
``options`` (:meth:`Options.to_json`; the header's ``priority`` level and absolute ``deadline`` are the
routing copies the rings and the serving order read), on the platform's job (``Job.options``), and into
each stage as :attr:`engine.stages.base.StageContext.options` and the stepped executors' ``begin``. Each
consumer reads its own field: the preview publisher ``preview_every``, the step cache ``quality``, the
denoise stages and the adapter-affine router ``lora``.

A new option is its field, bound and check here, its consumer, a line in ``docs/api.md`` and a test.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from engine.workflow.errors import InvalidRequest
from engine.workflow.params import ParamSpec


class Priority(StrEnum):
    """A request's priority: the API's names, lowest first (the platform's choices are made from this)."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"

    @property
    def level(self) -> int:
        """The Workflow Message header's integer (engine.dispatch.order: low -1, normal 0, high 1)."""
        return list(Priority).index(self) - 1


#: the longest deadline a request may carry, seconds
MAX_DEADLINE_S = 7 * 86400.0
LOSSLESS = "lossless"
#: the quality levels (SGLang's names): lossless is the one-call pipeline's bytes; the others cache steps
QUALITY_LEVELS = (LOSSLESS, "extra-high", "high")
#: the options a request sends among its params (not the model's: a one-call pipeline takes none of them)
PARAM_OPTIONS = ("preview_every", "quality", "lora")
#: those of them a one-call pipeline (the reference the tests compare with) is not given among its kwargs:
#: ``lora`` is resolved by the spec and loaded into the model apart
SERVING_PARAMS = frozenset(o for o in PARAM_OPTIONS if o != "lora")


def params_for(max_steps: float | None, step_cache: bool) -> tuple[ParamSpec, ...]:
    """The options a workflow takes among its parameters: ``preview_every`` where it has denoising steps
    (0, off, by default; at most its step limit ``max_steps``), ``quality`` where its denoise stages cache
    steps (``step_cache``; lossless by default)."""
    out = []
    if max_steps:
        out.append(ParamSpec("preview_every", int, 0, 0, int(max_steps),
                             doc="publish a small preview image of the current estimate every N denoising steps "
                                 "(0: off)"))
    if step_cache:
        out.append(ParamSpec("quality", str, LOSSLESS, max_length=16, choices=QUALITY_LEVELS,
                             doc="lossless (default: bit-exact), or extra-high / high: step caching trades "
                                 "exactness for speed"))
    return tuple(out)


def priority_of(value: object) -> Priority:
    """A request's ``priority`` field; :class:`InvalidRequest` naming it for anything but the names."""
    if isinstance(value, str) and value in Priority.__members__.values():
        return Priority(value)
    raise InvalidRequest("priority", f"priority must be one of {', '.join(Priority)}")


def deadline_of(value: object) -> float | None:
    """A request's ``deadline_s`` field (seconds from now, or None); :class:`InvalidRequest` naming it
    for anything but a finite number in (0, :data:`MAX_DEADLINE_S`]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_DEADLINE_S:
        raise InvalidRequest("deadline_s", f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:.0f}]")
    return float(value)


@dataclass(frozen=True)
class Options:
    """One request's options, checked when made (:class:`InvalidRequest` naming the field): what every
    consumer reads instead of picking at params and fields. The bounds a workflow sets (its step limit,
    the levels its denoise serves, its adapters) are its spec's check (:func:`params_for`); these are
    the ones every request has."""

    priority: Priority = Priority.NORMAL
    deadline_s: float | None = None
    preview_every: int = 0
    quality: str = LOSSLESS
    lora: tuple[Mapping[str, Any], ...] = ()  # resolved adapters: name, scale, digest (engine.adapters)

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", priority_of(self.priority))
        object.__setattr__(self, "deadline_s", deadline_of(self.deadline_s))
        every = self.preview_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise InvalidRequest("preview_every", "preview_every must be a whole number >= 0")
        if self.quality not in QUALITY_LEVELS:
            raise InvalidRequest("quality", f"quality must be one of {', '.join(QUALITY_LEVELS)}")
        lora = self.lora
        if not isinstance(lora, (list, tuple)) or not all(
                isinstance(e, Mapping) and {"name", "scale", "digest"} <= set(e) for e in lora):
            raise InvalidRequest("lora", "lora must be a list of resolved adapters (name, scale, digest)")
        object.__setattr__(self, "lora", tuple(dict(e) for e in lora))

    @classmethod
    def of(cls, params: Mapping[str, Any], priority: object = Priority.NORMAL,
           deadline_s: object = None) -> Options:
        """The options of a request: those among its params as its spec resolved them (a workflow that
        does not take one has its default), ``priority`` and ``deadline_s`` checked here."""
        among = {k: params[k] for k in PARAM_OPTIONS if params.get(k) is not None}
        return cls(priority=priority, deadline_s=deadline_s, **among)

    @classmethod
    def split(cls, resolved: Mapping[str, Any], priority: object = Priority.NORMAL,
              deadline_s: object = None) -> tuple[dict[str, Any], Options]:
        """(the model's parameters, the options) of a request whose params its spec resolved: the one
        place the options leave the params they came among."""
        return ({k: v for k, v in resolved.items() if k not in PARAM_OPTIONS},
                cls.of(resolved, priority, deadline_s))

    def params(self, taken: Collection[str] = ()) -> dict[str, Any]:
        """The options the API takes among a request's ``params``: those set, and those named in ``taken``
        (a workflow's parameter names) at their defaults too, as its spec resolves them."""
        return {k: v for k, v in self._fields(PARAM_OPTIONS).items() if k in taken or v != _DEFAULTS[k]}

    def to_json(self) -> dict[str, Any]:
        """The options as JSON (the Workflow Message header's ``options``, the platform's ``Job.options``):
        every field that is not its default, so a plain request carries ``{}``."""
        return {k: v for k, v in self._fields(FIELDS).items() if v != _DEFAULTS[k]}

    def _fields(self, names: Collection[str]) -> dict[str, Any]:
        """Fields as JSON values: the priority's name, the adapters as a list of objects."""
        out: dict[str, Any] = {}
        for name in names:
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, Priority) else \
                [dict(e) for e in value] if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, doc: object) -> Options:
        """The options :meth:`to_json` wrote; :class:`InvalidRequest` naming the field for anything else."""
        if not isinstance(doc, Mapping):
            raise InvalidRequest("options", "options must be an object")
        unknown = sorted(set(doc) - set(FIELDS))
        if unknown:
            raise InvalidRequest(unknown[0], f"unknown option(s): {', '.join(unknown)}")
        return cls(**doc)


#: the fields of :class:`Options`, as :meth:`Options.to_json` names them
FIELDS = tuple(f.name for f in fields(Options))
#: a request's options when it sets none
DEFAULT = Options()
_DEFAULTS = DEFAULT._fields(FIELDS)
