"""``quality`` on Wan2.1 (engine.stages.caching): TaylorSeer lite with a cache per guidance pass. Each level
of the staged run gives the denoised latents of the one-call WanPipeline / WanImageToVideoPipeline with
diffusers' own hook in the same configuration (the pipelines run their passes in
``cache_context("cond")`` / ``("uncond")``, one hook state each), guided and not; a cached request never
sends its uncond half to a Collaboration-mode peer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from engine.workflow.options import Options
from engine.workflow.spec import InvalidRequest

pytestmark = pytest.mark.models

BASE = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=10, seed=5)


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in ("wan2.1-t2v", "wan2.1-i2v")}


def _denoised(runner: Any, params: dict[str, Any], inputs: dict[str, bytes]) -> tuple[Any, Any]:
    """(the latents the denoise stage produced, the request's caches) of a staged run."""
    captured: dict[str, Any] = {}
    denoise = runner.executors["denoise"]
    original, make = denoise.run, denoise._cache

    def spy(i: Any, p: Any, ctx: Any) -> Any:
        out = original(i, p, ctx)
        captured["denoised"] = out["denoised"].clone()
        return out

    def cache(p: Any) -> Any:
        captured["cache"] = make(p)
        return captured["cache"]

    denoise.run, denoise._cache = spy, cache
    try:
        runner.run(runner.spec.resolve_params(params), inputs)
    finally:
        del denoise.run, denoise._cache
    return captured["denoised"], captured["cache"]


def _reference(folder: Path, workflow: str, params: dict[str, Any], png: bytes | None) -> Any:
    """The pipeline's latents for ``params``, with diffusers' TaylorSeer hook as the level sets it, on each
    transformer (Wan2.2 A14B's experts each get one: the hook keeps a state per module, so the low-noise
    expert's schedule starts at the boundary)."""
    import inspect

    import torch
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from engine.stages import caching
    from engine.stages.components import decode_image

    pipe = (WanPipeline if png is None else WanImageToVideoPipeline).from_pretrained(folder)
    settings = caching.settings(workflow, params.get("quality", "lossless"))
    for module in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if module is not None and settings is not None:
            module.enable_cache(settings.config())
    takes = inspect.signature(type(pipe).__call__).parameters
    kwargs = {k: v for k, v in params.items() if k in takes and k != "seed"}
    if png is not None:
        kwargs["image"] = decode_image(png)
    return pipe(generator=torch.Generator().manual_seed(params["seed"]), output_type="latent", **kwargs).frames


@pytest.mark.parametrize(("workflow", "guidance"), [("wan2.1-t2v", 5.0), ("wan2.1-t2v", 1.0), ("wan2.1-i2v", 5.0)])
def test_each_level_is_diffusers_own_hook(workflow: str, guidance: float, runners: dict[str, Any],
                                          tiny_models: dict[str, Path], input_png: bytes) -> None:
    import torch

    png = input_png if workflow == "wan2.1-i2v" else None
    inputs = {} if png is None else {"image": png}
    out = {}
    for q in ("lossless", "extra-high", "high"):
        params = {**BASE, "guidance_scale": guidance, "quality": q}
        out[q], cache = _denoised(runners[workflow], params, inputs)
        assert torch.equal(out[q], _reference(tiny_models[workflow], workflow, params, png)), q
        if q == "lossless":
            assert cache is None
        else:  # a cache per pass; high computes steps 0-2, 4 and 9 of 10
            assert len(cache.passes) == (2 if guidance > 1.0 else 1)
            if q == "high":
                assert [(c.computed, c.predicted) for c in cache.passes.values()] == [(5, 5)] * len(cache.passes)
    assert not torch.equal(out["high"], out["lossless"]) and not torch.equal(out["high"], out["extra-high"])


def test_a_cached_request_keeps_its_uncond_half(runners: dict[str, Any]) -> None:
    """Collaboration mode: a lossless guided request sends its uncond halves to the peer; one below lossless
    never does (its uncond cache is local), nor an unguided one, and each gets the bytes it gets alone. The
    share of a step the executor says it computes itself (what the warm-up calibration prices a step at in
    Collaboration mode) is half exactly where the halves go to the peer."""
    import torch

    from engine.stages.base import StageContext

    class Peer:
        """A Collaboration-mode peer that computes nothing: it says it took the step, and returns None (the
        request then computes the half itself), counting what it was sent."""

        def __init__(self) -> None:
            self.sent = 0

        def begin(self, fixed: Any) -> None: ...

        def send_step(self, i: int, step: Any) -> bool:
            self.sent += 1
            return True

        def local_time(self, seconds: float) -> None: ...

        def wait_step(self, i: int) -> None:
            return None

        def end(self) -> None: ...

    runner = runners["wan2.1-t2v"]
    spec = runner.spec
    embeds = runner.executors["text_encode"]
    denoise = runner.executors["denoise"]
    for q, guidance, sends in (("lossless", 5.0, True), ("high", 5.0, False), ("lossless", 1.0, False)):
        params, options = Options.split(spec.resolve_params({**BASE, "quality": q, "guidance_scale": guidance}))
        assert denoise.cfg_share(params, options) == (0.5 if sends else 1.0), (q, guidance)
        inputs = embeds.run({}, params, StageContext())
        peer = Peer()
        ctx = StageContext(options=options)
        ctx.cfg_parallel = peer
        with_peer = denoise.run(inputs, params, ctx)["denoised"]
        alone = denoise.run(inputs, params, StageContext(options=options))["denoised"]
        assert (peer.sent > 0) == sends, (q, guidance)
        assert torch.equal(with_peer, alone)


def test_every_wan_workflow_serves_the_levels() -> None:
    from engine.stages import caching

    for name in ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"):
        assert get_workflow(name).param("quality").choices == caching.levels(name) == ("lossless", "extra-high",
                                                                                        "high")
    with pytest.raises(InvalidRequest) as err:
        get_workflow("wan2.2-t2v-a14b").resolve_params({"prompt": "x", "quality": "highest"})
    assert err.value.field == "quality"


@pytest.fixture(scope="module")
def wan22(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in ("wan2.2-t2v-a14b", "wan2.2-ti2v-5b")}


@pytest.mark.parametrize("workflow", ["wan2.2-t2v-a14b", "wan2.2-ti2v-5b"])
def test_wan22_levels_are_diffusers_own_hook_per_expert(workflow: str, wan22: dict[str, Any],
                                                        tiny_models: dict[str, Path], input_png: bytes) -> None:
    """Each expert stage keeps its own caches, made at its first step: ``high`` on the A14B model is the
    pipeline's bytes with the hook on both transformers (a cache carried across the boundary would not be);
    the 5B model (one transformer, the first frame held) likewise with an image. Each stage records the share
    it skipped."""
    import torch

    from engine.stages.base import StageContext

    runner = wan22[workflow]
    png = input_png if workflow.endswith("5b") else None
    size = {"height": 64, "width": 64} if workflow.endswith("5b") else {}
    last = "denoise" if workflow.endswith("5b") else "denoise_low"
    out: dict[str, Any] = {}
    for q in ("lossless", "high"):  # 16 steps: each A14B expert runs past the warm-up, and skips
        params = runner.spec.resolve_params({**BASE, **size, "num_inference_steps": 16, "quality": q})
        seen: dict[str, Any] = {}
        for stage in ("denoise_high", last) if last == "denoise_low" else (last,):
            ex = runner.executors[stage]

            def spy(i: Any, p: Any, ctx: Any, stage: str = stage, run: Any = ex.run, seen: dict = seen) -> Any:
                c = StageContext(options=ctx.options)
                got = run(i, p, c)
                seen[stage] = (c.stats.get("cache_skipped"), got.get("denoised"))
                return got

            ex.run = spy
        try:
            runner.run(params, {} if png is None else {"image": png})
        finally:
            for ex in runner.executors.values():
                ex.__dict__.pop("run", None)
        out[q] = seen[last][1]
        if q == "lossless":  # the one-call pipeline's bytes, no cache (tests/engine/stages/test_wan22.py)
            assert all(skipped is None for skipped, _ in seen.values()), seen
            continue
        assert torch.equal(out[q], _reference(tiny_models[workflow], workflow, params, png)), (workflow, q)
        assert all(skipped is not None and skipped > 0 for skipped, _ in seen.values()), seen
    assert not torch.equal(out["high"], out["lossless"])
