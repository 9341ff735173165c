"""Live previews (issue 28 item 2): preview_every's validation, the store's preview stream, and every stepped
denoise stage publishing previews of its own latents through a real redis-server, on the tiny models."""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any

import pytest

from engine.store import JobStore, keys
from engine.workflow import get_workflow, workflows
from engine.workflow.spec import InvalidRequest


def _uid() -> str:
    return uuid.uuid4().hex


@pytest.mark.parametrize("value", [-1, 1.5, "2", True, 10_000])
def test_preview_every_is_checked_at_intake(value: Any) -> None:
    for name, spec in workflows().items():
        params, _inputs = spec.warm_up_request()
        with pytest.raises(InvalidRequest) as err:
            spec.resolve_params({**params, "preview_every": value})
        assert err.value.field == "preview_every", name


def test_preview_every_is_off_by_default_and_bounded_by_the_step_limit() -> None:
    for spec in workflows().values():
        params, _inputs = spec.warm_up_request()
        assert spec.resolve_params(params)["preview_every"] == 0
        top = spec.param("num_inference_steps").maximum
        assert spec.param("preview_every").maximum == top
        assert spec.resolve_params({**params, "preview_every": 5})["preview_every"] == 5


def test_store_keeps_previews_in_step_order(job_store: JobStore) -> None:
    uid = _uid()
    assert job_store.preview.latest(uid) is None
    first = job_store.preview.add(uid, "denoise_high", 2, 8, b"png-2")
    assert first is not None
    assert job_store.preview.add(uid, "denoise_low", 6, 8, b"png-6") is not None
    # a late writer (the other expert's worker) cannot put an earlier step after a later one
    assert job_store.preview.add(uid, "denoise_high", 4, 8, b"png-4") is None
    latest = job_store.preview.latest(uid)
    assert latest is not None and (latest.stage, latest.step, latest.total, latest.image) == ("denoise_low", 6, 8, b"png-6")
    assert [p.step for p in job_store.preview.since(uid)] == [2, 6]
    assert [p.step for p in job_store.preview.since(uid, after=first)] == [6]
    assert 0 < job_store.r.ttl(keys.preview_key(uid)) <= 60


def _run(models: dict[str, Path], workflow: str, params: dict[str, Any], inputs: dict[str, bytes], store: JobStore,
         uid: str) -> None:
    """The workflow's stages in sequence, each with the worker's preview publisher on its context."""
    from engine.stages.runner import LocalRunner
    from engine.worker.previews import Previews

    runner = LocalRunner(workflow, str(models[workflow]))
    publishers = []
    for name, ex in runner.executors.items():
        pub = Previews(store, ex)
        publishers.append(pub)
        run = ex.run

        def attached(i: Any, p: Any, ctx: Any, _run: Any = run, _pub: Any = pub, _name: str = name) -> Any:
            _pub.attach(ctx, uid, _name, p)
            try:
                return _run(i, p, ctx)
            finally:
                # this stage's previews written before the next stage runs: the store keeps only newer steps,
                # so A14B's low expert could otherwise overtake the high one's first previews (seen in CI)
                _pub.close()

        ex.run = attached  # type: ignore[method-assign]
    try:
        runner.run(get_workflow(workflow).resolve_params(params), inputs, progress=lambda *a: None)
    finally:
        for pub in publishers:
            pub.close()


@pytest.mark.parametrize("workflow,stages", [
    ("sd-t2i", {"denoise"}), ("flux.1-schnell", {"denoise"}), ("qwen-image", {"denoise"}),
    ("wan2.1-t2v", {"denoise"}), ("wan2.2-t2v-a14b", {"denoise_high", "denoise_low"}),
])
def test_every_stepped_denoise_publishes_its_previews(workflow: str, stages: set[str], job_store: JobStore,
                                                      tiny_models: dict[str, Path]) -> None:
    from PIL import Image

    params, inputs = get_workflow(workflow).warm_up_request()
    uid = _uid()
    _run(tiny_models, workflow, {**params, "num_inference_steps": 6, "preview_every": 2}, inputs, job_store, uid)
    got = job_store.preview.since(uid)
    assert [(p.step, p.total) for p in got] == [(2, 6), (4, 6), (6, 6)]
    assert {p.stage for p in got} == stages
    for p in got:
        img = Image.open(io.BytesIO(p.image))
        assert img.format == "JPEG" and p.mime == "image/jpeg" and max(img.size) <= 256


def test_no_preview_key_without_preview_every(job_store: JobStore, tiny_models: dict[str, Path]) -> None:
    params, inputs = get_workflow("sd-t2i").warm_up_request()
    uid = _uid()
    _run(tiny_models, "sd-t2i", {**params, "num_inference_steps": 4}, inputs, job_store, uid)
    assert job_store.r.keys(f"{keys.PREFIX}:preview:*") == []


def test_the_fitted_projection_follows_the_loaded_vae(tiny_models: dict[str, Path]) -> None:
    """The linear factors are the least-squares fit to this model's VAE: they predict its decode of latents
    it was not fitted on better than the mean colour does, and two different VAEs get different factors."""
    import torch
    import torch.nn.functional as F

    from engine.stages.components import load_component
    from engine.stages.preview import FAMILIES, decode, fit_projection

    fam = FAMILIES["sd"]
    vae = load_component(str(tiny_models["sd-t2i"]), "vae", fam.vae_class, torch.float32, "cpu")
    proj = fit_projection(vae, fam, vae.config.latent_channels)
    g = torch.Generator().manual_seed(7)
    z = F.interpolate(torch.randn(2, vae.config.latent_channels, 4, 4, generator=g), size=(16, 16), mode="bilinear")
    target = F.adaptive_avg_pool2d(decode(vae, z, fam), (16, 16))
    pred = torch.stack([proj.rgb(z[i:i + 1]) for i in range(2)])
    assert (pred - target).pow(2).mean() < (target - target.mean((0, 2, 3), keepdim=True)).pow(2).mean()
    flux = FAMILIES["flux"]
    other = load_component(str(tiny_models["flux.1-schnell"]), "vae", flux.vae_class, torch.float32, "cpu")
    assert not torch.allclose(fit_projection(other, flux, other.config.latent_channels).factors[:4, :], proj.factors)
