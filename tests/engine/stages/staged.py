"""Helpers of the stage tests: a staged run of a video workflow with the frames its vae_decode stage produced
captured, for comparing with the one-call pipeline (the final stage encodes them to mp4, which would hide a
pixel difference); requests stepped together on a stepped stage, joining at chosen steps; a request whose
params its spec resolved begun, or keyed, as a worker does it (its options apart: engine.workflow.options)."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.workflow.options import Options


def begin(executor: Any, inputs: Any, resolved: dict[str, Any]) -> Any:
    """``executor.begin`` on a request whose params its spec resolved: its model parameters and its options
    apart, as the Proxy sends them and a worker hands them on."""
    params, options = Options.split(resolved)
    return executor.begin(inputs, params, options)


def alone(executor: Any, inputs: Any, resolved: dict[str, Any], **ctx: Any) -> dict[str, Any]:
    """``executor.run`` on a request whose params its spec resolved (see :func:`begin`): its options in the
    context, as a worker gives them."""
    from engine.stages.base import StageContext

    params, options = Options.split(resolved)
    return executor.run(inputs, params, StageContext(options=options, **ctx))


def batch_key(executor: Any, resolved: dict[str, Any]) -> Any:
    """``executor.batch_key`` of a request whose params its spec resolved (see :func:`begin`)."""
    return executor.batch_key(*Options.split(resolved))


def staged_frames(runner: Any, params: dict[str, Any], inputs: dict[str, bytes]) -> tuple[np.ndarray, Any]:
    """(the frames vae_decode produced, the run's result) of ``runner`` (a LocalRunner) on ``params``."""
    captured: dict[str, np.ndarray] = {}
    decode = runner.executors["vae_decode"]
    original = decode.run

    def spy(i: Any, p: Any, ctx: Any) -> Any:
        out = original(i, p, ctx)
        captured["frames"] = out["frames"].numpy().copy()
        return out

    decode.run = spy
    try:
        result = runner.run(runner.spec.resolve_params(params), inputs)
    finally:
        del decode.run
    return captured["frames"], result


def step_joining(denoise: Any, embeds: list[Any], reqs: list[dict[str, Any]],
                 joins: dict[int, list[int]], ticks: int = 20,
                 leave: dict[int, int] | None = None) -> tuple[dict[int, Any], list[int]]:
    """Step a SteppedStage's requests together as a batcher would: request ``k`` begins at tick ``t`` for each
    ``k`` in ``joins[t]``, and leaves when its own steps are done, or (``leave[k]``: as a cancelled one leaves
    the batcher) after that many of them, with nothing in the output. Returns (each finished request's
    ``denoised``, the batch width at each tick)."""
    states: dict[int, Any] = {}
    out: dict[int, Any] = {}
    widths: list[int] = []
    for tick in range(ticks):
        for k in joins.get(tick, []):
            states[k] = begin(denoise, embeds[k], reqs[k])
        if not states:
            break
        widths.append(len(states))
        denoise.step(list(states.values()))
        for k, st in list(states.items()):
            done, total = denoise.progress(st)
            if leave and done == leave.get(k):
                del states[k]
            elif done == total:
                out[k] = denoise.end(st)["denoised"]
                del states[k]
    return out, widths
