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

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.bench.queueing import poisson_arrivals, run_batched, simulate, stats
from engine.bench.resources_profile import Profile, Request, Stage
from engine.manager.allocator import AllocationError, StageProfile, for_budget, for_rate

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


# -- batching: published gains -----------------------------------------------------------------------
# SGLang's dynamic batching of Qwen-Image on an H200 (the figures; SGLang's diffusion serving
# benchmark): a batch of k requests at 512x512 gives 1.82x the throughput of batch 1 at k = 2, 2.77x at 4,
# 3.14x at 8, and at 1024x1024 only 1.02x (taken here for every k >= 2). As latent tokens (an 8x VAE and 2x2
# patches: 16 px per token a side) those sizes are 1,024 and 4,096 tokens; between them the gain is
# interpolated in log(tokens), beyond them held (a larger request is compute-bound: Wan2.1 480p, 81 frames,
# is 32,760 tokens). Between published batch sizes the gain is interpolated linearly, above 8 held.
PUBLISHED_BATCH_SPEEDUP: tuple[tuple[float, dict[int, float]], ...] = (
    (1024.0, {1: 1.0, 2: 1.82, 4: 2.77, 8: 3.14}),
    (4096.0, {1: 1.0, 2: 1.02, 4: 1.02, 8: 1.02}),
)
BATCH_SOURCE = ("SGLang diffusion serving, dynamic batching, Qwen-Image on H200: 1.82x at batch 2, 2.77x at 4, "
                "3.14x at 8 at 512x512; 1.02x at 1024x1024")


def _speedup_at(k: int, table: dict[int, float]) -> float:
    ks = sorted(table)
    if k <= ks[0]:
        return table[ks[0]]
    for lo, hi in zip(ks, ks[1:], strict=False):
        if k <= hi:
            return table[lo] + (table[hi] - table[lo]) * (k - lo) / (hi - lo)
    return table[ks[-1]]


def published_speedup(k: int, tokens: float) -> float:
    """Throughput of a denoise batch of ``k`` equal requests of ``tokens`` latent tokens over serving them one
    at a time, from :data:`PUBLISHED_BATCH_SPEEDUP`."""
    (t0, lo), (t1, hi) = PUBLISHED_BATCH_SPEEDUP
    a, b = _speedup_at(k, lo), _speedup_at(k, hi)
    if tokens <= t0:
        return a
    if tokens >= t1:
        return b
    w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return a + (b - a) * w


def _published(stage: Stage) -> bool:
    """Stages the published gains apply to: the denoisers (the light stages keep their ``batch_gain``)."""
    return stage.scales == "tokens"


def batch_seconds(stage: Stage, times: Sequence[float], reqs: Sequence[Request], published: bool) -> float:
    """One batch's time at ``stage``: a denoiser with published gains takes sum / speedup when its members
    share a shape (else they gain nothing); other stages (1 - g) x sum + g x max."""
    if published and _published(stage):
        same = all(r == reqs[0] for r in reqs)
        return sum(times) / (published_speedup(len(times), reqs[0].tokens) if same else 1.0)
    g = stage.batch_gain
    return (1 - g) * sum(times) + g * max(times)


# -- monolithic ----------------------------------------------------------------------------------
def mono_fits(profile: Profile, batch: int) -> bool:
    return mono_memory(profile, batch)[0] == "resident"


def mono_memory(profile: Profile, batch: int) -> tuple[str, float]:
    """How a monolithic replica holds its weights, and the GiB it moves from host memory per batch:
    ``resident`` (everything fits: 0), ``swap <group>`` (the stages of a swap group take turns on the device,
    each loaded once per batch: Wan2.2 A14B's experts, as its reference code's offload_model does), or
    ``offload`` (every component moved in when it runs: diffusers' enable_model_cpu_offload)."""
    gpu = [s for s in profile.stages if s.device == "gpu"]
    act = batch * max((s.activation_gib for s in gpu), default=0.0)
    if sum(s.weights_gib for s in gpu) + act <= profile.device_memory_gib:
        return "resident", 0.0
    groups: dict[str, list[Stage]] = {}
    for s in gpu:
        if s.swap_group:
            groups.setdefault(s.swap_group, []).append(s)
    if groups:
        held = sum(s.weights_gib for s in gpu if not s.swap_group) + sum(
            max(m.weights_gib for m in g) for g in groups.values())
        if held + act <= profile.device_memory_gib:
            return "swap " + ",".join(sorted(groups)), sum(m.weights_gib for g in groups.values() for m in g)
    return "offload", sum(s.weights_gib for s in gpu)


