"""``onepiece bench e2e --adapters N``: requests spread over N LoRA adapters on one denoise pool, against a
monolith per adapter and a monolith that loads the adapter each request needs, on the same cores.

1. **pool**: a private engine (:class:`engine.bench.private.PrivateEngine`: its own Redis, etcd,
   ``onepiece node`` and ``onepiece proxy``; one instance per stage plus ``onepiece up``'s spare slots at the
   denoise stage (:func:`with_spare_denoise`), one thread each) whose adapter store
   holds N tiny adapters (``onepiece models make-tiny-lora``, seeds 1..N, registered as ``bench-lora-K``);
   a closed loop keeps ``--saturate`` requests in flight, each naming one of the N adapters at random, and
   completions per second are counted over ``--seconds`` (after a run without adapters on the same engine,
   ``pool_no_adapters_rps``: the staged engine's own figure on this host now). The denoise instance keeps every adapter hot and
   steps requests of different adapters in one batch (one UNet call per adapter set,
   engine.stages.sd.denoise); its adapter load and swap times (p50, p99) come from its report.
2. **a monolith per adapter**: N processes, each the one-call diffusers pipeline with its adapter loaded
   (``load_lora_weights`` + ``set_adapters``) and ``cores // N`` threads (at least 1), each serving its
   adapter's share of the requests in a closed loop: completions per second summed.
3. **a monolith that loads on demand**: K processes (the best K of 1..cores), each serving requests of
   random adapters and swapping its adapter when the next request needs another (``unload_lora_weights`` +
   ``load_lora_weights`` + ``set_adapters``, what a serial worker that merges on change does); load times
   p50/p99 reported.

The figure: the pool's throughput over the better baseline (``pool_vs_best_baseline``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.bench.harness import PARAMS, AsyncClient, _cores, _load_pipeline, _one_call, with_load_after
from engine.procs import released_together
from engine.store import keys

WORKFLOW = "sd-t2i"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def make_adapters(store_root: Path, model_dir: str, n: int, scratch: Path) -> list[tuple[str, str]]:
    """Register ``bench-lora-0..n-1`` (tiny LoRAs, seeds 1..n) in the store at ``store_root``; (name, file)."""
    from engine.adapters.registry import AdapterStore
    from engine.adapters.tiny import make_tiny_lora

    reg = AdapterStore(store_root)
    out = []
    for k in range(n):
        name = f"bench-lora-{k}"
        if reg.get(name) is None:
            reg.add(name, make_tiny_lora(WORKFLOW, scratch / name, k + 1, model_dir=model_dir), WORKFLOW, model_dir)
        out.append((name, str(reg.file(reg.get(name)))))
    return out


# -- the pool: a private engine under a closed loop -------------------------------------------------------
async def _closed_loop(proxy: str, token: str, params: dict[str, Any], names: list[str], in_flight: int,
                       seconds: float, seed: int) -> dict[str, Any]:
    """Completions per second with ``in_flight`` requests kept in the engine, each naming one of ``names``
    at random (none: no adapters)."""
    client = AsyncClient(proxy, token)
    rng = random.Random(seed)
    finished: list[float] = []
    failed = 0
    stop = False
    t0 = time.perf_counter() + min(3.0, seconds / 4)  # the pipeline fills first

    async def loop() -> None:
        nonlocal failed
        while not stop:
            lora = {"lora": [{"name": rng.choice(names), "scale": 1.0}]} if names else {}
            status, doc = await client.submit(WORKFLOW, {**params, "seed": rng.randrange(1 << 30), **lora}, None)
            if status != 202:
                raise RuntimeError(f"the pool refused a request: {status} {doc}")
            if await client.wait(doc["uid"], 300) == keys.COMPLETED:
                finished.append(time.perf_counter())
            else:
                failed += 1

    async def judge() -> None:
        nonlocal stop
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()) + seconds)
        stop = True

    try:
        await asyncio.gather(judge(), *(loop() for _ in range(in_flight)))
    finally:
        await client.close()
    end = t0 + seconds
    done = sum(1 for t in finished if t0 <= t < end)
    return {"rps": done / seconds, "failed": failed}


async def _warm(proxy: str, token: str, params: dict[str, Any], names: list[str]) -> None:
    client = AsyncClient(proxy, token)
    try:
        for lora in [{}] * 2 + [{"lora": [{"name": n, "scale": 1.0}]} for n in names]:
            status, doc = await client.submit(WORKFLOW, {**params, **lora}, None)
            if status != 202 or await client.wait(doc["uid"], 600) != keys.COMPLETED:
                raise RuntimeError(f"a warm-up request did not complete: {status} {doc}")
    finally:
        await client.close()


def with_spare_denoise(assignment: Any) -> Any:
    """The pool's deployment on this host's cores: one instance per stage plus the spare slots ``onepiece up``
    gives a host without a GPU (its usable cores minus one), placed where its Node Manager puts them, at the
    bottleneck (denoise). The baselines use every core; a pool left at one instance per stage would use
    about one (the figure would measure the deployment, not the pool)."""
    import dataclasses

    base = next(i for i in assignment.instances if i.stage == "denoise")
    spare = [dataclasses.replace(base, id=f"{base.workflow}.denoise.{k}") for k in range(1, max(0, _cores() - 1) + 1)]
    return dataclasses.replace(assignment, instances=(*assignment.instances, *spare))


def pool(model_dir: str, adapters: int, seconds: float, in_flight: int, work: Path,
         log: Any = print) -> dict[str, Any]:
    from engine.bench.private import PrivateEngine
    from engine.store import JobStore
    from engine.worker.config import default_assignment

    assignment = with_spare_denoise(default_assignment({WORKFLOW: model_dir}, device="cpu"))
    store_root = work / "state" / "adapters"  # the private engine's ONEPIECE_STATE_DIR/adapters
    names = [n for n, _f in make_adapters(store_root, model_dir, adapters, work / "lora")]
    with PrivateEngine(assignment.to_json(), work, f"bench-{os.getpid()}-lora-", threads_per_instance=1,
                       log=log) as eng:
        # warm: a process's first run pays one-off costs, and each adapter's first request loads it (timed)
        asyncio.run(_warm(eng.proxy, eng.token, PARAMS[WORKFLOW], names))
        # the same engine without adapters first: what the staged pool does on this host now
        plain = asyncio.run(_closed_loop(eng.proxy, eng.token, PARAMS[WORKFLOW], [], in_flight, seconds, 0))
        lora = asyncio.run(_closed_loop(eng.proxy, eng.token, PARAMS[WORKFLOW], names, in_flight, seconds, 1))
        out = {"pool_rps": lora["rps"], "pool_failed": lora["failed"], "pool_no_adapters_rps": plain["rps"]}
        store = JobStore.from_url(eng.services[0].url)
        try:
            reports = {i.id: json.loads(store.instances.read(i.id).get("adapters") or "null")
                       for i in assignment.instances if i.stage == "denoise"}
            batches = {i.id: store.instances.read(i.id) for i in assignment.instances if i.stage == "denoise"}
        finally:
            store.close()
    hot = [r for r in reports.values() if r]
    out.update(pool_denoise_instances=len(reports), pool_adapters_loaded=sorted(a for r in hot for a in r["loaded"]),
               pool_evicted=sum(r["evicted"] for r in hot),
               pool_load_s_p50=max((r["load_s_p50"] or 0.0 for r in hot), default=None),
               pool_load_s_p99=max((r["load_s_p99"] or 0.0 for r in hot), default=None),
               pool_swap_s_p50=max((r["swap_s_p50"] or 0.0 for r in hot), default=None),
               pool_swap_s_p99=max((r["swap_s_p99"] or 0.0 for r in hot), default=None),
               pool_requests={k: int(v.get("requests", 0)) for k, v in batches.items()})
    return out


# -- the monoliths ----------------------------------------------------------------------------------------
def _monolith(model_dir: str, params: dict[str, Any], threads: int, files: list[tuple[str, str]], fixed: bool,
              seed: int, ready: Any, go: Any, seconds: float, out: Any) -> None:
    """One monolithic replica: the one-call pipeline; ``fixed``: files[0] loaded once and kept; else each
    request names a random adapter of ``files`` and the replica swaps when it changes."""
    from engine.worker.threads import apply_env

    apply_env(os.environ, threads)  # a stage worker's budget, before torch loads
    import torch

    torch.set_num_threads(threads)
    pipe = _load_pipeline(model_dir, "cpu")
    rng = random.Random(seed)
    loads: list[float] = []
    current = None

    def use(name: str, path: str) -> None:
        nonlocal current
        if name == current:
            return
        t0 = time.perf_counter()
        if current is not None:
            pipe.unload_lora_weights()
        pipe.load_lora_weights(path, adapter_name=name.replace(".", "_").replace("-", "_"))
        pipe.set_adapters([name.replace(".", "_").replace("-", "_")], [1.0])
        current = name
        loads.append(time.perf_counter() - t0)

    use(*files[0])
    _one_call(pipe, params, "cpu")  # warm-up
    loads.clear()
    ready.put(os.getpid())
    go.wait()
    done, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        if not fixed:
            use(*rng.choice(files))
        _one_call(pipe, {**params, "seed": rng.randrange(1 << 30)}, "cpu")
        done += 1
    out.put((done, loads))


def _replicas(model_dir: str, params: dict[str, Any], seconds: float, plan: list[tuple[int, list, bool]]
              ) -> tuple[float, list[float]]:
    """(completions per second of all replicas together, load times) for replicas (threads, files, fixed)."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_monolith, daemon=True,
                         args=(model_dir, params, threads, files, fixed, k, ready, go, seconds, out))
             for k, (threads, files, fixed) in enumerate(plan)]
    with released_together(procs, ready, go) as t0:
        got = [out.get(timeout=seconds + 300) for _ in procs]
        took = max(seconds, time.perf_counter() - t0)
    return sum(d for d, _ in got) / took, [x for _, loads in got for x in loads]


