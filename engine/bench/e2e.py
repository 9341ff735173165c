"""``onepiece bench e2e``: the engine end to end against the one-call pipeline, and under open-loop load.

Runs against a live engine (the ``proxy:`` line of ``onepiece up``); the
baselines run on the same cores in the same run, on the same model folder
(the ``state:`` line's ``models/<workflow>``):

1. latency: sequential requests through the Proxy (submit, wait with the
   Proxy's long poll ``?wait=``, fetch the result) against the one-call
   diffusers pipeline in this process at its best thread count (1..cores);
   the difference divided by the number of stage hops is the cost per hop;
2. monolith: the one-call pipeline run by K processes (each with cores/K
   threads, K the best of 1..cores), requests completed per second: what a
   monolithic deployment reaches on this machine;
3. capacity: saturation, i.e. enough requests in flight (``--saturate``) to
   keep every stage instance busy, completions per second; printed as a ratio
   to the monolith (``staged_vs_monolith_capacity``);
4. open loop: Poisson arrivals at 0.5x, 1x, 2x and 10x that capacity. Every
   request is sent at its scheduled time whatever happened to earlier ones
   (an asyncio client, no cap on requests in flight) and timed from that
   time, so a slow engine cannot slow the offered load down (no coordinated
   omission). Each row: offered, accepted, completed within its deadline,
   completed late, expired, failed, refused, goodput and latencies.

5. single stage: the same engine serving sd-t2i as one stage (the one-call pipeline in one stage instance
   per core) beside its four stages, behind one Proxy, store and node, each saturated in turn
   (``staged_vs_single_stage_capacity``), and 6. mixed: sd-t2i, wan2.1-t2v and wan2.1-i2v in equal shares on
   the engine ``default_assignment`` deploys against one monolith per workflow (``mixed_vs_monolith_capacity``,
   ``staged_rss_mb``, ``monolith_rss_mb``); both on a private engine of the bench's own while the live one
   idles (:mod:`engine.bench.variants`).

``--hog N`` runs N processes that each keep one core busy beside the engine
for the whole run (after a quiet latency measurement, so the run reports both
and their ratio): the neighbour a shared host has.

``--workflow`` names any registered workflow; each has a small request of its own (:data:`PARAMS`, resolved
against the model's limits, refused before any work where it does not fit), and a blank png for each image
input, submitted to the Proxy and given to the one-call pipeline as ``image=``, so that both sides do the same
work. ``--quality LEVEL`` (default lossless) is every staged request's ``quality``; the one-call baselines run
diffusers' own cache hook with the level's settings (``engine.stages.caching.settings(...).config()`` to
``transformer.enable_cache``), the method the staged denoise runs per request. A level the workflow does not
serve is refused (exit 2). The JSON says what it measured: ``workflow``, ``quality``, ``params`` (resolved)
and ``inputs``.

This module is the harness: it takes the samples. The rows and ratios made from them are pure functions of
:mod:`engine.bench.figures`; the text printed for a reader is :mod:`engine.bench.e2e_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.bench import adapters, figures, stream, variants
from engine.bench import e2e_report as report
from engine.bench.cpu import ControlPlaneMeter, RunQueueMeter, roles_from_state
from engine.bench.harness import (
    PARAMS,
    AsyncClient,
    Client,
    _call,
    _cores,
    _load_pipeline,
    _one_call,
    with_load_after,
)
from engine.procs import released_together
from engine.stages import caching

LOADS = (0.5, 1.0, 2.0, 10.0)


class Refused(ValueError):
    """A bench request that cannot be run as asked (workflow, level, model folder or parameters): said before
    any work."""


def request(workflow: str, model_dir: str | Path, quality: str = caching.LOSSLESS,
            steps: int | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(params, inputs): what both sides of ``bench e2e`` run for ``workflow`` at ``quality``. The params are
    :data:`PARAMS`' entry with the level (where the workflow takes ``quality``) and ``steps`` (``--steps``: its
    ``num_inference_steps``, else the entry's), resolved against the limits of
    the model in ``model_dir`` (every default filled in: the staged requests carry them, and the one-call
    pipeline gets them as keywords); the inputs are a blank png per image input of the workflow, the staged
    submission's and the pipeline's ``image=``. :class:`Refused` (its message says why) for a workflow without a
    default request, a level it does not serve, a folder that is not the workflow's model, or params its model
    refuses."""
    from engine.stages.base import MissingComponent
    from engine.stages.layout import check_components
    from engine.stages.registry import needed
    from engine.workflow.registry import workflows
    from engine.workflow.spec import InvalidRequest

    if workflow not in PARAMS or workflow not in workflows():
        raise Refused(f"no bench request for workflow {workflow!r}; known: {', '.join(sorted(PARAMS))}")
    served = caching.levels(workflow)
    if quality not in caching.QUALITY_LEVELS:
        raise Refused(f"--quality {quality!r} is not a level; levels: {', '.join(caching.QUALITY_LEVELS)}")
    spec = workflows()[workflow]
    takes_quality = any(p.name == "quality" for p in spec.params)
    if quality not in served or (quality != caching.LOSSLESS and not takes_quality):
        raise Refused(f"{workflow} does not serve --quality {quality}; it serves {', '.join(served)}")
    try:
        check_components(model_dir, needed(workflow))
    except MissingComponent as exc:
        raise Refused(f"--model-dir is not a {workflow} model folder: {exc}") from exc
    raw = {**PARAMS[workflow], **({"quality": quality} if takes_quality else {}),
           **({"num_inference_steps": steps} if steps else {})}
    try:
        params = spec.bound(spec.limits_of(str(model_dir))).resolve_params(raw)
    except (InvalidRequest, OSError, ValueError) as exc:
        raise Refused(f"the bench's {workflow} request {raw} is not valid for the model in {model_dir}: "
                      f"{exc}") from exc
    return params, variants.image_inputs(workflow, params)


