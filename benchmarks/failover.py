"""Node Manager fail-over time: SIGKILL the leading replica, time until the standby leads.

Usage: python benchmarks/failover.py [--runs 20] [--ttl 3]
Starts its own etcd (engine.embedded) and two ``onepiece manager`` replicas per run.
Prints each run and the median and max, against the lease TTL (the floor: a
standby can only take over once the dead leader's lease has expired).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.embedded import EtcdServer

ONEPIECE = str(Path(sys.executable).parent / "onepiece")


def start(url: str, name: str, ttl: int, root: str) -> tuple[subprocess.Popen[str], queue.Queue[tuple[float, str]]]:
    p = subprocess.Popen([ONEPIECE, "manager", "--etcd-url", url, "--name", name, "--ttl", str(ttl), "--root", root,
                          "--interval", "0.5", "--workflow", "sd-t2i=/m"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    q: queue.Queue[tuple[float, str]] = queue.Queue()
    threading.Thread(target=lambda: [q.put((time.time(), ln.strip())) for ln in p.stdout], daemon=True).start()
    return p, q


def wait(q: queue.Queue[tuple[float, str]], prefix: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            t, line = q.get(timeout=0.1)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return t
    raise TimeoutError(prefix)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ttl", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, EtcdServer("etcd", Path(d)) as etcd:
        took = []
        for i in range(args.runs):
            root = f"/failover-{os.getpid()}-{i}"
            a, qa = start(etcd.url, "a", args.ttl, root)
            b = None
            try:
                wait(qa, "leader: a", 30)
                b, qb = start(etcd.url, "b", args.ttl, root)
                wait(qb, "manager: b", 30)
                time.sleep(0.5)  # b's first campaign tick has run and lost
                killed = time.time()
                os.kill(a.pid, signal.SIGKILL)
                took.append(wait(qb, "leader: b", args.ttl + 10) - killed)
                print(f"run {i + 1}: {took[-1]:.2f} s", flush=True)
            finally:
                for p in (a, b):
                    if p is None:
                        continue
                    if p.poll() is None:
                        p.kill()
                    p.wait()
        print(f"fail-over over {len(took)} runs, lease TTL {args.ttl} s: median {statistics.median(took):.2f} s, "
              f"max {max(took):.2f} s, min {min(took):.2f} s (median - TTL = {statistics.median(took) - args.ttl:.2f} s)")


if __name__ == "__main__":
    main()
