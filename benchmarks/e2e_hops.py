"""Where the time a staged request adds over the one-call pipeline goes, measured on a live engine.

    ONEPIECE_PROXY_TOKEN=... python benchmarks/e2e_hops.py --proxy URL --redis-url URL \
        --model-dir STATE/models/sd-t2i [--requests 30] [--json]

(the ``proxy:``, ``redis:`` and ``state:`` lines of ``onepiece up``; the token and the Redis password are
in ``STATE/secrets/``). Sequential requests through the Proxy; each request's own events give every
stage's compute time in its worker (``stage_finished``'s detail) and the gap between one stage's end and
the next one's start (encode, ring hand-off, wake-up, decode, the store checks). In the same run, the
same stage executors run in this process (one thread, as the workers' budget on this host): once
back to back, and once with a pause before every stage, the way a worker process meets its requests
(it sleeps on its ring while the others run, so its caches are cold and the scheduler may move it). The
ratios attribute the difference: worker compute vs back-to-back compute, vs paused compute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAMS = {"prompt": "a cat on the moon", "height": 64, "width": 64, "num_inference_steps": 3, "seed": 1}


def _events(store: Any, uid: str) -> list[dict[str, str]]:
    """The request's events, oldest first, from the newest end of the stream (it holds every job's)."""
    from engine.store import keys

    out = []
    for _id, fields in store.r.xrevrange(keys.EVENTS, count=500):
        e = {k.decode(): v.decode() for k, v in fields.items()}
        if e["uid"] == uid:
            out.append(e)
    return out[::-1]


def staged(proxy: str, redis_url: str, n: int) -> dict[str, list[float]]:
    from engine.bench.e2e import Client, _call
    from engine.store import JobStore

    store, client = JobStore.from_url(redis_url), Client(proxy)
    for _ in range(3):
        client.run_one("sd-t2i", PARAMS)
    out: dict[str, list[float]] = {}

    def put(k: str, v: float) -> None:
        out.setdefault(k, []).append(v * 1e3)

    for _ in range(n):
        t0 = time.time()
        status, doc = _call(f"{proxy}/v1/requests?workflow=sd-t2i", "POST", {"workflow": "sd-t2i", "params": PARAMS})
        assert status == 202, doc
        client.wait(doc["uid"])
        t_end = time.time()
        _call(f"{proxy}/v1/requests/{doc['uid']}/result")
        put("total (submit to result fetched)", time.time() - t0)
        last = t0
        for e in _events(store, doc["uid"]):
            ts = float(e["ts"])
            if e["type"] == "accepted":
                put("intake (send to accepted)", ts - t0)
            elif e["type"] == "stage_started":
                put(f"gap before {e['stage']}", ts - last)
            elif e["type"] == "stage_finished":
                put(f"worker compute {e['stage']}", float(e["detail"].split("s")[0]))
                last = ts
            elif e["type"] == "completed":
                put("completed -> client told", t_end - ts)
    store.close()
    return out


def in_process(model_dir: str, n: int, pause_s: float) -> dict[str, list[float]]:
    import torch

    from engine.stages.base import StageContext
    from engine.stages.registry import executor_class
    from engine.workflow import get_workflow

    torch.set_num_threads(1)
    spec = get_workflow("sd-t2i")
    params = spec.validate_request(dict(PARAMS), {})
    ex = {st: executor_class("sd-t2i", st)() for st in spec.route()}
    for e in ex.values():
        e.load(model_dir, "cpu")
    out: dict[str, list[float]] = {}
    for i in range(n + 2):
        values: dict[str, Any] = {}
        for st in spec.route():
            if pause_s:
                time.sleep(pause_s)
            t0 = time.perf_counter()
            values.update(ex[st].run(values, params, StageContext()))
            if i >= 2:
                out.setdefault(st, []).append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--pause-ms", type=float, default=50.0, help="pause before each stage in the paused pass")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    live = staged(a.proxy, a.redis_url, a.requests)
    warm = in_process(a.model_dir, a.requests, 0.0)
    paused = in_process(a.model_dir, a.requests, a.pause_ms / 1e3)
    med = {k: statistics.median(v) for k, v in live.items()}
    rows = []
    for st in warm:
        w, c, z = med.get(f"worker compute {st}", 0.0), statistics.median(warm[st]), statistics.median(paused[st])
        rows.append({"stage": st, "worker_ms": w, "back_to_back_ms": c, "paused_ms": z,
                     "worker_vs_back_to_back": w / c, "paused_vs_back_to_back": z / c})
    gaps = {k: v for k, v in med.items() if k.startswith("gap")}
    result = {"requests": a.requests, "pause_ms": a.pause_ms, "stages": rows, "gaps_ms": gaps,
              "other_ms": {k: v for k, v in med.items() if not k.startswith(("gap", "worker compute"))},
              "compute_added_ms": sum(r["worker_ms"] - r["back_to_back_ms"] for r in rows),
              "gaps_total_ms": sum(gaps.values())}
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'stage':14} {'worker ms':>10} {'back-to-back':>13} {'paused':>8} {'worker/b2b':>11} {'paused/b2b':>11}")
    for r in rows:
        print(f"{r['stage']:14} {r['worker_ms']:10.2f} {r['back_to_back_ms']:13.2f} {r['paused_ms']:8.2f} "
              f"{r['worker_vs_back_to_back']:11.2f} {r['paused_vs_back_to_back']:11.2f}")
    for k, v in {**gaps, **result["other_ms"]}.items():
        print(f"{k:36} p50 {v:7.2f} ms")
    print(f"compute added by running in workers: {result['compute_added_ms']:.1f} ms; "
          f"hand-off gaps: {result['gaps_total_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
