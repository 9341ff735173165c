"""Light-stage batching (issue 37, item 2): the text_encode stages of sd-t2i (CLIP), FLUX.1-dev (CLIP and
T5), Qwen-Image (Qwen2.5-VL) and Wan2.1 (umT5) serving requests one call each against several in one call (engine.stages.base.BatchedCallStage), side
by side in one process, one torch thread; beside each the one-call pipeline's own ``encode_prompt`` alone
and batched (the gain the model allows).

Rounds interleave every configuration (after one untimed round); each figure is the median over the rounds.
Each batched item is checked equal to its solo run before anything is timed.

    python benchmarks/light_batching.py [--models DIR] [--rounds 7] [--batches 2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

WORKFLOWS = ("sd-t2i", "flux.1-dev", "qwen-image", "wan2.1-t2v")


def _pipeline_encode(workflow: str, folder: str) -> Any:
    """The one-call pipeline's encode_prompt over a list of prompts, as its __call__ runs it."""
    from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusionPipeline, WanPipeline

    if workflow == "sd-t2i":
        sd = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
        return lambda prompts, r: sd.encode_prompt(prompts, "cpu", 1, True, [""] * len(prompts))
    if workflow.startswith("wan"):
        wan = WanPipeline.from_pretrained(folder, transformer=None, vae=None)
        return lambda prompts, r: wan.encode_prompt(prompts, [""] * len(prompts), True, device="cpu",
                                                    max_sequence_length=int(r["max_sequence_length"]))
    if workflow == "qwen-image":  # its __call__ encodes the prompt (and a negative one only where it guides)
        qwen = QwenImagePipeline.from_pretrained(folder, transformer=None, vae=None)

        def both(prompts: list[str], r: dict[str, Any]) -> Any:
            for texts in (prompts, [""] * len(prompts)):
                qwen.encode_prompt(texts, device="cpu", max_sequence_length=int(r["max_sequence_length"]))
        return both
    flux = FluxPipeline.from_pretrained(folder, transformer=None, vae=None)
    return lambda prompts, r: flux.encode_prompt(prompts, None, device="cpu",
                                                 max_sequence_length=int(r["max_sequence_length"]))


def measure(workflow: str, folder: str, rounds: int, batches: list[int]) -> dict[str, Any]:
    import torch

    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    enc = LocalRunner(workflow, folder, "cpu").executors["text_encode"]
    encode = _pipeline_encode(workflow, folder)
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(folder))
    n = max(batches)
    size = {"height": 32, "width": 32, "num_frames": 5} if workflow.startswith("wan") else {"height": 64, "width": 64}
    by_key: dict[Any, list[dict[str, Any]]] = {}
    for i in range(64 * n):  # n prompts of one batch key (Qwen-Image's: one token count)
        r = spec.resolve_params({"prompt": f"a photo of thing {i} on a table", **size, "num_inference_steps": 2})
        by_key.setdefault(enc.batch_key(r), []).append(r)
        if len(by_key[enc.batch_key(r)]) == n:
            break
    reqs = max(by_key.values(), key=len)
    if len(reqs) < n:
        raise SystemExit(f"{workflow}: found no {n} prompts of one batch key")
    solo = [enc.run({}, r, StageContext()) for r in reqs]

    def stage(b: int) -> None:  # n requests in calls of b
        for k in range(0, n, b):
            states = [enc.begin({}, r) for r in reqs[k:k + b]]
            enc.step(states)
            outs = [enc.end(s) for s in states]
            if b > 1 and not all(torch.equal(o["prompt_embeds"], solo[k + j]["prompt_embeds"])
                                 for j, o in enumerate(outs)):
                raise SystemExit(f"a batched item differs from its solo run at batch {b}")

    def pipeline(b: int) -> None:
        with torch.no_grad():
            for k in range(0, n, b):
                encode([r["prompt"] for r in reqs[k:k + b]], reqs[0])

    configs = {f"stage b={b}": (stage, b) for b in [1, *batches]}
    configs.update({f"pipeline b={b}": (pipeline, b) for b in [1, *batches]})
    times: dict[str, list[float]] = {k: [] for k in configs}
    for rnd in range(rounds + 1):
        for name, (fn, b) in configs.items():
            t0 = time.perf_counter()
            fn(b)
            if rnd:
                times[name].append(time.perf_counter() - t0)
    rps = {k: n / statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"workflow": workflow, "stage": "text_encode", "requests_per_round": n, "rounds": rounds,
                           "rps": rps, "stage_gain": {}, "pipeline_gain": {}, "stage_gain_vs_pipeline_gain": {}}
    for b in batches:
        sg, pg = rps[f"stage b={b}"] / rps["stage b=1"], rps[f"pipeline b={b}"] / rps["pipeline b=1"]
        out["stage_gain"][str(b)], out["pipeline_gain"][str(b)] = sg, pg
        out["stage_gain_vs_pipeline_gain"][str(b)] = sg / pg
    out["stage_vs_pipeline_alone"] = rps["stage b=1"] / rps["pipeline b=1"]
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="a folder of tiny models (default: built here)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", type=_ints, default=[2, 4, 8])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from engine.bench.figures import one_thread_provenance
    from engine.stages.tiny import models_or_tiny

    prov = one_thread_provenance()  # one torch thread; taken before the models load
    with models_or_tiny(args.models, list(WORKFLOWS)) as models:
        result: dict[str, Any] = {"provenance": prov, "threads": 1,
                                  "workflows": {w: measure(w, f"{models}/{w}", args.rounds, args.batches)
                                                for w in WORKFLOWS}}
    result["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"cpu: {prov['cpu_model']}, commit {(prov['commit'] or '')[:7]}, load before {prov['load_average'][0]:.2f}, "
          "1 thread")
    for w, r in result["workflows"].items():
        print(f"{w} text_encode, {r['requests_per_round']} requests a round; alone: the stage "
              f"{r['rps']['stage b=1']:.1f} requests/s, the pipeline's encode_prompt {r['rps']['pipeline b=1']:.1f} "
              f"({r['stage_vs_pipeline_alone']:.2f}x)")
        for b in args.batches:
            print(f"  batch {b}: stage {r['stage_gain'][str(b)]:.2f}x its solo rate, pipeline "
                  f"{r['pipeline_gain'][str(b)]:.2f}x its own: {r['stage_gain_vs_pipeline_gain'][str(b)]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
