"""Step-level batching of the Wan2.2 denoise stages (issue 37, "every stage batches"): the A14B experts
(``denoise_high``, ``denoise_low``) and the 5B model's ``denoise``, against the same requests one at a time, on
the tiny models, one thread.

For each stage and batch size N (1, 2, 4, 8), in this process, alternating the two sides round by round on
the same N requests (other seeds and prompts, the same step count), each side first every other round:
  * batched: the N requests begun on the stage and stepped together (engine.worker.batching's call); every
    item's outputs are checked byte for byte against the same request's ``run``;
  * one at a time: each of the N requests through the stage's ``run`` in turn (what an instance with
    ``max_batch`` 1 does).
The figure is the ratio of their requests/s (``batched_vs_one_at_a_time``), medians of ``--reps`` rounds.
The low expert's inputs are its high expert's outputs (each request run alone first).

    python benchmarks/wan22_batching.py [--models DIR] [--reps 5] [--steps 8] [--size 32] [--json]

Without ``--models``, the tiny models are built in a temporary folder first. On random tiny weights the
figures show the mechanics (what batching saves of each call's fixed cost), not a real model's gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

STAGES = (("wan2.2-t2v-a14b", "denoise_high"), ("wan2.2-t2v-a14b", "denoise_low"), ("wan2.2-ti2v-5b", "denoise"))
SIZES = (1, 2, 4, 8)


def _requests(workflow: str, folder: str, n: int, steps: int, size: int) -> list[dict[str, Any]]:
    from engine.workflow import get_workflow

    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(folder))
    return [spec.resolve_params({"prompt": f"a video of thing {i}", "height": size, "width": size,
                                 "num_frames": 5, "num_inference_steps": steps, "seed": 100 + i})
            for i in range(n)]


def _inputs(runner: Any, params: dict[str, Any], stage: str) -> dict[str, Any]:
    """What ``stage`` receives (text only for the 5B: an empty first frame), each stage before it run alone."""
    from engine.stages.base import StageContext

    values: dict[str, Any] = {"image": b""} if runner.spec.image_inputs() else {}
    route = runner.spec.route()
    for before in route[:route.index(stage)]:
        values.update(runner.executors[before].run(values, params, StageContext()))
    return values


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _batched(ex: Any, inputs: list[dict[str, Any]], reqs: list[dict[str, Any]]) -> tuple[float, list[Any]]:
    """(seconds, outputs) of the requests begun together and stepped together to their ends."""
    t0 = time.perf_counter()
    states = [ex.begin(e, r) for e, r in zip(inputs, reqs, strict=True)]
    while any(ex.progress(s)[0] < ex.progress(s)[1] for s in states):
        ex.step(states)
    ends = [ex.end(s) for s in states]
    return time.perf_counter() - t0, ends


def _one_at_a_time(ex: Any, inputs: list[dict[str, Any]], reqs: list[dict[str, Any]]) -> float:
    """Seconds of the requests through ``run`` one after the other."""
    from engine.stages.base import StageContext

    t0 = time.perf_counter()
    for e, r in zip(inputs, reqs, strict=True):
        ex.run(e, r, StageContext())
    return time.perf_counter() - t0


def measure(workflow: str, stage: str, folder: str, steps: int, size: int, reps: int) -> dict[str, Any]:
    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner

    runner = LocalRunner(workflow, folder, "cpu")
    ex = runner.executors[stage]
    out: dict[str, Any] = {"steps": steps, "size": f"{size}x{size}x5", "sizes": {}}
    for n in SIZES:
        reqs = _requests(workflow, folder, n, steps, size)
        inputs = [_inputs(runner, r, stage) for r in reqs]
        solo = [ex.run(e, r, StageContext()) for e, r in zip(inputs, reqs, strict=True)]
        batched_t: list[float] = []
        alone_t: list[float] = []
        equal = True
        for rep in range(reps):  # interleaved, each side first every other round
            for side in ("batched", "alone") if rep % 2 == 0 else ("alone", "batched"):
                if side == "alone":
                    alone_t.append(_one_at_a_time(ex, inputs, reqs))
                    continue
                seconds, ends = _batched(ex, inputs, reqs)
                batched_t.append(seconds)
                equal &= all(_same(a, b) for a, b in zip(ends, solo, strict=True))
        b, a = statistics.median(batched_t), statistics.median(alone_t)
        out["sizes"][n] = {"batched_rps": n / b, "one_at_a_time_rps": n / a, "batched_vs_one_at_a_time": a / b,
                           "items_equal_solo": bool(equal)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="a folder of tiny models (default: built here)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=32, help="height and width (5 frames)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from engine.bench.figures import one_thread_provenance
    from engine.stages.tiny import models_or_tiny

    prov = one_thread_provenance()  # one torch thread; taken before the models load
    commit, load = (prov["commit"] or "")[:7], prov["load_average"]
    with models_or_tiny(args.models, sorted({w for w, _ in STAGES})) as models:
        stages = {f"{w} {s}": measure(w, s, f"{models}/{w}", args.steps, args.size, args.reps) for w, s in STAGES}
    result = {"commit": commit, "cpu": prov["cpu_model"], "threads": 1, "load_average_before": load,
              "load_average_after": list(os.getloadavg()), "provenance": prov, "stages": stages}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"cpu: {result['cpu']}, commit {commit}, load before {load[0]:.2f}, after "
          f"{result['load_average_after'][0]:.2f}, 1 thread")
    for name, r in stages.items():
        for n, row in r["sizes"].items():
            print(f"{name:30} {r['size']} {r['steps']} steps, batch {n}: {row['batched_rps']:6.2f} rps batched, "
                  f"{row['one_at_a_time_rps']:6.2f} one at a time: {row['batched_vs_one_at_a_time']:.2f}x, "
                  f"items equal solo: {row['items_equal_solo']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
