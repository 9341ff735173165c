"""What running the stage workers below the control plane buys: the Proxy's refusal latency while its
workers are saturated, workers niced (the default) against workers at the node's priority, in one run.

    python benchmarks/worker_nice.py [--pairs 3] [--seconds 10] [--json]

Starts its own ``onepiece up --workflows sd-t2i`` (a scratch state folder, tiny models built there, free
ports; the workers get ``ONEPIECE_WORKER_NICE``'s default from the node, no flag), measures the engine's
capacity by saturation, then runs the open loop of ``onepiece bench e2e`` at 10x that capacity (most
requests refused, the workers never idle) in alternating phases: "on", every thread of every stage
worker at the node's niceness + 10 (as started), and "off", every thread set back to the node's niceness
(this runs as root, which may raise a priority again; the node itself never does). The same engine, the
same load, interleaved, so drift on a shared host falls on both sides. Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NICE = 10  # the default increment (engine.worker.priority.DEFAULT)


def start_up(state: Path) -> tuple[subprocess.Popen[str], str]:
    """``onepiece up`` serving sd-t2i only; (its process, the Proxy's URL) once it says ready."""
    models = state / "models"
    subprocess.run([sys.executable, "-m", "engine.cli", "models", "make-tiny", "--workflow", "sd-t2i",
                    "--out", str(models / "sd-t2i")], check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "up", "--state-dir", str(state), "--models",
                             str(models), "--workflows", "sd-t2i", "--web-port", "0", "--proxy-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proxy = ""
    assert proc.stdout is not None
    for line in proc.stdout:  # its start-up lines, until "ready"
        if line.startswith("proxy: "):
            proxy = line.split(": ", 1)[1].strip()
        if line.startswith("ready"):
            return proc, proxy
    raise RuntimeError(f"onepiece up exited with {proc.wait()}")


def worker_pids(state: Path) -> list[int]:
    """The live stage workers: the pids in the node's ready files."""
    pids = []
    for f in (state / "logs" / "node").glob("*.ready"):
        pid = json.loads(f.read_text())["pid"]
        if Path(f"/proc/{pid}").exists():
            pids.append(pid)
    return pids


def set_nice(pids: list[int], value: int) -> None:
    """Every thread of every worker to ``value`` (niceness is per thread on Linux)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), value)
            except ProcessLookupError:  # a thread that just ended
                pass


def thread_nices(pids: list[int]) -> set[int]:
    out = set()
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
            except ProcessLookupError:
                pass
    return out


def phase(proxy: str, state: Path, nice: int, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    from engine.bench.e2e import PARAMS, open_loop

    pids = worker_pids(state)  # read again: the Node Manager may have restarted or moved one
    set_nice(pids, nice)
    load0 = os.getloadavg()[0]
    row = asyncio.run(open_loop(proxy, "sd-t2i", PARAMS["sd-t2i"], rate, seconds, seed=seed, deadline_s=10.0))
    held = thread_nices(worker_pids(state)) == {nice}  # no worker (re)started at another niceness meanwhile
    return {"worker_nice": nice, "nice_held": held, "loadavg_1m_before": load0, **row}


def measure(proxy: str, state: Path, pairs: int, seconds: float) -> dict[str, Any]:
    from engine.bench.e2e import PARAMS, saturate

    pids = worker_pids(state)
    node = os.getpriority(os.PRIO_PROCESS, os.getppid() if not pids else _ppid(pids[0]))
    started = sorted(thread_nices(pids))  # what `onepiece up` gave them: node + 10 without any flag
    capacity, _ = asyncio.run(saturate(proxy, "sd-t2i", PARAMS["sd-t2i"], 16, seconds))
    rows = []
    for i in range(pairs):  # on, off, on, off, ...: interleaved so drift on the host falls on both
        for label, nice in (("on", node + NICE), ("off", node)):
            rows.append({"phase": label, **phase(proxy, state, nice, 10 * capacity, seconds, seed=2 * i)})
    out: dict[str, Any] = {"workers": len(pids), "node_nice": node, "workers_started_at": started,
                           "capacity_rps": capacity, "rate_rps": 10 * capacity, "phases": rows}
    for label in ("on", "off"):
        mine = [r for r in rows if r["phase"] == label]
        for k in ("reject_latency_p50_ms", "reject_latency_p99_ms", "reject_service_p99_ms", "goodput_rps",
                  "client_send_lag_p99_ms"):
            vals = [r[k] for r in mine if r[k] is not None]
            out[f"{label}_{k}_median"] = statistics.median(vals) if vals else None
    for k in ("reject_latency_p50_ms", "reject_latency_p99_ms", "reject_service_p99_ms"):
        on, off = out[f"on_{k}_median"], out[f"off_{k}_median"]
        out[f"on_vs_off_{k}"] = on / off if on and off else None
    return out


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="on/off phase pairs")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of each phase and capacity window")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="onepiece-nice-") as tmp:
        state = Path(tmp)
        up, proxy = start_up(state)
        try:
            os.environ["ONEPIECE_PROXY_TOKEN"] = (state / "secrets" / "proxy-token").read_text().strip()
            out = measure(proxy, state, args.pairs, args.seconds)
        finally:
            up.terminate()
            up.wait(60)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['workers']} workers started at niceness {out['workers_started_at']} (node {out['node_nice']}); "
          f"capacity {out['capacity_rps']:.1f} rps, offered {out['rate_rps']:.0f} rps")
    for r in out["phases"]:
        print(f"{r['phase']:>3} nice {r['worker_nice']:2d}: refused {r['refused']:5d}, refusal p50 "
              f"{r['reject_latency_p50_ms']:.1f} p99 {r['reject_latency_p99_ms']:.1f} ms (from send p99 "
              f"{r['reject_service_p99_ms']:.1f}), goodput {r['goodput_rps']:.1f} rps, held {r['nice_held']}")
    print(json.dumps({k: v for k, v in out.items() if k != "phases"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
