"""Wan2.2 on tiny models: each workflow's staged run equals its one-call diffusers pipeline (frames and mp4
bytes); the A14B experts are two stages, each holding one transformer, split exactly where the pipeline
switches experts, with UniPC's whole state crossing between them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.models

SMALL = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=4, seed=5)
TI2V = {**SMALL, "height": 64, "width": 64}  # sides: multiples of 32 (16x VAE, 2x2 patches)
A14B = ("wan2.2-t2v-a14b", "wan2.2-i2v-a14b")
ALL = (*A14B, "wan2.2-ti2v-5b")


class Recorder:
    """A stage context that records each stage's progress reports."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def __call__(self, step: int, total: int) -> None:
        self.steps.append((step, total))


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {name: LocalRunner(name, tiny_models[name], "cpu") for name in ALL}


def _params(name: str, **extra: Any) -> dict[str, Any]:
    return {**(TI2V if name.endswith("5b") else SMALL), **extra}


def _staged(runner: Any, params: dict[str, Any], png: bytes | None) -> tuple[np.ndarray, bytes, dict[str, list]]:
    """(uint8 frames, mp4 bytes, stage -> the (step, total) progress it reported) of a staged run (``png``
    None: without the image inputs, where they are optional)."""
    from engine.stages.base import StageContext

    captured: dict[str, Any] = {}
    progress: dict[str, list[tuple[int, int]]] = {}
    for stage, ex in runner.executors.items():
        def spy(inputs: Any, p: Any, ctx: Any, stage: str = stage, run: Any = ex.run) -> Any:
            rec = progress.setdefault(stage, [])
            out = run(inputs, p, StageContext(progress=lambda s, n: rec.append((s, n))))
            if stage == "vae_decode":
                captured["frames"] = out["frames"].numpy().copy()
            return out

        ex.run = spy
    try:
        inputs = {"image": png} if runner.spec.image_inputs() and png is not None else {}
        result = runner.run(runner.spec.resolve_params(params), inputs)
    finally:
        for ex in runner.executors.values():
            del ex.run
    return captured["frames"], bytes(result.outputs["video"]), progress


def _pipeline(folder: Path, params: dict[str, Any], png: bytes, image: bool, hooks: bool = False) -> Any:
    import torch
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from engine.stages.components import decode_image

    cls = WanImageToVideoPipeline if image else WanPipeline
    pipe = cls.from_pretrained(folder)
    calls: dict[str, int] = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        module = getattr(pipe, name, None)
        if module is not None:
            module.register_forward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
    kwargs = {k: v for k, v in params.items() if k != "seed"}
    if image:
        kwargs["image"] = decode_image(png)
    frames = pipe(generator=torch.Generator().manual_seed(params["seed"]), output_type="np", **kwargs).frames[0]
    return (frames * 255).round().astype("uint8"), calls, pipe


@pytest.mark.parametrize("name", ALL)
def test_staged_frames_and_mp4_equal_the_one_call_pipeline(name: str, runners: dict[str, Any],
                                                          tiny_models: dict[str, Path], input_png: bytes) -> None:
    from engine.stages.wan.video import encode_mp4

    runner = runners[name]
    params = _params(name)
    frames, mp4, _ = _staged(runner, params, input_png)
    # WanPipeline for text-to-video; the I2V pipeline (expand_timesteps from the folder: the 5B model) with an image
    reference, _, _ = _pipeline(tiny_models[name], params, input_png, name != "wan2.2-t2v-a14b")
    assert frames.shape == reference.shape == (5, params["height"], params["width"], 3)
    assert frames.std() > 1.0  # not a blank video that would match anything
    np.testing.assert_array_equal(frames, reference)
    assert mp4[4:8] == b"ftyp" and mp4 == encode_mp4(reference, runner.spec.param("fps").default)
    # the seed reaches the video
    assert not np.array_equal(_staged(runner, _params(name, seed=6), input_png)[0], reference)


