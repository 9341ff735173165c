"""A discrete-event simulation of a staged workflow, to see allocation decisions at scale.

Requests arrive (Poisson, or any iterable of arrival times), pass every stage in
order, and at each stage wait FIFO for one of its ``n_s`` instances, which serves
a request in ``seconds(stage, request)``. Transfers between stages take
``bytes / link_bandwidth`` (0 by default). The simulation reports completed
throughput and latency percentiles; the same allocator code that drives the
real engine (engine.manager.allocator) chooses ``n_s``, so its decisions can be
examined for clusters this machine cannot hold. Pure Python, deterministic for
a given seed; ``heapq`` keeps one event per instance release.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SimResult:
    completed: int
    throughput: float  # completed requests per second over the measured window
    latency_p50: float
    latency_p99: float
    utilisation: dict[str, float]  # busy fraction of each stage's instances


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def simulate(
    stages: list[str],
    instances: Mapping[str, int],
    service: Callable[[str, int], float],
    arrivals: Iterable[float],
    transfer: Callable[[str, int], float] | None = None,
    warmup: float = 0.1,
) -> SimResult:
    """Run requests (index i arriving at ``arrivals[i]``) through ``stages``.

    ``service(stage, i)`` gives request i's service time at a stage; ``transfer(stage, i)``
    the time to hand its output to the next stage. The first ``warmup`` fraction of
    completions is left out of the figures (the pipeline filling up).
    """
    arr = list(arrivals)
    if not arr:
        return SimResult(0, 0.0, 0.0, 0.0, {s: 0.0 for s in stages})
    # per stage: a heap of the times its instances become free
    free = {s: [0.0] * max(0, instances.get(s, 0)) for s in stages}
    for s in stages:
        if not free[s]:
            raise ValueError(f"stage {s!r} has no instances")
        heapq.heapify(free[s])
    busy = dict.fromkeys(stages, 0.0)
    done: list[tuple[float, float]] = []  # (finish, latency)
    # FCFS at every stage: requests in the order they become ready there, each taking the
    # earliest free instance (exact for a multi-server FIFO queue)
    ready = list(arr)
    for s in stages:
        order = sorted(range(len(ready)), key=lambda i: ready[i])
        out = [0.0] * len(ready)
        for i in order:
            t_free = heapq.heappop(free[s])
            start = max(t_free, ready[i])
            d = service(s, i)
            end = start + d
            busy[s] += d
            heapq.heappush(free[s], end)
            out[i] = end + (transfer(s, i) if transfer else 0.0)
        ready = out
    for i, t in enumerate(ready):
        done.append((t, t - arr[i]))
    done.sort()
    skip = int(len(done) * warmup)
    window = done[skip:]
    if len(window) < 2:
        window = done
    span = window[-1][0] - (done[skip - 1][0] if skip else arr[0])
    lat = sorted(x[1] for x in window)
    horizon = done[-1][0] - arr[0]
    return SimResult(
        completed=len(window),
        throughput=len(window) / span if span > 0 else float("inf"),
        latency_p50=statistics.median(lat),
        latency_p99=lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        utilisation={s: busy[s] / (instances[s] * horizon) if horizon > 0 else 0.0 for s in stages},
    )
