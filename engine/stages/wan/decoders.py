"""wan2.1-i2v vae_decode: de-normalised latents -> uint8 frames, in chunks as the causal VAE decodes them.

uint8 because float32 frames of a full-size video are 370 MiB: the ring
carries 92 MiB of uint8 instead (and video_encode shrinks that to an mp4).
Wan's VAE decodes latent frame by latent frame (a causal cache of each
convolution's last frames), so the frames of latent frame i are final once it
is decoded: :meth:`WanVaeDecode.run_chunks` yields them then (1 frame for the
first latent frame, ``scale_factor_temporal`` for each next one), which lets
the mp4 stage stream the video while the rest is decoded (engine.worker.chunks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import StageContext
from engine.stages.components import TorchStage, no_grad, to_uint8
from engine.stages.wan.pipe import partial_pipeline
from engine.stages.wan.vae import load_wan_vae

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


class WanVaeDecode(TorchStage):
    """``denoised`` (1, C, T, h, w) -> ``frames`` (F, H, W, 3) uint8 (:meth:`run_chunks`: in chunks)."""

    components: ClassVar[tuple[str, ...]] = ("vae",)

    def _load(self, model_dir: Path) -> None:
        self.pipe = partial_pipeline(vae=load_wan_vae(self, model_dir))

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        chunks = [c["frames"] for c in self.run_chunks(inputs, params, ctx)]
        return {"frames": chunks[0] if len(chunks) == 1 else torch.cat(chunks)}

    @no_grad
    def run_chunks(self, inputs: Mapping[str, Any], params: Mapping[str, Any],
                   ctx: StageContext) -> Iterator[dict[str, Any]]:
        """``{"frames": ...}`` per latent frame, in order: byte for byte the frames :meth:`run` gives, since
        every step after the decoder (unpatchify, clamp, postprocess, rounding) works frame by frame."""
        vae = self.pipe.vae
        latents = inputs["denoised"].to(self.device, vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latents = latents / inv_std + mean
        pieces = self._decoded(vae, latents) if self._causal(vae, latents) else iter([vae.decode(latents)[0]])
        n = latents.shape[2]
        for i, video in enumerate(pieces):
            frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
            yield {"frames": torch.from_numpy(to_uint8(frames[0]))}
            if ctx.progress is not None:
                ctx.progress(i + 1, n)

    def chunk_count(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> int:
        """How many chunks :meth:`run_chunks` yields for ``inputs`` (so each goes out as soon as it exists)."""
        latents = inputs["denoised"]
        return int(latents.shape[2]) if self._causal(self.pipe.vae, latents) else 1

    @staticmethod
    def _causal(vae: Any, latents: torch.Tensor) -> bool:
        """Whether ``vae.decode`` would run the latent-frame loop :meth:`_decoded` repeats (not its tiled
        path, and one video at a time)."""
        h, w = latents.shape[-2:]
        tiled = vae.use_tiling and (w > vae.tile_sample_min_width // vae.spatial_compression_ratio
                                    or h > vae.tile_sample_min_height // vae.spatial_compression_ratio)
        return latents.shape[0] == 1 and not tiled

    @staticmethod
    def _decoded(vae: Any, z: torch.Tensor) -> Iterator[torch.Tensor]:
        """``AutoencoderKLWan._decode``'s loop (diffusers 0.42), one latent frame's output at a time."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae.clear_cache()
        try:
            x = vae.post_quant_conv(z)
            for i in range(z.shape[2]):
                vae._conv_idx = [0]
                out = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0)
                if vae.config.patch_size is not None:
                    out = unpatchify(out, patch_size=vae.config.patch_size)
                yield torch.clamp(out, min=-1.0, max=1.0)
        finally:
            vae.clear_cache()
