"""``onepiece bench rebalance``: the Node Manager's planner's decisions at cluster scale, by simulation.

Stage times come from the workflow's own cost model (engine/workflow/specs) for two request mixes; the
Node Manager's real planner (:func:`engine.manager.planner.plan`, the function every tick calls) sizes and
places the stages for the first mix on nodes of up to 8 slots, then plans again once the stage times of the
second mix are measured (it must decide to apply, past its hysteresis); the discrete-event simulation runs
the second mix on the first mix's allocation (static) and on the new one (rebalanced). Also times the
planner's whole decision at 1,000 devices. Figures are ratios within the run; absolute stage times are the
cost model's estimates, not measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

from engine.bench.queueing import simulate
from engine.manager.overrides import Overrides
from engine.manager.planner import ManagerConfig, Observation, Plan, plan
from engine.workflow.pools import Pool

MIXES = {
    "distilled-4-steps": {"num_frames": 81, "num_inference_steps": 4},
    "full-30-steps": {"num_frames": 81, "num_inference_steps": 30},
}


def stage_times(workflow: str, params: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(workflow, stage) -> the cost model's seconds for a request of ``params``, as a node would report."""
    from engine.workflow import get_workflow

    wf = get_workflow(workflow)
    p = wf.resolve_params({"prompt": "benchmark", "height": 480, "width": 832, **params})
    return {(workflow, stage): max(seconds, 1e-3) for stage, seconds in wf.estimate_cost(p).items()}


class Cluster:
    """``devices`` slots on nodes of up to 8, planned for one workflow by the real planner."""

    def __init__(self, workflow: str, devices: int) -> None:
        from engine.workflow import get_workflow

        slots = math.gcd(devices, 8)
        self.workflow, self.nodes = workflow, [f"n{i}" for i in range(devices // slots)]
        self.cfg = ManagerConfig(workflows={workflow: ""}, slots_per_node=slots, root="/bench")
        self.pools = [Pool(((workflow, s),)) for s in get_workflow(workflow).route()]  # one per stage: no folder

    def plan(self, times: dict[tuple[str, str], float], before: Plan | None = None) -> Plan:
        """The tick after ``before`` was applied (its cooldown over), with ``times`` measured."""
        current = {n: {"instances": v} for n, v in (before.placed if before else {}).items()}
        seen = Observation({n: {"node": n, "instances": {}} for n in self.nodes}, current, {}, {}, {})
        return plan(seen, Overrides(), times, self.cfg, now=2 * self.cfg.cooldown + 1,
                    last_change=self.cfg.cooldown if before else -float("inf"), stage_pools=self.pools)


def run(devices: int, requests: int, workflow: str = "wan2.1-i2v") -> dict[str, Any]:
    (name_a, mix_a), (name_b, mix_b) = MIXES.items()
    times_a, times_b = stage_times(workflow, mix_a), stage_times(workflow, mix_b)
    cluster = Cluster(workflow, devices)
    plan_a = cluster.plan(times_a)
    plan_b = cluster.plan(times_b, plan_a)  # the new mix measured: the planner decides whether to move
    after = cluster.plan(times_b, plan_b)  # what it then publishes for the instances placed
    alloc_a, alloc_b = plan_a.counts[workflow], plan_b.counts[workflow]
    seconds = {s: t for (_, s), t in times_b.items()}
    stages = list(seconds)
    burst = [0.0] * requests  # saturating load: throughput is the allocation's capacity
    static = simulate(stages, alloc_a, lambda s, i: seconds[s], burst)
    rebalanced = simulate(stages, alloc_b, lambda s, i: seconds[s], burst)
    big = Cluster(workflow, 1000)
    big_before = big.plan(times_a)
    decide = []
    for _ in range(20):
        t0 = time.perf_counter()
        big.plan(times_b, big_before)
        decide.append(time.perf_counter() - t0)
    assert after.publish is not None
    return {
        "devices": devices, "nodes": len(cluster.nodes), "slots_per_node": cluster.cfg.slots_per_node,
        "mix_before": name_a, "mix_after": name_b,
        "allocation_before": alloc_a, "allocation_after": alloc_b,
        "planner_applied": plan_b.apply, "planner_reason": plan_b.reason,
        "throughput_static_rps": static.throughput, "throughput_rebalanced_rps": rebalanced.throughput,
        "rebalanced_vs_static": rebalanced.throughput / static.throughput,
        "predicted_rebalanced_rps": after.publish.capacity[workflow]["rps"],
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
    print(f"allocation after:  {result['allocation_after']} (planner: {result['planner_reason']})")
    print(f"throughput of the new mix, static allocation:     {result['throughput_static_rps']:.4f} req/s")
    print(f"throughput of the new mix, rebalanced allocation: {result['throughput_rebalanced_rps']:.4f} req/s "
          f"({result['rebalanced_vs_static']:.2f}x static; planner predicted {result['predicted_rebalanced_rps']:.4f})")
    print(f"planner decision at 1,000 devices: p50 {result['decision_ms_at_1000_devices_p50']:.2f} ms, "
          f"max {result['decision_ms_at_1000_devices_max']:.2f} ms")
    return 0
