"""``onepiece models make-tiny-lora``: a deterministic random LoRA for a workflow's denoise model.

The adapter targets the attention projections (``to_q``, ``to_k``, ``to_v``,
``to_out.0``) of the denoise model (SD's UNet, Wan's transformer) and is written
in the layout of the workflow pipeline's ``save_lora_weights`` (the diffusers/PEFT format,
with the PEFT ``LoraConfig`` in the file's metadata), so ``load_lora_weights``
reads it as any published LoRA. Shapes come from the model's weights (the tiny
model ``make-tiny`` writes for the workflow, or ``model_dir``); both factors are
random (a trained LoRA's are; PEFT's default zero ``lora_B`` would be a no-op),
drawn from a generator seeded with ``seed``: same seed, same bytes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from engine.adapters.formats import weight_shapes
from engine.adapters.registry import denoise_component
from engine.stages.tiny import make_tiny

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def make_tiny_lora(workflow: str, out: str | Path, seed: int = 0, rank: int = 4,
                   model_dir: str | Path | None = None, std: float = 0.2) -> Path:
    """Write ``out/pytorch_lora_weights.safetensors`` for ``workflow``; returns the file."""
    import torch
    from safetensors.torch import save_file

    component = denoise_component(workflow)
    if model_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            shapes = weight_shapes(make_tiny(tmp, workflow, 0)[workflow] / component)
    else:
        shapes = weight_shapes(Path(model_dir) / component)
    modules = sorted(k[: -len(".weight")] for k, s in shapes.items()
                     if k.endswith(".weight") and len(s) == 2 and k[: -len(".weight")].endswith(TARGETS))
    if not modules:
        raise ValueError(f"{workflow}'s {component} has no attention projections to adapt")
    g = torch.Generator().manual_seed(int(seed))
    layers: dict[str, torch.Tensor] = {}
    for m in modules:
        out_f, in_f = shapes[m + ".weight"]
        layers[f"{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
        layers[f"{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    # lora_alpha = r: scaling 1, so the request's scale is the adapter's whole weight
    config = {"r": rank, "lora_alpha": rank, "target_modules": sorted({m.rsplit(".", 1)[-1] if not
                                                                        m.endswith("to_out.0") else "to_out.0"
                                                                        for m in modules}),
              "init_lora_weights": True, "use_dora": False, "lora_bias": False}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the layout of the pipeline's save_lora_weights (keys "<component>.<module>.lora_A.weight", the LoraConfig as
    # "<component>.<field>" in the metadata's lora_adapter_metadata), written with one metadata entry: safetensors
    # orders several in a random order, and the same seed must give the same bytes
    meta = json.dumps({f"{component}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)
    save_file({f"{component}.{k}": v.contiguous() for k, v in layers.items()}, str(out / WEIGHT_NAME),
              metadata={"lora_adapter_metadata": meta})
    return out / WEIGHT_NAME