def test_ti2v_without_an_image_is_wanpipelines_text_to_video(runners: dict[str, Any], tiny_models: dict[str, Path],
                                                             input_png: bytes) -> None:
    """wan2.2-ti2v-5b takes a prompt alone: the staged run is WanPipeline's over the TI2V folder (its noise drawn
    as WanPipeline draws it, no first frame held), frames and mp4 bytes; with an image it is another video."""
    from engine.stages.wan.video import encode_mp4

    name = "wan2.2-ti2v-5b"
    runner, params = runners[name], _params(name)
    assert runner.spec.required_inputs() == [] and runner.spec.image_inputs() == ["image"]
    frames, mp4, progress = _staged(runner, params, None)
    reference, calls, pipe = _pipeline(tiny_models[name], params, input_png, image=False)
    assert pipe.config.expand_timesteps and calls["transformer"] == 2 * params["num_inference_steps"]
    assert frames.std() > 1.0
    np.testing.assert_array_equal(frames, reference)
    assert mp4 == encode_mp4(reference, runner.spec.param("fps").default)
    assert progress["denoise"][-1] == (4, 4)
    assert not np.array_equal(_staged(runner, params, input_png)[0], reference)  # the image does reach it


def test_ti2v_refuses_a_bad_image_naming_it() -> None:
    from engine.proxy.intake import Intake
    from engine.proxy.parsing import BadRequest
    from engine.workflow import get_workflow

    spec = get_workflow("wan2.2-ti2v-5b")
    with pytest.raises(Exception) as e:
        spec.validate_request({"prompt": "x"}, {"image": b"not an image"})
    assert getattr(e.value, "field", None) == "image"
    with pytest.raises(Exception) as e:
        spec.validate_request({"prompt": "x"}, {"image": b""})  # given, but empty: not an image either
    assert getattr(e.value, "field", None) == "image"
    intake = Intake()
    with pytest.raises(BadRequest) as b:
        intake.submission("wan2.2-ti2v-5b", {"prompt": "x"}, {"image": b"\x89PNG broken"})
    assert b.value.status == 400 and b.value.field == "image"
    # without one: accepted, and its first message carries an empty image for vae_encode
    ticket = intake.ticket(intake.submission("wan2.2-ti2v-5b", {"prompt": "x"}, {}))
    from engine.workflow import message as wm

    assert bytes(wm.decode(ticket.message).blobs["image"]) == b""


@pytest.mark.parametrize("case", [*ALL, "wan2.2-ti2v-5b text only"])
def test_hop_bytes_are_the_bytes_each_stage_is_handed(case: str, runners: dict[str, Any],
                                                      tiny_models: dict[str, Path], input_png: bytes) -> None:
    """Bound to the loaded folder (C_lat, C_cond, D_text, N_order from its configs), hop_bytes is exactly the
    payload a stage is handed (tensors and blobs), for every hop of every Wan2.2 workflow; unbound, those
    dimensions count as 1 and the figure is far under."""
    from engine.workflow import get_workflow

    name = case.split()[0]
    spec = get_workflow(name)
    bound = spec.bound(spec.limits_of(str(tiny_models[name])))
    assert {"C_lat", "D_text", "N_order"} <= set(bound.dim_values)
    params = bound.resolve_params(_params(name))
    inputs = {"image": input_png} if spec.image_inputs() and "text" not in case else {}
    result = runners[name].run(params, inputs)
    route = spec.route()
    sent = {after: result.stats[before].payload_bytes for before, after in zip(route, route[1:], strict=False)}
    assert bound.hop_bytes(params, inputs, "float32") == sent
    assert all(spec.hop_bytes(params, inputs, "float32")[s] < sent[s] for s in sent if s != "video_encode")


def test_a_hop_over_the_ring_is_refused_at_intake_naming_a_field() -> None:
    """The issue's case: a 720p, 81-frame wan2.2-t2v-a14b request hands denoise_low ~86 MB (the boundary latents
    and UniPC's history at the published model's C_lat 16, umT5's 4096 wide embeddings) while the default ring
    takes 64 MiB. Counted with model dimensions as 1 it looked like 3 MB and was accepted."""
    from engine.proxy.intake import Intake
    from engine.proxy.parsing import BadRequest
    from engine.workflow import get_workflow, limits

    published = limits.dim_entries({"C_lat": 16, "D_text": 4096, "N_order": 2})
    request = {"prompt": "x", "width": 1280, "height": 720, "num_frames": 81}
    def ring(wf: str, stage: str) -> int:  # the expert's ring at the default; the decoders' sized for frames
        return (64 << 20) if stage == "denoise_low" else (1 << 30)

    unbound = Intake()
    unbound.check_fits(unbound.ticket(unbound.submission("wan2.2-t2v-a14b", request, {})), None, ring)
    intake = Intake(limits=lambda wf: limits.parse(published))  # as the routes carry them
    ticket = intake.ticket(intake.submission("wan2.2-t2v-a14b", request, {}))
    hops = ticket.sub.spec.hop_bytes(ticket.sub.params)
    assert 85e6 < hops["denoise_low"] < 87e6
    with pytest.raises(BadRequest) as e:
        intake.check_fits(ticket, None, ring)
    assert e.value.field == "num_frames" and "denoise_low" in str(e.value)
    # a shorter clip fits
    intake.check_fits(intake.ticket(intake.submission("wan2.2-t2v-a14b", {**request, "num_frames": 41}, {})),
                      None, ring)
    assert get_workflow("wan2.2-t2v-a14b").bound(limits.parse(published)).dim_values["D_text"] == 4096


