"""``quality`` per request (engine.stages.caching): each level of FLUX.1's denoise alone gives the bytes of
the one-call FluxPipeline with diffusers' own TaylorSeer hook in the same configuration (lossless: with
none); requests of different levels share batched steps, each item equal to its solo run, one leaving
mid-run; the schedule skips what it says; the level is bounded per workflow and an operator can change its
settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from engine.workflow.spec import InvalidRequest
from tests.engine.stages.staged import batch_key, begin, step_joining

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in ("flux.1-schnell", "flux.1-dev")}


def _params(workflow: str, folder: Path, **p: Any) -> dict[str, Any]:
    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder))).resolve_params({"prompt": "a cat", "height": 64, "width": 64,
                                                                    **p})


def _embeds(runner: Any, params: dict[str, Any]) -> dict[str, Any]:
    from engine.stages.base import StageContext

    return runner.executors["text_encode"].run({}, params, StageContext())


def _solo(runner: Any, params: dict[str, Any]) -> tuple[Any, Any]:
    """(the denoised latents, the request's cache) of a request stepped alone."""
    denoise = runner.executors["denoise"]
    st = begin(denoise, _embeds(runner, params), params)
    while denoise.progress(st)[0] < len(st.timesteps):
        denoise.step([st])
    return denoise.end(st)["denoised"], st.cache


def _reference(folder: Path, workflow: str, params: dict[str, Any]) -> Any:
    """FluxPipeline's latents for ``params``, with diffusers' TaylorSeer hook as the level configures it."""
    import torch
    from diffusers import FluxPipeline

    from engine.stages import caching
    from engine.workflow.options import SERVING_PARAMS

    pipe = FluxPipeline.from_pretrained(folder)
    settings = caching.settings(workflow, params["quality"])
    if settings is not None:
        pipe.transformer.enable_cache(settings.config())
    kwargs = {k: v for k, v in params.items() if k != "seed" and k not in SERVING_PARAMS}
    packed = pipe(generator=torch.Generator().manual_seed(params["seed"]), output_type="latent", **kwargs).images
    return pipe._unpack_latents(packed, params["height"], params["width"], pipe.vae_scale_factor)


@pytest.mark.parametrize(("workflow", "steps"), [("flux.1-dev", 12), ("flux.1-schnell", 4)])
def test_each_level_alone_is_diffusers_own_hook(workflow: str, steps: int, runners: dict[str, Any],
                                                tiny_models: dict[str, Path]) -> None:
    import torch

    out = {}
    for q in ("lossless", "extra-high", "high"):
        params = _params(workflow, tiny_models[workflow], num_inference_steps=steps, seed=3, quality=q)
        out[q], cache = _solo(runners[workflow], params)
        assert torch.equal(out[q], _reference(tiny_models[workflow], workflow, params)), q
        assert (cache is None) == (q == "lossless")
    assert not torch.equal(out["high"], out["lossless"])  # the cache changed something
    # at 4 steps both levels predict only the last step (after 3 full ones); at 12 their schedules differ
    assert torch.equal(out["high"], out["extra-high"]) == (steps == 4)


def test_the_schedule_skips_what_it_says(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """TaylorSeer's schedule (diffusers' defaults for high: 3 full steps, then one in 5; extra-high one in 2):
    it depends on the step index only."""
    folder = tiny_models["flux.1-dev"]
    runner = runners["flux.1-dev"]
    _, high = _solo(runner, _params("flux.1-dev", folder, num_inference_steps=28, seed=1, quality="high"))
    _, extra = _solo(runner, _params("flux.1-dev", folder, num_inference_steps=28, seed=1, quality="extra-high"))
    # high: steps 0-2 and 4, 9, 14, 19, 24 computed; extra-high: 0-2 and 4, 6, ..., 26
    assert (high.computed, high.predicted) == (8, 20)
    assert (extra.computed, extra.predicted) == (15, 13)
    assert high.skipped_share() == pytest.approx(20 / 28)


def test_mixed_levels_share_a_batch_each_item_its_solo_run(runners: dict[str, Any],
                                                           tiny_models: dict[str, Path]) -> None:
    """lossless, extra-high, high and a high one that leaves after its fourth step (as a cancelled request
    leaves the batcher) step together, joining at different steps: quality is not part of the batch key, and
    each item equals its solo run."""
    import torch

    workflow, folder = "flux.1-dev", tiny_models["flux.1-dev"]
    runner = runners[workflow]
    denoise = runner.executors["denoise"]
    reqs = [_params(workflow, folder, num_inference_steps=n, seed=s, quality=q, guidance_scale=g)
            for n, s, q, g in ((12, 1, "lossless", 3.5), (10, 2, "extra-high", 5.0), (14, 3, "high", 2.0),
                               (12, 4, "high", 3.5))]
    assert len({batch_key(denoise, r) for r in reqs}) == 1
    solo = [_solo(runner, r)[0] for r in reqs]
    embeds = [_embeds(runner, r) for r in reqs]
    # 3 leaves after its fourth step, as a cancelled request leaves the batcher (its cache with it)
    out, widths = step_joining(denoise, embeds, reqs, {0: [0, 3], 1: [1], 2: [2]}, leave={3: 4})
    assert max(widths) == 4 and sorted(out) == [0, 1, 2]
    for k in range(3):
        assert torch.equal(out[k], solo[k]), f"request {k} ({reqs[k]['quality']}) differs from its solo run"


def test_quality_is_bounded_per_workflow_and_lossless_by_default(tiny_models: dict[str, Path]) -> None:
    params = _params("flux.1-dev", tiny_models["flux.1-dev"])
    assert params["quality"] == "lossless"
    with pytest.raises(InvalidRequest) as err:
        _params("flux.1-dev", tiny_models["flux.1-dev"], quality="ultra")
    assert err.value.field == "quality" and "lossless, extra-high, high" in str(err.value)
    with pytest.raises(InvalidRequest) as err:  # a workflow whose denoise does not cache: not its parameter
        get_workflow("sd-t2i").resolve_params({"prompt": "x", "quality": "high"})
    assert err.value.field == "quality"
    from engine.stages import caching

    for name in ("flux.1-schnell", "flux.1-dev"):  # the spec offers exactly the levels the stage can serve
        assert get_workflow(name).param("quality").choices == caching.levels(name)


def test_an_operator_overrides_a_levels_settings(monkeypatch: pytest.MonkeyPatch, runners: dict[str, Any],
                                                  tiny_models: dict[str, Path]) -> None:
    monkeypatch.setenv("ONEPIECE_QUALITY_MAP", '{"flux.1-dev": {"high": {"cache_interval": 2}}}')
    folder = tiny_models["flux.1-dev"]
    _, cache = _solo(runners["flux.1-dev"], _params("flux.1-dev", folder, num_inference_steps=28, seed=1,
                                                   quality="high"))
    assert (cache.computed, cache.predicted) == (15, 13)  # extra-high's schedule now
