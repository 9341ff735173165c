"""``onepiece bench e2e``: the engine end to end against the one-call pipeline, and under open-loop load.

Runs against a live engine (the ``proxy:`` line of ``onepiece up``) and, for the
baseline, the one-call diffusers pipeline in this process on the same model
folder (the ``state:`` line's ``models/<workflow>``), both warm:

1. latency: sequential requests through the Proxy (submit, poll status every
   ``?wait=``, the Proxy's long poll), fetch the result) against the pipeline's own call; the
   difference divided by the number of stage hops is the added cost per hop;
2. capacity: requests in flight kept at the number of instances for a fixed
   time, completions per second;
3. open loop: Poisson arrivals at 0.5x, 1x, 2x and 10x that capacity for a fixed
   time each: goodput, latency p50/p99 of completed requests, rejections and how
   fast they were answered (p99), and whether every accepted request completed.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PARAMS = {"sd-t2i": {"prompt": "a cat on the moon", "height": 64, "width": 64, "num_inference_steps": 3,
                     "seed": 1}}


def _call(url: str, method: str = "GET", body: dict[str, Any] | None = None,
          timeout: float = 60) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, ctype = r.read(), r.status, r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    return status, json.loads(raw) if ctype.startswith("application/json") else raw


class Client:
    def __init__(self, proxy: str, poll_s: float) -> None:
        self.proxy, self.poll_s = proxy.rstrip("/"), poll_s

    def submit(self, workflow: str, params: dict[str, Any], deadline_s: float | None = None
               ) -> tuple[int, Any, float]:
        body: dict[str, Any] = {"workflow": workflow, "params": params}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        t0 = time.perf_counter()
        status, doc = _call(self.proxy + "/v1/requests", "POST", body)
        return status, doc, time.perf_counter() - t0

    def wait(self, uid: str, timeout: float = 300, poll_s: float | None = None) -> str:
        """Wait for the end with the Proxy's long poll (``?wait=``): no client polling loop loading the host."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = min(30.0, max(0.0, deadline - time.monotonic()))
            status, doc = _call(f"{self.proxy}/v1/requests/{uid}?wait={left:.3f}", timeout=left + 30)
            state = doc.get("state") if isinstance(doc, dict) else None
            if state in ("completed", "failed", "cancelled", "expired"):
                return state
            if status != 200:
                time.sleep(self.poll_s if poll_s is None else poll_s)
        return "timeout"

    def run_one(self, workflow: str, params: dict[str, Any]) -> tuple[str, float]:
        t0 = time.perf_counter()
        status, doc, _ = self.submit(workflow, params)
        if status != 202:
            return f"rejected {status}", time.perf_counter() - t0
        state = self.wait(doc["uid"])
        if state == "completed":
            _call(f"{self.proxy}/v1/requests/{doc['uid']}/result")
        return state, time.perf_counter() - t0


