"""Devices needed for a target throughput at a latency objective: monolithic vs OnePiece, by simulation.

Two deployments of the same workflow, fed the same Poisson arrivals and the
same requests (common random numbers, so their difference is not noise):

- **monolithic** (diffusers-style): every replica holds every accelerator stage
  and serves a request end to end; a free replica takes up to ``batch`` waiting
  requests at once (it never waits to fill a batch); a batch of k takes, per
  stage, (1 - g) x sum + g x max of its members' times (``batch_gain`` g).
  Replicas must hold all weights plus ``batch`` x the largest activation; if
  that does not fit the device, weights are swapped in from host memory for
  every batch (diffusers' model CPU offload) at ``pcie_gbps``. With
  ``gpus_per_replica`` g > 1 a replica is g devices running sequence parallel
  at ``sp_speedup`` (the latency-optimised multi-GPU setup).
- **OnePiece**: per-stage instances, one device each (``batch`` 1, as the
  engine runs them), their counts chosen by the Node Manager's allocator
  (``engine.manager.allocator.for_budget``) from the mix's mean stage times;
  results cross ``link_gbps`` plus ``hop_s`` per hop. Host-only stages (mp4
  encoding) get CPU workers, which are reported but not counted as devices.

For each target rate the fewest devices whose simulated p99 latency meets the
objective is found by search (p99 falls as devices are added, since FCFS
queues with common arrivals are monotone in the number of servers).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.bench.resources_profile import Profile, Request
from engine.manager.allocator import AllocationError, StageProfile, for_budget, for_rate
from engine.manager.simulate import poisson_arrivals, simulate

Mix = Sequence[tuple[float, Request]]


@dataclass(frozen=True)
class Point:
    """One deployment at one target rate."""

    deployment: str
    rate: float  # offered requests/s
    devices: int
    throughput: float
    latency_p50: float
    latency_p99: float
    utilisation: float  # mean busy fraction of the devices
    detail: dict[str, object]

    @property
    def device_seconds_per_request(self) -> float:
        return self.devices / self.throughput if self.throughput > 0 else math.inf

    def as_dict(self) -> dict[str, object]:
        return {"deployment": self.deployment, "rate_rps": self.rate, "devices": self.devices,
                "throughput_rps": self.throughput, "device_s_per_request": self.device_seconds_per_request,
                "utilisation": self.utilisation, "latency_p50_s": self.latency_p50,
                "latency_p99_s": self.latency_p99, **self.detail}


def stats(arrivals: Sequence[float], finishes: Sequence[float], warmup: float = 0.1
          ) -> tuple[int, float, float, float]:
    """(completed, throughput, p50, p99) over the measured window, computed as
    ``engine.manager.simulate.simulate`` does (the first ``warmup`` fraction of completions left out)."""
    done = sorted((f, f - a) for a, f in zip(arrivals, finishes, strict=True))
    skip = int(len(done) * warmup)
    window = done[skip:] if len(done) - skip >= 2 else done
    span = window[-1][0] - (done[skip - 1][0] if skip and len(done) - skip >= 2 else min(arrivals))
    lat = sorted(x[1] for x in window)
    return (len(window), len(window) / span if span > 0 else math.inf, statistics.median(lat),
            lat[min(len(lat) - 1, int(len(lat) * 0.99))])


def draw(mix: Mix, n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed + 7919)
    weights = [w for w, _ in mix]
    kinds = [r for _, r in mix]
    return rng.choices(kinds, weights=weights, k=n)


def mean_seconds(profile: Profile, mix: Mix) -> dict[str, float]:
    total = sum(w for w, _ in mix)
    return {s.name: sum(w * profile.seconds(s, r) for w, r in mix) / total for s in profile.stages}


def slo_seconds(profile: Profile, mix: Mix, slo_x: float) -> float:
    """The latency objective: ``slo_x`` times the idle end-to-end time of the mix's longest request."""
    return slo_x * max(profile.total_seconds(r) for _, r in mix)


def run_batched(ready: Sequence[float], servers: int, batch: int, duration: Callable[[list[int]], float]
                ) -> tuple[list[float], float]:
    """A FCFS multi-server queue whose free server takes up to ``batch`` waiting requests at once
    (never waiting to fill a batch). Returns (finish time of each request, busy server-seconds)."""
    order = sorted(range(len(ready)), key=lambda i: ready[i])
    free = [0.0] * servers
    finish = [0.0] * len(ready)
    busy = 0.0
    k = 0
    while k < len(order):
        start = max(heapq.heappop(free), ready[order[k]])
        members = [order[k]]
        k += 1
        while k < len(order) and len(members) < batch and ready[order[k]] <= start:
            members.append(order[k])
            k += 1
        d = duration(members)
        busy += d
        heapq.heappush(free, start + d)
        for i in members:
            finish[i] = start + d
    return finish, busy


# -- monolithic ----------------------------------------------------------------------------------
def mono_fits(profile: Profile, batch: int) -> bool:
    gpu = [s for s in profile.stages if s.device == "gpu"]
    need = sum(s.weights_gib for s in gpu) + batch * max((s.activation_gib for s in gpu), default=0.0)
    return need <= profile.device_memory_gib


