"""``onepiece bench e2e --workflow W --quality LEVEL`` (issue 37, item 6): every registered workflow has a
small request of its own that its tiny model takes, with a png where it takes an image, on both sides; a level
the workflow does not serve, a name that is no level, or another workflow's folder is refused with exit code 2
before any work; the one-call baseline at a level is diffusers' pipeline with its own cache hook of the level's
settings, and its batched call carries the image."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from engine.bench import e2e, e2e_report, harness


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_registered_workflow_has_a_bench_request() -> None:
    """The table follows the registry: a new workflow without a bench request fails here, and --workflow takes
    each of them."""
    from engine.workflow.registry import workflows

    assert set(e2e.PARAMS) == set(workflows())
    for wf in workflows():
        assert _args("--model-dir", "m", "--workflow", wf).workflow == wf
    with pytest.raises(SystemExit):
        _args("--model-dir", "m", "--workflow", "no-such-workflow")


@pytest.mark.models
def test_each_request_fits_its_tiny_model(tiny_models: dict[str, Path]) -> None:
    """Resolved against the tiny model's limits (the spec's rules and the loaded config's maxima), with the
    quality level where the workflow takes one, and a png per image input."""
    from engine.stages import caching
    from engine.workflow import get_workflow

    for wf in e2e.PARAMS:
        spec = get_workflow(wf)
        levels = caching.levels(wf)
        for quality in levels:
            params, inputs = e2e.request(wf, tiny_models[wf], quality)
            assert spec.bound(spec.limits_of(str(tiny_models[wf]))).resolve_params(params) == params, wf
            assert {k: params[k] for k in e2e.PARAMS[wf]} == e2e.PARAMS[wf], (wf, params)
            assert params.get("quality", caching.LOSSLESS) == quality, (wf, params)
            assert set(inputs) == set(spec.image_inputs()), (wf, inputs)
            assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in inputs.values())
    assert set(e2e.request("wan2.1-i2v", tiny_models["wan2.1-i2v"])[1]) == {"image"}
    assert "high" in caching.levels("flux.1-dev")  # a level beside lossless is exercised above


@pytest.mark.models
def test_steps_sets_every_request_s_steps_within_the_model_s_limit(tiny_models: dict[str, Path]) -> None:
    """``--steps N`` is the request's ``num_inference_steps`` on both sides (the figures at the step counts of
    benchmarks/quality.md); without it, the table's; over the loaded model's limit, refused before any work."""
    assert _args("--model-dir", "m", "--steps", "28").steps == 28 and _args("--model-dir", "m").steps is None
    params, _ = e2e.request("flux.1-dev", tiny_models["flux.1-dev"], "high", 28)
    assert params["num_inference_steps"] == 28 and params["quality"] == "high"
    assert e2e.request("wan2.1-t2v", tiny_models["wan2.1-t2v"], steps=None)[0]["num_inference_steps"] == 2
    with pytest.raises(e2e.Refused, match="num_inference_steps"):
        e2e.request("flux.1-schnell", tiny_models["flux.1-schnell"], "high", 17)  # its tiny folder's limit: 16


def test_a_level_the_workflow_does_not_serve_is_refused_before_any_work(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with the levels it serves, before the Proxy is asked anything (the one given here would refuse
    the connection: reaching it would raise); a folder without the workflow's model is refused the same way."""
    from engine.stages import caching

    assert "high" not in caching.levels("sd-t2i")
    dead = "http://127.0.0.1:9"
    cases = [("sd-t2i", "high", "sd-t2i does not serve --quality high; it serves lossless"),
             ("flux.1-dev", "ultra", "--quality 'ultra' is not a level; levels: lossless, extra-high, high"),
             ("flux.1-schnell", "lossless", "--model-dir is not a flux.1-schnell model folder")]
    for wf, quality, said in cases:
        capsys.readouterr()
        args = _args("--proxy", dead, "--model-dir", str(tmp_path), "--workflow", wf, "--quality", quality, "--json")
        assert e2e.main(args) == 2, (wf, quality)
        captured = capsys.readouterr()
        assert said in captured.err and captured.out == "", (wf, quality, captured)


