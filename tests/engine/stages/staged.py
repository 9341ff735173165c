"""A staged run of a video workflow with the frames its vae_decode stage produced captured, for comparing
with the one-call pipeline (the final stage encodes them to mp4, which would hide a pixel difference)."""

from __future__ import annotations

from typing import Any

import numpy as np


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
