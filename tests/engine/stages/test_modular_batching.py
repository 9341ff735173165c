"""FLUX.1's and Qwen-Image's denoise stepped in batches (engine.stages.modular.SteppedModularStage) give
every request the bytes it gets alone: requests joining at step boundaries, with other step counts, seeds,
(dev) embedded guidance scales and (Qwen-Image) true-CFG scales, guided and unguided, prompts of other
lengths; and an instance serving them through its real inbox ring and job store batches them, a request
cancelled mid-batch leaving the others untouched. The solo run itself is the one-call pipeline's
(tests/engine/stages/test_flux_qwen.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from tests.engine.stages.staged import step_joining

pytestmark = pytest.mark.models

FLUX = ("flux.1-schnell", "flux.1-dev")
STEPPED = (*FLUX, "qwen-image")


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in STEPPED}


def _requests(workflow: str, folder: Path, rows: list[tuple[str, int, int, float]],
              size: tuple[int, int] = (64, 64)) -> list[dict[str, Any]]:
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(str(folder)))
    out = []
    for prompt, steps, seed, guidance in rows:
        p: dict[str, Any] = {"prompt": prompt, "height": size[0], "width": size[1], "num_inference_steps": steps,
                             "seed": seed}
        if workflow == "flux.1-dev":
            p["guidance_scale"] = guidance
        if workflow == "qwen-image" and guidance > 1.0:  # true CFG: a negative prompt and a scale over 1
            p.update(negative_prompt="blurry", true_cfg_scale=guidance)
        out.append(spec.resolve_params(p))
    return out


def _embeds(runner: Any, params: dict[str, Any]) -> dict[str, Any]:
    from engine.stages.base import StageContext

    return runner.executors["text_encode"].run({}, params, StageContext())


@pytest.mark.parametrize("workflow", STEPPED)
def test_requests_joining_mid_batch_with_other_step_counts_equal_their_solo_runs(
        workflow: str, runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    import torch

    from engine.stages.base import StageContext

    runner = runners[workflow]
    denoise = runner.executors["denoise"]
    # (Qwen-Image: the third is unguided, a cond pass only, beside the others' cond and uncond passes)
    reqs = _requests(workflow, tiny_models[workflow], [("a red boat", 6, 1, 3.5), ("a green tree", 3, 2, 5.0),
                                                       ("a blue car", 5, 3, 1.0), ("a grey cat", 4, 4, 3.5)])
    embeds = [_embeds(runner, r) for r in reqs]
    solo = [denoise.run(e, r, StageContext())["denoised"] for e, r in zip(embeds, reqs, strict=True)]
    assert len({denoise.batch_key(r) for r in reqs}) == 1
    # request 0 starts alone; 1 and 2 join after its second step; 3 joins when 1 has left
    out, widths = step_joining(denoise, embeds, reqs, {0: [0], 2: [1, 2], 5: [3]})
    assert max(widths) == 3 and sorted(out) == [0, 1, 2, 3]
    for k in range(4):
        assert torch.equal(out[k], solo[k]), f"request {k} differs from its solo run"
    assert not torch.equal(solo[0], solo[3])  # different seeds and prompts give different latents


def test_each_request_keeps_its_own_timesteps_and_guidance(runners: dict[str, Any],
                                                           tiny_models: dict[str, Path]) -> None:
    """Two requests that differ only in guidance (dev) step together yet end apart: the embedded guidance
    is per row, as the timestep is (a shared one would give both the first request's latents)."""
    import torch

    runner = runners["flux.1-dev"]
    denoise = runner.executors["denoise"]
    a, b = _requests("flux.1-dev", tiny_models["flux.1-dev"], [("a cat", 3, 7, 2.0), ("a cat", 3, 7, 6.0)])
    e = _embeds(runner, a)
    states = [denoise.begin(e, a), denoise.begin(e, b)]
    for _ in range(3):
        denoise.step(states)
    first, second = (denoise.end(st)["denoised"] for st in states)
    assert not torch.equal(first, second)


def test_qwen_passes_of_one_text_length_share_a_call_each_request_its_own_scale(
        runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """Three guided requests, one negative prompt, prompts of one length: a batched step makes one
    transformer call per text length among the six passes (two here: the prompts' and the negative's), and
    requests stepped alone afterwards keep their own true-CFG scale (the guider is the request's, not the
    last begun one's)."""
    import torch

    from engine.stages.base import StageContext

    runner = runners["qwen-image"]
    denoise = runner.executors["denoise"]
    reqs = _requests("qwen-image", tiny_models["qwen-image"], [("a cat", 2, 1, 2.0), ("a dog", 2, 2, 6.0),
                                                               ("a cat", 2, 3, 4.0)])
    embeds = [_embeds(runner, r) for r in reqs]
    assert embeds[0]["prompt_embeds"].shape == embeds[1]["prompt_embeds"].shape
    solo = [denoise.run(e, r, StageContext())["denoised"] for e, r in zip(embeds, reqs, strict=True)]
    calls: list[int] = []
    hook = denoise.pipe.transformer.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        states = [denoise.begin(e, r) for e, r in zip(embeds, reqs, strict=True)]
        denoise.step(states)
        lengths = {e[k].shape[1] for e in embeds for k in ("prompt_embeds", "negative_prompt_embeds")}
        assert len(lengths) == 2 and len(calls) == 2  # 6 passes, 2 text lengths: 2 calls
        for st in states:  # the second step one by one, in the order begun: each with its own guider
            denoise.step([st])
    finally:
        hook.remove()
    for k, st in enumerate(states):
        assert torch.equal(denoise.end(st)["denoised"], solo[k]), f"request {k} differs from its solo run"


def test_other_sizes_or_text_lengths_never_share_a_step(runners: dict[str, Any],
                                                        tiny_models: dict[str, Path]) -> None:
    denoise = runners["flux.1-dev"].executors["denoise"]
    folder = tiny_models["flux.1-dev"]
    base, = _requests("flux.1-dev", folder, [("x", 2, 0, 3.5)])
    other_size, = _requests("flux.1-dev", folder, [("x", 2, 0, 3.5)], size=(64, 96))
    assert denoise.batch_key(base) != denoise.batch_key(other_size)
    assert denoise.batch_key(base) != denoise.batch_key({**base, "max_sequence_length": 64})
    assert denoise.batch_key(base) == denoise.batch_key({**base, "seed": 9, "num_inference_steps": 7,
                                                         "guidance_scale": 1.0})


def test_an_instance_batches_flux_requests_and_a_cancel_leaves_the_rest(
        runners: dict[str, Any], tiny_models: dict[str, Path], redis_server: Any, etcd_server: Any) -> None:
    """Through the TaskWorker's batching loop, its ring and store: three requests share steps, one is
    cancelled after the second shared step; the other two are handed on once each, equal to their solo
    runs, and their stage runs say they shared a batch of three."""
    import torch

    from engine.stages.base import StageContext
    from engine.store import keys
    from tests.engine.worker.rig import DenoiseRig

    workflow = "flux.1-dev"
    runner = runners[workflow]
    denoise = runner.executors["denoise"]
    rows = [("a red boat", 6, 1, 3.5), ("a green tree", 4, 2, 5.0), ("a blue car", 8, 3, 2.0)]
    uids = [uuid.uuid4().hex for _ in rows]
    reqs = dict(zip(uids, _requests(workflow, tiny_models[workflow], rows), strict=True))
    good, cancelled = uids[:2], uids[2]
    embeds = {u: _embeds(runner, p) for u, p in reqs.items()}
    solo = {u: denoise.run(embeds[u], reqs[u], StageContext())["denoised"] for u in good}
    rig = DenoiseRig(redis_server.url, etcd_server.url, workflow)
    try:
        with rig.cancels_midway(denoise, cancelled, width=3) as shared:
            rig.serve(rig.worker(denoise), uids, reqs, embeds)
        handed: dict[str, Any] = {}
        rig.collect(handed)
        assert sorted(handed) == sorted(good)
        for u in good:
            assert torch.equal(handed[u], solo[u]), "a batched request differs from its solo run"
        assert rig.store.state(cancelled) == keys.CANCELLED and len(shared) >= 2
        assert rig.inbox.held == 0
        finished = [e for u in good for e in rig.store.events(u) if e["type"] == keys.STAGE_FINISHED]
        assert len(finished) == 2 and all("batch=3" in e["detail"] for e in finished), finished
    finally:
        rig.close()
