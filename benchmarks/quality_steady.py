"""``quality`` in the denoise stage as a saturated deployment feeds it (issue 37, the end-to-end figures'
cause): requests join a running stepped batch one at a time as others finish, so the items' step indices,
and with them their skip schedules, are out of phase; benchmarks/quality.py starts its four requests
together, so all of them skip the same steps.

For a workflow whose denoise steps (FLUX.1, Qwen-Image, Wan2.1), on its tiny model at bench e2e's size
(64x64; Wan2.1 32x32 with 5 frames), one thread: a batch
of up to 4 requests kept full, at most one joining per step (so the items stay one or more steps apart, as
arrivals spread over time leave them; a finished request is replaced at the next step), until
``--requests`` have finished, all lossless and all high, interleaved over ``--reps`` rounds; and the same
requests four at a time in phase (quality.py's way). Per configuration: requests/s, the ratio to lossless,
and the share of steps on which the transformer ran at all (some item computed).

    python benchmarks/quality_steady.py [--models DIR] [--workflow W ...] [--requests 16] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine.bench.figures import provenance
from engine.workflow.options import Options

STEPS = 28
BATCH = 4
#: each workflow's request size: bench e2e's (images 64x64; Wan2.1 32x32 with 5 frames, guided)
SIZES = {"wan2.1-t2v": {"height": 32, "width": 32, "num_frames": 5}}


def _steady(den: Any, embeds: list[Any], reqs: list[dict[str, Any]]) -> tuple[float, float]:
    """(seconds, share of steps that ran the transformer) for ``reqs`` through ``den`` with at most
    :data:`BATCH` in the batch, one request joining per step while there is room."""
    pending = list(zip(embeds, reqs, strict=True))
    active: list[Any] = []
    steps = transformer_steps = 0
    t0 = time.perf_counter()
    while pending or active:
        if pending and len(active) < BATCH:  # one join per step: the items' step indices stay apart
            e, r = pending.pop(0)
            active.append(den.begin(e, *Options.split(r)))  # its model parameters, its options
        computed = [s.cache.computed if s.cache is not None else 0 for s in active]
        den.step(active)
        steps += 1
        transformer_steps += any(s.cache is None or s.cache.computed > c for s, c in zip(active, computed,
                                                                                       strict=True))
        for s in [s for s in active if den.progress(s)[0] >= len(s.timesteps)]:
            den.end(s)
            active.remove(s)
    return time.perf_counter() - t0, transformer_steps / steps


def _in_phase(den: Any, embeds: list[Any], reqs: list[dict[str, Any]]) -> float:
    """Seconds for ``reqs`` :data:`BATCH` at a time, each batch begun together (benchmarks/quality.py's way)."""
    t0 = time.perf_counter()
    for k in range(0, len(reqs), BATCH):
        states = [den.begin(e, *Options.split(r)) for e, r in zip(embeds[k:k + BATCH], reqs[k:k + BATCH],
                                                                   strict=True)]
        while states:
            den.step(states)
            for s in [s for s in states if den.progress(s)[0] >= len(s.timesteps)]:
                den.end(s)
                states.remove(s)
    return time.perf_counter() - t0


def measure(workflow: str, folder: str, n: int, reps: int) -> dict[str, Any]:
    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(folder))
    runner = LocalRunner(workflow, folder, "cpu")
    den = runner.executors["denoise"]
    steps = min(STEPS, int(spec.param("num_inference_steps").maximum or STEPS))

    def reqs(level: str) -> list[dict[str, Any]]:
        size = SIZES.get(workflow, {"height": 64, "width": 64})
        return [spec.resolve_params({"prompt": f"a photo of thing {i}", **size,
                                     "num_inference_steps": steps, "seed": 50 + i, "quality": level})
                for i in range(n)]

    embeds = [runner.executors["text_encode"].run({}, r, StageContext()) for r in reqs("lossless")]
    runs: dict[str, list[float]] = {k: [] for k in ("steady lossless", "steady high", "in phase lossless",
                                                    "in phase high")}
    share: dict[str, float] = {}
    for rnd in range(reps + 1):  # the first round untimed
        for level in ("lossless", "high"):
            took, share[level] = _steady(den, embeds, reqs(level))
            if rnd:
                runs[f"steady {level}"].append(took)
            took = _in_phase(den, embeds, reqs(level))
            if rnd:
                runs[f"in phase {level}"].append(took)
    rps = {k: n / statistics.median(v) for k, v in runs.items()}
    return {"workflow": workflow, "steps": steps, "batch": BATCH, "requests": n, "reps": reps, "rps": rps,
            "steady_high_x_lossless": rps["steady high"] / rps["steady lossless"],
            "in_phase_high_x_lossless": rps["in phase high"] / rps["in phase lossless"],
            "steady_transformer_step_share": share}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="tiny model folders (default: built in a temporary folder)")
    p.add_argument("--workflow", action="append", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1)
    before = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        from engine.stages.tiny import make_tiny

        wfs = a.workflow or ["flux.1-dev", "flux.1-schnell", "qwen-image", "wan2.1-t2v"]
        folders = {w: f"{a.models}/{w}" if a.models else make_tiny(f"{tmp}/{w}", w)[w] for w in wfs}
        out = [measure(w, str(folders[w]), a.requests, a.reps) for w in wfs]
    from engine.bench.harness import with_load_after

    doc = {"cases": out, "provenance": with_load_after(before)}
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0
    for r in out:
        print(f"{r['workflow']:15} {r['steps']} steps: steady high {r['steady_high_x_lossless']:.2f}x, in phase "
              f"{r['in_phase_high_x_lossless']:.2f}x; transformer ran on {r['steady_transformer_step_share']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