def monoliths(model_dir: str, files: list[tuple[str, str]], seconds: float) -> dict[str, Any]:
    params = PARAMS[WORKFLOW]
    cores = _cores()
    n = len(files)
    per_adapter, _ = _replicas(model_dir, params, seconds, [(max(1, cores // n), [f], True) for f in files])
    on_demand: dict[int, tuple[float, list[float]]] = {}
    for k in range(1, cores + 1):
        on_demand[k] = _replicas(model_dir, params, seconds, [(max(1, cores // k), files, False)] * k)
    best = max(on_demand, key=lambda k: on_demand[k][0])
    rps, loads = on_demand[best]
    return {"cores": cores, "monolith_per_adapter_rps": per_adapter, "monolith_per_adapter_processes": n,
            "monolith_on_demand_rps": rps, "monolith_on_demand_processes": best,
            "monolith_on_demand_rps_by_k": {str(k): v[0] for k, v in on_demand.items()},
            "monolith_on_demand_loads": len(loads), "monolith_on_demand_load_s_p50": _pct(loads, 0.5),
            "monolith_on_demand_load_s_p99": _pct(loads, 0.99)}


def run(model_dir: str, adapters: int, seconds: float, in_flight: int, log: Any = print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-lora-") as tmp:
        work = Path(tmp)
        result: dict[str, Any] = {"workflow": WORKFLOW, "adapters": adapters, "seconds": seconds,
                                  "saturate_in_flight": in_flight}
        result.update(pool(model_dir, adapters, seconds, in_flight, work / "pool", log))
        files = make_adapters(work / "pool" / "state" / "adapters", model_dir, adapters, work / "lora")
        result.update(monoliths(model_dir, files, seconds))
    best = max(result["monolith_per_adapter_rps"], result["monolith_on_demand_rps"])
    result["pool_vs_best_baseline"] = result["pool_rps"] / best if best else None
    return result


def main(args: Any) -> int:
    """The ``--adapters`` run of ``onepiece bench e2e`` (engine.bench.e2e hands it over)."""
    import sys

    from engine.bench.figures import provenance

    before = provenance()
    r = run(args.model_dir, args.adapters, args.seconds, args.saturate,
            log=lambda s: print(s, file=sys.stderr, flush=True))
    r["provenance"] = with_load_after(before)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    print(f"{r['workflow']}, requests spread over {r['adapters']} LoRA adapters, {r['cores']} cores, "
          f"{r['saturate_in_flight']} in flight:")
    print(f"  one pool (adapters hot, mixed batches): {r['pool_rps']:.2f} requests/s "
          f"({r['pool_denoise_instances']} denoise instance(s), {r['pool_evicted']} evictions, "
          f"{r['pool_failed']} failed); adapter load p50 {ms(r['pool_load_s_p50'])} p99 {ms(r['pool_load_s_p99'])}, "
          f"swap p50 {ms(r['pool_swap_s_p50'])} p99 {ms(r['pool_swap_s_p99'])}")
    print(f"  the same pool without adapters: {r['pool_no_adapters_rps']:.2f} requests/s "
          f"(adapters cost {r['pool_rps'] / r['pool_no_adapters_rps']:.2f}x of it)" if r["pool_no_adapters_rps"] else
          "  the same pool without adapters: no request completed")
    print(f"  a monolith per adapter ({r['monolith_per_adapter_processes']} processes): "
          f"{r['monolith_per_adapter_rps']:.2f} requests/s")
    print(f"  a monolith loading on demand ({r['monolith_on_demand_processes']} process(es), its best): "
          f"{r['monolith_on_demand_rps']:.2f} requests/s, {r['monolith_on_demand_loads']} loads, load p50 "
          f"{ms(r['monolith_on_demand_load_s_p50'])} p99 {ms(r['monolith_on_demand_load_s_p99'])}")
    ratio = r["pool_vs_best_baseline"]
    print(f"  pool vs the better baseline: {ratio:.2f}x" if ratio is not None else "  no baseline completed")
    return 0
