"""Tiny random-weight FLUX.1 (schnell, dev) and Qwen-Image checkpoints, in the published folder layouts.

Like :mod:`engine.stages.tiny`: written with ``save_pretrained`` (``model_index.json`` plus one folder per
component), loaded by the stage executors and by ``FluxPipeline`` / ``QwenImagePipeline.from_pretrained``
alike; the same seed gives byte-identical files; nothing is downloaded. The configs follow diffusers' own
pipeline tests, with tokenizers built from small word lists (no vocabulary file is fetched).

What differs between the two FLUX.1 models is what differs between the published ones: dev's
transformer has ``guidance_embeds: true`` (a guidance-distilled model takes ``guidance_scale`` as an
input, no negative pass) and its scheduler shifts with the image's size (``use_dynamic_shifting``);
schnell's has neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.stages import tiny_common as common

# The published tokenizers' limits: CLIP reads 77 tokens; FLUX.1's T5 tokenizer says 512 and Qwen2's 32768
# (the pipelines then cap the sequence: 512 for Flux, 1024 for Qwen-Image).
T5_MAX_LENGTH = 512
QWEN_MAX_LENGTH = 32768


def _clip(seed: int) -> tuple[Any, Any]:
    """A CLIP tokenizer (77 tokens) and text encoder whose hidden size (32) is the pooled projection."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["<|startoftext|>", "<|endoftext|>", "!"] + list(chars) + [c + "</w>" for c in chars]
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>"), ("o", "n</w>"), ("t", "h"), ("th", "e</w>")]
    vocab += ["ca", "cat</w>", "do", "dog</w>", "on</w>", "th", "the</w>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=77)
    common.manual_seed(seed)
    encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, projection_dim=32,
        max_position_embeddings=77, vocab_size=len(vocab), bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    return tokenizer, encoder


def _t5(seed: int) -> tuple[Any, Any]:
    """A T5 tokenizer (``model_max_length`` 512, as FLUX.1's) and a T5 encoder of width 32."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(f"\u2581{w}", -1.0) for w in common.WORDS] + [(w, -1.5) for w in common.WORDS]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)
    common.manual_seed(seed + 1)
    encoder = T5EncoderModel(T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, vocab_size=len(tokenizer),
    ))
    return tokenizer, encoder


def _flux(out: Path, seed: int, dev: bool, desc: str) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    bar = common.progress_bar(4, desc)
    tokenizer, text_encoder = _clip(seed)
    tokenizer_2, text_encoder_2 = _t5(seed)
    bar.update()
    common.manual_seed(seed + 2)
    # in_channels 16: 4 latent channels packed 2x2; joint_attention_dim = T5's d_model, pooled = CLIP's
    # hidden size; the rope axes add up to the head dim.
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
        guidance_embeds=dev,
    )
    bar.update()
    common.manual_seed(seed + 3)
    # Two blocks: an 2x VAE (FLUX.1's has four, 8x); no quant convs, a shift factor, as FLUX.1's.
    vae = AutoencoderKL(
        block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
        layers_per_block=1, down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035, sample_size=32,
    )
    bar.update()
    # The published schedulers: dev shifts by the image's token count, schnell keeps shift 1.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0 if dev else 1.0, use_dynamic_shifting=dev, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    return common.saved(pipe, out, bar)


def build_flux_schnell(out: Path, seed: int = 0) -> Path:
    """A tiny FLUX.1-schnell checkpoint (FluxPipeline layout, no guidance embedding)."""
    return _flux(out, seed, dev=False, desc="flux.1-schnell")


def build_flux_dev(out: Path, seed: int = 0) -> Path:
    """A tiny FLUX.1-dev checkpoint (FluxPipeline layout, guidance embedding, size-dependent shift)."""
    return _flux(out, seed, dev=True, desc="flux.1-dev")


def _qwen_tokenizer() -> Any:
    """A byte-level BPE tokenizer with Qwen2's chat tokens, over single bytes plus a few merges."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    merges = [("c", "a"), ("ca", "t"), ("d", "o"), ("do", "g"), ("o", "n"), ("t", "h"), ("th", "e"),
              ("\u0120", "a"), ("\u0120", "the")]
    vocab = alphabet + [a + b for a, b in merges] + ["<|endoftext|>"]
    ids = {t: i for i, t in enumerate(dict.fromkeys(vocab))}
    tokenizer = Qwen2Tokenizer(vocab=ids, merges=merges,
                               model_max_length=QWEN_MAX_LENGTH)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL)})
    return tokenizer


# Qwen2.5-VL's chat and vision tokens (the config names the vision ones' ids; text-to-image uses none of them)
_QWEN_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_qwen_image(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen-Image checkpoint (QwenImagePipeline layout: Qwen2.5-VL text encoder, QwenImage
    transformer, its Wan-style VAE)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    bar = common.progress_bar(4, "qwen-image")
    tokenizer = _qwen_tokenizer()
    common.manual_seed(seed)
    # The vision tower is part of the published text encoder (Qwen2.5-VL); the text-to-image pipeline
    # reads only the language model's last hidden states.
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL}
    special = {"bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"],
               "pad_token_id": tokenizer.pad_token_id}
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     **special},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer), sliding_window=32, vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], **special,
    ))
    bar.update()
    common.manual_seed(seed + 1)
    # in_channels 16: 4 latent channels packed 2x2; joint_attention_dim = the text encoder's hidden size.
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    bar.update()
    common.manual_seed(seed + 2)
    # Two temporal downsamples: a 4x VAE (Qwen-Image's has three, 8x).
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    bar.update()
    # Qwen-Image's published scheduler: exponential time shift by the image's token count, a terminal sigma.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    return common.saved(pipe, out, bar)


# What a tiny model serves by default where the pipeline's default would take minutes on a CPU: dev's 28
# steps and Qwen-Image's 50 steps at 512x512 (its 4x VAE times 128). schnell's own default (4 steps at 256x256,
# its 2x VAE times 128) runs in about a second, so its folder declares nothing.
_WHY = "tiny random-weight model: a default image that runs in seconds on a CPU"
SERVING = {
    "flux.1-dev": {"defaults": {"num_inference_steps": 8}, "why": _WHY},
    "qwen-image": {"defaults": {"height": 256, "width": 256, "num_inference_steps": 8}, "why": _WHY},
}
BUILDS = {"flux.1-schnell": build_flux_schnell, "flux.1-dev": build_flux_dev, "qwen-image": build_qwen_image}