@pytest.mark.parametrize("name", A14B)
def test_the_request_crosses_experts_at_the_pipelines_boundary_step(name: str, runners: dict[str, Any],
                                                                   tiny_models: dict[str, Path],
                                                                   input_png: bytes) -> None:
    from engine.stages.wan.experts import boundary_step

    runner = runners[name]
    params = _params(name, num_inference_steps=8, guidance_scale_2=2.0)  # the low expert's own guidance
    frames, _, progress = _staged(runner, params, input_png)
    reference, calls, pipe = _pipeline(tiny_models[name], params, input_png, name != "wan2.2-t2v-a14b")
    np.testing.assert_array_equal(frames, reference)
    # where the pipeline switched: its high-noise expert ran 2 predictions (guided) per step before the boundary
    ratio = pipe.config.boundary_ratio
    assert ratio == {"wan2.2-t2v-a14b": 0.875, "wan2.2-i2v-a14b": 0.9}[name]
    pipe.scheduler.set_timesteps(8)
    high = int((pipe.scheduler.timesteps >= ratio * 1000).sum())
    assert 0 < high < 8 and calls == {"transformer": 2 * high, "transformer_2": 2 * (8 - high)}
    assert boundary_step(pipe.scheduler.timesteps, ratio, 1000) == high
    # the stages ran those steps: each reports its own steps, the high one up to the boundary
    assert progress["denoise_high"] == [(i, high) for i in range(1, high + 1)]
    assert progress["denoise_low"] == [(i, 8 - high) for i in range(1, 8 - high + 1)]
    # guidance_scale_2 reaches the low-noise expert: another value, other frames (the high stage's are the same)
    other = _staged(runner, {**params, "guidance_scale_2": 4.0}, input_png)[0]
    assert not np.array_equal(other, frames)


@pytest.mark.parametrize("name", A14B)
def test_each_expert_stage_holds_one_transformer(name: str, runners: dict[str, Any],
                                                 tiny_models: dict[str, Path]) -> None:
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    def transformers(ex: Any) -> list[Any]:
        """Every Wan transformer an executor holds, itself or in a pipeline of its own."""
        found = []
        for v in vars(ex).values():
            held = [v, *(v.components.values() if isinstance(getattr(v, "components", None), dict) else ())]
            found += [m for o in held if isinstance(o, torch.nn.Module)
                      for m in o.modules() if isinstance(m, WanTransformer3DModel)]
        return found

    ex = runners[name].executors
    for stage, executor in ex.items():
        held = transformers(executor)
        assert len(held) == (1 if stage.startswith("denoise_") else 0), (stage, held)
    high, low = (type(ex[s]) for s in ("denoise_high", "denoise_low"))
    assert (high.components, high.reads) == (("transformer", "scheduler"), ("vae",) if name == "wan2.2-t2v-a14b" else ())
    assert (low.components, low.reads) == (("transformer_2", "scheduler"), ())
    for stage, folder in (("denoise_high", "transformer"), ("denoise_low", "transformer_2")):
        [model] = transformers(ex[stage])
        saved = load_file(str(tiny_models[name] / folder / "diffusion_pytorch_model.safetensors"))
        state = model.state_dict()
        assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in saved), stage
    # the two experts are different models (a swap would show in the frames)
    high, low = transformers(ex["denoise_high"])[0], transformers(ex["denoise_low"])[0]
    assert not torch.equal(high.proj_out.weight, low.proj_out.weight)


