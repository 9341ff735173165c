"""``onepiece bench e2e``'s baselines that need a deployment of their own.

Both run a private one-node engine (:mod:`engine.bench.private`: the same Proxy, rings, store and node code
as any deployment, with redis and etcd of its own), on the cores the live engine leaves idle meanwhile.

- **single stage** (``staged_vs_single_stage_capacity``): one engine serving sd-t2i both ways at once, as
  its four stages (``default_assignment``) and as one stage running the whole one-call pipeline
  (:mod:`engine.bench.single_stage`, ``single_stage_instances`` instances, one per core by default so that
  both sides can use every core); each side saturated in turn through the same Proxy; one request of each
  with the same seed checks their png bytes are equal (``single_stage_output_equal``).
- **mixed** (``mixed_vs_monolith_capacity``): sd-t2i, wan2.1-t2v and wan2.1-i2v at small sizes, an equal
  mix (requests go round the three workflows in turn), on the engine deployed as
  ``engine.worker.config.default_assignment(models)`` gives it (one instance per stage, or per stage pool
  where workflows share components), against the best monolith deployment of the same mix, searched over
  processes x threads (:func:`mix_configs`: a process per workflow, or K processes each serving every
  workflow) and fed the same closed loop. Memory, each side summed over its processes: ``staged_rss_mb`` /
  ``monolith_rss_mb`` (peak resident, VmHWM: a shared page counts once per process that maps it) and
  ``staged_pss_mb`` / ``monolith_pss_mb`` (proportional, from smaps_rollup: shared pages split); the staged
  side's include its Proxy, node, redis and etcd (``staged_*_breakdown_mb`` per role).

Capacity: ``in_flight`` requests kept in the engine, and after a fill, one window of ``seconds`` per
configuration on both sides (the assignments here are static). Both sides encode their outputs (png, mp4).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.bench.cpu import vm_hwm_mb
from engine.bench.figures import pss_kb
from engine.bench.harness import PARAMS, AsyncClient, _load_pipeline, _one_call
from engine.bench.single_stage import MODULE as SINGLE_MODULE
from engine.bench.single_stage import NAME as SINGLE
from engine.bench.single_stage import STAGE as SINGLE_STAGE
from engine.store import keys

MIX_WORKFLOWS = ("sd-t2i", "wan2.1-t2v", "wan2.1-i2v")
#: bench e2e's own small requests (engine.bench.e2e.PARAMS)
MIX_PARAMS: dict[str, dict[str, Any]] = {wf: PARAMS[wf] for wf in MIX_WORKFLOWS}

Job = tuple[str, dict[str, Any], dict[str, bytes]]  # (workflow, params, request inputs)


def _cores() -> int:
    from engine.worker.threads import usable_cores

    return usable_cores()


def image_inputs(workflow: str, params: dict[str, Any]) -> dict[str, bytes]:
    """A blank png of the request's size for each image input of ``workflow`` (none for the others)."""
    from engine.workflow import get_workflow
    from engine.workflow.images import blank_png

    return {name: blank_png(params["width"], params["height"]) for name in get_workflow(workflow).image_inputs()}


def mix_jobs(workflows: Sequence[str] = MIX_WORKFLOWS) -> list[Job]:
    """One small request per workflow, with a png for the workflows that take an image."""
    return [(wf, MIX_PARAMS[wf], image_inputs(wf, MIX_PARAMS[wf])) for wf in workflows]


