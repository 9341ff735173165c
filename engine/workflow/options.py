"""A request's options: how it is served, not what its model computes. Declared once, here.

``priority`` and ``deadline_s`` come as top-level fields of a request; ``preview_every``, ``quality`` and
``lora`` come among its ``params`` (where the API takes them, :data:`PARAM_OPTIONS`). Every workflow takes
the ones its stages serve, bounded from its own spec (:func:`params_for`, which
:class:`engine.workflow.spec.WorkflowSpec` adds to its parameters): no spec file declares them. The edge
checks them once (the Proxy's :class:`engine.proxy.parsing.Parser`, which the platform's in-process engine
shares) and builds :class:`Options` for admission. They travel on as the Workflow Message carries them (the
ones among the params in its params, the priority as the header's level, the deadline as its absolute
time), and each consumer past the Proxy reads its own through :meth:`Options.of` on those params: the
worker's preview publisher (``preview_every``), the denoise stages' step cache (``quality``); ``lora`` is
resolved against the adapter registry by the spec.

A new option is its field, bound and check here, its consumer, a line in ``docs/api.md`` and a test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.workflow.errors import InvalidRequest
from engine.workflow.params import ParamSpec


class Priority(StrEnum):
    """A request's priority: the API's names, lowest first (the platform's choices are made from this)."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


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
    """One request's options, checked: what every consumer reads instead of picking at params and fields."""

    priority: Priority = Priority.NORMAL
    deadline_s: float | None = None
    preview_every: int = 0
    quality: str = LOSSLESS
    lora: tuple[Mapping[str, Any], ...] = ()  # resolved adapters: name, scale, digest (engine.adapters)

    @classmethod
    def of(cls, params: Mapping[str, Any], priority: object = Priority.NORMAL,
           deadline_s: object = None) -> Options:
        """The options of a request: those among its params as its spec resolved them (a workflow that
        does not take one has its default), ``priority`` and ``deadline_s`` checked here."""
        return cls(priority_of(priority), deadline_of(deadline_s), int(params.get("preview_every") or 0),
                   str(params.get("quality") or LOSSLESS), tuple(params.get("lora") or ()))
