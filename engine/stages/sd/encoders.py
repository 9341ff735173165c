"""sd-t2i text_encode: CLIP text embeddings through the pipeline's own ``encode_prompt``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import BatchedCallStage
from engine.stages.components import TorchStage, no_grad
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


class SDTextEncode(TorchStage, BatchedCallStage):
    """Prompt and negative prompt -> ``prompt_embeds``, ``negative_prompt_embeds``.

    Several requests encode in one call (engine.stages.base.BatchedCallStage): CLIP's tokenizer pads every
    prompt to the model's 77 tokens, so any prompts share a batch, and each item's embeddings are its solo
    bytes (tests/engine/stages/test_light_batching.py)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "CLIPTokenizer"), "text_encoder": ("transformers", "CLIPTextModel"),
    }

    def _load(self, model_dir: Path) -> None:
        from diffusers import StableDiffusionPipeline

        # A pipeline holding only this stage's components lets us call the
        # real encode_prompt (bit-identical to the one-call pipeline).
        self.pipe = StableDiffusionPipeline(
            **self.load_components(model_dir), vae=None, unet=None, scheduler=None,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        return "clip"  # padded to one length: every request can share a call

    @no_grad
    def call(self, items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> list[dict[str, Any]]:
        # The negative embeddings are always computed so every request has the
        # same message shape; denoise ignores them when guidance_scale <= 1.
        # encode_prompt encodes "" for a missing negative prompt, as each item's "" here.
        prompts = [str(p["prompt"]) for _, p in items]
        negatives = [p.get("negative_prompt") or "" for _, p in items]
        pos, neg = self.pipe.encode_prompt(prompts, self.device, 1, True, negatives)
        return [{"prompt_embeds": pos[k:k + 1], "negative_prompt_embeds": neg[k:k + 1]} for k in range(len(items))]
