"""Stretched stage times: a test and benchmark hook, kept out of the TaskWorker's loop.

On a CPU-only machine the tiny models run every stage in milliseconds, so a
test that must catch a request mid-denoise, a benchmark that needs a clear
bottleneck, or the simulation's validation stretch the stages to a chosen
profile (:class:`engine.worker.config.StageTiming`, ``onepiece node
--stage-time/--stage-stretch/--step-time``). The worker process wraps its
executor in :class:`StretchedExecutor` only when its config asks for it
(:func:`stretched`); production workers run the executor itself.

The wrapper sleeps rather than computes, so a stretched stage occupies its
instance (as a GPU kernel would) without taking a CPU core from the others.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.stages.base import StageContext, StageExecutor


class StretchedExecutor(StageExecutor):
    """``inner`` with each run taking at least ``floor_s`` seconds and at least ``factor`` times its compute
    time, and each denoising step ``step_s`` seconds more (slept after the step's progress is reported)."""

    def __init__(self, inner: StageExecutor, floor_s: float = 0.0, factor: float = 1.0, step_s: float = 0.0) -> None:
        # no StageExecutor.__init__: device and model_dir are the inner executor's (through __getattr__)
        self.inner = inner
        self.floor_s = floor_s
        self.factor = factor
        self.step_s = step_s

    def __getattr__(self, name: str) -> Any:  # the inner executor's other attributes (dtype_name, ...)
        return getattr(self.__dict__["inner"], name)

    def calibration_inputs(self, made: dict[str, Any], params: Any) -> dict[str, Any]:
        return self.inner.calibration_inputs(made, params)  # a StageExecutor's own would hide the inner's

    @property
    def components(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.inner.components

    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        self.inner.load(model_dir, device)

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        if self.step_s:
            report = ctx.progress

            def progress(step: int, total: int) -> None:
                if report is not None:
                    report(step, total)
                time.sleep(self.step_s)

            ctx = dataclasses.replace(ctx, progress=progress)
        t0 = time.perf_counter()
        out = self.inner.run(inputs, params, ctx)
        compute = time.perf_counter() - t0
        pad = max(self.floor_s - compute, (self.factor - 1.0) * compute, 0.0)
        if pad:
            time.sleep(pad)
        return out


def stretched(executor: StageExecutor, floor_s: float = 0.0, factor: float = 1.0,
              step_s: float = 0.0) -> StageExecutor:
    """``executor`` itself when nothing is stretched (the production default), else wrapped."""
    if floor_s <= 0 and factor <= 1.0 and step_s <= 0:
        return executor
    return StretchedExecutor(executor, floor_s, factor, step_s)
