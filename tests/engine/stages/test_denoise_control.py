"""Denoise reports progress per step and stops on cancellation or deadline between steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.stages.base import Cancelled, DeadlineExceeded, StageContext

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def sd_denoise_inputs(tiny_models: dict[str, Path]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    from engine.stages.sd.denoise import SDDenoise
    from engine.stages.sd.encoders import SDTextEncode
    from engine.workflow import get_workflow

    params = get_workflow("sd-t2i").resolve_params(
        {"prompt": "a dog", "height": 64, "width": 64, "num_inference_steps": 4})
    enc = SDTextEncode()
    enc.load(tiny_models["sd-t2i"], "cpu")
    embeds = enc.run({}, params, StageContext())
    denoise = SDDenoise()
    denoise.load(tiny_models["sd-t2i"], "cpu")
    return denoise, embeds, params


def test_progress_is_reported_after_every_step(sd_denoise_inputs: Any) -> None:
    denoise, embeds, params = sd_denoise_inputs
    seen: list[tuple[int, int]] = []
    denoise.run(embeds, params, StageContext(progress=lambda s, n: seen.append((s, n))))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_cancellation_is_checked_between_steps(sd_denoise_inputs: Any) -> None:
    denoise, embeds, params = sd_denoise_inputs
    seen: list[int] = []
    ctx = StageContext(progress=lambda s, n: seen.append(s), cancelled=lambda: len(seen) >= 2)
    with pytest.raises(Cancelled):
        denoise.run(embeds, params, ctx)
    assert seen == [1, 2]


def test_deadline_is_checked_between_steps(sd_denoise_inputs: Any) -> None:
    denoise, embeds, params = sd_denoise_inputs
    now = [100.0]
    ctx = StageContext(progress=lambda s, n: now.__setitem__(0, now[0] + 1.0), deadline=101.5,
                       clock=lambda: now[0])
    with pytest.raises(DeadlineExceeded):
        denoise.run(embeds, params, ctx)
    assert now[0] == 102.0  # two steps ran, the third was refused


def test_wan_denoise_honours_cancellation(tiny_models: dict[str, Path], input_png: bytes) -> None:
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    runner = LocalRunner("wan2.1-i2v", tiny_models["wan2.1-i2v"], "cpu")
    params = get_workflow("wan2.1-i2v").resolve_params(
        {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3})
    steps: list[tuple[str, int]] = []
    with pytest.raises(Cancelled):
        runner.run(params, {"image": input_png}, progress=lambda st, s, n: steps.append((st, s)),
                   cancelled=lambda: len(steps) >= 1)
    assert steps == [("denoise", 1)]