async def saturate_mix(proxy: str, token: str | None, jobs: Sequence[Job], in_flight: int, seconds: float,
                       max_windows: int = 1) -> tuple[float, list[float], dict[str, int], dict[str, int]]:
    """(capacity, completions per second in each window, completions per workflow in the windows, completions
    per workflow in the whole run: the fill, the windows and the requests in flight at the end) with
    ``in_flight`` requests kept in the engine, each new request the next of ``jobs`` in turn. The private
    engine's assignment is static, so one window after the fill measures its configuration (as one window
    measures each monolith's); with ``max_windows`` > 1, windows follow until one is no better than 5% above
    the best before it, and the capacity is the last. A window lasts ``seconds`` and, past them, until it holds
    ``in_flight`` completions (at most 30x ``seconds``): on a host slower than the window is long, a window
    with no completion would say 0 requests/s, which is no measurement."""
    client = AsyncClient(proxy, token)
    turn = itertools.count()
    finished: list[tuple[float, str]] = []
    windows: list[float] = []
    t0 = time.perf_counter() + min(3.0, seconds / 4)
    counted: dict[str, int] = {}
    stop = False
    completed = asyncio.Event()  # set at each completion (the judge's wait for a window's last ones)

    async def loop() -> None:
        while not stop:
            wf, params, inputs = jobs[next(turn) % len(jobs)]
            status, doc = await client.submit(wf, params, None, inputs)
            if status != 202:
                await asyncio.sleep(0.05)
                continue
            if await client.wait(doc["uid"], 300) == keys.COMPLETED:
                finished.append((time.perf_counter(), wf))
                completed.set()

    async def judge() -> None:
        nonlocal stop
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        first = time.perf_counter()
        while len(windows) < max_windows:
            start = time.perf_counter()
            await asyncio.sleep(seconds)
            while sum(1 for t, _ in finished if t >= start) < in_flight \
                    and (left := start + 30 * seconds - time.perf_counter()) > 0:
                completed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(completed.wait(), left)
            end = time.perf_counter()
            windows.append(sum(1 for t, _ in finished if start <= t < end) / (end - start))
            if len(windows) >= 2 and windows[-1] <= 1.05 * max(windows[:-1]):
                break
        for t, wf in finished:
            if t >= first:
                counted[wf] = counted.get(wf, 0) + 1
        stop = True

    try:
        await asyncio.gather(judge(), *(loop() for _ in range(in_flight)))
    finally:
        await client.close()
    served: dict[str, int] = {}
    for _, wf in finished:
        served[wf] = served.get(wf, 0) + 1
    return windows[-1], windows, counted, served


async def _results(proxy: str, token: str, jobs: Sequence[Job]) -> list[bytes | None]:
    """Each job once, one after the other: its result's bytes (None if it did not complete)."""
    client = AsyncClient(proxy, token)
    out: list[bytes | None] = []
    try:
        for wf, params, inputs in jobs:
            status, doc = await client.submit(wf, params, None, inputs)
            if status != 202 or await client.wait(doc["uid"], 300) != keys.COMPLETED:
                out.append(None)
                continue
            async with client.session.get(f"{client.proxy}/v1/requests/{doc['uid']}/result") as r:
                out.append(await r.read() if r.status == 200 else None)
    finally:
        await client.close()
    return out


def _assignment(model_dirs: dict[str, str]) -> dict[str, Any]:
    from engine.worker.config import default_assignment

    return json.loads(default_assignment(model_dirs, device="cpu").to_json())


