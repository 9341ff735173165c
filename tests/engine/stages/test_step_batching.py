"""SD's denoise stepped in batches (engine.stages.base.SteppedStage) gives every request the bytes it gets
alone: requests joining at step boundaries, with other step counts, seeds and guidance scales."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.stages.staged import step_joining

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def sd(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")


def _embeds(sd: Any, params: dict[str, Any]) -> dict[str, Any]:
    from engine.stages.base import StageContext

    return sd.executors["text_encode"].run({}, params, StageContext())


def _png(sd: Any, params: dict[str, Any], denoised: Any) -> bytes:
    from engine.stages.base import StageContext

    pixels = sd.executors["vae_decode"].run({"denoised": denoised}, params, StageContext())["pixels"]
    return bytes(sd.executors["image_encode"].run({"pixels": pixels}, params, StageContext())["image"])


def test_requests_joining_mid_batch_with_other_step_counts_equal_their_solo_runs(sd: Any) -> None:
    import torch

    from engine.stages.base import StageContext

    denoise = sd.executors["denoise"]
    reqs = [sd.spec.resolve_params({"prompt": p, "height": 64, "width": 64, "num_inference_steps": n, "seed": s,
                                    "guidance_scale": g})
            for p, n, s, g in (("a red boat", 6, 1, 7.5), ("a green tree", 3, 2, 5.0), ("a blue car", 5, 3, 9.0),
                               ("a grey cat", 4, 4, 7.5))]
    embeds = [_embeds(sd, r) for r in reqs]
    solo = [denoise.run(e, r, StageContext())["denoised"] for e, r in zip(embeds, reqs, strict=True)]
    assert len({denoise.batch_key(r) for r in reqs}) == 1
    # request 0 starts alone; 1 and 2 join after its second step; 3 joins when 1 has left
    out, widths = step_joining(denoise, embeds, reqs, {0: [0], 2: [1, 2], 5: [3]})
    assert max(widths) == 3 and sorted(out) == [0, 1, 2, 3]
    for k in range(4):
        assert torch.equal(out[k], solo[k]), f"request {k} differs from its solo run"
        assert _png(sd, reqs[k], out[k]) == _png(sd, reqs[k], solo[k])
    assert not torch.equal(solo[0], solo[3])  # different seeds and prompts give different latents


def test_an_unguided_request_never_shares_a_step(sd: Any) -> None:
    denoise = sd.executors["denoise"]
    unguided = sd.spec.resolve_params({"prompt": "x", "height": 64, "width": 64, "guidance_scale": 1.0})
    guided = sd.spec.resolve_params({"prompt": "x", "height": 64, "width": 64})
    other = sd.spec.resolve_params({"prompt": "x", "height": 128, "width": 64})
    assert denoise.batch_key(unguided) is None
    assert denoise.batch_key(guided) != denoise.batch_key(other)


def test_batch_forming_keeps_arrival_order() -> None:
    from engine.worker.batching import joiners

    a, b = ("64", "64"), ("128", "64")
    assert joiners(None, 0, [a, a, b, a], 8) == 2  # the oldest run of one key; b keeps its place
    assert joiners(a, 2, [a, a, a], 4) == 2  # up to max_batch
    assert joiners(a, 1, [b, a], 4) == 0  # an older incompatible request waits: nothing newer overtakes it
    assert joiners(None, 0, [None, a], 4) == 1  # a request that cannot share starts alone
    assert joiners(a, 1, [None], 4) == 0
