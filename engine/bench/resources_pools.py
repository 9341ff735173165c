"""Several workflows on one cluster, and Wan2.2 A14B's experts as stages, by simulation.

**Shared pools**: Wan2.1 T2V-14B and I2V-14B served together. OnePiece serves every stage
whose executor and weights two workflows share (``Stage.pool``: the umT5 encoder, the VAE decoder, the mp4
encoder; the engine decides it by the weights' content digest) from one pool, sized by the Node Manager's
allocator over the summed demand of both workflows (Theorem 1 over the union of the chains); a request
leaves a shared pool for its own workflow's next stage. The baseline is one monolithic deployment per
workflow, each sized alone for its own share of the traffic. Both see the same arrivals (the per-workflow
streams are the pooled stream split by workflow) and the same latency objective; every workflow's own p99
must meet it. ``share=False`` sizes the same OnePiece without sharing (one pool per workflow and stage): the
difference is what sharing buys.

**Wan2.2 A14B**: a high-noise and a low-noise 14B expert, each a stage of its own in
OnePiece (each instance holds one expert), against a monolith that holds both experts when they fit the
device, else swaps them per request over PCIe (the reference code's ``offload_model``), else moves every
component in when it runs (diffusers' model CPU offload): ``resources_sim.mono_memory``. On 141, 80 and 48 GB
devices, at the rates a fully busy monolith of a given size would serve; the same p99 objective for both.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.bench.queueing import poisson_arrivals, stats
from engine.bench.resources_profile import Profile, Request
from engine.bench.resources_sim import Point, _min_meeting, draw, simulate_monolithic, size
from engine.manager.allocator import AllocationError, StageProfile, for_budget, for_rate


@dataclass(frozen=True)
class Workflow:
    name: str
    profile: Profile
    share: float  # of the arrivals


def pool_of(wf: Workflow, stage: str, share: bool) -> str:
    s = wf.profile.stage(stage)
    return s.pool if share and s.pool else f"{wf.name}/{stage}"


def pools(wfs: Sequence[Workflow], share: bool) -> dict[str, dict[str, Any]]:
    """pool -> {"device", "per_arrival_s" (the summed mean demand of one arrival of the mix), "workflows",
    "memory_gib"}. Stages sharing a pool must agree on device and memory (they are the same weights)."""
    total = sum(w.share for w in wfs)
    out: dict[str, dict[str, Any]] = {}
    for wf in wfs:
        for s in wf.profile.stages:
            p = out.setdefault(pool_of(wf, s.name, share), {"device": s.device, "per_arrival_s": 0.0,
                                                            "workflows": [], "memory_gib": s.memory_gib})
            p["per_arrival_s"] += wf.share / total * wf.profile.seconds(s, wf.profile.reference)
            p["workflows"].append(wf.name)
    return out


def simulate_pools(wfs: Sequence[Workflow], kinds: Sequence[int], arrivals: Sequence[float],
                   instances: dict[str, int], share: bool, hop_s: float = 0.02, warmup: float = 0.1) -> Point:
    """Requests of several workflows through FCFS multi-server pools (batch 1, as the engine's TaskWorkers).
    ``kinds[i]`` is request i's workflow (its reference shape). Events run in time order, so each pool serves
    requests in the order they reach it."""
    chains = [[(pool_of(wf, s.name, share), s) for s in wf.profile.stages] for wf in wfs]
    free: dict[str, list[float]] = {p: [0.0] * n for p, n in instances.items()}
    busy: dict[str, float] = dict.fromkeys(instances, 0.0)
    finish = [0.0] * len(arrivals)
    heap: list[tuple[float, int, int, int]] = [(a, i, i, 0) for i, a in enumerate(arrivals)]
    heapq.heapify(heap)
    seq = len(arrivals)
    while heap:
        ready, _, i, k = heapq.heappop(heap)
        wf = wfs[kinds[i]]
        pool, st = chains[kinds[i]][k]
        t = wf.profile.seconds(st, wf.profile.reference)
        start = max(heapq.heappop(free[pool]), ready)
        heapq.heappush(free[pool], start + t)
        busy[pool] += t
        done = start + t
        if k + 1 == len(chains[kinds[i]]):
            finish[i] = done + hop_s
            continue
        nxt = done + wf.profile.transfer_seconds(st.name, wf.profile.reference) + hop_s
        heapq.heappush(heap, (nxt, seq, i, k + 1))
        seq += 1
    span = max(arrivals) - min(arrivals)
    _, tp, p50, _ = stats(arrivals, finish, warmup)
    p99s = {}
    for j, wf in enumerate(wfs):
        idx = [i for i in range(len(arrivals)) if kinds[i] == j]
        if len(idx) >= 2:
            p99s[wf.name] = stats([arrivals[i] for i in idx], [finish[i] for i in idx], warmup)[3]
    gpu = {p for wf in wfs for s in wf.profile.stages if s.device == "gpu" for p in [pool_of(wf, s.name, share)]}
    devices = sum(instances[p] for p in gpu)
    horizon = max(finish) - min(arrivals)
    rho = {p: busy[p] / (instances[p] * span) if span > 0 else 0.0 for p in instances}
    return Point("onepiece", 0.0, devices, tp, p50, max(p99s.values()),
                 sum(busy[p] for p in gpu) / (devices * horizon) if devices and horizon > 0 else 0.0,
                 {"instances": dict(instances), "latency_p99_by_workflow_s": p99s, "max_rho": max(rho.values()),
                  "shared": share})


@dataclass(frozen=True)
class Cluster:
    workflows: tuple[Workflow, ...]
    slo_x: float = 2.0
    hop_s: float = 0.02
    max_util: float = 0.95
    requests: int = 2000
    seed: int = 0


def slo(cl: Cluster) -> float:
    """The latency objective every workflow meets: ``slo_x`` times the longest workflow's idle time."""
    return cl.slo_x * max(w.profile.total_seconds(w.profile.reference) for w in cl.workflows)


def _traffic(cl: Cluster, rate: float) -> tuple[list[float], list[int]]:
    mean_gpu = sum(w.share * w.profile.total_seconds(w.profile.reference, "gpu") for w in cl.workflows) / sum(
        w.share for w in cl.workflows)
    n = max(cl.requests, min(30_000, int(40 * rate * mean_gpu)))
    arrivals = poisson_arrivals(rate, n, cl.seed)
    kinds = draw([(w.share, j) for j, w in enumerate(cl.workflows)], n, cl.seed)  # type: ignore[misc]
    return arrivals, list(kinds)  # type: ignore[arg-type]


def size_monoliths(cl: Cluster, rate: float) -> dict[str, Any] | None:
    """One monolithic deployment per workflow, each the fewest replicas meeting the objective for its own
    share of the same arrivals; None when a workflow fits no device."""
    arrivals, kinds = _traffic(cl, rate)
    objective = slo(cl)
    per: dict[str, Any] = {}
    for j, wf in enumerate(cl.workflows):
        mine = [a for a, k in zip(arrivals, kinds, strict=True) if k == j]
        prof = wf.profile
        if any(s.memory_gib > prof.device_memory_gib for s in prof.stages if s.device == "gpu"):
            return None
        reqs = [prof.reference] * len(mine)
        lo = math.ceil(rate * wf.share / sum(w.share for w in cl.workflows)
                       * prof.total_seconds(prof.reference, "gpu") - 1e-9)
        p = _min_meeting(lo, lambda n, prof=prof, reqs=reqs, mine=mine: simulate_monolithic(prof, reqs, mine, n),
                         objective, max(64, 20 * lo), cl.max_util)
        if p is None:
            return None
        per[wf.name] = p
    return {"devices": sum(p.devices for p in per.values()),
            "by_workflow": {k: {"devices": p.devices, "latency_p99_s": p.latency_p99} for k, p in per.items()},
            "latency_p99_s": max(p.latency_p99 for p in per.values())}


def size_pools(cl: Cluster, rate: float, share: bool = True) -> Point | None:
    """OnePiece's pools (shared across workflows when ``share``), the fewest devices meeting the objective."""
    arrivals, kinds = _traffic(cl, rate)
    info = pools(cl.workflows, share)
    mem = max(wf.profile.device_memory_gib for wf in cl.workflows)
    if any(p["memory_gib"] > mem for p in info.values() if p["device"] == "gpu"):
        return None
    gpu = [StageProfile(name, max(p["per_arrival_s"], 1e-9)) for name, p in info.items() if p["device"] == "gpu"]
    cpu = [StageProfile(name, max(p["per_arrival_s"], 1e-9)) for name, p in info.items() if p["device"] != "gpu"]
    cpu_n = for_rate(cpu, rate, utilisation=0.5).instances if cpu else {}

    def run(budget: int) -> Point:
        return simulate_pools(cl.workflows, kinds, arrivals, {**for_budget(gpu, budget).instances, **cpu_n},
                              share, cl.hop_s)

    lo = for_rate(gpu, rate).total
    try:
        return _min_meeting(lo, run, slo(cl), max(64, 20 * lo), cl.max_util)
    except AllocationError:
        return None


def shared_pools(cl: Cluster, sizes: Sequence[int]) -> list[dict[str, Any]]:
    """At the rates a fully busy monolith of each size serves: devices of one monolith per workflow, of
    OnePiece without sharing, and of OnePiece with shared pools."""
    total = sum(w.share for w in cl.workflows)
    mean_gpu = sum(w.share / total * w.profile.total_seconds(w.profile.reference, "gpu") for w in cl.workflows)
    rows = []
    for n in sizes:
        rate = n / mean_gpu
        m, alone, shared = size_monoliths(cl, rate), size_pools(cl, rate, False), size_pools(cl, rate, True)
        row: dict[str, Any] = {"rate_rps": rate, "monoliths": m,
                               "onepiece_unshared": alone and _brief(alone), "onepiece_shared": shared and _brief(shared)}
        row["ratio_shared"] = m["devices"] / shared.devices if m and shared else None
        row["ratio_unshared"] = m["devices"] / alone.devices if m and alone else None
        rows.append(row)
    return rows


def _brief(p: Point) -> dict[str, Any]:
    return {"devices": p.devices, "instances": p.detail["instances"], "latency_p99_s": p.latency_p99,
            "latency_p99_by_workflow_s": p.detail.get("latency_p99_by_workflow_s"), "utilisation": p.utilisation}


# -- Wan2.2 A14B: experts as stages ----------------------------------------------------------------
# (label, usable GiB, PCIe Gb/s one way, accelerator time factor): H200 141 GB (PCIe Gen5), H100 80 GB
# (Gen5), L40S 48 GB (Gen4, 989/362 dense BF16 TFLOPS: 2.73x the H200's time); sources in the profile
DEVICES_A14B: tuple[tuple[str, float, float, float], ...] = (
    ("H200 141 GB", 131.0, 512.0, 1.0), ("H100 80 GB", 74.5, 512.0, 1.0), ("L40S 48 GB", 44.7, 256.0, 989 / 362))


def on_device(profile: Profile, memory_gib: float, pcie_gbps: float, factor: float,
              activation_gib: float | None = None) -> Profile:
    stages = tuple(replace(s, seconds=s.seconds * factor if s.device == "gpu" else s.seconds,
                           activation_gib=activation_gib if activation_gib is not None and s.scales == "tokens"
                           else s.activation_gib) for s in profile.stages)
    return replace(profile, stages=stages, device_memory_gib=memory_gib, pcie_gbps=pcie_gbps)


def experts(profile: Profile, sizes: Sequence[int], requests: int = 2000, slo_x: float = 2.0,
            hop_s: float = 0.02, steps: Sequence[int] = (40, 4),
            activations: Sequence[float | None] = (None, 8.0)) -> list[dict[str, Any]]:
    """Devices for the same p99 at the same rates, monolith (both experts, or swapped) vs expert stages, per
    device, step count and denoise activation (None: the profile's)."""
    from engine.bench.resources_sim import Scenario, mono_memory

    rows = []
    for label, mem, pcie, factor in DEVICES_A14B:
        for act in activations:
            for st in steps:
                prof = on_device(profile, mem, pcie, factor, act)
                prof = replace(prof, reference=Request(prof.reference.height, prof.reference.width,
                                                       prof.reference.frames, st))
                mode, moved = mono_memory(prof, 1)
                sc = Scenario(prof, [(1.0, prof.reference)], slo_x=slo_x, hop_s=hop_s, requests=requests)
                gpu_s = prof.total_seconds(prof.reference, "gpu")
                for n in sizes:
                    m, o = size(sc, n / gpu_s)
                    rows.append({
                        "device": label, "device_memory_gib": mem, "steps": st,
                        "denoise_activation_gib": max(s.activation_gib for s in prof.stages if s.scales == "tokens"),
                        "monolith_memory": mode, "swap_gib_per_request": moved,
                        "swap_s_per_request": moved * 2**30 * 8 / (pcie * 1e9),
                        "request_device_s": gpu_s, "rate_rps": n / gpu_s,
                        "monolithic": m and {"devices": m.devices, "latency_p99_s": m.latency_p99},
                        "onepiece": o and {"devices": o.devices, "instances": o.detail["instances"],
                                           "latency_p99_s": o.latency_p99},
                        "ratio": m.devices / o.devices if m and o else None})
    return rows
