"""Price and ETA against the measured time of the FIRST request at each size, on a freshly started engine
(issue 39 item 1: within a factor of 1.5).

    OMP_NUM_THREADS=1 python benchmarks/estimates_sweep.py [--models DIR] [--calibrate-s 2] [--out FILE]

Starts its own redis-server and etcd (engine.embedded), one ``onepiece node`` serving sd-t2i, FLUX.1-schnell,
FLUX.1-dev and wan2.1-t2v (one instance per stage pool, ``default_assignment``) and one ``onepiece proxy``, the
commands an operator runs; ``--models DIR`` serves the folders in DIR (``<workflow>/`` each), else tiny models
are built in a temporary folder first (engine.stages.tiny.models_or_tiny). It waits until every instance has
published its warm-up calibration (engine.worker.calibrate), then, one request at a time on the idle engine:
sd-t2i at 64, 128 and 256 px at its default steps, 512 px at ``--steps-512`` steps (50 would take about 15
minutes of one CPU core with the tiny model: the per-step price is what is checked, the steps multiply it),
then FLUX.1-schnell, FLUX.1-dev and wan2.1-t2v at their defaults. For each, before submitting: the price (the Proxy's
rule, engine.workflow.pricing.Pricer, over the fits the instances published, as the Proxy reads them); the
ETA (``eta_s`` and ``eta_p90_s`` of the Proxy's 202); then the measured time (202 to completed, as the client
sees it) and the ratios. Writes JSON (``--out``, default ``benchmarks/estimates/<date>.json``); the
figures and how they were taken: benchmarks/estimates.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKFLOWS = ["sd-t2i", "flux.1-schnell", "flux.1-dev", "wan2.1-t2v"]


def sweep(steps_512: int) -> list[tuple[str, dict[str, Any]]]:
    """(workflow, params over its defaults) of each request, in order."""
    return [("sd-t2i", {"height": 64, "width": 64}), ("sd-t2i", {"height": 128, "width": 128}),
            ("sd-t2i", {"height": 256, "width": 256}),
            ("sd-t2i", {"height": 512, "width": 512, "num_inference_steps": steps_512}),
            ("flux.1-schnell", {}), ("flux.1-dev", {}), ("wan2.1-t2v", {})]


class Proxy:
    """The Proxy's HTTP API with its token."""

    def __init__(self, url: str, token: str) -> None:
        from engine.proxy.auth import auth_headers

        self.url, self.headers = url, auth_headers(token)

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={**self.headers, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def start(folder: Path, tmp: Path, calibrate_s: str | None) -> tuple[list[Any], list[subprocess.Popen[str]], Any, str]:
    """(services, processes, the job store, the Proxy's URL): redis, etcd, one node, one Proxy."""
    from engine.embedded import EtcdServer, RedisServer
    from engine.store import JobStore

    redis, etcd = RedisServer("redis-server", tmp / "redis").start(), EtcdServer("etcd", tmp / "etcd").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
    env.update(ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd.url, ONEPIECE_DEVICE=os.environ.get(
        "ONEPIECE_DEVICE", "cpu"), ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"])
    if calibrate_s is not None:
        env["ONEPIECE_CALIBRATE_S"] = calibrate_s
    run = tmp / "node"
    run.mkdir()
    (run / "assignment.json").write_text(assignment(folder).to_json())
    cli = [sys.executable, "-m", "engine.cli"]
    node = subprocess.Popen([*cli, "node", "--node", "bench", "--run-dir", str(run), "--assignment",
                             str(run / "assignment.json"), "--ring-prefix", f"est-{os.getpid()}-",
                             "--ring-bytes", str(16 << 20), "--ring-slots", "64"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True)
    proxy = subprocess.Popen([*cli, "proxy", "--port", "0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert proxy.stdout is not None
    line = proxy.stdout.readline()
    if not line.startswith("proxy: "):
        raise RuntimeError(f"the proxy did not start: {line}")
    return [redis, etcd], [node, proxy], JobStore.from_url(redis.url), line.split(": ", 1)[1].strip()


def assignment(folder: Path) -> Any:
    from engine.worker.config import default_assignment

    return default_assignment({wf: str(folder / wf) for wf in WORKFLOWS})


def wait_calibrated(proxy: Proxy, store: Any, folder: Path, timeout: float) -> dict[str, Any]:
    """Wait until the Proxy is ready and every instance published a finished calibration (at most ``timeout``
    seconds: then the rest are listed as ``missing``); what each did."""
    from engine.store import keys

    want = [i.id for i in assignment(folder).instances]
    t0 = time.monotonic()
    while True:
        reports: dict[str, Any] = {}
        for inst in want:
            stats = store.instances.read(inst) if store.r.exists(keys.instance_key(inst)) else {}
            found = {k: json.loads(v) for k, v in stats.items() if k.startswith("calibration.")}
            if found and all(r.get("done") for r in found.values()):
                reports[inst] = found
        ready = proxy.call("GET", "/readyz")[0] == 200
        if ready and len(reports) == len(want):
            return {"instances": reports, "seconds_to_calibrated": round(time.monotonic() - t0, 1)}
        if ready and time.monotonic() - t0 > timeout:
            return {"instances": reports, "seconds_to_calibrated": None, "missing": sorted(set(want) - set(reports))}
        time.sleep(0.5)


def price_now(store: Any, folder: Path, wf: str, params: dict[str, Any]) -> tuple[dict[str, Any], float | None,
                                                                                     list[float]]:
    """(resolved params, the price, each stage's seconds) from the fits published now, as the Proxy reads them."""
    from engine.proxy.eta import stage_seconds
    from engine.worker.calibrate import bound_spec
    from engine.workflow.pricing import Fit, Pricer

    spec = bound_spec(wf, folder / wf)
    resolved = spec.resolve_params({"prompt": "a lighthouse at dusk", **params})
    served = {}
    for inst in assignment(folder).instances:
        for member_wf, stage in inst.members:
            if member_wf == wf:
                served[(inst.id, wf)] = stage
    fits: dict[tuple[str, str], list[Fit]] = {}
    for (inst, name), raw in store.instances.price_fits(served).items():
        if (f := Fit.from_json(raw)) is not None:
            fits.setdefault((name, served[(inst, name)]), []).append(f)
    pricer = Pricer()
    pricer.update(fits)
    return resolved, pricer.price(spec, resolved), stage_seconds(pricer.fits, spec, resolved)


def measured_stages(store: Any, uid: str) -> dict[str, float]:
    """Each stage's run (stage_started to stage_finished), from the job's events."""
    from engine.store import keys

    out, began = {}, {}
    for e in store.events(uid):
        if e["type"] == keys.STAGE_STARTED:
            began[e["stage"]] = float(e["ts"])
        elif e["type"] == keys.STAGE_FINISHED and e["stage"] in began:
            out[e["stage"]] = round(float(e["ts"]) - began[e["stage"]], 3)
    return out


def one(proxy: Proxy, store: Any, folder: Path, wf: str, params: dict[str, Any]) -> dict[str, Any]:
    resolved, price, per_stage = price_now(store, folder, wf, params)
    t0 = time.monotonic()
    status, doc = proxy.call("POST", "/v1/requests", {"workflow": wf, "params": resolved, "inputs": {}})
    if status != 202:
        raise RuntimeError(f"{wf} {params}: {status} {doc}")
    uid = doc["uid"]
    while True:
        code, st = proxy.call("GET", f"/v1/requests/{uid}?wait=30", timeout=60)
        if code == 200 and st["state"] in ("completed", "failed", "cancelled", "expired"):
            break
    took = time.monotonic() - t0
    if st["state"] != "completed":
        raise RuntimeError(f"{wf} {params}: {st}")
    size = f"{resolved.get('width')}x{resolved.get('height')}" + (
        f"x{resolved['num_frames']}" if "num_frames" in resolved else "")
    return {"workflow": wf, "size": size, "steps": resolved.get("num_inference_steps"), "price_s": price,
            "price_stages_s": [round(s, 3) for s in per_stage], "eta_s": doc.get("eta_s"),
            "eta_p90_s": doc.get("eta_p90_s"), "measured_s": round(took, 3),
            "measured_stages_s": measured_stages(store, uid),
            "price_ratio": round(price / took, 3) if price else None,
            "eta_ratio": round(doc["eta_s"] / took, 3) if doc.get("eta_s") else None}


def main() -> None:
    from engine.bench.figures import provenance
    from engine.bench.harness import with_load_after
    from engine.stages.tiny import models_or_tiny

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="<workflow>/ folders (default: tiny models built here)")
    p.add_argument("--calibrate-s", default=None, help="the node's --calibrate-s (default: the node's)")
    p.add_argument("--steps-512", type=int, default=5, help="sd-t2i 512x512's steps (default 5)")
    p.add_argument("--timeout", type=float, default=180, help="seconds to wait for the calibration")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "estimates" / f"{dt.date.today()}.json")
    args = p.parse_args()
    os.environ.setdefault("ONEPIECE_PROXY_TOKEN", secrets.token_urlsafe(24))
    before = provenance()
    with models_or_tiny(args.models, WORKFLOWS) as folder, tempfile.TemporaryDirectory(prefix="est-") as tmp:
        services, procs, store, url = start(Path(folder), Path(tmp), args.calibrate_s)
        try:
            proxy = Proxy(url, os.environ["ONEPIECE_PROXY_TOKEN"])
            calibration = wait_calibrated(proxy, store, Path(folder), args.timeout)
            rows = []
            for wf, params in sweep(args.steps_512):
                rows.append(one(proxy, store, Path(folder), wf, params))
                r = rows[-1]
                print(f"{wf:15} {r['size']:>10} {r['steps']!s:>3} steps  price {r['price_s'] or 0:8.2f}s  "
                      f"eta {r['eta_s'] or 0:8.2f}s  measured {r['measured_s']:8.2f}s  "
                      f"price/measured {r['price_ratio']}  eta/measured {r['eta_ratio']}", flush=True)
        finally:
            for proc in procs:
                proc.send_signal(2)
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            store.close()
            for s in services:
                s.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"calibration": calibration, "rows": rows, "models": args.models or "tiny",
                                    "calibrate_s": args.calibrate_s or "default", "steps_512": args.steps_512,
                                    "cpus": os.cpu_count(),
                                    "provenance": with_load_after(before)}, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