def describe_inputs(inputs: dict[str, bytes], params: dict[str, Any]) -> dict[str, str]:
    """What a record says of the request's input files: name -> "blank png WxH"."""
    return {name: f"blank png {params['width']}x{params['height']}" for name in inputs}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


# -- baselines: the one-call pipeline -------------------------------------------------------------------


class OneCall:
    """The warm one-call pipeline in this process, at its best intra-op thread count (1..cores)."""

    def __init__(self, model_dir: str, params: dict[str, Any], device: str = "cpu", tries: int = 5,
                 inputs: dict[str, bytes] | None = None, cache: caching.CacheSettings | None = None) -> None:
        self.params, self.inputs, self.device, self.tries = params, inputs or {}, device, tries
        self.pipe = _load_pipeline(model_dir, device, image=bool(self.inputs), cache=cache)
        self.by_threads: dict[int, float] = {}
        self.threads = 1
        self.tune()

    def tune(self) -> float:
        """Times ``tries`` calls in a row at each thread count, keeps the fastest count; returns its median
        (the isolated one-call latency on the host as it is now)."""
        import torch

        for threads in range(1, _cores() + 1):
            torch.set_num_threads(threads)
            self.call()  # the first run of each setting warms up
            self.by_threads[threads] = statistics.median(self.call() for _ in range(self.tries))
        self.threads = min(self.by_threads, key=lambda t: self.by_threads[t])
        torch.set_num_threads(self.threads)
        return self.by_threads[self.threads]

    def call(self) -> float:
        t0 = time.perf_counter()
        _one_call(self.pipe, self.params, self.device, inputs=self.inputs)
        return time.perf_counter() - t0


def side_by_side(client: Client, one: OneCall, workflow: str, n: int) -> list[tuple[float, float]]:
    """(staged seconds, one-call seconds) pairs, the two run alternately so that both see the same host; a
    staged request that did not complete leaves its pair out."""
    for _ in range(2):  # warm the workers
        client.run_one(workflow, one.params, one.inputs)
    pairs, other = [], []
    for _ in range(n):
        state, took = client.run_one(workflow, one.params, one.inputs)
        base = one.call()
        if state == "completed":
            pairs.append((took, base))
        else:
            other.append(state)
    if not pairs:
        raise SystemExit(f"error: no staged request completed ({', '.join(sorted(set(other)))}): is the engine "
                         f"serving {workflow}?")
    return pairs


