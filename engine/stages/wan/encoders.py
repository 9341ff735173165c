"""wan2.1-i2v text_encode (umT5) and image_encode (CLIP vision)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import BatchedCallStage, StageContext
from engine.stages.components import TorchStage, decode_image, no_grad
from engine.stages.wan.pipe import partial_pipeline
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


class _WanEncode(TorchStage):
    """An encoder stage: a partial pipeline holding its components, whose own ``encode_*`` it calls."""

    def _load(self, model_dir: Path) -> None:
        self.pipe = partial_pipeline(**self.load_components(model_dir))


class WanTextEncode(_WanEncode, BatchedCallStage):
    """Prompt and negative prompt -> ``prompt_embeds``, ``negative_prompt_embeds`` (1, L, D).

    Requests of one ``max_sequence_length`` encode in one call (BatchedCallStage): the tokenizer pads every
    prompt to that length and the pipeline cuts each row back to its own tokens, so each item is its solo
    bytes (tests/engine/stages/test_light_batching.py)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "AutoTokenizer"), "text_encoder": ("transformers", "UMT5EncoderModel"),
    }

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        return int(params["max_sequence_length"])

    @no_grad
    def call(self, items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> list[dict[str, Any]]:
        # Negative embeddings always computed: fixed message shape per workflow.
        pos, neg = self.pipe.encode_prompt(
            prompt=[str(p["prompt"]) for _, p in items],
            negative_prompt=[p.get("negative_prompt") or "" for _, p in items],
            do_classifier_free_guidance=True, max_sequence_length=int(items[0][1]["max_sequence_length"]),
            device=self.device,
        )
        # The pipeline casts both to the transformer's dtype before denoising.
        pos, neg = pos.to(self.dtype), neg.to(self.dtype)
        return [{"prompt_embeds": pos[k:k + 1], "negative_prompt_embeds": neg[k:k + 1]} for k in range(len(items))]


class WanImageEncode(_WanEncode):
    """Input image bytes -> ``image_embeds``: CLIP vision's penultimate hidden states."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "image_processor": ("transformers", "CLIPImageProcessor"), "image_encoder": ("transformers", "CLIPVisionModel"),
    }

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        image = decode_image(inputs["image"])
        embeds = self.pipe.encode_image(image, self.device)
        return {"image_embeds": embeds.to(self.dtype)}
