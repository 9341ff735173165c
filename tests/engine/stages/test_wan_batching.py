"""Wan2.1's denoise batches its steps (issue 37, item 1): requests of one size and guidance mode share one
transformer call per step over every request's cond and uncond rows, joining at step boundaries with other
step counts, guidance scales, seeds and quality levels, and each item is the bytes of the same request run
alone by the stage (``WanDenoise.run``, the one-call pipeline's bytes: test_bit_identical.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from engine.workflow.options import Options
from tests.engine.stages.staged import alone, batch_key, step_joining

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in ("wan2.1-t2v", "wan2.1-i2v")}


def _inputs(runner: Any, params: dict[str, Any], png: bytes | None) -> dict[str, Any]:
    """What the denoise stage receives: the outputs of the stages before it."""
    from engine.stages.base import StageContext

    values: dict[str, Any] = {} if png is None else {"image": png}
    for stage in runner.spec.route()[:runner.spec.route().index("denoise")]:
        values.update(runner.executors[stage].run(values, params, StageContext()))
    return values


def denoise_default(workflow: str) -> int:
    return get_workflow(workflow).stage("denoise").max_batch


def _params(workflow: str, folder: Path, **p: Any) -> dict[str, Any]:
    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder))).resolve_params(
        {"height": 32, "width": 32, "num_frames": 5, **p})


@pytest.mark.parametrize("workflow", ["wan2.1-t2v", "wan2.1-i2v"])
def test_requests_joining_mid_batch_equal_their_solo_runs(workflow: str, runners: dict[str, Any],
                                                          tiny_models: dict[str, Path], input_png: bytes) -> None:
    import torch


    runner, folder = runners[workflow], tiny_models[workflow]
    denoise = runner.executors["denoise"]
    png = input_png if workflow == "wan2.1-i2v" else None
    rows = [("a red boat", 6, 1, 5.0, "lossless"), ("a green tree in the wind", 4, 2, 3.0, "high"),
            ("a blue car", 7, 3, 6.5, "extra-high"), ("a dog", 5, 4, 5.0, "lossless")]
    reqs = [_params(workflow, folder, prompt=p, num_inference_steps=n, seed=s, guidance_scale=g, quality=q)
            for p, n, s, g, q in rows]
    assert len({batch_key(denoise, r) for r in reqs}) == 1
    embeds = [_inputs(runner, r, png) for r in reqs]
    solo = [alone(denoise, e, r)["denoised"] for e, r in zip(embeds, reqs, strict=True)]
    out, widths = step_joining(denoise, embeds, reqs, {0: [0, 3], 1: [1], 2: [2]})
    assert max(widths) == 4 and sorted(out) == [0, 1, 2, 3]  # the default max_batch (the spec's)
    assert denoise_default(workflow) == 4
    for k in range(4):
        assert torch.equal(out[k], solo[k]), f"request {k} ({reqs[k]['quality']}) differs from its solo run"
    assert not torch.equal(solo[0], solo[2])  # the requests differ: equality means something


def test_what_cannot_share_a_step_never_does(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """Another size, an unguided request (one pass) and a request with LoRA adapters (they are the model's
    active set while it runs) are other batch keys, or none."""
    workflow, folder = "wan2.1-t2v", tiny_models["wan2.1-t2v"]
    denoise = runners[workflow].executors["denoise"]
    base = _params(workflow, folder, prompt="x")
    keys = {denoise.batch_key(base), denoise.batch_key({**base, "height": 64}),
            denoise.batch_key({**base, "guidance_scale": 1.0})}
    assert len(keys) == 3
    assert denoise.batch_key(base, Options(lora=({"name": "a", "scale": 1.0, "digest": "0" * 64},))) is None


def test_an_instance_in_collaboration_mode_runs_each_request_alone(runners: dict[str, Any],
                                                                     tiny_models: dict[str, Path]) -> None:
    """A Wan denoise instance always has a Collaboration-mode service (cfg_parallel); its requests batch
    while their workflow is in Individual mode, and run alone (on the plain path, with a peer computing
    their uncond halves) while it is in Collaboration mode."""
    from types import SimpleNamespace

    from engine.worker.taskworker import TaskWorker
    from engine.workflow import message as wm

    workflow = "wan2.1-t2v"
    denoise = runners[workflow].executors["denoise"]
    params = _params(workflow, tiny_models[workflow], prompt="x")
    h = wm.Header(uid="u", workflow=workflow, stage="denoise", route=["denoise"], params=params)
    for mode, by_itself in (("individual", False), ("collaboration", True)):
        worker = SimpleNamespace(collab=object(), executor=denoise, routes=SimpleNamespace(mode=lambda w, m=mode: m))
        assert (TaskWorker._batch_key(worker, h) is None) == by_itself, mode
