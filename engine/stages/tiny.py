"""Deterministic tiny random-weight checkpoints for the workflows' tests and demos.

Each builder writes, with ``save_pretrained``, the same folder layout as the
real published weights (``model_index.json`` plus one sub-folder per
component), so the stage executors and ``DiffusionPipeline.from_pretrained``
load either without a code change. Same seed -> byte-identical files. Nothing
is downloaded. Configs and pitfalls: /work/shared/MODELS.md.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.stages import tiny_common as common
from engine.stages import tiny_t2i, tiny_wan22
from engine.workflow.limits import SERVING_FILE
from engine.workflow.pools import link_identical


def build_wan_i2v(out: Path, seed: int = 0) -> Path:
    """Write a tiny Wan2.1 I2V checkpoint (WanImageToVideoPipeline layout) to ``out``."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    bar = common.progress_bar(4, "wan2.1-i2v")
    tokenizer, text_encoder = common.wan_text(seed)
    bar.update()
    common.manual_seed(seed + 1)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=8, projection_dim=8, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=4,
    ))
    image_processor = CLIPImageProcessor(crop_size=32, size=32)
    bar.update()
    vae = common.wan_vae(seed)
    # in_channels 36 = 16 noise + 4 mask + 16 first-frame latents; image_dim = the CLIP hidden size
    transformer = common.wan_transformer(seed, 36, 8)
    bar.update()
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=common.wan_scheduler(),
        image_processor=image_processor, image_encoder=image_encoder, transformer=transformer,
    )
    return common.saved(pipe, out, bar)


def build_wan_t2v(out: Path, seed: int = 0) -> Path:
    """Write a tiny Wan2.1 T2V checkpoint (WanPipeline layout, like Wan2.1-T2V-1.3B-Diffusers) to ``out``.

    Its tokenizer, text encoder and VAE are byte-identical to the tiny I2V model's (same seeds).
    """
    from diffusers import WanPipeline

    bar = common.progress_bar(3, "wan2.1-t2v")
    tokenizer, text_encoder = common.wan_text(seed)
    bar.update()
    vae = common.wan_vae(seed)
    transformer = common.wan_transformer(seed, 16, None)  # noise latents only; no image cross-attention
    bar.update()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=common.wan_scheduler(),
                       transformer=transformer)
    return common.saved(pipe, out, bar)


def build_sd_t2i(out: Path, seed: int = 0) -> Path:
    """Write a tiny Stable Diffusion 1.x checkpoint (StableDiffusionPipeline layout) to ``out``."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    bar = common.progress_bar(5, "sd-t2i")
    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab_list = ["<|startoftext|>", "<|endoftext|>", "!"] + list(chars) + [c + "</w>" for c in chars]
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>"), ("o", "n</w>"), ("t", "h"), ("th", "e</w>")]
    vocab_list += ["ca", "cat</w>", "do", "dog</w>", "on</w>", "th", "the</w>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab_list)}, merges=merges, model_max_length=77)
    bar.update()
    common.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        max_position_embeddings=77, vocab_size=len(vocab_list), bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    bar.update()
    common.manual_seed(seed + 1)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2,
    )
    bar.update()
    common.manual_seed(seed + 2)
    vae = AutoencoderKL(
        block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
    )
    bar.update()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return common.saved(pipe, out, bar)


# The default request of a tiny Wan model: a 5 s clip (81 frames at 16 fps, as the pipeline's default) at
# 224x128 (the pipeline's 832x480 shape, scaled): ~10 s on one CPU thread, where 832x480 cannot run at all
# (rope_max_seq_len 32) and 512x288 takes many minutes.
WAN_SERVING = {"defaults": {"width": 224, "height": 128, "num_frames": 81},
               "why": "tiny random-weight model: a default clip that runs in seconds on a CPU"}


def _serving(build: Callable[[Path, int], Path], serving: dict[str, Any]) -> Callable[[Path, int], Path]:
    """``build``, then the folder's serving defaults (engine.workflow.limits.SERVING_FILE)."""
    def run(out: Path, seed: int = 0) -> Path:
        folder = build(out, seed)
        write_serving(folder, serving)
        return folder

    return run


def write_serving(folder: Path, serving: dict[str, Any]) -> None:
    import json

    (folder / SERVING_FILE).write_text(json.dumps(serving, indent=2) + "\n")


SERVING = {"wan2.1-i2v": WAN_SERVING, "wan2.1-t2v": WAN_SERVING}


def ensure_serving(folder: Path, workflow: str) -> bool:
    """Give a tiny model folder built before serving defaults existed its own (``onepiece up`` reuses the
    tiny models of an earlier run); True if it wrote one."""
    if workflow not in SERVING or (folder / SERVING_FILE).exists():
        return False
    write_serving(folder, SERVING[workflow])
    return True


BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "wan2.1-i2v": _serving(build_wan_i2v, WAN_SERVING), "wan2.1-t2v": _serving(build_wan_t2v, WAN_SERVING),
    "sd-t2i": build_sd_t2i,
}

# Wan2.2 (engine.stages.tiny_wan22: its A14B models reuse Wan2.1's umT5 and VAE, byte-identical)

SERVING.update(tiny_wan22.SERVING)
BUILDERS.update({n: _serving(b, tiny_wan22.SERVING[n]) for n, b in tiny_wan22.BUILDS.items()})

# FLUX.1 and Qwen-Image (engine.stages.tiny_t2i)

SERVING.update(tiny_t2i.SERVING)
BUILDERS.update({n: _serving(b, tiny_t2i.SERVING[n]) if n in tiny_t2i.SERVING else b for n, b in tiny_t2i.BUILDS.items()})


def make_tiny(out: str | Path, workflow: str | None = None, seed: int = 0) -> dict[str, Path]:
    """Build tiny checkpoints; returns workflow name -> model folder.

    With ``workflow``, ``out`` is that workflow's model folder; without it,
    every workflow gets ``out/<workflow>``. Raises ``KeyError`` for a workflow
    without a tiny builder.
    """
    if workflow is not None:
        if workflow not in BUILDERS:
            raise KeyError(f"no tiny model for workflow {workflow!r}; known: {', '.join(BUILDERS)}")
        return {workflow: BUILDERS[workflow](Path(out), seed)}
    built = {n: build(Path(out) / n, seed) for n, build in BUILDERS.items()}
    link_identical(out)  # components several workflows share (same bytes) are kept once on disk
    return built


@contextlib.contextmanager
def models_or_tiny(folder: str | Path | None, workflows: list[str] | None = None) -> Iterator[Path]:
    """``folder`` as it is, or (``None``) tiny models built into a temporary folder removed afterwards.

    For benchmarks and scripts whose ``--models`` is optional: nothing reads a folder that only some
    machine happens to hold. The folder holds ``<workflow>/`` sub-folders, as ``make_tiny(out)`` writes;
    ``workflows`` limits what is built (default: every workflow with a tiny builder).
    """
    if folder is not None:
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="onepiece-tiny-") as tmp:
        if workflows is None:
            make_tiny(tmp)
        else:
            for w in workflows:
                make_tiny(Path(tmp) / w, w)
        yield Path(tmp)
