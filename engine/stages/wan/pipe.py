"""A ``WanImageToVideoPipeline`` holding only one stage's components.

Calling the pipeline's own methods (``encode_prompt``, ``encode_image``,
``prepare_latents``) is what keeps the staged output bit-identical to the
one-call pipeline, and keeps working as diffusers fixes those methods.
"""

from __future__ import annotations

from typing import Any


def partial_pipeline(**components: Any) -> Any:
    """The pipeline with the given components and every other one set to None."""
    from diffusers import WanImageToVideoPipeline

    base: dict[str, Any] = {"tokenizer": None, "text_encoder": None, "vae": None, "scheduler": None}
    base.update(components)
    return WanImageToVideoPipeline(**base)