def simulate_monolithic(profile: Profile, reqs: Sequence[Request], arrivals: Sequence[float], replicas: int,
                        batch: int = 1, gpus_per_replica: int = 1, sp_speedup: float = 1.0,
                        pcie_gbps: float | None = None, warmup: float = 0.1, published: bool = False) -> Point:
    gpu = [s for s in profile.stages if s.device == "gpu"]
    cpu = [s for s in profile.stages if s.device != "gpu"]
    # weights that do not fit are swapped in from host memory for every batch (mono_memory)
    mode, moved_gib = mono_memory(profile, batch)
    offload_s = moved_gib * 2**30 * 8 / ((pcie_gbps or profile.pcie_gbps) * 1e9)
    per = [[profile.seconds(s, r) for s in gpu] for r in reqs]

    def duration(members: list[int]) -> float:
        d = offload_s
        for j, st in enumerate(gpu):
            d += batch_seconds(st, [per[i][j] for i in members], [reqs[i] for i in members], published)
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
                  "offload": offload_s > 0, "memory_mode": mode, "swap_s_per_batch": offload_s,
                  "max_rho": demand / (replicas * span) if span > 0 else 0.0})


# -- OnePiece ------------------------------------------------------------------------------------
def batch_factor(stage: Stage, mix: Mix, batch: int, published: bool = False) -> float:
    """A request's share of a full batch of ``batch`` over its time alone: 1 / speedup."""
    if batch <= 1:
        return 1.0
    if published and _published(stage):
        total = sum(w for w, _ in mix)
        return sum(w / published_speedup(batch, r.tokens) for w, r in mix) / total
    return 1 - stage.batch_gain + stage.batch_gain / batch


def stage_profiles(profile: Profile, mix: Mix, device: str = "gpu", batch: int = 1,
                   published: bool = False) -> list[StageProfile]:
    """What the Node Manager would measure per stage: mean seconds per request (with full batches
    of ``batch`` where a stage batches: :func:`batch_factor` of it)."""
    means = mean_seconds(profile, mix)
    return [StageProfile(s.name, max(means[s.name] * batch_factor(s, mix, batch, published), 1e-9))
            for s in profile.stages if s.device == device]


def cpu_workers(profile: Profile, mix: Mix, rate: float) -> dict[str, int]:
    """Host workers for host-only stages: enough to keep them at most half busy."""
    cpu = stage_profiles(profile, mix, "cpu")
    return for_rate(cpu, rate, utilisation=0.5).instances if cpu else {}


def simulate_onepiece(profile: Profile, reqs: Sequence[Request], arrivals: Sequence[float],
                      instances: dict[str, int], hop_s: float = 0.0, batch: int = 1, warmup: float = 0.1,
                      published: bool = False) -> Point:
    """The staged deployment. With ``batch`` > 1, stages with a batch gain take up to ``batch``
    waiting requests at once (a what-if: the engine's TaskWorkers run one request at a time);
    otherwise this is ``engine.bench.queueing.simulate``."""
    names = profile.names
    gpu = {s.name for s in profile.stages if s.device == "gpu"}
    span = max(arrivals) - min(arrivals)

    def hop(s: str, i: int) -> float:
        return profile.transfer_seconds(s, reqs[i]) + hop_s if s != names[-1] else hop_s

    batched = {s.name for s in profile.stages if batch > 1 and (s.batch_gain > 0 or (published and _published(s)))}
    if not batched:
        res = simulate(names, instances, lambda s, i: profile.seconds(s, reqs[i]), arrivals, hop, warmup=warmup)
        tp, p50, p99, util = res.throughput, res.latency_p50, res.latency_p99, res.utilisation
        demand = {s: sum(profile.seconds(s, r) for r in reqs) for s in names}
    else:
        ready = list(arrivals)
        demand, util = {}, {}
        for st in profile.stages:
            times = [profile.seconds(st, r) for r in reqs]

            def duration(members: list[int], times: list[float] = times, st: Stage = st) -> float:
                return batch_seconds(st, [times[i] for i in members], [reqs[i] for i in members], published)

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
    onepiece_batch: int = 1  # per-stage batching of the stages with a batch gain (and the denoisers if published)
    published_batching: bool = False  # denoisers batch with PUBLISHED_BATCH_SPEEDUP (both deployments)
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
        return simulate_monolithic(prof, reqs, arrivals, n, sc.batch, sc.gpus_per_replica, sc.sp_speedup,
                                   published=sc.published_batching)

    # a stage that does not fit one device alone needs sharding, which neither deployment models
    too_big = [s.name for s in prof.stages if s.device == "gpu" and s.memory_gib > prof.device_memory_gib]
    # at best every batch is full: a lower bound on the replicas the rate needs
    full = sum(means[s.name] * batch_factor(s, mix, sc.batch, sc.published_batching)
               for s in prof.stages if s.device == "gpu")
    lo_mono = math.ceil(rate * full / sc.sp_speedup - 1e-9)
    m = None if too_big else _min_meeting(lo_mono, mono, slo, max(64, 20 * lo_mono), sc.max_util)

    gpu_profiles = stage_profiles(prof, mix, batch=sc.onepiece_batch, published=sc.published_batching)
    cpu = cpu_workers(prof, mix, rate)

    def onepiece(budget: int) -> Point:
        alloc = for_budget(gpu_profiles, budget)
        return simulate_onepiece(prof, reqs, arrivals, {**alloc.instances, **cpu}, sc.hop_s, sc.onepiece_batch,
                                 published=sc.published_batching)

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
