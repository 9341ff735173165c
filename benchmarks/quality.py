"""``quality`` levels against lossless, side by side in one process (issue 37, items 3-6): FLUX.1-dev and
FLUX.1-schnell on the tiny models, one thread, 28 steps at 64x64 (schnell: its folder's limit, 16).

For each workflow, four requests stepped together as an instance's batcher steps them, per level:
  * denoise requests/s, and the ratio to lossless measured in the same run (the goal: high at least 1.5x);
  * the share of transformer calls skipped (predicted by TaylorSeer instead);
  * the difference to lossless of each request's decoded pixels: PSNR (dB) and the largest pixel difference;
  * a mixed batch (lossless, extra-high, high, high) against four lossless;
  * the cost of the cache where nothing is skipped: a cache whose warm-up spans every step (it computes and
    updates its factors at each) against lossless (the goal: at most 10%).

    python benchmarks/quality.py [--models DIR] [--reps 3] [--json]

On random tiny weights the differences show the mechanics (what is skipped and how far the prediction
lands), not the visual quality, which needs real weights on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

WORKFLOWS = ("flux.1-dev", "flux.1-schnell")
STEPS = 28


def _run(den: Any, embeds: list[Any], reqs: list[dict[str, Any]], reps: int) -> tuple[float, list[Any], list[Any]]:
    """(requests/s, the denoised latents, the caches) of ``reqs`` stepped together, median of ``reps``."""
    times, outs, caches = [], [], []
    for _ in range(reps):
        states = [den.begin(e, r) for e, r in zip(embeds, reqs, strict=True)]
        t0 = time.perf_counter()
        active = list(states)
        while active:
            den.step(active)
            active = [s for s in active if den.progress(s)[0] < len(s.timesteps)]
        times.append(time.perf_counter() - t0)
        outs = [den.end(s)["denoised"] for s in states]
        caches = [s.cache for s in states]
    return len(reqs) / statistics.median(times), outs, caches


def _pixels(runner: Any, params: dict[str, Any], latents: Any) -> Any:
    from engine.stages.base import StageContext

    return runner.executors["vae_decode"].run({"denoised": latents}, params, StageContext())["pixels"]


def _psnr(a: Any, b: Any) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def measure(workflow: str, folder: str, reps: int) -> dict[str, Any]:
    from dataclasses import replace

    from engine.stages import caching
    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(folder))
    runner = LocalRunner(workflow, folder, "cpu")
    den = runner.executors["denoise"]
    steps = min(STEPS, int(spec.param("num_inference_steps").maximum or STEPS))  # schnell's folder allows 16

    def reqs(levels: list[str]) -> list[dict[str, Any]]:
        return [spec.resolve_params({"prompt": f"a photo of thing {i}", "height": 64, "width": 64,
                                     "num_inference_steps": steps, "seed": 50 + i, "quality": q})
                for i, q in enumerate(levels)]

    base = reqs(["lossless"] * 4)
    embeds = [runner.executors["text_encode"].run({}, r, StageContext()) for r in base]
    out: dict[str, Any] = {"steps": steps, "batch": 4, "levels": {}}
    lossless_rps, lossless_out, _ = _run(den, embeds, base, reps)
    lossless_px = [_pixels(runner, r, x) for r, x in zip(base, lossless_out, strict=True)]
    out["levels"]["lossless"] = {"rps": lossless_rps, "x_lossless": 1.0, "skipped_share": 0.0}
    for q in ("extra-high", "high"):
        rs = reqs([q] * 4)
        rps, latents, caches = _run(den, embeds, rs, reps)
        px = [_pixels(runner, r, x) for r, x in zip(rs, latents, strict=True)]
        s = caching.settings(workflow, q)
        out["levels"][q] = {
            "method": f"TaylorSeer lite (interval {s.cache_interval}, {s.disable_cache_before_step} full steps "
                      f"first, order {s.max_order})" if s else "",
            "rps": rps, "x_lossless": rps / lossless_rps,
            "skipped_share": statistics.mean(c.skipped_share() for c in caches),
            "psnr_db_vs_lossless": min(_psnr(a, b) for a, b in zip(px, lossless_px, strict=True)),
            "max_pixel_diff_vs_lossless": max(int((a.int() - b.int()).abs().max()) for a, b in
                                              zip(px, lossless_px, strict=True))}
    mixed_rps, _, _ = _run(den, embeds, reqs(["lossless", "extra-high", "high", "high"]), reps)
    out["mixed_batch"] = {"levels": ["lossless", "extra-high", "high", "high"], "rps": mixed_rps,
                          "x_lossless": mixed_rps / lossless_rps}
    # the cache's bookkeeping where nothing is skipped: warm-up over every step (computes and updates each)
    never = replace(caching.LEVELS[workflow]["high"], disable_cache_before_step=steps + 1)
    saved = caching.LEVELS[workflow]
    caching.LEVELS[workflow] = {**saved, "high": never}
    try:
        check_rps, _, caches = _run(den, embeds, reqs(["high"] * 4), reps)
    finally:
        caching.LEVELS[workflow] = saved
    assert all(c.predicted == 0 for c in caches)
    out["cache_check_cost"] = {"rps": check_rps, "overhead": lossless_rps / check_rps - 1.0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="a folder of tiny models (default: built here)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from engine.bench.figures import provenance
    from engine.stages.tiny import models_or_tiny

    prov = provenance()  # before the models load: the load average is the host's own
    commit, cpu, load = (prov["commit"] or "")[:7], prov["cpu_model"], prov["load_average"]
    with models_or_tiny(args.models, list(WORKFLOWS)) as models:
        result = {"commit": commit, "cpu": cpu, "threads": 1, "load_average_before": load, "provenance": prov,
                  "workflows": {w: measure(w, f"{models}/{w}", args.reps) for w in WORKFLOWS}}
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"cpu: {cpu}, commit {commit}, load before {load[0]:.2f}, 1 thread, batch of 4")
    for w, r in result["workflows"].items():
        for q, row in r["levels"].items():
            extra = "" if q == "lossless" else (f", skipped {row['skipped_share']:.0%}, PSNR vs lossless "
                                                f"{row['psnr_db_vs_lossless']:.1f} dB, max pixel diff "
                                                f"{row['max_pixel_diff_vs_lossless']}")
            print(f"{w:15} {r['steps']} steps {q:10}: {row['rps']:6.2f} rps ({row['x_lossless']:.2f}x lossless){extra}")
        print(f"{w:15} mixed     : {r['mixed_batch']['rps']:6.2f} rps ({r['mixed_batch']['x_lossless']:.2f}x); "
              f"cache with nothing skipped: {r['cache_check_cost']['overhead']:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