def test_unipc_state_crosses_whole(tiny_models: dict[str, Path]) -> None:
    """Every attribute of the high stage's scheduler at the boundary is the low stage's after the restore, and
    both go on to the same samples: nothing of UniPC's multistep state is left behind."""
    import torch
    from diffusers import UniPCMultistepScheduler

    from engine.stages.wan.experts import ExpertMismatch, restore_scheduler, scheduler_state

    config = UniPCMultistepScheduler.load_config(tiny_models["wan2.2-t2v-a14b"] / "scheduler")
    gen = torch.Generator().manual_seed(0)
    outputs = [torch.randn(1, 16, 2, 4, 4, generator=gen) for _ in range(8)]

    def fresh() -> Any:
        s = UniPCMultistepScheduler.from_config(config)
        s.set_timesteps(8)
        s.set_begin_index(0)
        return s

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b)

    for boundary in (1, 2, 6):
        a, sample = fresh(), torch.randn(1, 16, 2, 4, 4, generator=gen)
        for i in range(boundary):
            sample = a.step(outputs[i], a.timesteps[i], sample, return_dict=False)[0]
        b = fresh()
        restore_scheduler(b, scheduler_state(a, boundary), boundary, "cpu")
        assert set(vars(a)) == set(vars(b))
        differ = [k for k in vars(a) if not same(vars(a)[k], vars(b)[k])]
        assert not differ, (boundary, differ)
        x, y = sample, sample.clone()
        for i in range(boundary, 8):
            x = a.step(outputs[i], a.timesteps[i], x, return_dict=False)[0]
            y = b.step(outputs[i], b.timesteps[i], y, return_dict=False)[0]
        assert torch.equal(x, y)
    # a boundary at step 0 (the high expert ran nothing): the low stage starts from a fresh scheduler
    from engine.stages.wan.experts import _empty_state

    b = fresh()
    restore_scheduler(b, _empty_state(fresh(), sample, 0), 0, "cpu")
    assert all(same(v, vars(fresh())[k]) for k, v in vars(b).items())
    # a low-noise stage on a folder that switches elsewhere refuses to continue
    with pytest.raises(ExpertMismatch, match="step 2 of 8"):
        restore_scheduler(fresh(), scheduler_state(a, 2), 3, "cpu")


@pytest.mark.parametrize("name", ALL)
def test_the_default_request_runs(name: str, runners: dict[str, Any], tiny_models: dict[str, Path],
                                  input_png: bytes) -> None:
    """The folder's defaults (serving.json within the model's limits) make a clip."""
    from engine.workflow import get_workflow

    spec = get_workflow(name).bound(get_workflow(name).limits_of(str(tiny_models[name])))
    params = spec.resolve_params({"prompt": "a cat"})
    assert params["num_frames"] > 5 and params["num_inference_steps"] == 8  # serving.json's, not the pipeline's
    inputs = {"image": input_png} if spec.image_inputs() else {}
    result = runners[name].run(params, inputs)
    assert bytes(result.outputs["video"])[4:8] == b"ftyp"
    assert result.stats["vae_decode"].out_bytes >= params["num_frames"] * params["height"] * params["width"] * 3


def test_a14b_shares_wan21s_text_encoder_vae_and_mp4_pools(tiny_models: dict[str, Path]) -> None:
    """The tiny A14B models ship Wan2.1's tokenizer, umT5 and VAE byte for byte (as the releases do), so their
    text_encode, vae_decode and video_encode are the Wan2.1 pools' (engine.workflow.pools: by content digest);
    the experts are pools of their own, one transformer each."""
    from engine.stages.registry import pools
    from engine.workflow.pools import folder_digest, pool_of

    for component in ("tokenizer", "text_encoder", "vae"):
        assert {folder_digest(tiny_models[n] / component) for n in (*A14B, "wan2.1-t2v", "wan2.1-i2v")} == {
            folder_digest(tiny_models["wan2.1-t2v"] / component)}, component
    assert folder_digest(tiny_models["wan2.2-ti2v-5b"] / "vae") != folder_digest(tiny_models["wan2.1-t2v"] / "vae")
    names = ("wan2.1-t2v", "wan2.1-i2v", *A14B)
    of = pool_of(pools({n: str(tiny_models[n]) for n in names}))
    for stage in ("text_encode", "vae_decode", "video_encode"):
        assert {of[(n, stage)].members for n in names} == {tuple(sorted((n, stage) for n in names))}, stage
    for n in A14B:
        for stage in ("denoise_high", "denoise_low"):
            assert of[(n, stage)].members == ((n, stage),)
