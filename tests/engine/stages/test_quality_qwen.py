"""``quality`` on Qwen-Image (engine.stages.caching): TaylorSeer lite with a cache per guidance pass. Alone,
each level gives the latents of the one-call QwenImagePipeline with diffusers' own hook in the same
configuration (the pipeline runs its cond and uncond passes in ``cache_context("cond")`` / ``("uncond")``,
one hook state each), with and without true CFG; in a batch, requests of every level, guided or not, step
together and each item equals its solo run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from tests.engine.stages.staged import batch_key, step_joining
from tests.engine.stages.test_quality import _embeds, _solo

pytestmark = pytest.mark.models

WF = "qwen-image"


@pytest.fixture(scope="module")
def runner(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner(WF, tiny_models[WF], "cpu")


def _params(folder: Path, **p: Any) -> dict[str, Any]:
    spec = get_workflow(WF)
    return spec.bound(spec.limits_of(str(folder))).resolve_params({"prompt": "a cat", "height": 64, "width": 64,
                                                                    **p})


def _reference(folder: Path, params: dict[str, Any]) -> Any:
    """QwenImagePipeline's latents for ``params``, with diffusers' TaylorSeer hook as the level sets it."""
    import torch
    from diffusers import QwenImagePipeline

    from engine.stages import caching
    from engine.workflow.options import SERVING_PARAMS

    pipe = QwenImagePipeline.from_pretrained(folder)
    settings = caching.settings(WF, params["quality"])
    if settings is not None:
        pipe.transformer.enable_cache(settings.config())
    kwargs = {k: v for k, v in params.items() if k != "seed" and k not in SERVING_PARAMS}
    packed = pipe(generator=torch.Generator().manual_seed(params["seed"]), output_type="latent", **kwargs).images
    return pipe._unpack_latents(packed, params["height"], params["width"], pipe.vae_scale_factor)


@pytest.mark.parametrize("negative", [None, "blurry"], ids=["one-pass", "true-cfg"])
def test_each_level_alone_is_diffusers_own_hook(negative: str | None, runner: Any,
                                                tiny_models: dict[str, Path]) -> None:
    import torch

    folder = tiny_models[WF]
    out = {}
    for q in ("lossless", "extra-high", "high"):
        params = _params(folder, num_inference_steps=10, seed=3, quality=q, negative_prompt=negative)
        out[q], cache = _solo(runner, params)
        assert torch.equal(out[q], _reference(folder, params)), q
        if q == "lossless":
            assert cache is None
        else:  # one cache per pass, each on the level's schedule: high computes steps 0-2, 4 and 9 of 10
            assert len(cache.passes) == (2 if negative else 1)
            if q == "high":
                assert [(c.computed, c.predicted) for c in cache.passes.values()] == [(5, 5)] * len(cache.passes)
    assert not torch.equal(out["high"], out["lossless"]) and not torch.equal(out["high"], out["extra-high"])


def test_mixed_levels_and_guidance_share_a_batch_each_item_its_solo_run(runner: Any,
                                                                        tiny_models: dict[str, Path]) -> None:
    """lossless, extra-high and high requests, guided (two passes) and not, prompts of different lengths,
    joining at different steps and one high request leaving after its fourth step (as a cancelled one leaves
    the batcher): quality is not part of the batch key, and each item equals its solo run."""
    import torch

    folder = tiny_models[WF]
    denoise = runner.executors["denoise"]
    reqs = [_params(folder, num_inference_steps=n, seed=s, quality=q, negative_prompt=neg, prompt=p)
            for n, s, q, neg, p in ((10, 1, "lossless", "blurry", "a cat"),
                                    (8, 2, "extra-high", None, "a red car parked in the snow at night"),
                                    (11, 3, "high", "blurry, dark", "a cat"),
                                    (10, 4, "high", None, "a dog"))]
    assert len({batch_key(denoise, r) for r in reqs}) == 1
    solo = [_solo(runner, r)[0] for r in reqs]
    embeds = [_embeds(runner, r) for r in reqs]
    # 3 leaves after its fourth step, as a cancelled request leaves the batcher (its cache with it)
    out, widths = step_joining(denoise, embeds, reqs, {0: [0, 3], 1: [1], 2: [2]}, leave={3: 4})
    assert max(widths) == 4 and sorted(out) == [0, 1, 2]
    for k in range(3):
        assert torch.equal(out[k], solo[k]), f"request {k} ({reqs[k]['quality']}) differs from its solo run"


def test_the_spec_offers_the_levels_the_stage_serves() -> None:
    from engine.stages import caching

    assert get_workflow(WF).param("quality").choices == caching.levels(WF) == ("lossless", "extra-high", "high")


def test_the_worker_reports_each_runs_skipped_share(runner: Any, tiny_models: dict[str, Path],
                                                     redis_server: Any, etcd_server: Any) -> None:
    """Through the TaskWorker's batching loop, its ring and store: a lossless, an extra-high and a high
    request share steps with a fourth (high) that is cancelled after the second shared step; the three are
    each handed on equal to their solo run, the cancelled one is not, and each cached run's stage_finished
    event says what share of its transformer calls its cache skipped (what the ledger's stage run
    records)."""
    import uuid

    import torch

    from engine.store import keys
    from tests.engine.worker.rig import DenoiseRig

    denoise = runner.executors["denoise"]
    levels = ("lossless", "extra-high", "high", "high")
    every = [uuid.uuid4().hex for _ in levels]
    uids, cancelled = every[:3], every[3]
    reqs = {u: _params(tiny_models[WF], num_inference_steps=10, seed=k, quality=q, prompt=f"a photo of thing {k}")
            for k, (u, q) in enumerate(zip(every, levels, strict=True))}
    embeds = {u: _embeds(runner, p) for u, p in reqs.items()}
    solo = {u: _solo(runner, reqs[u]) for u in uids}
    rig = DenoiseRig(redis_server.url, etcd_server.url, WF)
    try:
        with rig.cancels_midway(denoise, cancelled, width=4) as shared:
            rig.serve(rig.worker(denoise), every, reqs, embeds)
        handed: dict[str, Any] = {}
        rig.collect(handed)
        assert sorted(handed) == sorted(uids)  # the cancelled one was not handed on
        assert rig.store.state(cancelled) == keys.CANCELLED and len(shared) >= 2
        details = {}
        for u in uids:
            assert torch.equal(handed[u], solo[u][0]), reqs[u]["quality"]
            finished = [e for e in rig.store.events(u) if e["type"] == keys.STAGE_FINISHED]
            assert len(finished) == 1
            details[reqs[u]["quality"]] = finished[0]["detail"]
        assert "batch=4" in details["lossless"] and "cache_skipped" not in details["lossless"], details
        for q in ("extra-high", "high"):  # the share its solo run's cache counted: 4 and 5 of 10 predicted
            want = solo[uids[levels.index(q)]][1].skipped_share()
            assert f"cache_skipped={want:.3f}" in details[q], details
    finally:
        rig.close()
