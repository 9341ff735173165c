"""sd-t2i image_encode: uint8 pixels -> png bytes (CPU only, no model)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

from engine.stages.base import ModelFreeStage, StageContext


class SDImageEncode(ModelFreeStage):
    """``pixels`` (1, H, W, 3) uint8 -> ``image`` png bytes."""

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(self.array(inputs["pixels"])[0]).save(buf, format="PNG")
        return {"image": buf.getvalue()}
