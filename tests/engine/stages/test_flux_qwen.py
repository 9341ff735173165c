"""FLUX.1 (schnell, dev) and Qwen-Image: the staged run gives the one-call pipeline's png bytes, each stage
holds only its own components, the denoise loop stops between steps, and every limit the loaded folder
sets is refused at validation naming its field."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from engine.workflow.options import SERVING_PARAMS
from engine.workflow.spec import InvalidRequest

pytestmark = pytest.mark.models

PROMPT = "a cat on the moon"
CASES = {
    "schnell": ("flux.1-schnell", dict(prompt=PROMPT, height=64, width=64, seed=5)),
    "dev": ("flux.1-dev", dict(prompt=PROMPT, height=64, width=96, num_inference_steps=3, max_sequence_length=64,
                               seed=5)),
    "qwen-guided": ("qwen-image", dict(prompt=PROMPT, negative_prompt="blurry", height=64, width=96,
                                       num_inference_steps=3, seed=5)),
    "qwen": ("qwen-image", dict(prompt=PROMPT, height=64, width=64, num_inference_steps=3, seed=5)),
}
PIPELINES = {"flux.1-schnell": "FluxPipeline", "flux.1-dev": "FluxPipeline", "qwen-image": "QwenImagePipeline"}


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in PIPELINES}


def _bound(workflow: str, folder: Path) -> Any:
    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder)))


def _staged(runners: dict[str, Any], tiny_models: dict[str, Path], workflow: str, params: dict[str, Any]) -> bytes:
    result = runners[workflow].run(_bound(workflow, tiny_models[workflow]).resolve_params(params), {})
    return bytes(result.outputs["image"])


def _pipeline_png(folder: Path, workflow: str, params: dict[str, Any]) -> bytes:
    import diffusers
    import torch

    resolved = _bound(workflow, folder).resolve_params(params)
    pipe = getattr(diffusers, PIPELINES[workflow]).from_pretrained(folder)
    kwargs = {k: v for k, v in resolved.items() if k != "seed" and k not in SERVING_PARAMS}
    image = pipe(generator=torch.Generator().manual_seed(resolved["seed"]), **kwargs).images[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("case", sorted(CASES))
def test_staged_png_is_the_pipelines(case: str, runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    import numpy as np
    from PIL import Image

    workflow, params = CASES[case]
    staged = _staged(runners, tiny_models, workflow, params)
    assert staged == _pipeline_png(tiny_models[workflow], workflow, params)  # the same png bytes
    pixels = np.asarray(Image.open(io.BytesIO(staged)))
    assert pixels.shape == (params["height"], params["width"], 3) and pixels.std() > 1.0  # not a blank image
    assert _staged(runners, tiny_models, workflow, {**params, "seed": 6}) != staged  # the seed reaches it
    assert _staged(runners, tiny_models, workflow, {**params, "prompt": "a red car in the snow"}) != staged


def test_guidance_changes_the_image(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """dev's embedded guidance and Qwen-Image's true CFG (with a negative prompt) reach the transformer;
    without a negative prompt Qwen-Image makes one pass whatever true_cfg_scale says, as the pipeline."""
    dev = CASES["dev"][1]
    assert _staged(runners, tiny_models, "flux.1-dev", {**dev, "guidance_scale": 1.0}) != \
        _staged(runners, tiny_models, "flux.1-dev", dev)
    guided = CASES["qwen-guided"][1]
    assert _staged(runners, tiny_models, "qwen-image", {**guided, "true_cfg_scale": 1.0}) != \
        _staged(runners, tiny_models, "qwen-image", guided)
    plain = CASES["qwen"][1]
    assert _staged(runners, tiny_models, "qwen-image", {**plain, "true_cfg_scale": 9.0}) == \
        _staged(runners, tiny_models, "qwen-image", plain)


LOADED = {  # stage -> the components its block pipeline holds; every other one of the folder stays None
    "flux.1-dev": {"text_encode": {"tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"},
                   "denoise": {"transformer", "scheduler"}, "vae_decode": {"vae"}},
    "qwen-image": {"text_encode": {"tokenizer", "text_encoder"}, "denoise": {"transformer", "scheduler"},
                   "vae_decode": {"vae"}},
}


@pytest.mark.parametrize("workflow", sorted(LOADED))
def test_each_stage_holds_only_its_components(workflow: str, runners: dict[str, Any],
                                              tiny_models: dict[str, Path]) -> None:
    import torch

    index = json.loads((tiny_models[workflow] / "model_index.json").read_text())
    folder_components = {k for k, v in index.items() if isinstance(v, list) and v[0] is not None}
    for stage, want in LOADED[workflow].items():
        pipe = runners[workflow].executors[stage].pipe
        held = {c for c in folder_components if getattr(pipe, c, None) is not None}
        assert held == want, (stage, held)
        modules = [getattr(pipe, c) for c in held if isinstance(getattr(pipe, c), torch.nn.Module)]
        assert all(not m.training for m in modules)


def test_denoise_stops_between_steps(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    from engine.stages.base import Cancelled, StageContext

    workflow, params = CASES["dev"]
    resolved = _bound(workflow, tiny_models[workflow]).resolve_params(params)
    runner = runners[workflow]
    embeds = runner.executors["text_encode"].run({}, resolved, StageContext())
    steps: list[tuple[int, int]] = []
    ctx = StageContext(progress=lambda i, n: steps.append((i, n)), cancelled=lambda: len(steps) >= 1)
    with pytest.raises(Cancelled):
        runner.executors["denoise"].run(embeds, resolved, ctx)
    assert steps == [(1, 3)]  # one step ran, the check before the second stopped it
    steps.clear()
    out = runner.executors["denoise"].run(embeds, resolved, StageContext(progress=lambda i, n: steps.append((i, n))))
    assert steps == [(1, 3), (2, 3), (3, 3)] and out["denoised"].shape == (1, 4, 32, 48)
    # the loop block's step is its own again after a run
    assert "loop_step" not in vars(runner.executors["denoise"].block_seq.sub_blocks["denoise"])


# -- limits from the loaded folder --------------------------------------------------------------------------

def _configs(src: Path, dst: Path, **edits: dict[str, Any]) -> Path:
    """A copy of ``src``'s JSON files (all that limits read), with ``component={key: value}`` edits."""
    for f in src.rglob("*.json"):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, out)
    for component, changes in edits.items():
        path = next(p for p in (dst / component).glob("*config.json"))
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dst


