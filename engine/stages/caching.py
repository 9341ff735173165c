"""Step caching per request: the ``quality`` a request asks for, as a cache state of its own.

``quality`` takes SGLang's names: ``lossless`` (the default: no cache, the one-call pipeline's bytes),
``extra-high`` and ``high``. A level maps, per workflow, to a step-caching method and its settings
(:data:`LEVELS`; an operator overrides it per workflow with ``ONEPIECE_QUALITY_MAP``, JSON:
``{"flux.1-dev": {"high": {"cache_interval": 4}}}``).

The method is diffusers' TaylorSeer in its lite form (``TaylorSeerCacheConfig(use_lite_mode=True)``): the
transformer runs in full on the first ``disable_cache_before_step`` steps and then once every
``cache_interval`` steps; on the steps between, its output is predicted from a Taylor expansion of its last
full outputs (order ``max_order``), and no block runs. Its skip schedule depends only on the step index,
never on the weights or the inputs, so a request's cost is known when it is admitted.

diffusers applies the method as hooks on the model's modules, with one state per model: here each request
keeps its own :class:`StepCache` (diffusers' own ``TaylorSeerState`` holding its factors, and the hook's
schedule), so requests of any quality share a batched step: those that compute run the transformer
together (each item its solo bytes), those that predict skip the call, each from its own factors. The
transformer's output is its ``proj_out``'s, which is what the lite hook caches, so a request alone gets
the bytes of the one-call pipeline with ``transformer.enable_cache(config)`` (tests/engine/stages/test_quality.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from engine import envs
from engine.workflow.options import LOSSLESS, QUALITY_LEVELS, Options


@dataclass(frozen=True)
class CacheSettings:
    """A TaylorSeer lite configuration (diffusers' ``TaylorSeerCacheConfig`` fields)."""

    cache_interval: int
    disable_cache_before_step: int
    max_order: int = 1
    disable_cache_after_step: int | None = None

    def config(self) -> Any:
        """diffusers' own config of these settings (what the reference pipeline is given)."""
        from diffusers import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(cache_interval=self.cache_interval,
                                     disable_cache_before_step=self.disable_cache_before_step,
                                     disable_cache_after_step=self.disable_cache_after_step,
                                     max_order=self.max_order, use_lite_mode=True)


# high: diffusers' defaults for TaylorSeer (interval 5, 3 full steps first, first order), the paper's
# N=5 setting; extra-high: a full step every other step after the same warm-up
_TAYLORSEER = {"extra-high": CacheSettings(cache_interval=2, disable_cache_before_step=3),
               "high": CacheSettings(cache_interval=5, disable_cache_before_step=3)}
#: workflow -> level -> settings, for the workflows whose denoise stage caches (the others serve lossless)
LEVELS: dict[str, dict[str, CacheSettings]] = {"flux.1-schnell": _TAYLORSEER, "flux.1-dev": _TAYLORSEER,
                                               "qwen-image": _TAYLORSEER, "wan2.1-t2v": _TAYLORSEER,
                                               "wan2.1-i2v": _TAYLORSEER, "wan2.2-t2v-a14b": _TAYLORSEER,
                                               "wan2.2-i2v-a14b": _TAYLORSEER, "wan2.2-ti2v-5b": _TAYLORSEER}


def levels(workflow: str) -> tuple[str, ...]:
    """The quality levels a workflow serves: lossless, and those its denoise stage can cache at."""
    return (LOSSLESS, *(q for q in QUALITY_LEVELS[1:] if q in LEVELS.get(workflow, {})))


def settings(workflow: str, quality: str) -> CacheSettings | None:
    """The cache settings of ``quality`` on ``workflow`` (None: lossless), the operator's override applied."""
    if quality == LOSSLESS:
        return None
    base = LEVELS[workflow][quality]
    raw = envs.QUALITY_MAP
    if raw:
        over = json.loads(raw).get(workflow, {}).get(quality)
        if over:
            base = replace(base, **over)
    return base


@dataclass
class StepCache:
    """One request's cache: diffusers' ``TaylorSeerState`` and the lite hook's schedule
    (``TaylorSeerCacheHook._measure_should_compute``), advanced once per transformer call it stands for."""

    settings: CacheSettings
    state: Any = None
    computed: int = 0
    predicted: int = 0

    def __post_init__(self) -> None:
        import torch
        from diffusers.hooks.taylorseer_cache import TaylorSeerState

        # the config's default factor dtype (bfloat16), as the hook keeps them
        dtype = self.settings.config().taylor_factors_dtype or torch.bfloat16
        self.state = TaylorSeerState(taylor_factors_dtype=dtype, max_order=self.settings.max_order)

    def should_compute(self) -> bool:
        """Whether this step runs the transformer (then :meth:`update`) or is predicted (:meth:`predict`)."""
        s, st = self.settings, self.state
        st.current_step += 1
        step = st.current_step
        warm = step < s.disable_cache_before_step
        interval = (step - s.disable_cache_before_step - 1) % s.cache_interval == 0
        cool = s.disable_cache_after_step is not None and step >= s.disable_cache_after_step
        return warm or interval or cool

    def update(self, output: Any) -> None:
        self.state.update((output,))
        self.computed += 1

    def predict(self) -> Any:
        self.predicted += 1
        return self.state.predict()[0]

    def skipped_share(self) -> float:
        n = self.computed + self.predicted
        return self.predicted / n if n else 0.0


@dataclass
class PassCaches:
    """One request's caches when its step calls the transformer once per guidance pass (Qwen-Image's true
    CFG: cond, then uncond): a :class:`StepCache` per pass, as QwenImagePipeline gives diffusers' hook one
    state per ``cache_context("cond")`` / ``("uncond")``. Each pass's schedule counts its own calls, so both
    compute or both predict at a step."""

    settings: CacheSettings
    passes: dict[int, StepCache] = field(default_factory=dict)

    def of(self, n: int) -> StepCache:
        """The cache of the request's ``n``-th pass at a step (0: cond), made at its first call."""
        if n not in self.passes:
            self.passes[n] = StepCache(self.settings)
        return self.passes[n]

    @property
    def computed(self) -> int:
        return sum(c.computed for c in self.passes.values())

    @property
    def predicted(self) -> int:
        return sum(c.predicted for c in self.passes.values())

    def skipped_share(self) -> float:
        n = self.computed + self.predicted
        return self.predicted / n if n else 0.0


def for_request(workflow: str, options: Options, per_pass: bool = False) -> StepCache | PassCaches | None:
    """The cache of a request with these ``options`` (``per_pass``: one per guidance pass), or None for
    lossless (a workflow without the ``quality`` option serves every request lossless)."""
    s = settings(workflow, options.quality)
    if s is None:
        return None
    return PassCaches(s) if per_pass else StepCache(s)