def one_call_latency(workflow: str, model_dir: str, params: dict[str, Any], n: int) -> float:
    """Median seconds of the diffusers one-call pipeline, warm, in this process."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    p = {k: v for k, v in params.items() if k != "seed"}
    times = []
    for i in range(n + 1):
        g = torch.Generator().manual_seed(params.get("seed", 0))
        t0 = time.perf_counter()
        pipe(generator=g, output_type="np", **p)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def open_loop(client: Client, workflow: str, params: dict[str, Any], rate: float, seconds: float,
              seed: int, deadline_s: float) -> dict[str, Any]:
    """Poisson arrivals; every request carries ``deadline_s``, so admission can refuse what
    would not start in time. Status is polled every 50 ms here: a load generator that polls
    hard on a small host steals the cores the workers need."""
    rng = random.Random(seed)
    results: list[tuple[str, float]] = []
    rejects: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        t0 = time.perf_counter()
        status, doc, took = client.submit(workflow, params, deadline_s)
        if status != 202:
            with lock:
                rejects.append(took)
            return
        state = client.wait(doc["uid"], poll_s=0.05)
        with lock:
            results.append((state, time.perf_counter() - t0))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool:
        t = 0.0
        while t < seconds:
            t += rng.expovariate(rate)
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one)
    elapsed = time.perf_counter() - start
    done = [lat for state, lat in results if state == "completed"]
    states: dict[str, int] = {}
    for state, _ in results:
        states[state] = states.get(state, 0) + 1
    lat = sorted(done)
    rj = sorted(rejects)
    return {
        "rate_rps": rate, "accepted": len(results), "completed": len(done),
        "not_completed": len(results) - len(done), "accepted_states": states, "rejected": len(rejects),
        "goodput_rps": len(done) / elapsed,
        "latency_p50_s": statistics.median(lat) if lat else None,
        "latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        "reject_latency_p99_ms": rj[min(len(rj) - 1, int(len(rj) * 0.99))] * 1e3 if rj else None,
    }


def run(proxy: str, model_dir: str, workflow: str, n: int, seconds: float, poll_ms: float,
        deadline_s: float) -> dict[str, Any]:
    from engine.workflow import get_workflow

    params = PARAMS[workflow]
    client = Client(proxy, poll_ms / 1000)
    hops = len(get_workflow(workflow).route()) - 1
    for _ in range(2):  # warm the workers
        client.run_one(workflow, params)
    staged = []
    for _ in range(n):
        state, took = client.run_one(workflow, params)
        if state == "completed":
            staged.append(took)
    base = one_call_latency(workflow, model_dir, params, n)
    med = statistics.median(staged)
    # capacity: keep as many requests in flight as there are stages, for a while
    done, t0 = 0, time.perf_counter()
    with ThreadPoolExecutor(max_workers=hops + 1) as pool:
        while time.perf_counter() - t0 < seconds:
            done += sum(1 for s, _ in pool.map(lambda _: client.run_one(workflow, params), range(hops + 1))
                        if s == "completed")
    capacity = done / (time.perf_counter() - t0)
    loads = [open_loop(client, workflow, params, capacity * f, seconds, seed=i, deadline_s=deadline_s)
             for i, f in enumerate((0.5, 1.0, 2.0, 10.0))]
    for f, r in zip((0.5, 1.0, 2.0, 10.0), loads, strict=True):
        r["load_x_capacity"] = f
        r["goodput_x_capacity"] = r["goodput_rps"] / capacity
    return {
        "workflow": workflow, "params": params, "stage_hops": hops,
        "staged_latency_p50_s": med, "one_call_latency_p50_s": base,
        "staged_vs_one_call": med / base, "added_per_hop_ms": (med - base) / hops * 1e3,
        "poll_interval_ms": poll_ms, "capacity_rps": capacity, "deadline_s": deadline_s, "open_loop": loads,
    }


def main(args: Any) -> int:
    result = run(args.proxy, args.model_dir, args.workflow, args.requests, args.seconds, args.poll_ms,
                 args.deadline_s)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['workflow']}: staged p50 {result['staged_latency_p50_s'] * 1e3:.1f} ms vs one-call "
          f"{result['one_call_latency_p50_s'] * 1e3:.1f} ms = {result['staged_vs_one_call']:.2f}x; "
          f"{result['added_per_hop_ms']:.1f} ms added per stage hop ({result['stage_hops']} hops; waited with "
          f"the Proxy's long poll)")
    print(f"capacity: {result['capacity_rps']:.2f} requests/s; open-loop requests carry a "
          f"{result['deadline_s']:.0f} s deadline")
    print(f"{'load':>6} {'offered':>8} {'accepted':>8} {'done':>6} {'rejected':>8} {'goodput':>8} "
          f"{'x cap':>6} {'p50 s':>7} {'p99 s':>7} {'reject p99 ms':>13}")
    for r in result["open_loop"]:
        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        print(f"{r['load_x_capacity']:>5}x {r['rate_rps']:8.2f} {r['accepted']:8d} {r['completed']:6d} "
              f"{r['rejected']:8d} {r['goodput_rps']:8.2f} {r['goodput_x_capacity']:6.2f} "
              f"{f(r['latency_p50_s'], '7.2f')} {f(r['latency_p99_s'], '7.2f')} "
              f"{f(r['reject_latency_p99_ms'], '13.1f')}")
    return 0