def _refused(spec: Any, params: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        spec.validate_request({"prompt": PROMPT, **params}, {})
    return e.value


def test_flux_defaults_and_limits_come_from_the_folder(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    schnell = _bound("flux.1-schnell", tiny_models["flux.1-schnell"])
    d = schnell.validate_request({"prompt": PROMPT}, {})
    # 128 latent pixels a side times the tiny VAE's 2x (FLUX.1's 8x gives 1024); the model card's 4 steps, 256 tokens
    assert (d["height"], d["width"], d["num_inference_steps"], d["max_sequence_length"]) == (256, 256, 4, 256)
    assert "guidance_scale" not in d and _refused(schnell, {"guidance_scale": 3.5}).field == "guidance_scale"
    assert _refused(schnell, {"num_inference_steps": 17}).field == "num_inference_steps"  # distilled: 16 at most
    assert _refused(schnell, {"height": 72}).field == "height"  # not a multiple of 16
    assert _refused(schnell, {"width": 2064}).field == "width"
    assert _refused(schnell, {"max_sequence_length": 513}).field == "max_sequence_length"
    assert _refused(schnell, {"prompt": "  "}).field == "prompt"
    # a folder whose T5 tokenizer reads 128 tokens and whose scheduler has 10 timesteps: both bound the request
    folder = _configs(tiny_models["flux.1-schnell"], tmp_path / "short", tokenizer_2={"model_max_length": 128},
                      scheduler={"num_train_timesteps": 10})
    short = _bound("flux.1-schnell", folder)
    e = _refused(short, {"max_sequence_length": 129})
    assert e.field == "max_sequence_length" and "T5 tokenizer reads at most 128" in str(e)
    assert short.validate_request({"prompt": PROMPT, "max_sequence_length": 128}, {})["max_sequence_length"] == 128
    e = _refused(short, {"num_inference_steps": 11})
    assert e.field == "num_inference_steps" and "10 training timesteps" in str(e)

    dev = _bound("flux.1-dev", tiny_models["flux.1-dev"])
    d = dev.validate_request({"prompt": PROMPT}, {})
    # the tiny folder's serving.json asks for 8 steps (the pipeline's 28 take long on a CPU); the rest is dev's
    assert (d["height"], d["num_inference_steps"], d["guidance_scale"], d["max_sequence_length"]) == (256, 8, 3.5, 512)
    plain = _configs(tiny_models["flux.1-dev"], tmp_path / "plain")
    (plain / "serving.json").unlink()
    assert _bound("flux.1-dev", plain).param("num_inference_steps").default == 28  # without it, the pipeline's
    assert _refused(dev, {"guidance_scale": 20.5}).field == "guidance_scale"
    assert _refused(dev, {"num_inference_steps": 101}).field == "num_inference_steps"
    assert _refused(dev, {"width": 100}).field == "width"  # not a multiple of 16
    assert _refused(dev, {"height": 48}).field == "height"  # under 64
    # dev's spec on a folder whose transformer has no guidance embedding (schnell's): no guidance to give
    on_schnell = _bound("flux.1-dev", tiny_models["flux.1-schnell"])
    assert on_schnell.validate_request({"prompt": PROMPT}, {})["guidance_scale"] == 0
    e = _refused(on_schnell, {"guidance_scale": 3.5})
    assert e.field == "guidance_scale" and "no guidance embedding" in str(e)


def test_qwen_defaults_and_limits_come_from_the_folder(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.workflow.limits import SERVING_FILE

    folder = _configs(tiny_models["qwen-image"], tmp_path / "qwen", tokenizer={"model_max_length": 100},
                      scheduler={"num_train_timesteps": 20})
    (folder / SERVING_FILE).unlink()
    spec = _bound("qwen-image", folder)
    d = spec.validate_request({"prompt": PROMPT}, {})
    # 128 latent pixels times the tiny VAE's 4x (Qwen-Image's 8x gives 1024); the pipeline's 50 steps,
    # capped at the scheduler's 20 here
    assert (d["height"], d["width"], d["num_inference_steps"], d["true_cfg_scale"]) == (512, 512, 20, 4.0)
    assert d["max_sequence_length"] == 100 and d["negative_prompt"] is None
    e = _refused(spec, {"max_sequence_length": 101})
    assert e.field == "max_sequence_length" and "reads at most 100" in str(e)
    assert _refused(spec, {"num_inference_steps": 21}).field == "num_inference_steps"
    # the tiny folder as built: its serving.json's smaller default, the pipeline's 1024-token bound
    tiny = _bound("qwen-image", tiny_models["qwen-image"])
    d = tiny.validate_request({"prompt": PROMPT}, {})
    assert (d["height"], d["width"], d["num_inference_steps"], d["max_sequence_length"]) == (256, 256, 8, 512)
    assert _refused(tiny, {"max_sequence_length": 1025}).field == "max_sequence_length"
    assert _refused(tiny, {"height": 2064}).field == "height"
    assert _refused(tiny, {"width": 100}).field == "width"  # not a multiple of 16
    assert _refused(tiny, {"true_cfg_scale": 21.0}).field == "true_cfg_scale"
    assert _refused(tiny, {"guidance_scale": 1.0}).field == "guidance_scale"  # not guidance-distilled: no such field


def test_specs_are_light_and_the_tiny_builders_are_deterministic(tmp_path: Path,
                                                                tiny_models: dict[str, Path]) -> None:
    """The specs import no torch (a subprocess: this one has it), and a second build gives the same bytes."""
    import subprocess
    import sys

    code = ("import sys; from engine.workflow import get_workflow; "
            "[get_workflow(w) for w in ('flux.1-schnell', 'flux.1-dev', 'qwen-image')]; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    from engine.stages.tiny import make_tiny

    again = make_tiny(tmp_path / "q", "qwen-image")["qwen-image"]
    built = sorted(f for f in again.rglob("*") if f.is_file())
    assert len(built) > 10
    for f in built:
        assert (tiny_models["qwen-image"] / f.relative_to(again)).read_bytes() == f.read_bytes(), f


def test_qwen_transformer_gets_the_pipelines_masks(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """QwenImagePipeline gives its transformer no text mask when every token counts (the flash kernel stays
    possible on CUDA); the staged denoise gives it the same, guided or not."""
    from engine.stages.base import StageContext

    runner = runners["qwen-image"]
    transformer = runner.executors["denoise"].pipe.transformer
    seen: list[Any] = []
    hook = transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("encoder_hidden_states_mask", "absent")), with_kwargs=True)
    try:
        params = _bound("qwen-image", tiny_models["qwen-image"]).resolve_params(CASES["qwen-guided"][1])
        embeds = runner.executors["text_encode"].run({}, params, StageContext())
        assert bool(embeds["prompt_embeds_mask"].all()) and embeds["prompt_embeds_mask"].dtype.is_floating_point is False
        runner.executors["denoise"].run(embeds, params, StageContext())
    finally:
        hook.remove()
    assert seen == [None] * 6  # 3 steps, conditional and unconditional passes
