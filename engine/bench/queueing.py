"""The benchmarks' queueing simulation: a staged workflow's FIFO queues, a batched queue, their figures.

Requests arrive (Poisson, or any iterable of arrival times), pass every stage in
order, and at each stage wait FIFO for one of its ``n_s`` instances, which serves
a request in ``seconds(stage, request)``. Transfers between stages take
``bytes / link_bandwidth`` (0 by default). The simulation reports completed
throughput and latency percentiles; the same allocator code that drives the
real engine (engine.manager.allocator) chooses ``n_s``, so its decisions can be
examined for clusters this machine cannot hold. Pure Python, deterministic for
a given seed; ``heapq`` keeps one event per instance release.

:func:`run_batched` is one stage's queue whose free server takes several
waiting requests at once (the monolith's batching, ``resources_sim``), and
:func:`stats` the same figures for finish times computed elsewhere. The
deployments built on these (monolithic vs OnePiece, shared pools, the
experts) are ``engine.bench.resources_sim`` and ``resources_pools``;
``onepiece bench rebalance`` and ``resources_validate`` run :func:`simulate`.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def stats(arrivals: Sequence[float], finishes: Sequence[float], warmup: float = 0.1
          ) -> tuple[int, float, float, float]:
    """(completed, throughput, p50, p99) over the measured window, computed as
    :func:`simulate` does (the first ``warmup`` fraction of completions left out)."""
    done = sorted((f, f - a) for a, f in zip(arrivals, finishes, strict=True))
    skip = int(len(done) * warmup)
    window = done[skip:] if len(done) - skip >= 2 else done
    span = window[-1][0] - (done[skip - 1][0] if skip and len(done) - skip >= 2 else min(arrivals))
    lat = sorted(x[1] for x in window)
    return (len(window), len(window) / span if span > 0 else math.inf, statistics.median(lat),
            lat[min(len(lat) - 1, int(len(lat) * 0.99))])


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
