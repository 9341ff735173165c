"""The pieces every tiny-model builder shares: a word list, seeding, the progress bar, the last save, and
Wan2.1's umT5 text encoder, VAE, transformer and scheduler (which the Wan2.2 builders reuse, byte-identical).

Imported by :mod:`engine.stages.tiny` (the Wan2.1 and SD builders and the table of every builder),
:mod:`engine.stages.tiny_wan22` and :mod:`engine.stages.tiny_t2i`; it imports none of them. torch, diffusers
and transformers are imported inside the functions, when a model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Words the tiny tokenizers know; the rest of a prompt falls back to characters.
WORDS = ("a", "cat", "dog", "on", "the", "moon", "red", "car", "in", "snow", "walks", "beach", "sunset", "blurry")


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="component", leave=False)


def saved(pipe: Any, out: Path, bar: Any) -> Path:
    """Write ``pipe``'s folder layout to ``out`` and close its progress bar (every builder's last step)."""
    pipe.save_pretrained(out)
    bar.update()
    bar.close()
    return out


def manual_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def wan_text(seed: int) -> tuple[Any, Any]:
    """umT5 tokenizer and text encoder: the same in both Wan workflows (as Wan2.1's published T2V and I2V
    releases share umt5-xxl)."""
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(f"\u2581{w}", -1.0) for w in WORDS] + [(w, -1.5) for w in WORDS]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, vocab_size=len(tokenizer),
    ))
    return tokenizer, text_encoder


def wan_vae(seed: int) -> Any:
    """The Wan VAE (shared by both Wan workflows, as in the published weights)."""
    from diffusers import AutoencoderKLWan

    manual_seed(seed + 2)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def wan_transformer(seed: int, in_channels: int, image_dim: int | None) -> Any:
    from diffusers import WanTransformer3DModel

    manual_seed(seed + 3)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=image_dim,
    )


def wan_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=3.0)
