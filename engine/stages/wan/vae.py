"""wan2.1-i2v vae_encode: the first-frame condition and the initial noise.

The pipeline's ``prepare_latents`` draws the initial noise from the request's
generator and VAE-encodes the first frame padded with zeros; UniPC draws no
more random numbers, so the noise can be drawn here and carried to denoise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import InvalidInput, StageContext
from engine.stages.components import TorchStage, decode_image, load_component, no_grad, read_config
from engine.stages.wan.pipe import partial_pipeline

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


def load_wan_vae(stage: TorchStage, model_dir: Path) -> Any:
    # Wan's VAE stays float32 even when the transformer runs in bf16: that is
    # how the model card runs it (bf16 VAE visibly degrades video).
    return load_component(model_dir, "vae", ("diffusers", "AutoencoderKLWan"), torch.float32, stage.device)


def wan_vae_factors(model_dir: Path) -> tuple[int, int]:
    """(temporal, spatial) compression of the folder's Wan VAE, read from its config (not a pipeline's
    fallback for a VAE it was not given: MODELS.md, "Pitfall")."""
    config = read_config(model_dir, "vae")
    down = config.get("temperal_downsample", [False, True, True])
    return config.get("scale_factor_temporal", 2 ** sum(down)), config.get("scale_factor_spatial", 2 ** len(down))


def check_wan_size(height: int, width: int, frames: int, multiple: tuple[int, int], temporal: int) -> None:
    """:class:`InvalidInput` unless the size tiles into transformer patches and the frames into VAE chunks."""
    if height % multiple[0] or width % multiple[1]:
        raise InvalidInput("size", f"height/width must be multiples of {multiple} for this model")
    if frames % temporal != 1:
        raise InvalidInput("num_frames", f"num_frames - 1 must be divisible by {temporal}")


class WanVaeEncode(TorchStage):
    """Input image bytes -> ``latents`` (noise) and ``condition`` (mask + first-frame latents), float32."""

    components: ClassVar[tuple[str, ...]] = ("vae",)
    reads: ClassVar[tuple[str, ...]] = ("transformer",)  # its patch size, when the folder has one

    def _load(self, model_dir: Path) -> None:
        self.pipe = partial_pipeline(vae=load_wan_vae(self, model_dir))
        # Pixel sizes must tile into transformer patches; the patch size lives
        # in the transformer's config, which this stage reads but never loads.
        patch = (1, 2, 2)
        config = model_dir / "transformer" / "config.json"
        if config.is_file():
            patch = tuple(json.loads(config.read_text()).get("patch_size", patch))
        self.multiple = self.pipe.vae_scale_factor_spatial * patch[1], self.pipe.vae_scale_factor_spatial * patch[2]

    @no_grad
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        pipe = self.pipe
        height, width, frames = params["height"], params["width"], params["num_frames"]
        check_wan_size(height, width, frames, self.multiple, pipe.vae_scale_factor_temporal)
        image = decode_image(inputs["image"])
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        latents, condition = pipe.prepare_latents(
            pixels, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32, self.device, generator,
        )
        return {"latents": latents, "condition": condition}
