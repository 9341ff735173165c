"""Per-stage timing of full-size Wan2.1 I2V 14B 480p, built from its published configs with random weights.

Nothing can be downloaded, and timing does not depend on weight values, so each
component is constructed from the published configuration (recorded in the
output), filled with random weights on the device, and timed on inputs of the
real shapes: 480x832, 81 frames, a 512-token prompt, classifier-free guidance
(two transformer passes per step). Stages run one at a time and are freed in
between, so peak memory is per stage.

    python benchmarks/wan_fullsize_profile.py --out profile.json            # GPU (bf16; VAE float32)
    python benchmarks/wan_fullsize_profile.py --tiny --device cpu           # the same code on tiny configs

The output is what `onepiece bench resources` reads as a stage profile.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

# Published configurations (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers; google/umt5-xxl; CLIP ViT-H/14).
FULL = {
    "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=36,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280,
                        added_kv_proj_dim=5120, rope_max_seq_len=1024),
    "text_encoder": dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                         relative_attention_num_buckets=32, relative_attention_max_distance=128,
                         feed_forward_proj="gated-gelu", vocab_size=256384, pad_token_id=0, eos_token_id=1,
                         decoder_start_token_id=0),
    "image_encoder": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                          patch_size=14, image_size=224, projection_dim=1024, hidden_act="gelu"),
    "vae": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                temperal_downsample=[False, True, True]),
    "shape": dict(height=480, width=832, frames=81, text_tokens=512, image_size=224),
}
TINY = {
    "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36,
                        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=8),
    "text_encoder": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                         relative_attention_max_distance=16, feed_forward_proj="gated-gelu", vocab_size=100,
                         pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    "image_encoder": dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                          patch_size=4, image_size=32, projection_dim=8),
    "vae": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True]),
    "shape": dict(height=64, width=64, frames=9, text_tokens=16, image_size=32),
}


def _timed(fn: Any, sync: Any, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up (kernels chosen, caches filled)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps-timed", type=int, default=2, help="denoising steps to time (per-step figure)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    cfg = TINY if args.tiny else FULL
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    bf16 = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sh = cfg["shape"]
    t_lat = (sh["frames"] - 1) // 4 + 1
    h_lat, w_lat = sh["height"] // 8, sh["width"] // 8
    g = torch.Generator(device=dev).manual_seed(0)
    results: dict[str, Any] = {
        "what": "Wan2.1 I2V 14B 480p, random weights from the published configs" if not args.tiny else "tiny configs",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(bf16).replace("torch.", ""), "vae_dtype": "float32",
        "shape": sh, "configs": {k: v for k, v in cfg.items() if k != "shape"}, "stages": {},
    }

    def build(factory: Any, dtype: Any) -> Any:
        # built in float32 on the device (random init by the modules' own initialisers), then cast:
        # the 14B transformer peaks at 56 + 28 GB during the cast, within an H200's memory
        t0 = time.perf_counter()
        with torch.device(dev):
            model = factory().eval()
        model = model.to(dtype)
        # as from_pretrained(torch_dtype=...) does: some modules stay in float32
        keep = getattr(model, "_keep_in_fp32_modules", None) or []
        for name, param in model.named_parameters():
            if any(k in name.split(".") for k in keep):
                param.data = param.data.float()
        sync()
        return model, time.perf_counter() - t0

    def record(stage: str, build_s: float, compute: float, runs: list[float], out_bytes: int, params: int,
               per: str = "request") -> None:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        results["stages"][stage] = {"build_s": round(build_s, 3), "seconds": round(compute, 4), "per": per,
                                    "runs": [round(x, 4) for x in runs], "peak_gib": round(peak, 2) if peak else None,
                                    "hands_on_bytes": out_bytes, "params": params}
        print(f"{stage:14s} {compute:9.4f} s/{per:8s} build {build_s:6.1f} s  peak "
              f"{peak if peak is None else round(peak, 1)} GiB  hands on {out_bytes:,} B  params {params:,}",
              flush=True)

    def free() -> None:  # callers drop their references first
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def nparams(m: Any) -> int:
        return sum(p.numel() for p in m.parameters())

    with torch.inference_mode():
        # text_encode: umT5 over the prompt
        model, b = build(lambda: UMT5EncoderModel(UMT5Config(**cfg["text_encoder"])), bf16)
        ids = torch.randint(2, cfg["text_encoder"]["vocab_size"], (1, sh["text_tokens"]), device=dev, generator=g)
        out: dict[str, Any] = {}
        med, runs = _timed(lambda: out.__setitem__("y", model(ids).last_hidden_state), sync, args.repeats)
        prompt_embeds = out["y"]
        record("text_encode", b, med, runs, prompt_embeds.numel() * prompt_embeds.element_size() * 2, nparams(model))
        model = None
        free()

        # image_encode: CLIP vision, penultimate hidden states
        model, b = build(lambda: CLIPVisionModel(CLIPVisionConfig(**cfg["image_encoder"])), bf16)
        px = torch.randn(1, 3, sh["image_size"], sh["image_size"], device=dev, generator=g, dtype=bf16)
        med, runs = _timed(lambda: out.__setitem__("y", model(px, output_hidden_states=True).hidden_states[-2]),
                           sync, args.repeats)
        image_embeds = out["y"]
        record("image_encode", b, med, runs, image_embeds.numel() * image_embeds.element_size(), nparams(model))
        model = None
        free()

        # vae_encode: the condition video (first frame, then zeros), float32 as the model card runs it
        vae, b = build(lambda: AutoencoderKLWan(**cfg["vae"]), torch.float32)
        video = torch.zeros(1, 3, sh["frames"], sh["height"], sh["width"], device=dev)
        video[:, :, 0] = torch.randn(1, 3, sh["height"], sh["width"], device=dev, generator=g)
        med, runs = _timed(lambda: out.__setitem__("y", vae.encode(video).latent_dist.mode()), sync, 1)
        cond = out["y"]
        cond_bytes = (cond.numel() + 4 * cond.numel() // 16) * 2  # latents + 4-channel mask, bf16
        record("vae_encode", b, med, runs, cond_bytes + t_lat * h_lat * w_lat * 16 * 2, nparams(vae))
        video = None

        # denoise: the 14B transformer, cond + uncond per step
        tr, b = build(lambda: WanTransformer3DModel(**cfg["transformer"]), bf16)
        x = torch.randn(1, 36, t_lat, h_lat, w_lat, device=dev, generator=g, dtype=bf16)
        neg = torch.randn_like(prompt_embeds)
        ts = torch.tensor([999], device=dev)

        def step() -> None:
            tr(x, ts, prompt_embeds.to(bf16), encoder_hidden_states_image=image_embeds.to(bf16), return_dict=False)
            tr(x, ts, neg.to(bf16), encoder_hidden_states_image=image_embeds.to(bf16), return_dict=False)

        med, runs = _timed(step, sync, args.steps_timed)
        record("denoise", b, med, runs, t_lat * h_lat * w_lat * 16 * 2, nparams(tr), per="step")
        tr = x = neg = None
        free()

        # vae_decode: latents to frames
        lat = torch.randn(1, 16, t_lat, h_lat, w_lat, device=dev, generator=g)
        med, runs = _timed(lambda: out.__setitem__("y", vae.decode(lat).sample), sync, 1)
        frames = out["y"]
        record("vae_decode", 0.0, med, runs, frames.numel(), nparams(vae))  # handed on as uint8
        vae = lat = frames = None
        free()

    results["note"] = ("seconds is per request, except denoise (per step: two transformer passes); "
                       "a request costs text + image + vae_encode + steps x denoise + vae_decode")
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
