"""``quality`` levels against lossless, side by side in one process (issue 37, items 3-6): FLUX.1-dev,
FLUX.1-schnell and Qwen-Image (one pass, and true CFG: a negative prompt, two passes each with its own
cache) on the tiny models, one thread, 28 steps at 64x64 (schnell: its folder's limit, 16).

For each case, four requests through the denoise stage as an instance serves them (stepped together where
the stage steps; Wan2.1's one after another), per level, the configurations interleaved round by round:
  * denoise requests/s, and the ratio to lossless measured in the same run (the goal: high at least 1.5x);
  * the share of transformer calls skipped (predicted by TaylorSeer instead);
  * the difference to lossless of each request's decoded pixels: PSNR (dB) and the largest pixel difference;
  * a mixed batch (lossless, extra-high, high, high) against four lossless;
  * the cost of the cache where nothing is skipped: a cache whose warm-up spans every step (it computes and
    updates its factors at each) against lossless (the goal: at most 10%).

    python benchmarks/quality.py [--models DIR] [--reps 3] [--case NAME ...] [--json]

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

#: case -> (workflow, the params every request of it adds)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "flux.1-dev": ("flux.1-dev", {}),
    "flux.1-schnell": ("flux.1-schnell", {}),
    "qwen-image": ("qwen-image", {}),
    "qwen-image, true CFG": ("qwen-image", {"negative_prompt": "blurry"}),
    "wan2.1-t2v": ("wan2.1-t2v", {"height": 32, "width": 32, "num_frames": 5}),  # guided: two passes
}
STEPS = 28
SIZE = {"height": 64, "width": 64}


def _run(den: Any, embeds: list[Any], reqs: list[dict[str, Any]]) -> tuple[float, list[Any], list[Any]]:
    """(seconds, the denoised latents, the caches) of ``reqs`` through the denoise stage as an instance serves
    them: stepped together where the stage steps (engine.worker.batching), else one after another."""
    from engine.stages.base import StageContext
    from engine.workflow.options import Options

    if not hasattr(den, "step"):  # Wan2.1: a request at a time, its caches made by the stage
        made: list[Any] = []
        make = den._cache
        den._cache = lambda p: made.append(make(p)) or made[-1]
        try:
            t0 = time.perf_counter()
            outs = [den.run(e, p, StageContext(options=o))["denoised"]
                    for e, (p, o) in zip(embeds, map(Options.split, reqs), strict=True)]
            return time.perf_counter() - t0, outs, made
        finally:
            del den._cache
    states = [den.begin(e, *Options.split(r)) for e, r in zip(embeds, reqs, strict=True)]  # params, options
    t0 = time.perf_counter()
    active = list(states)
    while active:
        den.step(active)
        active = [s for s in active if den.progress(s)[0] < len(s.timesteps)]
    took = time.perf_counter() - t0
    return took, [den.end(s)["denoised"] for s in states], [s.cache for s in states]


def _pixels(runner: Any, params: dict[str, Any], latents: Any) -> Any:
    from engine.stages.base import StageContext

    out = runner.executors["vae_decode"].run({"denoised": latents}, params, StageContext())
    return out.get("pixels", out.get("frames"))


def _psnr(a: Any, b: Any) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def measure(workflow: str, folder: str, reps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of one case, interleaved: each round runs lossless, extra-high, high, the mixed
    batch and the no-skip cache once in turn (after one untimed round), so that drift on the host falls on
    all of them alike; each figure is the median over ``reps`` rounds."""
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
        return [spec.resolve_params({"prompt": f"a photo of thing {i}", **SIZE, "num_inference_steps": steps,
                                     "seed": 50 + i, "quality": q, **extra})
                for i, q in enumerate(levels)]

    base = reqs(["lossless"] * 4)
    embeds = [runner.executors["text_encode"].run({}, r, StageContext()) for r in base]
    # the cache's bookkeeping where nothing is skipped: a "high" whose warm-up spans every step (it computes
    # and updates its factors at each), through the operator's override
    never = {workflow: {"high": {"disable_cache_before_step": steps + 1}}}
    configs = {"lossless": base, "extra-high": reqs(["extra-high"] * 4), "high": reqs(["high"] * 4),
               "mixed": reqs(["lossless", "extra-high", "high", "high"]), "check": reqs(["high"] * 4)}
    times: dict[str, list[float]] = {k: [] for k in configs}
    results: dict[str, tuple[list[Any], list[Any]]] = {}
    for rnd in range(reps + 1):
        for name, rs in configs.items():
            if name == "check":
                os.environ["ONEPIECE_QUALITY_MAP"] = json.dumps(never)
            try:
                took, latents, caches = _run(den, embeds, rs)
            finally:
                os.environ.pop("ONEPIECE_QUALITY_MAP", None)
            if rnd:
                times[name].append(took)
            results[name] = latents, caches
    rps = {k: 4 / statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"workflow": workflow, "params": extra, "steps": steps, "batch": 4,
                           "served": "stepped together" if hasattr(den, "step") else "one after another",
                           "levels": {}}
    lossless_px = [_pixels(runner, r, x) for r, x in zip(base, results["lossless"][0], strict=True)]
    out["levels"]["lossless"] = {"rps": rps["lossless"], "x_lossless": 1.0, "skipped_share": 0.0}
    for q in ("extra-high", "high"):
        latents, caches = results[q]
        px = [_pixels(runner, r, x) for r, x in zip(configs[q], latents, strict=True)]
        s = caching.settings(workflow, q)
        out["levels"][q] = {
            "method": f"TaylorSeer lite (interval {s.cache_interval}, {s.disable_cache_before_step} full steps "
                      f"first, order {s.max_order})" if s else "",
            "rps": rps[q], "x_lossless": rps[q] / rps["lossless"],
            "skipped_share": statistics.mean(c.skipped_share() for c in caches),
            "psnr_db_vs_lossless": min(_psnr(a, b) for a, b in zip(px, lossless_px, strict=True)),
            "max_pixel_diff_vs_lossless": max(int((a.int() - b.int()).abs().max()) for a, b in
                                              zip(px, lossless_px, strict=True))}
    out["mixed_batch"] = {"levels": ["lossless", "extra-high", "high", "high"], "rps": rps["mixed"],
                          "x_lossless": rps["mixed"] / rps["lossless"]}
    assert all(c.predicted == 0 and c.computed > 0 for c in results["check"][1])
    out["cache_check_cost"] = {"rps": rps["check"], "overhead": rps["lossless"] / rps["check"] - 1.0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="a folder of tiny models (default: built here)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--case", action="append", choices=sorted(CASES), help="measure only these (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cases = args.case or list(CASES)
    from engine.bench.figures import one_thread_provenance
    from engine.stages.tiny import models_or_tiny

    prov = one_thread_provenance()  # one torch thread; taken before the models load
    commit, cpu, load = (prov["commit"] or "")[:7], prov["cpu_model"], prov["load_average"]
    with models_or_tiny(args.models, sorted({CASES[c][0] for c in cases})) as models:
        result = {"commit": commit, "cpu": cpu, "threads": 1, "load_average_before": load, "provenance": prov,
                  "workflows": {c: measure(CASES[c][0], f"{models}/{CASES[c][0]}", args.reps, CASES[c][1])
                                for c in cases}}
    result["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"cpu: {cpu}, commit {commit}, load before {load[0]:.2f}, 1 thread, batch of 4")
    for w, r in result["workflows"].items():
        for q, row in r["levels"].items():
            extra = "" if q == "lossless" else (f", skipped {row['skipped_share']:.0%}, PSNR vs lossless "
                                                f"{row['psnr_db_vs_lossless']:.1f} dB, max pixel diff "
                                                f"{row['max_pixel_diff_vs_lossless']}")
            print(f"{w:21} {r['steps']} steps {q:10}: {row['rps']:6.2f} rps ({row['x_lossless']:.2f}x lossless){extra}")
        print(f"{w:21} mixed     : {r['mixed_batch']['rps']:6.2f} rps ({r['mixed_batch']['x_lossless']:.2f}x); "
              f"cache with nothing skipped: {r['cache_check_cost']['overhead']:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