def simulate_monolithic(profile: Profile, reqs: Sequence[Request], arrivals: Sequence[float], replicas: int,
                        batch: int = 1, gpus_per_replica: int = 1, sp_speedup: float = 1.0,
                        pcie_gbps: float = 200.0, warmup: float = 0.1) -> Point:
    gpu = [s for s in profile.stages if s.device == "gpu"]
    cpu = [s for s in profile.stages if s.device != "gpu"]
    offload_s = 0.0
    if not mono_fits(profile, batch):
        # weights swapped in from host memory for every batch (diffusers' enable_model_cpu_offload)
        offload_s = sum(s.weights_gib for s in gpu) * 2**30 * 8 / (pcie_gbps * 1e9)
    per = [[profile.seconds(s, r) for s in gpu] for r in reqs]
    gains = [s.batch_gain for s in gpu]

    def duration(members: list[int]) -> float:
        d = offload_s
        for j, g in enumerate(gains):
            times = [per[i][j] for i in members]
            d += (1 - g) * sum(times) + g * max(times)
        return d / sp_speedup

    done, busy = run_batched(arrivals, replicas, batch, duration)
    demand = busy
    finish = [done[i] + sum(profile.seconds(s, reqs[i]) for s in cpu) for i in range(len(reqs))]
    completed, tp, p50, p99 = stats(arrivals, finish, warmup)
    horizon = max(finish) - min(arrivals)
    span = max(arrivals) - min(arrivals)
    return Point("monolithic", 0.0, replicas * gpus_per_replica, tp, p50, p99,
                 busy / (replicas * horizon) if horizon > 0 else 0.0,
                 {"replicas": replicas, "batch": batch, "gpus_per_replica": gpus_per_replica,
                  "offload": offload_s > 0, "max_rho": demand / (replicas * span) if span > 0 else 0.0})


# -- OnePiece ------------------------------------------------------------------------------------
def stage_profiles(profile: Profile, mix: Mix, device: str = "gpu", batch: int = 1) -> list[StageProfile]:
    """What the Node Manager would measure per stage: mean seconds per request (with full batches
    of ``batch`` where a stage batches, (1 - g + g / batch) of it)."""
    means = mean_seconds(profile, mix)
    return [StageProfile(s.name, max(means[s.name] * ((1 - s.batch_gain + s.batch_gain / batch) if batch > 1
                                                      else 1.0), 1e-9))
            for s in profile.stages if s.device == device]


def cpu_workers(profile: Profile, mix: Mix, rate: float) -> dict[str, int]:
    """Host workers for host-only stages: enough to keep them at most half busy."""
    cpu = stage_profiles(profile, mix, "cpu")
    return for_rate(cpu, rate, utilisation=0.5).instances if cpu else {}


def simulate_onepiece(profile: Profile, reqs: Sequence[Request], arrivals: Sequence[float],
                      instances: dict[str, int], hop_s: float = 0.0, batch: int = 1, warmup: float = 0.1) -> Point:
    """The staged deployment. With ``batch`` > 1, stages with a batch gain take up to ``batch``
    waiting requests at once (a what-if: the engine's TaskWorkers run one request at a time);
    otherwise this is ``engine.manager.simulate.simulate``."""
    names = profile.names
    gpu = {s.name for s in profile.stages if s.device == "gpu"}
    span = max(arrivals) - min(arrivals)

    def hop(s: str, i: int) -> float:
        return profile.transfer_seconds(s, reqs[i]) + hop_s if s != names[-1] else hop_s

    batched = {s.name for s in profile.stages if batch > 1 and s.batch_gain > 0}
    if not batched:
        res = simulate(names, instances, lambda s, i: profile.seconds(s, reqs[i]), arrivals, hop, warmup=warmup)
        tp, p50, p99, util = res.throughput, res.latency_p50, res.latency_p99, res.utilisation
        demand = {s: sum(profile.seconds(s, r) for r in reqs) for s in names}
    else:
        ready = list(arrivals)
        demand, util = {}, {}
        for st in profile.stages:
            times = [profile.seconds(st, r) for r in reqs]
            g = st.batch_gain

            def duration(members: list[int], times: list[float] = times, g: float = g) -> float:
                ts = [times[i] for i in members]
                return (1 - g) * sum(ts) + g * max(ts)

            done, busy = run_batched(ready, instances[st.name], batch if st.name in batched else 1, duration)
            demand[st.name] = busy
            ready = [done[i] + hop(st.name, i) for i in range(len(reqs))]
        _, tp, p50, p99 = stats(arrivals, ready, warmup)
        horizon = max(ready) - min(arrivals)
        util = {s: demand[s] / (instances[s] * horizon) for s in names}
    devices = sum(instances[s] for s in gpu)
    mean_util = sum(util[s] * instances[s] for s in gpu) / devices if devices else 0.0
    rho = {s: demand[s] / (instances[s] * span) if span > 0 else 0.0 for s in names}
    return Point("onepiece", 0.0, devices, tp, p50, p99, mean_util,
                 {"instances": dict(instances), "cpu_workers": sum(instances[s] for s in names if s not in gpu),
                  "max_rho": max(rho.values()), "devices_packed": packed_devices(profile, instances, rho)})


