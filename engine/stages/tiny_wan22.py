"""Deterministic tiny Wan2.2 checkpoints (the layouts of Wan-AI's Wan2.2 Diffusers releases).

- ``wan2.2-t2v-a14b`` (``WanPipeline``) and ``wan2.2-i2v-a14b`` (``WanImageToVideoPipeline``): two experts,
  ``transformer`` (high noise) and ``transformer_2`` (low noise), switched at ``boundary_ratio`` (recorded in
  ``model_index.json`` as the releases record it: 0.875 for T2V, 0.9 for I2V). Their tokenizer, umT5 text
  encoder and VAE are Wan2.1's, byte-identical to the tiny Wan2.1 models' files (same builders, same seeds),
  as the A14B releases ship Wan2.1's umt5-xxl and VAE; the I2V release has no CLIP image encoder (its
  transformer has no image cross-attention: ``image_dim`` None).
- ``wan2.2-ti2v-5b`` (``WanPipeline`` with ``expand_timesteps``): one transformer over the Wan2.2 VAE
  (``AutoencoderKLWan`` with its Wan2.2 config: 48 latent channels, patchified input, residual blocks,
  16x spatial compression), served as text-and-image-to-video (``WanImageToVideoPipeline`` over the same folder).

Same seed -> byte-identical files. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.stages import tiny_common as common

# Wan2.2's own sampling settings (Wan-AI's configs): the T2V experts sample with flow shift 12, I2V and the
# 5B model with 5.
T2V_BOUNDARY, I2V_BOUNDARY = 0.875, 0.9


def _scheduler(flow_shift: float) -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=flow_shift)


def _experts(seed: int, in_channels: int) -> tuple[Any, Any]:
    """The high-noise and the low-noise expert: the tiny Wan transformer with two other seeds (so that
    neither equals the other nor a Wan2.1 model's transformer, and a swapped expert shows in the output)."""
    return (common.wan_transformer(seed + 10, in_channels, None),
            common.wan_transformer(seed + 20, in_channels, None))


def _a14b(out: Path, seed: int, desc: str, pipeline: str, in_channels: int, shift: float, boundary: float) -> Path:
    """A tiny A14B model: Wan2.1's umT5 and VAE, two experts, the release's flow shift and boundary."""
    import diffusers

    bar = common.progress_bar(3, desc)
    tokenizer, text_encoder = common.wan_text(seed)
    bar.update()
    vae = common.wan_vae(seed)
    high, low = _experts(seed, in_channels)
    bar.update()
    pipe = getattr(diffusers, pipeline)(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                        scheduler=_scheduler(shift), transformer=high, transformer_2=low,
                                        boundary_ratio=boundary)
    return common.saved(pipe, out, bar)


def build_wan22_t2v_a14b(out: Path, seed: int = 0) -> Path:
    """A tiny Wan2.2-T2V-A14B (``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``)."""
    return _a14b(out, seed, "wan2.2-t2v-a14b", "WanPipeline", 16, 12.0, T2V_BOUNDARY)


def build_wan22_i2v_a14b(out: Path, seed: int = 0) -> Path:
    """A tiny Wan2.2-I2V-A14B (``WanImageToVideoPipeline`` with two experts, no image encoder); its experts
    take 36 channels: 16 noise + 4 mask + 16 first-frame latents."""
    return _a14b(out, seed, "wan2.2-i2v-a14b", "WanImageToVideoPipeline", 36, 5.0, I2V_BOUNDARY)


def _wan22_vae(seed: int) -> Any:
    """The Wan2.2 VAE's layout (Wan2.2-TI2V-5B: z_dim 48, 2x2 patchified RGB in and out, residual
    up/down-sampling, 4x temporal and 16x spatial compression), with tiny widths."""
    import random

    from diffusers import AutoencoderKLWan

    rng = random.Random(seed + 31)
    z = 48
    mean = [round(rng.uniform(-1.0, 1.0), 4) for _ in range(z)]
    std = [round(rng.uniform(0.5, 2.5), 4) for _ in range(z)]
    common.manual_seed(seed + 32)
    return AutoencoderKLWan(base_dim=4, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                            latents_mean=mean, latents_std=std)


def build_wan22_ti2v_5b(out: Path, seed: int = 0) -> Path:
    """A tiny Wan2.2-TI2V-5B (``WanPipeline`` layout with ``expand_timesteps``, as the release records it)."""
    from diffusers import WanPipeline

    bar = common.progress_bar(3, "wan2.2-ti2v-5b")
    tokenizer, text_encoder = common.wan_text(seed)
    bar.update()
    vae = _wan22_vae(seed)
    transformer = common.wan_transformer(seed + 40, 48, None)
    # the 5B transformer predicts all 48 latent channels (the tiny builder's default is Wan2.1's 16)
    transformer = _with_out_channels(transformer, seed + 40, 48)
    bar.update()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_scheduler(5.0),
                       transformer=transformer, expand_timesteps=True)
    return common.saved(pipe, out, bar)


def _with_out_channels(transformer: Any, seed: int, channels: int) -> Any:
    from diffusers import WanTransformer3DModel

    config = dict(transformer.config)
    config["out_channels"] = channels
    common.manual_seed(seed + 3)
    return WanTransformer3DModel.from_config(config)


# Default requests that run in about a second on one CPU thread (the tiny transformer's rope_max_seq_len of 32
# bounds sides to 512 px for the A14B models and 1024 px for the 5B one; the VAE decode is most of the time):
# a 1 s clip at the release's frame rate (16 fps; 24 for the 5B model), the pipeline's 832x480 shape scaled to
# 112x64 (the 5B model's 1280x704 to 160x96, sides multiples of 32), 8 steps (both experts run: 6 + 2 steps
# for T2V, 3 + 5 for I2V).
A14B_SERVING = {"defaults": {"width": 112, "height": 64, "num_frames": 17, "num_inference_steps": 8},
                "why": "tiny random-weight model: a default clip that runs in seconds on a CPU"}
TI2V_SERVING = {"defaults": {"width": 160, "height": 96, "num_frames": 25, "num_inference_steps": 8},
                "why": "tiny random-weight model: a default clip that runs in seconds on a CPU"}

SERVING = {"wan2.2-t2v-a14b": A14B_SERVING, "wan2.2-i2v-a14b": A14B_SERVING, "wan2.2-ti2v-5b": TI2V_SERVING}
BUILDS = {"wan2.2-t2v-a14b": build_wan22_t2v_a14b, "wan2.2-i2v-a14b": build_wan22_i2v_a14b,
          "wan2.2-ti2v-5b": build_wan22_ti2v_5b}
