"""Which stages can batch without changing a request's bytes, and what batching buys (issue 24, item 3).

For each stage's model on the tiny models (``onepiece models make-tiny``), one thread: the outputs of a
batch against the same inputs run alone, byte for byte (and the largest difference where they differ),
and the requests/s of SD's step-level batched denoise at batch 1, 2, 4 and 8 against batch 1, side by side
in this process. A stage batches by default only where the bytes are equal (StageSpec.max_batch).

    python benchmarks/batch_equality.py [--models DIR] [--json]

Without ``--models``, the tiny models are built in a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def _equal(f: Any, *xs: Any) -> dict[str, Any]:
    """``f`` over the whole batch of ``xs`` (tensors of one batch size) against ``f`` over each row alone."""
    import torch

    alone = torch.cat([f(*(x[i:i + 1] for x in xs)) for i in range(xs[0].shape[0])])
    batched = f(*xs)
    return {"equal": bool(torch.equal(alone, batched)), "max_diff": float((alone - batched).abs().max())}


def equality(models: str) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan, UNet2DConditionModel, WanTransformer3DModel
    from transformers import CLIPTextModel, UMT5EncoderModel

    from engine.stages import invariant

    torch.manual_seed(0)
    sd, wan = f"{models}/sd-t2i", f"{models}/wan2.1-t2v"
    out: dict[str, Any] = {}
    with torch.no_grad():
        unet = UNet2DConditionModel.from_pretrained(f"{sd}/unet").eval()
        for side in (8, 32, 64):  # guided pairs: a batch of 2N against N calls of 2, per-sample timesteps
            x, e = torch.randn(6, 4, side, side), torch.randn(6, 77, 32)
            t = torch.tensor([500.0, 500.0, 300.0, 300.0, 999.0, 999.0])
            pairs = torch.cat([unet(x[i:i + 2], t[i], encoder_hidden_states=e[i:i + 2]).sample for i in (0, 2, 4)])
            both = unet(x, t, encoder_hidden_states=e).sample
            out[f"sd unet, guided pairs, latent {side}"] = {"equal": bool(torch.equal(pairs, both)),
                                                            "max_diff": float((pairs - both).abs().max())}
            out[f"sd unet, unguided, latent {side}"] = _equal(
                lambda v, c: unet(v, torch.tensor(500.0), encoder_hidden_states=c).sample, x[:2], e[:2])
        # N guided requests stepped together, as the batcher does (2N rows, a timestep per request), against
        # each request's pair alone: where the batched bytes stop being the solo ones sets the default max_batch
        for side in (8, 32):
            for n in range(2, 9):
                x, e = torch.randn(2 * n, 4, side, side), torch.randn(2 * n, 77, 32)
                t = torch.tensor([float(100 + 37 * (i // 2)) for i in range(2 * n)])
                pairs = torch.cat([unet(x[2 * i:2 * i + 2], t[2 * i], encoder_hidden_states=e[2 * i:2 * i + 2]).sample
                                   for i in range(n)])
                both = unet(x, t, encoder_hidden_states=e).sample
                out[f"sd unet, {n} guided requests stepped together, latent {side}"] = {
                    "equal": bool(torch.equal(pairs, both)), "max_diff": float((pairs - both).abs().max())}
                with invariant.rows_per_request(2):  # what the stepped denoise runs (engine.stages.invariant)
                    both = unet(x, t, encoder_hidden_states=e).sample
                out[f"sd unet, {n} guided requests, per-request 2-D linears, latent {side}"] = {
                    "equal": bool(torch.equal(pairs, both)), "max_diff": float((pairs - both).abs().max())}
        vae = AutoencoderKL.from_pretrained(f"{sd}/vae").eval()
        out["sd vae decode, latent 32"] = _equal(lambda v: vae.decode(v).sample, torch.randn(2, 4, 32, 32))
        clip = CLIPTextModel.from_pretrained(f"{sd}/text_encoder").eval()
        out["sd clip text encoder"] = _equal(lambda v: clip(v)[0], torch.randint(0, 50, (2, 77)))
        tr = WanTransformer3DModel.from_pretrained(f"{wan}/transformer").eval()
        out["wan transformer, 21x16x16 latent"] = _equal(
            lambda v, c: tr(v, torch.tensor([500] * v.shape[0]), c).sample, torch.randn(2, 16, 21, 16, 16),
            torch.randn(2, 512, 32))
        umt5 = UMT5EncoderModel.from_pretrained(f"{wan}/text_encoder").eval()
        out["wan umt5 text encoder"] = _equal(lambda v: umt5(v).last_hidden_state, torch.randint(0, 50, (2, 512)))
        wvae = AutoencoderKLWan.from_pretrained(f"{wan}/vae").eval()
        out["wan vae decode, 3x8x8 latent"] = _equal(lambda v: wvae.decode(v).sample, torch.randn(2, 16, 3, 8, 8))
    return out


def gains(models: str, sides: tuple[int, ...] = (64, 128), steps: int = 20, reps: int = 3) -> dict[str, Any]:
    """requests/s of the stepped SD denoise at batch 1, 2, 4, 8, as ratios to batch 1 (median of ``reps``)."""
    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner

    runner = LocalRunner("sd-t2i", f"{models}/sd-t2i", "cpu")
    dn = runner.executors["denoise"]
    out: dict[str, Any] = {}
    for side in sides:
        rps = {}
        for n in (1, 2, 4, 8):
            ps = [runner.spec.resolve_params({"prompt": f"p{i}", "height": side, "width": side,
                                              "num_inference_steps": steps, "seed": i}) for i in range(n)]
            es = [runner.executors["text_encode"].run({}, p, StageContext()) for p in ps]
            times = []
            for _ in range(reps):
                states = [dn.begin(e, p) for e, p in zip(es, ps, strict=True)]
                t0 = time.perf_counter()
                while dn.progress(states[0])[0] < steps:
                    dn.step(states)
                times.append(time.perf_counter() - t0)
            rps[n] = n / statistics.median(times)
        out[f"{side}x{side}"] = {"batch_1_rps": rps[1], **{f"batch_{n}_x": rps[n] / rps[1] for n in (2, 4, 8)}}
    return out


def _cpu() -> dict[str, Any]:
    """The host's CPU model and widest vector ISA: which kernels MKL and oneDNN pick depends on it."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"model": name, "isa": isa}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None,
                   help="a folder of tiny models (onepiece models make-tiny --out; default: built here)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from engine.stages.tiny import models_or_tiny

    with models_or_tiny(args.models, ["sd-t2i", "wan2.1-t2v"]) as models:
        result = {"threads": 1, "load_average": os.getloadavg(), "cpu": _cpu(), "equality": equality(str(models)),
                  "sd_denoise_step_batching": gains(str(models))}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"cpu: {result['cpu']['model']} ({result['cpu']['isa']})")
    for name, r in result["equality"].items():
        verdict = "equal bytes" if r["equal"] else "differs, max {:.2e}".format(r["max_diff"])
        print(f"{name:40} {verdict}")
    for side, g in result["sd_denoise_step_batching"].items():
        print(f"sd denoise {side}: {g['batch_1_rps']:.2f} requests/s alone; batch 2 {g['batch_2_x']:.2f}x, "
              f"4 {g['batch_4_x']:.2f}x, 8 {g['batch_8_x']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
