"""On CUDA (bf16), the staged FLUX.1 and Qwen-Image runs still give the one-call pipeline's png bytes, with
the pipeline loaded the same way (every component in bf16, as the stages load them). Skipped without a GPU."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = {
    "flux.1-dev": ("FluxPipeline", dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3,
                                        max_sequence_length=64)),
    "qwen-image": ("QwenImagePipeline", dict(prompt="a cat on the moon", negative_prompt="blurry", height=64,
                                             width=64, num_inference_steps=3)),
}


@pytest.mark.parametrize("workflow", sorted(CASES))
def test_staged_png_on_cuda_is_the_bf16_pipelines(workflow: str, tiny_models: dict[str, Path]) -> None:
    import diffusers

    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    cls, params = CASES[workflow]
    folder = tiny_models[workflow]
    spec = get_workflow(workflow)
    resolved = spec.bound(spec.limits_of(str(folder))).resolve_params({**params, "seed": 5})
    runner = LocalRunner(workflow, folder, "cuda")
    result = runner.run(resolved, {})
    assert runner.executors["denoise"].dtype == torch.bfloat16
    pipe = getattr(diffusers, cls).from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda")
    kwargs = {k: v for k, v in resolved.items() if k != "seed"}
    image = pipe(generator=torch.Generator().manual_seed(5), **kwargs).images[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    assert bytes(result.outputs["image"]) == buf.getvalue()