@pytest.mark.models
def test_a_proxy_that_does_not_answer_is_said_so(tiny_models: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A valid request, no Proxy at the URL: exit 2 naming it, before the baselines load anything."""
    folder = str(tiny_models["flux.1-dev"])
    args = _args("--proxy", "http://127.0.0.1:9", "--model-dir", folder, "--workflow", "flux.1-dev", "--quality",
                 "high", "--state", folder)
    capsys.readouterr()
    assert e2e.main(args) == 2
    assert "error: no Proxy answers at http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.models
def test_the_one_call_baseline_at_a_level_is_diffusers_own_hook(tiny_models: dict[str, Path]) -> None:
    """``--quality high`` on flux.1-dev: the baseline's png bytes are FluxPipeline's with
    ``transformer.enable_cache`` of the level's settings, and not the lossless ones (the cache predicted some
    of the 8 steps); ``quality`` never reaches the pipeline as a keyword."""
    import torch
    from diffusers import FluxPipeline

    from engine.stages import caching

    wf, folder = "flux.1-dev", tiny_models["flux.1-dev"]
    params, inputs = e2e.request(wf, folder, "high")
    assert params["quality"] == "high" and "quality" not in harness.pipeline_kwargs(params, inputs)
    settings = caching.settings(wf, "high")
    pipe = harness._load_pipeline(str(folder), "cpu", cache=settings)
    baseline = harness._one_call(pipe, params, "cpu", inputs=inputs)

    reference = FluxPipeline.from_pretrained(folder)
    reference.transformer.enable_cache(settings.config())
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "quality", "preview_every")}
    out = reference(generator=torch.Generator().manual_seed(params["seed"]), output_type="np", **kwargs)
    assert baseline == harness.encode_outputs(out) and len(baseline) == 1
    lossless, _ = e2e.request(wf, folder)
    assert harness._one_call(harness._load_pipeline(str(folder), "cpu"), lossless, "cpu") != baseline


@pytest.mark.models
@pytest.mark.parametrize("wf", ["wan2.1-i2v", "wan2.2-ti2v-5b"])
def test_the_one_call_baseline_takes_the_image_batched_too(wf: str, tiny_models: dict[str, Path]) -> None:
    """An image-input workflow's one-call baseline gets the request's png as ``image=`` (the TI2V folder's
    through its image-to-video pipeline), alone and in a batched call (a video per request, each item its solo
    run's up to the batch's float rounding); another first frame gives another video."""
    import torch

    params, inputs = e2e.request(wf, tiny_models[wf])
    pipe = harness._load_pipeline(str(tiny_models[wf]), "cpu", image=True)
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    batched = harness._one_call(pipe, params, "cpu", batch=2, inputs=inputs)  # what the batched monolith runs
    assert len(batched) == 2 and all(v[4:8] == b"ftyp" for v in batched)

    def frames(files: dict[str, bytes], batch: int = 1) -> Any:
        gens = [torch.Generator().manual_seed(params["seed"] + i) for i in range(batch)]
        kwargs = harness.pipeline_kwargs(params, files, batch)
        return pipe(generator=gens if batch > 1 else gens[0], output_type="np", **kwargs).frames

    solo, two = frames(inputs), frames(inputs, 2)
    assert two.shape == (2, *solo.shape[1:]) and solo.std() > 0
    assert abs(two[0] - solo[0]).max() < 1e-5 and abs(two[1] - solo[0]).max() > 1e-3  # item 1: the next seed
    white = _png(params["width"], params["height"], 255)
    assert abs(frames({"image": white})[0] - solo[0]).max() > 1e-3  # the image reaches the video


def _png(width: int, height: int, level: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (level,) * 3).save(buf, "PNG")
    return buf.getvalue()


def test_the_text_names_the_quality_and_the_request() -> None:
    line = e2e_report._request_line({"params": {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2,
                                         "seed": 1}, "inputs": {"image": "blank png 32x32"}})
    assert line == "32x32, 5 frames, 2 steps, seed 1, image: blank png 32x32 (both sides)"
    r: dict[str, Any] = {"params": {"width": 64, "height": 64, "num_inference_steps": 8, "seed": 1}, "inputs": {}}
    assert e2e_report._request_line(r) == "64x64, 8 steps, seed 1 (both sides)"
