"""sd-t2i text_encode: CLIP text embeddings through the pipeline's own ``encode_prompt``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.stages.base import StageContext
from engine.stages.components import TorchStage


class SDTextEncode(TorchStage):
    """Prompt and negative prompt -> ``prompt_embeds``, ``negative_prompt_embeds``."""

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

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        # The negative embeddings are always computed so every request has the
        # same message shape; denoise ignores them when guidance_scale <= 1.
        pos, neg = self.pipe.encode_prompt(
            params["prompt"], self.device, 1, True, params.get("negative_prompt"),
        )
        return {"prompt_embeds": pos, "negative_prompt_embeds": neg}