def single_stage(model_dir: str, seconds: float, in_flight: int, instances: int | None = None,
                 work: str | Path | None = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The staged sd-t2i against the same engine serving it as one stage, same run, same cores."""
    from engine.bench.private import PrivateEngine

    n = instances or _cores()
    doc = _assignment({"sd-t2i": model_dir})
    template = doc["instances"][0]
    one = {**template, "workflow": SINGLE, "stage": SINGLE_STAGE, "step_delay_s": 0.0}
    if "also" in one:
        one["also"] = []  # a pool of its own: no other workflow runs the one-call pipeline
    doc["instances"] += [{**one, "id": f"{SINGLE}.{SINGLE_STAGE}.{k}"} for k in range(n)]
    doc["model_dirs"][SINGLE] = model_dir
    params = PARAMS["sd-t2i"]
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-single-", dir=work) as tmp, \
            PrivateEngine(json.dumps(doc), Path(tmp), f"b{os.getpid()}s-", bench_workflows=(SINGLE_MODULE,),
                          log=log) as eng:
        staged_png, single_png = asyncio.run(_results(eng.proxy, eng.token, [("sd-t2i", params, {}),
                                                                              (SINGLE, params, {})]))
        staged, staged_w, _, _ = asyncio.run(saturate_mix(eng.proxy, eng.token, [("sd-t2i", params, {})],
                                                       in_flight, seconds))
        single, single_w, _, _ = asyncio.run(saturate_mix(eng.proxy, eng.token, [(SINGLE, params, {})],
                                                       in_flight, seconds))
    return {"single_stage_capacity_rps": single, "single_stage_windows_rps": single_w,
            "single_stage_instances": n, "single_stage_staged_capacity_rps": staged,
            "single_stage_staged_windows_rps": staged_w,
            "single_stage_output_equal": staged_png is not None and staged_png == single_png,
            "staged_vs_single_stage_capacity": staged / single if single else None}


# -- one monolith per workflow, fed a closed loop ----------------------------------------------------
def _mix_monolith(jobs: Sequence[Job], model_dirs: dict[str, str], threads: int, device: str, ready: Any,
                  inbox: Any, done: Any) -> None:
    """A monolith holding the pipelines of ``jobs``' workflows: serves the workflow names put in ``inbox``
    (None ends it), one request at a time (``bench e2e``'s one-call pipeline: its image given, its png / mp4
    made as the staged side's last stage makes them)."""
    from engine.worker.threads import apply_env

    apply_env(os.environ, threads)
    import torch

    torch.set_num_threads(threads)
    served = {wf: (_load_pipeline(model_dirs[wf], device, image=bool(inputs)), params, inputs)
              for wf, params, inputs in jobs}
    for pipe, params, inputs in served.values():
        _one_call(pipe, params, device, inputs=inputs)  # warm-up
    ready.put(os.getpid())
    while (wf := inbox.get()) is not None:
        pipe, params, inputs = served[wf]
        _one_call(pipe, params, device, inputs=inputs)
        done.put((wf, time.monotonic()))


def mix_configs(workflows: Sequence[str], cores: int) -> list[tuple[str, list[tuple[tuple[str, ...], int]]]]:
    """The monolith deployments the mixed run searches, as (name, [(workflows a process serves, threads)]):
    one process per workflow (cores / workflows threads each, at least 1), and K processes each serving
    every workflow from one queue with cores / K threads, for K in 1..cores (the single-workflow monolith's
    processes x threads search)."""
    wfs = tuple(workflows)
    out = [("per-workflow", [((wf,), max(1, cores // len(wfs))) for wf in wfs])]
    out += [(f"shared-{k}x{max(1, cores // k)}", [(wfs, max(1, cores // k))] * k) for k in range(1, cores + 1)]
    return out


def _closed_loop(send: Callable[[], None], done: Any, in_flight: int, seconds: float) -> tuple[float, list[tuple[float, str]]]:
    """Keeps ``in_flight`` requests outstanding (``send`` one more per completion); after a fill of
    min(3 s, seconds / 4), one window of ``seconds``: (completions per second in it, its completions)."""
    for _ in range(in_flight):
        send()
    start = time.monotonic() + min(3.0, seconds / 4)
    end = start + seconds
    finished: list[tuple[float, str]] = []
    while time.monotonic() < end:
        try:
            wf, t = done.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            continue
        finished.append((t, wf))
        send()
    inside = [(t, wf) for t, wf in finished if start <= t < end]
    return len(inside) / seconds, inside


def _monolith_config(model_dirs: dict[str, str], jobs: Sequence[Job], layout: list[tuple[tuple[str, ...], int]],
                     in_flight: int, seconds: float, device: str) -> dict[str, Any]:
    """One monolith deployment (``layout``, :func:`mix_configs`) fed the staged side's closed loop; its
    capacity (one window) and its processes' peak RSS and PSS, read at the window's end."""
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    by_wf = {wf: wf for wf, _, _ in jobs}
    inboxes: dict[tuple[str, ...], Any] = {wfs: ctx.Queue() for wfs, _ in layout}
    for wfs in inboxes:
        for wf in wfs:
            by_wf[wf] = wfs
    procs = [ctx.Process(target=_mix_monolith, daemon=True,
                         args=([j for j in jobs if j[0] in wfs], model_dirs, threads, device, ready, inboxes[wfs], done))
             for wfs, threads in layout]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=600)
        turn = itertools.count()

        def send() -> None:
            wf = jobs[next(turn) % len(jobs)][0]
            inboxes[by_wf[wf]].put(wf)

        rps, _ = _closed_loop(send, done, in_flight, seconds)
        rss = sum(vm_hwm_mb(p.pid) for p in procs)
        pss = sum(pss_kb(p.pid) for p in procs) / 1024
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        for q in (ready, done, *inboxes.values()):
            q.close()
    return {"rps": rps, "processes": len(procs), "threads": layout[0][1], "rss_mb": rss, "pss_mb": pss}


def monolith_mix(model_dirs: dict[str, str], jobs: Sequence[Job], in_flight: int, seconds: float,
                 device: str = "cpu") -> dict[str, Any]:
    """The best monolith deployment of the mix on the same cores (:func:`mix_configs`, each fed the staged
    side's closed loop for one window); its capacity, and its processes' summed peak RSS and PSS."""
    by_config = {name: _monolith_config(model_dirs, jobs, layout, in_flight, seconds, device)
                 for name, layout in mix_configs([wf for wf, _, _ in jobs], _cores())}
    best = max(by_config, key=lambda n: by_config[n]["rps"])
    b = by_config[best]
    return {"monolith_mix_capacity_rps": b["rps"], "monolith_mix_config": best,
            "monolith_mix_processes": b["processes"], "monolith_mix_threads": b["threads"],
            "monolith_mix_by_config": by_config, "monolith_rss_mb": b["rss_mb"], "monolith_pss_mb": b["pss_mb"]}


def mixed(model_dirs: dict[str, str], seconds: float, in_flight: int, device: str = "cpu",
          work: str | Path | None = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The three workflows' equal mix on the staged engine (``default_assignment``) against the best monolith
    deployment of it (:func:`monolith_mix`), same cores, one after the other."""
    from engine.bench.private import PrivateEngine

    jobs = mix_jobs([wf for wf in MIX_WORKFLOWS if wf in model_dirs])
    doc = _assignment({wf: model_dirs[wf] for wf, _, _ in jobs})
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-mixed-", dir=work) as tmp, \
            PrivateEngine(json.dumps(doc), Path(tmp), f"b{os.getpid()}m-", log=log) as eng:
        asyncio.run(_results(eng.proxy, eng.token, jobs))  # one of each first: every stage warm
        staged, windows, per_wf, served = asyncio.run(saturate_mix(eng.proxy, eng.token, jobs, in_flight, seconds))
        rss, pss = eng.peak_rss_mb(), eng.pss_mb()
    out: dict[str, Any] = {"mixed_workflows": [wf for wf, _, _ in jobs], "mixed_params": MIX_PARAMS,
                           "mixed_instances": len(doc["instances"]), "mixed_capacity_rps": staged,
                           "mixed_windows_rps": windows, "mixed_completed_by_workflow": per_wf,
                           "mixed_served_by_workflow": served,
                           "staged_rss_mb": sum(rss.values()), "staged_rss_breakdown_mb": rss,
                           "staged_pss_mb": sum(pss.values()), "staged_pss_breakdown_mb": pss}
    out.update(monolith_mix(model_dirs, jobs, in_flight, seconds, device))
    mono = out["monolith_mix_capacity_rps"]
    out["mixed_vs_monolith_capacity"] = staged / mono if mono else None
    return out