def _monolith_worker(model_dir: str, params: dict[str, Any], threads: int, device: str, ready: Any, go: Any,
                     window: tuple[float, float] | Any, out: Any, batch: int = 1,
                     inputs: dict[str, bytes] | None = None, cache: caching.CacheSettings | None = None) -> None:
    """One monolithic replica: the whole pipeline per request (or per ``batch`` requests), with its share of
    the cores (``inputs``, ``cache``: as :class:`OneCall`'s)."""
    from engine.worker.threads import apply_env

    apply_env(os.environ, threads)  # as a stage worker's budget, before torch loads (spawned: nothing is yet)
    import torch

    torch.set_num_threads(threads)
    pipe = _load_pipeline(model_dir, device, image=bool(inputs), cache=cache)
    _one_call(pipe, params, device, batch, inputs)  # warm-up
    ready.put(os.getpid())
    go.wait()
    seconds = window.value
    done, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        _one_call(pipe, params, device, batch, inputs)
        done += batch
    out.put(done)


def monolith_capacity(model_dir: str, params: dict[str, Any], seconds: float, device: str = "cpu",
                      batch: int = 1, ks: list[int] | None = None, inputs: dict[str, bytes] | None = None,
                      cache: caching.CacheSettings | None = None) -> tuple[float, int, dict[int, float]]:
    """(requests/s, best K, requests/s per K): the one-call pipeline in K processes on the same cores, each
    call serving ``batch`` requests (``inputs``, ``cache``: as :class:`OneCall`'s)."""
    ctx = mp.get_context("spawn")
    per_k: dict[int, float] = {}
    cores = _cores()
    for k in ks or range(1, cores + 1):
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        window = ctx.Value("d", seconds)
        procs = [ctx.Process(target=_monolith_worker, daemon=True,
                             args=(model_dir, params, max(1, cores // k), device, ready, go, window, out, batch,
                                   inputs, cache))
                 for _ in range(k)]
        with released_together(procs, ready, go) as t0:
            done = sum(out.get(timeout=seconds + 300) for _ in procs)
            # every replica stops at its first request ending past the window: count the time they took
            per_k[k] = done / max(seconds, time.perf_counter() - t0)
    best = max(per_k, key=lambda k: per_k[k])
    return per_k[best], best, per_k


# -- the engine under load: an asyncio client that sends on schedule ---------------------------------------


async def saturate(proxy: str, workflow: str, params: dict[str, Any], in_flight: int, seconds: float,
                   max_windows: int = 5, meter: ControlPlaneMeter | None = None,
                   inputs: dict[str, bytes] | None = None) -> tuple[float, list[float]]:
    """(capacity, completions per second in each window) with ``in_flight`` requests kept in the engine: a
    closed loop that never lets a stage run dry. The Node Manager reacts to the load (it moves instances
    to the bottleneck, and a moved instance takes seconds to start), so windows of ``seconds`` follow one
    another until one is no better than 5% above the best before it (at most ``max_windows``); the
    capacity is the last window, one window of the configuration the engine settled on, as each monolith
    configuration gets one (the best of several would favour the side measured more often). The pipeline fills for min(3 s, seconds/4) before the first window.
    ``meter`` is told when the windows begin and end, and how many requests completed in between; every request
    carries ``inputs``."""
    client = AsyncClient(proxy)
    windows: list[float] = []
    t0 = time.perf_counter() + min(3.0, seconds / 4)
    finished: list[float] = []
    stop = False

    async def loop() -> None:
        while not stop:
            status, doc = await client.submit(workflow, params, None, inputs)
            if status != 202:
                await asyncio.sleep(0.05)
                continue
            if await client.wait(doc["uid"], 300) == "completed":
                finished.append(time.perf_counter())

    async def judge() -> None:
        nonlocal stop
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        if meter is not None:
            meter.begin()
        while len(windows) < max_windows:
            start = time.perf_counter()
            await asyncio.sleep(seconds)
            end = time.perf_counter()
            windows.append(sum(1 for t in finished if start <= t < end) / (end - start))
            if len(windows) >= 2 and windows[-1] <= 1.05 * max(windows[:-1]):
                break
        if meter is not None:
            meter.end(sum(1 for t in finished if t >= t0), time.perf_counter() - t0)
        stop = True

    try:
        await asyncio.gather(judge(), *(loop() for _ in range(in_flight)))
    finally:
        await client.close()
    return windows[-1], windows


async def open_loop(proxy: str, workflow: str, params: dict[str, Any], rate: float, seconds: float, seed: int,
                    deadline_s: float, inputs: dict[str, bytes] | None = None) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``seconds``; every request carries ``deadline_s`` (and ``inputs``) and is
    timed from its scheduled send. Waits (bounded) until every accepted request has ended."""
    rng = random.Random(seed)
    client = AsyncClient(proxy)
    outcomes: list[tuple[str, float, float]] = []  # (state or "refused"/"error N", scheduled send, end)
    told: list[tuple[float, float, float]] = []  # (p50, p90 the Proxy said at submit, seconds from then to the end)
    provisional: list[bool] = []
    served: list[float] = []  # a refusal's time from the actual send to its answer (the server's share)
    lag: list[float] = []  # how late the client sent (its own scheduling delay), for the record
    start = time.perf_counter() + 0.05
    tasks: list[asyncio.Task[None]] = []

    async def one(at: float) -> None:
        sent = time.perf_counter()
        lag.append(sent - at)
        try:
            status, doc = await client.submit(workflow, params, deadline_s, inputs)
        except Exception as exc:
            outcomes.append((f"error {type(exc).__name__}", at, time.perf_counter()))
            return
        if status != 202:
            outcomes.append(("refused" if status == 503 else f"error {status}", at, time.perf_counter()))
            if status == 503:
                served.append(time.perf_counter() - sent)
            return
        accepted_at = time.perf_counter()
        state = await client.wait(doc["uid"], deadline_s + 60)
        outcomes.append((state, at, time.perf_counter()))
        if state == "completed" and "eta_s" in doc:
            told.append((doc["eta_s"], doc["eta_p90_s"], time.perf_counter() - accepted_at))
            provisional.append(bool(doc.get("provisional")))

    try:
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(start + t)))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return {"rate_rps": rate, "offered": len(tasks), **figures.open_loop_row(outcomes, served, lag, start, seconds, deadline_s),
            **figures.eta_fields(told, provisional)}


async def priority_overload(proxy: str, workflow: str, params: dict[str, Any], rate: float, seconds: float,
                            seed: int, high_share: float = 0.25, wait_s: float = 300,
                            inputs: dict[str, bytes] | None = None) -> dict[str, dict[str, Any]]:
    """Poisson arrivals at ``rate`` for ``seconds``, each ``high`` with probability ``high_share`` and else
    ``low``, without deadlines (so that a low one is only refused or served, never expired: whether it
    starves shows); timed from its scheduled send. priority -> offered, accepted, completed, refused,
    not_finished and latencies of the completed."""
    rng = random.Random(seed)
    client = AsyncClient(proxy)
    outcomes: dict[str, list[tuple[str, float]]] = {"high": [], "low": []}
    start = time.perf_counter() + 0.05
    tasks: list[asyncio.Task[None]] = []

    async def one(at: float, priority: str) -> None:
        try:
            status, doc = await client.submit(workflow, params, None, inputs, priority=priority)
        except Exception as exc:
            outcomes[priority].append((f"error {type(exc).__name__}", time.perf_counter() - at))
            return
        if status != 202:
            outcomes[priority].append(("refused" if status == 503 else f"error {status}", time.perf_counter() - at))
            return
        outcomes[priority].append((await client.wait(doc["uid"], wait_s), time.perf_counter() - at))

    try:
        t = 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            if (delay := start + t - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(start + t, "high" if rng.random() < high_share else "low")))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    out = {}
    for priority, rows in outcomes.items():
        done = [s for st, s in rows if st == "completed"]
        refused = sum(1 for st, _ in rows if st == "refused")
        out[priority] = {"offered": len(rows), "accepted": len(rows) - refused - sum(st.startswith("error") for st, _ in rows),
                         "completed": len(done), "refused": refused,
                         "not_finished": sum(1 for st, _ in rows if st == "timeout"),
                         "p50_s": _pct(done, 0.5), "p99_s": _pct(done, 0.99), "max_s": max(done, default=None)}
    return out


def priority_and_eta_figures(proxy: str, workflow: str, params: dict[str, Any], capacity: float, seconds: float,
                    rows: list[dict[str, Any]], unloaded: list[float], seed: int,
                    inputs: dict[str, bytes] | None = None) -> dict[str, Any]:
    """``eta_calibration`` (the open-loop rows' ETA fields at 0.5x and 1x) and ``priority_2x`` (run now)."""
    keys = ("eta_jobs", "eta_within_p50_share", "eta_p90_coverage", "eta_provisional_share",
            "eta_p50_median_rel_error", "eta_p50_within_50pct_share", "eta_constant_median_rel_error",
            "eta_constant_within_50pct_share", "eta_p50_beats_constant")
    calibration = {f"{r['load_x_capacity']}x": {k: r[k] for k in keys} for r in rows
                   if r["load_x_capacity"] in (0.5, 1.0)}
    pr = asyncio.run(priority_overload(proxy, workflow, params, 2 * capacity, seconds, seed=seed, inputs=inputs))
    return {"eta_calibration": calibration, "priority_2x": figures.priority_figure(pr, unloaded, 2 * capacity, 0.25)}


@contextmanager
def hogs(n: int) -> Any:
    """``n`` processes that each keep one core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def monolith_figures(model_dir: str, params: dict[str, Any], seconds: float, device: str,
                     batches: tuple[int, ...], inputs: dict[str, bytes] | None = None,
                     cache: caching.CacheSettings | None = None) -> dict[str, Any]:
    """The monolith baselines: the one-call pipeline in K processes (K the best of 1..cores), then batched
    at each of ``batches`` with that K; one window per configuration (``inputs``, ``cache``: as
    :class:`OneCall`'s)."""
    mono, k, per_k = monolith_capacity(model_dir, params, seconds, device, inputs=inputs, cache=cache)
    by_batch = {b: monolith_capacity(model_dir, params, seconds, device, b, [k], inputs, cache)[0]
                for b in batches}
    best_b = max(by_batch, key=lambda b: by_batch[b]) if by_batch else None
    return {"monolith_capacity_rps": mono, "monolith_processes": k,
            "monolith_rps_by_processes": {str(kk): v for kk, v in per_k.items()},
            "batched_monolith_rps_by_batch": {str(b): v for b, v in by_batch.items()},
            "batched_monolith_batch": best_b, "batched_monolith_capacity_rps": by_batch.get(best_b) if best_b else None}


def run(proxy: str, model_dir: str, workflow: str, n: int, seconds: float, deadline_s: float, hog: int = 0,
        saturate_in_flight: int = 16, device: str = "cpu", loads: tuple[float, ...] = LOADS,
        processes: dict[str, int] | None = None, batches: tuple[int, ...] = (2, 4, 8),
        single_stage: bool = False, single_stage_instances: int | None = None,
        mix_model_dirs: dict[str, str] | None = None, quality: str = caching.LOSSLESS,
        steps: int | None = None) -> dict[str, Any]:
    """Every figure, for :func:`request`'s request of ``workflow`` at ``quality`` on both sides (the staged
    requests carry the level, the one-call pipelines run diffusers' hook of its settings); ``processes`` (role
    -> pid of the engine's processes) adds the control plane's CPU per completed request while saturated
    (:mod:`engine.bench.cpu`). ``single_stage`` adds the single-stage baseline (sd-t2i only) and
    ``mix_model_dirs`` (workflow -> model folder) the mixed run against a monolith per workflow, each on a
    private engine of its own (:mod:`engine.bench.variants`) while the live one idles."""
    from engine.workflow import get_workflow

    params, inputs = request(workflow, model_dir, quality, steps)
    cache = caching.settings(workflow, quality)
    client = Client(proxy)
    hops = len(get_workflow(workflow).route()) - 1
    out: dict[str, Any] = {"workflow": workflow, "quality": quality, "params": params,
                           "inputs": describe_inputs(inputs, params), "stage_hops": hops, "hog": hog,
                           "cores": _cores(), "deadline_s": deadline_s}
    one = OneCall(model_dir, params, device, tries=max(3, min(n, 5)), inputs=inputs, cache=cache)
    if hog:  # isolation: the quiet side by the same protocol as the loaded one (interleaved pairs)
        quiet = figures.latency_figures(side_by_side(client, one, workflow, n), one.by_threads[one.threads], hops)
        out.update({f"{k}_quiet": v for k, v in quiet.items() if k != "staged_latency_p50_s"},
                   staged_latency_p50_quiet_s=quiet["staged_latency_p50_s"])
    with hogs(hog):
        isolated = one.tune() if hog else one.by_threads[one.threads]  # the one-call at its best on this host
        pairs = side_by_side(client, one, workflow, n)
        staged = [s for s, _ in pairs]
        out.update(figures.latency_figures(pairs, isolated, hops), one_call_threads=one.threads,
                   one_call_p50_by_threads={str(k): v for k, v in one.by_threads.items()})
        del one
        if hog:
            out["hog_vs_quiet_p50"] = out["staged_latency_p50_s"] / out["staged_latency_p50_quiet_s"]
            out["one_call_hog_vs_quiet_p50"] = out["one_call_latency_p50_s"] / out["one_call_latency_p50_s_quiet"]
        out.update(monolith_figures(model_dir, params, seconds, device, batches, inputs, cache))
        mono = out["monolith_capacity_rps"]
        meter = ControlPlaneMeter(processes) if processes else None
        capacity, windows = asyncio.run(saturate(proxy, workflow, params, saturate_in_flight, seconds, meter=meter,
                                                 inputs=inputs))
        if meter is not None:
            out.update(meter.report())
        batched = out["batched_monolith_capacity_rps"]
        out.update(capacity_windows_rps=windows, capacity_rps=capacity, saturate_in_flight=saturate_in_flight,
                   staged_vs_monolith_capacity=capacity / mono,
                   staged_vs_batched_monolith_capacity=capacity / batched if batched else None)
        rows = open_loop_rows(proxy, workflow, params, capacity, loads, seconds, deadline_s, inputs, processes)
        out["open_loop"] = rows
        out.update(priority_and_eta_figures(proxy, workflow, params, capacity, seconds, rows, staged, seed=len(loads),
                                   inputs=inputs))
        out.update(baselines_on_private_engines(model_dir, seconds, saturate_in_flight, device, single_stage,
                                                single_stage_instances, mix_model_dirs))
    return out


def open_loop_rows(proxy: str, workflow: str, params: dict[str, Any], capacity: float, loads: tuple[float, ...],
                   seconds: float, deadline_s: float, inputs: dict[str, bytes] | None,
                   processes: dict[str, int] | None) -> list[dict[str, Any]]:
    """One open-loop run per load (a multiple of ``capacity``), each with the Proxy's refusal delays."""
    rows = []
    waits = RunQueueMeter((processes or {}).get("proxy"))  # the refusals' scheduling delay, measured
    for i, f in enumerate(loads):
        waits.begin()
        r = asyncio.run(open_loop(proxy, workflow, params, capacity * f, seconds, seed=i, deadline_s=deadline_s,
                                  inputs=inputs))
        r.update(waits.end())
        r["load_x_capacity"] = f
        r["goodput_busy_x_capacity"] = r["goodput_busy_rps"] / capacity
        r["goodput_in_window_x_capacity"] = r["goodput_in_window_rps"] / capacity
        rows.append(r)
    return rows


def baselines_on_private_engines(model_dir: str, seconds: float, in_flight: int, device: str = "cpu",
                                 single_stage: bool = True, single_stage_instances: int | None = None,
                                 mix_model_dirs: dict[str, str] | None = None) -> dict[str, Any]:
    """The single-stage engine and the mixed run (:mod:`engine.bench.variants`)."""
    out: dict[str, Any] = {}
    if single_stage:
        out.update(variants.single_stage(model_dir, seconds, in_flight, single_stage_instances))
    if mix_model_dirs:
        out.update(variants.mixed(mix_model_dirs, seconds, in_flight, device))
    return out


def _floats(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not out or any(not (x > 0) for x in out):
        raise argparse.ArgumentTypeError(f"every value must be above 0, got {text!r}")
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not out or any(x < 2 for x in out):
        raise argparse.ArgumentTypeError(f"every batch size must be at least 2, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``onepiece bench e2e``."""
    p.add_argument("--proxy", default=None, help="the Proxy's URL (onepiece up prints it; required but with --adapters)")
    p.add_argument("--model-dir", required=True, help="the workflow's model folder, for the one-call baseline")
    p.add_argument("--workflow", default="sd-t2i", choices=sorted(PARAMS),
                   help="the workflow measured, with a small request of its own (images 64x64, videos 32x32 with 5 "
                   "frames; a blank png where it takes an image, on both sides); --model-dir must be its folder")
    p.add_argument("--quality", default=caching.LOSSLESS, metavar="LEVEL",
                   help="the quality level of every request (lossless, extra-high, high; default lossless); the "
                   "one-call baselines run diffusers' cache hook with the level's settings. A level the workflow "
                   "does not serve is refused")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="num_inference_steps of every request, both sides (default: the workflow's bench request's: "
                   "3 for sd-t2i, 8 for the FLUX.1 and Qwen-Image ones, the video ones' own); over the model's "
                   "limit is refused")
    p.add_argument("--requests", type=int, default=10, help="sequential requests for the latency figure")
    p.add_argument("--seconds", type=float, default=15.0, help="duration of the capacity and each load run")
    p.add_argument("--deadline-s", type=float, default=10.0, help="deadline every open-loop request carries")
    p.add_argument("--hog", type=int, default=0, metavar="N",
                   help="run N processes that each keep one core busy beside the engine for the whole run "
                   "(after a quiet latency measurement, reported beside it)")
    p.add_argument("--saturate", type=int, default=16, metavar="N",
                   help="requests kept in flight to measure capacity (enough to keep every stage busy)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device of the one-call baselines")
    p.add_argument("--state", default=None, metavar="DIR",
                   help="onepiece up's state folder (its processes.json names the processes whose CPU is the "
                   "control plane's); default: two folders above --model-dir")
    p.add_argument("--no-single-stage", action="store_true",
                   help="skip the single-stage baseline (sd-t2i as one stage on a private engine; only with "
                   "--workflow sd-t2i)")
    p.add_argument("--single-stage-instances", type=int, default=None, metavar="N",
                   help="instances of the single-stage baseline (default: one per usable core)")
    p.add_argument("--no-mixed", action="store_true",
                   help="skip the mixed run of sd-t2i, wan2.1-t2v and wan2.1-i2v against a monolith per workflow")
    p.add_argument("--mix-models", default=None, metavar="DIR",
                   help="the mixed run's model folders, one per workflow (default: --model-dir's parent; "
                   "onepiece models make-tiny --out DIR builds them)")
    p.add_argument("--no-stream", action="store_true",
                   help="skip the streamed-video figure (first_fragment_vs_complete, wan2.1-t2v)")
    p.add_argument("--loads", type=_floats, default=LOADS, metavar="X,...",
                   help="open-loop loads as multiples of the measured capacity (default: 0.5,1,2,10)")
    p.add_argument("--batches", type=_ints, default=(2, 4, 8), metavar="B,...",
                   help="batch sizes of the batched one-call baseline (default: 2,4,8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="instead: requests spread over N LoRA adapters on one denoise pool (a private engine) vs a "
                   "monolith per adapter and one loading on demand, on the same cores (engine.bench.adapters)")


def main(args: Any) -> int:
    if args.adapters:  # LoRA adapters on one pool
        return adapters.main(args)
    if not args.proxy:
        print("error: --proxy is required (the proxy: line of onepiece up)", file=sys.stderr)
        return 2
    try:  # the workflow, the level and the request checked before any work
        params, _ = request(args.workflow, args.model_dir, args.quality, args.steps)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _warn_cache_idle(args.workflow, args.quality, params)
    single_stage = not args.no_single_stage
    if single_stage and args.workflow != "sd-t2i":
        single_stage = False
        print(f"single-stage baseline skipped: it serves sd-t2i only (--workflow {args.workflow})", file=sys.stderr)
    state = args.state or str(Path(args.model_dir).resolve().parents[1])
    if not _credential(args.proxy, state):
        return 2
    if _ready_checks(args.proxy).get(f"routes:{args.workflow}") == "none":
        print(f"error: the engine behind {args.proxy} does not serve {args.workflow} (onepiece up --workflows "
              f"{args.workflow})", file=sys.stderr)
        return 2
    processes = roles_from_state(state)
    if not processes:
        print(f"no processes.json under {state}: the control plane's CPU is not measured (--state)", file=sys.stderr)
    before = figures.provenance()
    result = run(args.proxy, args.model_dir, args.workflow, args.requests, args.seconds, args.deadline_s,
                 hog=args.hog, saturate_in_flight=args.saturate, device=args.device, processes=processes,
                 loads=tuple(args.loads), batches=tuple(args.batches),
                 single_stage=single_stage, single_stage_instances=args.single_stage_instances,
                 mix_model_dirs=None if args.no_mixed else _mix_models(args), quality=args.quality,
                 steps=args.steps)
    if not args.no_stream:  # streamed video: first playable fragment against completion
        if _ready_checks(args.proxy).get(f"routes:{stream.WORKFLOW}") == "ok":
            result.update(stream.figure(args.proxy))
        else:
            print(f"streamed-video figure skipped: the engine does not serve {stream.WORKFLOW} (onepiece up "
                  f"--workflows {args.workflow},{stream.WORKFLOW}; --no-stream skips it)", file=sys.stderr)
    result["provenance"] = with_load_after(before)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        report.print_text(result)
    return 0


def _warn_cache_idle(workflow: str, quality: str, params: dict[str, Any]) -> None:
    """A note on stderr where the level's cache predicts no step of the request (all its steps are the cache's
    full warm-up ones): the figures are then lossless's."""
    s = caching.settings(workflow, quality)
    if s is not None and int(params["num_inference_steps"]) <= s.disable_cache_before_step:
        print(f"note: at {params['num_inference_steps']} steps --quality {quality} predicts no step of {workflow} "
              f"(its first {s.disable_cache_before_step} steps run in full)", file=sys.stderr)


def _credential(proxy: str, state: str) -> bool:
    """Whether the Proxy takes our credential: ONEPIECE_PROXY_TOKEN, else the one `onepiece up` generated in
    its state folder (printed to stderr and False when refused, or when nothing answers at ``proxy``)."""
    from engine import envs

    token = Path(state) / "secrets" / "proxy-token"
    if not envs.PROXY_TOKEN and token.is_file():
        os.environ["ONEPIECE_PROXY_TOKEN"] = token.read_text().strip()
    try:
        status, _ = _call(f"{proxy.rstrip('/')}/v1/workflows")
    except OSError as exc:  # URLError: nothing listens there
        print(f"error: no Proxy answers at {proxy} ({exc}): the proxy: line of onepiece up", file=sys.stderr)
        return False
    if status in (401, 403):
        print(f"error: the Proxy refused the credential ({status}): set ONEPIECE_PROXY_TOKEN, or --state to the "
              "folder of the onepiece up that runs it (its secrets/proxy-token)", file=sys.stderr)
        return False
    return True


def _ready_checks(proxy: str) -> dict[str, str]:
    """The Proxy's readiness checks (``routes:<workflow>``: ``ok`` where an instance of its first stage is up)."""
    _, ready = _call(f"{proxy.rstrip('/')}/readyz")
    return ready.get("checks", {}) if isinstance(ready, dict) else {}


def _mix_models(args: Any) -> dict[str, str] | None:
    """workflow -> model folder for the mixed run, or None (said why) when a folder is missing."""
    models = Path(args.mix_models or Path(args.model_dir).resolve().parent)
    mix = {wf: str(models / wf) for wf in variants.MIX_WORKFLOWS if (models / wf / "model_index.json").is_file()}
    if len(mix) < len(variants.MIX_WORKFLOWS):
        print(f"mixed run skipped: {models} lacks {sorted(set(variants.MIX_WORKFLOWS) - set(mix))} "
              "(onepiece models make-tiny builds them)", file=sys.stderr)
        return None
    return mix


