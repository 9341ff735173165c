"""wan2.1-i2v vae_decode: de-normalised latents -> uint8 frames.

uint8 because float32 frames of a full-size video are 370 MiB: the ring
carries 92 MiB of uint8 instead (and video_encode shrinks that to an mp4).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.stages.base import StageContext
from engine.stages.components import TorchStage, to_uint8
from engine.stages.wan.pipe import partial_pipeline
from engine.stages.wan.vae import load_wan_vae


class WanVaeDecode(TorchStage):
    """``denoised`` (1, C, T, h, w) -> ``frames`` (F, H, W, 3) uint8."""

    components: ClassVar[tuple[str, ...]] = ("vae",)

    def _load(self, model_dir: Path) -> None:
        self.pipe = partial_pipeline(vae=load_wan_vae(self, model_dir))

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        vae = self.pipe.vae
        latents = inputs["denoised"].to(self.device, vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        return {"frames": torch.from_numpy(to_uint8(frames[0]))}
