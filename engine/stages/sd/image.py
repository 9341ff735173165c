"""sd-t2i image_encode: uint8 pixels -> png bytes (CPU only, no model)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from engine.stages.base import StageContext, StageExecutor


class SDImageEncode(StageExecutor):
    """``pixels`` (1, H, W, 3) uint8 -> ``image`` png bytes."""

    components: ClassVar[tuple[str, ...]] = ()

    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        self.model_dir = Path(model_dir)

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        from PIL import Image

        pixels = inputs["pixels"]
        array = pixels.numpy() if hasattr(pixels, "numpy") else pixels
        buf = io.BytesIO()
        Image.fromarray(array[0]).save(buf, format="PNG")
        return {"image": buf.getvalue()}
