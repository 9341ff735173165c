"""``onepiece bench rebalance``: allocation decisions at cluster scale, by simulation.

Stage times come from the workflow's own cost model (engine/workflow/specs) for
two request mixes; the Node Manager's allocator sizes the stages for each mix
on the same device budget; the discrete-event simulation then runs the second
mix on the first mix's allocation (static) and on its own (rebalanced). Also
times the allocator's decision at 1,000 devices. Figures are ratios within the
run; absolute stage times are the cost model's estimates, not measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine.manager.allocator import StageProfile, for_budget
from engine.manager.simulate import simulate

MIXES = {
    "distilled-4-steps": {"num_frames": 81, "num_inference_steps": 4},
    "full-30-steps": {"num_frames": 81, "num_inference_steps": 30},
}


def profile(workflow: str, params: dict[str, Any]) -> list[StageProfile]:
    from engine.workflow import get_workflow

    wf = get_workflow(workflow)
    p = wf.resolve_params({"prompt": "benchmark", "height": 480, "width": 832, **params})
    return [StageProfile(stage, max(seconds, 1e-3)) for stage, seconds in wf.estimate_cost(p).items()]


def run(devices: int, requests: int, workflow: str = "wan2.1-i2v") -> dict[str, Any]:
    (name_a, mix_a), (name_b, mix_b) = MIXES.items()
    prof_a, prof_b = profile(workflow, mix_a), profile(workflow, mix_b)
    alloc_a, alloc_b = for_budget(prof_a, devices), for_budget(prof_b, devices)
    times_b = {p.name: p.seconds for p in prof_b}
    stages = [p.name for p in prof_b]
    burst = [0.0] * requests  # saturating load: throughput is the allocation's capacity
    static = simulate(stages, alloc_a.instances, lambda s, i: times_b[s], burst)
    rebalanced = simulate(stages, alloc_b.instances, lambda s, i: times_b[s], burst)
    decide = []
    big = profile(workflow, mix_b)
    for _ in range(20):
        t0 = time.perf_counter()
        for_budget(big, 1000)
        decide.append(time.perf_counter() - t0)
    return {
        "devices": devices,
        "mix_before": name_a, "mix_after": name_b,
        "allocation_before": alloc_a.instances, "allocation_after": alloc_b.instances,
        "throughput_static_rps": static.throughput, "throughput_rebalanced_rps": rebalanced.throughput,
        "rebalanced_vs_static": rebalanced.throughput / static.throughput,
        "predicted_rebalanced_rps": alloc_b.throughput,
        "decision_ms_at_1000_devices_p50": statistics.median(decide) * 1e3,
        "decision_ms_at_1000_devices_max": max(decide) * 1e3,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``onepiece bench rebalance``."""
    p.add_argument("--devices", type=int, default=64, help="device budget for the two allocations")
    p.add_argument("--requests", type=int, default=4000, help="simulated requests per run")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def main(args: Any) -> int:
    result = run(args.devices, args.requests)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"devices: {result['devices']}; mix shifts from {result['mix_before']} to {result['mix_after']}")
    print(f"allocation before: {result['allocation_before']}")
    print(f"allocation after:  {result['allocation_after']}")
    print(f"throughput of the new mix, static allocation:     {result['throughput_static_rps']:.4f} req/s")
    print(f"throughput of the new mix, rebalanced allocation: {result['throughput_rebalanced_rps']:.4f} req/s "
          f"({result['rebalanced_vs_static']:.2f}x static; allocator predicted {result['predicted_rebalanced_rps']:.4f})")
    print(f"allocator decision at 1,000 devices: p50 {result['decision_ms_at_1000_devices_p50']:.2f} ms, "
          f"max {result['decision_ms_at_1000_devices_max']:.2f} ms")
    return 0
