"""sd-t2i vae_decode: latents -> uint8 RGB pixels (never float images across a ring)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import StageContext
from engine.stages.components import TorchStage, load_component, no_grad, to_uint8

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


class SDVaeDecode(TorchStage):
    """``denoised`` -> ``pixels`` (1, H, W, 3) uint8."""

    components: ClassVar[tuple[str, ...]] = ("vae",)

    def _load(self, model_dir: Path) -> None:
        from diffusers.image_processor import VaeImageProcessor

        self.vae = load_component(model_dir, "vae", ("diffusers", "AutoencoderKL"), self.dtype, self.device)
        scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.processor = VaeImageProcessor(vae_scale_factor=scale)

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        latents = inputs["denoised"].to(self.device, self.vae.dtype)
        image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
        # No safety checker in this workflow: every image is denormalised.
        images = self.processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])
        return {"pixels": torch.from_numpy(to_uint8(images))}
