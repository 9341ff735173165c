"""wan2.1-i2v text_encode (umT5) and image_encode (CLIP vision)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.stages.base import StageContext
from engine.stages.components import TorchStage, decode_image
from engine.stages.wan.pipe import partial_pipeline


class _WanEncode(TorchStage):
    """An encoder stage: a partial pipeline holding its components, whose own ``encode_*`` it calls."""

    def _load(self, model_dir: Path) -> None:
        self.pipe = partial_pipeline(**self.load_components(model_dir))


class WanTextEncode(_WanEncode):
    """Prompt and negative prompt -> ``prompt_embeds``, ``negative_prompt_embeds`` (1, L, D)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "AutoTokenizer"), "text_encoder": ("transformers", "UMT5EncoderModel"),
    }

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        # Negative embeddings always computed: fixed message shape per workflow.
        pos, neg = self.pipe.encode_prompt(
            prompt=params["prompt"], negative_prompt=params.get("negative_prompt") or "",
            do_classifier_free_guidance=True, max_sequence_length=params["max_sequence_length"],
            device=self.device,
        )
        # The pipeline casts both to the transformer's dtype before denoising.
        return {"prompt_embeds": pos.to(self.dtype), "negative_prompt_embeds": neg.to(self.dtype)}


class WanImageEncode(_WanEncode):
    """Input image bytes -> ``image_embeds``: CLIP vision's penultimate hidden states."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "image_processor": ("transformers", "CLIPImageProcessor"), "image_encoder": ("transformers", "CLIPVisionModel"),
    }

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        image = decode_image(inputs["image"])
        embeds = self.pipe.encode_image(image, self.device)
        return {"image_embeds": embeds.to(self.dtype)}