def packed_devices(profile: Profile, instances: dict[str, int], rho: dict[str, float], max_util: float = 0.95,
                   diffusion: str = "denoise") -> int:
    """Devices if the light stages (every accelerator stage but ``diffusion``) share devices, as an
    assignment may place several instances on one device: enough devices for their summed busy
    time x occupancy at ``max_util`` and for their summed memory. Optimistic: the simulation
    does not model their contention on a shared device."""
    gpu = [s for s in profile.stages if s.device == "gpu"]
    heavy = [s for s in gpu if s.name == diffusion] or [max(gpu, key=lambda s: profile.seconds(s, profile.reference))]
    light = [s for s in gpu if s is not heavy[0]]
    if not light:
        return instances[heavy[0].name]
    busy = sum(rho[s.name] * instances[s.name] * s.occupancy for s in light)
    mem = sum(s.memory_gib * instances[s.name] for s in light)
    shared = max(1, math.ceil(busy / max_util - 1e-9), math.ceil(mem / profile.device_memory_gib - 1e-9))
    return instances[heavy[0].name] + min(shared, sum(instances[s.name] for s in light))


def _min_meeting(lo: int, run: Callable[[int], Point], slo: float, hi_cap: int, max_util: float = 0.95
                 ) -> Point | None:
    """The smallest n >= lo whose run meets ``slo`` (p99) with no device group busier than
    ``max_util`` of the run (a finite run near saturation can look fast), by growth then bisection."""

    def ok(p: Point) -> bool:
        return p.latency_p99 <= slo and float(p.detail.get("max_rho", 0.0)) <= max_util  # type: ignore[arg-type]

    lo = max(1, lo)
    best: Point | None = None
    n, last_bad = lo, lo - 1
    while n <= hi_cap:
        p = run(n)
        if ok(p):
            best = p
            break
        last_bad = n
        n = max(n + 1, int(n * 1.25))
    if best is None:
        return None
    hi = n
    while hi - last_bad > 1:
        mid = (hi + last_bad) // 2
        p = run(mid)
        if ok(p):
            best, hi = p, mid
        else:
            last_bad = mid
    return best


@dataclass(frozen=True)
class Scenario:
    """Everything but the rate: the profile, the request mix and the deployment assumptions."""

    profile: Profile
    mix: Mix
    slo_x: float = 2.0
    batch: int = 1
    gpus_per_replica: int = 1
    sp_speedup: float = 1.0
    hop_s: float = 0.02
    onepiece_batch: int = 1  # what-if: per-stage batching of the stages with a batch gain
    max_util: float = 0.95
    requests: int = 2000
    seed: int = 0


def size(sc: Scenario, rate: float) -> tuple[Point | None, Point | None]:
    """(monolithic, OnePiece): the fewest devices meeting the objective at ``rate``, simulated."""
    prof, mix = sc.profile, sc.mix
    means = mean_seconds(prof, mix)
    mean_gpu = sum(means[s.name] for s in prof.stages if s.device == "gpu")
    # enough requests that the run spans many service times of the largest deployment
    n_req = max(sc.requests, min(30_000, int(40 * rate * mean_gpu)))
    arrivals = poisson_arrivals(rate, n_req, sc.seed)
    reqs = draw(mix, n_req, sc.seed)
    slo = slo_seconds(prof, mix, sc.slo_x)

    def mono(n: int) -> Point:
        return simulate_monolithic(prof, reqs, arrivals, n, sc.batch, sc.gpus_per_replica, sc.sp_speedup)

    # a stage that does not fit one device alone needs sharding, which neither deployment models
    too_big = [s.name for s in prof.stages if s.device == "gpu" and s.memory_gib > prof.device_memory_gib]
    lo_mono = math.ceil(rate * mean_gpu / (sc.sp_speedup * sc.batch) - 1e-9)
    m = None if too_big else _min_meeting(lo_mono, mono, slo, max(64, 20 * lo_mono), sc.max_util)

    gpu_profiles = stage_profiles(prof, mix, batch=sc.onepiece_batch)
    cpu = cpu_workers(prof, mix, rate)

    def onepiece(budget: int) -> Point:
        alloc = for_budget(gpu_profiles, budget)
        return simulate_onepiece(prof, reqs, arrivals, {**alloc.instances, **cpu}, sc.hop_s, sc.onepiece_batch)

    o: Point | None = None
    if not too_big:
        lo_op = for_rate(gpu_profiles, rate).total
        try:
            o = _min_meeting(lo_op, onepiece, slo, max(64, 20 * lo_op), sc.max_util)
        except AllocationError:
            o = None
    out = []
    for p in (m, o):
        out.append(None if p is None else Point(p.deployment, rate, p.devices, p.throughput, p.latency_p50,
                                                p.latency_p99, p.utilisation, {**p.detail, "slo_s": slo}))
    return out[0], out[1]
