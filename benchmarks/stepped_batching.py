"""Step-level batching of a modular denoise stage against the one-call pipeline batched at the same sizes
(issue 37, item 1): FLUX.1-schnell, FLUX.1-dev and Qwen-Image (its default request: no negative prompt,
one pass a step) on the tiny models, one thread.

For each workflow and batch size N (1, 2, 4, 8), in this process, alternating the two sides rep by rep:
  * stepped: N requests begun on the denoise stage and stepped together (engine.worker.batching's call),
    each with its own seed, timesteps and scheduler; every item's latents are checked byte for byte against
    the same request run alone;
  * pipeline: ``FluxPipeline`` (``QwenImagePipeline``) called once with N images' embeddings (given, so it runs
    the same work: noise, timesteps, the transformer loop; ``output_type="latent"``, no VAE).
The gain of each side is its requests/s at N over its own requests/s at 1; the figure the issue sets a goal
on is ``stepped gain / pipeline gain`` at 4 (goal: at least 0.9); ``stepped_vs_pipeline_rps`` is the absolute
ratio at each size (the stepped solo run skips some of the pipeline's per-call work, which lowers its gain
ratio while it serves as many requests). Medians of ``--reps`` timings.

    python benchmarks/stepped_batching.py [--models DIR] [--reps 5] [--json]

Without ``--models``, the tiny models are built in a temporary folder first. On random tiny weights the
figures show the mechanics (what batching saves of each call's fixed cost), not a real model's gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

WORKFLOWS = ("flux.1-schnell", "flux.1-dev", "qwen-image")
PIPELINES = {"flux.1-schnell": "FluxPipeline", "flux.1-dev": "FluxPipeline", "qwen-image": "QwenImagePipeline"}
SIZES = (1, 2, 4, 8)


def _requests(spec: Any, n: int, steps: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        p = {"prompt": f"a photo of thing {i}", "height": 64, "width": 64, "num_inference_steps": steps,
             "seed": 100 + i}
        if "guidance_scale" in {q.name for q in spec.params}:
            p["guidance_scale"] = 3.5
        out.append(spec.resolve_params(p))
    return out


def measure(workflow: str, folder: str, steps: int, reps: int) -> dict[str, Any]:
    import diffusers
    import torch

    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(folder))
    runner = LocalRunner(workflow, folder, "cpu")
    den = runner.executors["denoise"]
    pipe = getattr(diffusers, PIPELINES[workflow]).from_pretrained(folder)
    out: dict[str, Any] = {"steps": steps, "sizes": {}}
    for n in SIZES:
        reqs = _requests(spec, n, steps)
        embeds = [runner.executors["text_encode"].run({}, r, StageContext()) for r in reqs]
        solo = [den.run(e, r, StageContext())["denoised"] for e, r in zip(embeds, reqs, strict=True)]
        stepped_t, pipe_t, equal = [], [], True
        for _ in range(reps):
            states = [den.begin(e, r) for e, r in zip(embeds, reqs, strict=True)]
            t0 = time.perf_counter()
            while den.progress(states[0])[0] < steps:
                den.step(states)
            stepped_t.append(time.perf_counter() - t0)
            equal &= all(torch.equal(den.end(st)["denoised"], s) for st, s in zip(states, solo, strict=True))
            kwargs = {name: torch.cat([e[name] for e in embeds])
                      for name in ("prompt_embeds", "pooled_prompt_embeds", "prompt_embeds_mask") if name in embeds[0]}
            kwargs.update(height=64, width=64, num_inference_steps=steps, output_type="latent",
                          generator=[torch.Generator().manual_seed(int(r["seed"])) for r in reqs])
            if "guidance_scale" in reqs[0]:
                kwargs["guidance_scale"] = float(reqs[0]["guidance_scale"])
            t0 = time.perf_counter()
            with torch.no_grad():
                pipe(**kwargs)
            pipe_t.append(time.perf_counter() - t0)
        out["sizes"][n] = {"stepped_rps": n / statistics.median(stepped_t),
                           "pipeline_rps": n / statistics.median(pipe_t), "items_equal_solo": bool(equal)}
    one = out["sizes"][1]
    for row in out["sizes"].values():
        row["stepped_gain"] = row["stepped_rps"] / one["stepped_rps"]
        row["pipeline_gain"] = row["pipeline_rps"] / one["pipeline_rps"]
        row["gain_ratio"] = row["stepped_gain"] / row["pipeline_gain"]
        row["stepped_vs_pipeline_rps"] = row["stepped_rps"] / row["pipeline_rps"]  # absolute, same size
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="a folder of tiny models (default: built here)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from engine.bench.figures import one_thread_provenance
    from engine.stages.tiny import models_or_tiny

    prov = one_thread_provenance()  # one torch thread; taken before the models load
    commit, load = (prov["commit"] or "")[:7], prov["load_average"]
    with models_or_tiny(args.models, list(WORKFLOWS)) as models:
        result = {"commit": commit, "cpu": prov["cpu_model"], "threads": 1, "load_average_before": load,
                  "provenance": prov,
                  "workflows": {w: measure(w, f"{models}/{w}", args.steps, args.reps) for w in WORKFLOWS}}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"cpu: {result['cpu']}, commit {commit}, load before {load[0]:.2f}, 1 thread")
    for w, r in result["workflows"].items():
        for n, row in r["sizes"].items():
            print(f"{w:15} batch {n}: stepped {row['stepped_rps']:6.2f} rps (gain {row['stepped_gain']:.2f}x), "
                  f"pipeline {row['pipeline_rps']:6.2f} rps (gain {row['pipeline_gain']:.2f}x), "
                  f"gain ratio {row['gain_ratio']:.2f}, stepped/pipeline rps {row['stepped_vs_pipeline_rps']:.2f}, "
                  f"items equal solo: {row['items_equal_solo']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
