"""A private one-node engine for ``onepiece bench e2e``'s variants: the same Proxy, rings, store and control
plane code as a deployment, serving a static assignment the bench chooses.

redis-server and etcd of its own (so nothing else on the host shares its routes or admission counters),
``onepiece node --assignment`` (the TaskManager and its stage workers) and ``onepiece proxy``, started as
processes with the bench's environment; ``ONEPIECE_BENCH_WORKFLOWS`` registers benchmark-only workflows
(:mod:`engine.bench.single_stage`) in every one of them. :meth:`PrivateEngine.peak_rss_mb` reads each
process's peak resident memory (VmHWM) while they still run, :meth:`PrivateEngine.pss_mb` its proportional
set size (shared pages split between the processes that map them).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import procs
from engine.bench.cpu import tree_peak_rss_mb, tree_pss_mb


def _get(url: str, token: str) -> tuple[int, Any]:
    from engine.proxy.auth import auth_headers

    req = urllib.request.Request(url, headers=auth_headers(token))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


class PrivateEngine:
    """redis + etcd + ``onepiece node`` (static ``assignment``, a JSON text) + ``onepiece proxy``."""

    def __init__(self, assignment_json: str, work: Path, ring_prefix: str, threads_per_instance: int = 1,
                 bench_workflows: tuple[str, ...] = (), startup_timeout_s: float = 300.0,
                 log: Callable[[str], None] = lambda s: None) -> None:
        self.assignment_json, self.work, self.ring_prefix = assignment_json, Path(work), ring_prefix
        self.threads, self.bench_workflows, self.timeout, self.log = (threads_per_instance, bench_workflows,
                                                                       startup_timeout_s, log)
        self.services: list[Any] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.proxy = ""
        self.token = secrets.token_urlsafe(24)  # the Proxy's credential, for this engine only
        self.workflows = sorted({i["workflow"] for i in json.loads(assignment_json)["instances"]})

    def __enter__(self) -> PrivateEngine:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> PrivateEngine:
        from engine import envs
        from engine.embedded import EtcdServer, RedisServer

        self.work.mkdir(parents=True, exist_ok=True)
        redis = RedisServer(envs.REDIS_SERVER_BIN, self.work / "redis").start()
        self.services.append(redis)
        etcd = EtcdServer(envs.ETCD_BIN, self.work / "etcd").start()
        self.services.append(etcd)
        (self.work / "assignment.json").write_text(self.assignment_json)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
        env.update(ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd.url, ONEPIECE_DEVICE="cpu",
                   ONEPIECE_PROXY_TOKEN=self.token, ONEPIECE_STATE_DIR=str(self.work / "state"),
                   # no warm-up calibration (engine.worker.calibrate): it would run inside the capacity
                   # windows, which the one-call baselines beside it do not pay; pricing is not measured here
                   ONEPIECE_CALIBRATE_S="0")
        if self.bench_workflows:
            env["ONEPIECE_BENCH_WORKFLOWS"] = ",".join(self.bench_workflows)
        cli = [sys.executable, "-m", "engine.cli"]
        cmds = {
            "node": [*cli, "node", "--node", "bench-node", "--run-dir", str(self.work / "node"), "--assignment",
                     str(self.work / "assignment.json"), "--ring-prefix", self.ring_prefix,
                     "--ring-bytes", str(16 << 20), "--ring-slots", "256",
                     "--threads-per-instance", str(self.threads)],
            "proxy": [*cli, "proxy", "--port", "0", "--max-queue", "100000"],
        }
        for name, cmd in cmds.items():
            with open(self.work / f"{name}.log", "wb") as out:
                self.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout
        while not self.proxy:
            for line in (self.work / "proxy.log").read_text(errors="replace").splitlines():
                if line.startswith("proxy: "):
                    self.proxy = line.split(": ", 1)[1].strip()
            self._check(deadline, "the proxy did not print its address")
            time.sleep(0.1)
        # ready when the Proxy routes every workflow of the assignment to a first stage
        while True:
            _, doc = _get(self.proxy + "/readyz", self.token)
            checks = doc.get("checks", {}) if isinstance(doc, dict) else {}
            missing = [wf for wf in self.workflows if checks.get(f"routes:{wf}") != "ok"]
            if not missing:
                break
            self._check(deadline, f"no route to {missing}")
            time.sleep(0.25)
        self._wait_workers(deadline)
        self.log(f"private engine up: {len(json.loads(self.assignment_json)['instances'])} instances of "
                 f"{', '.join(self.workflows)}")
        return self

    def _wait_workers(self, deadline: float) -> None:
        """Every instance of the assignment has written its ready file (its model is loaded)."""
        want = {i["id"] for i in json.loads(self.assignment_json)["instances"]}
        while True:
            ready = {p.name.split(".ready")[0] for p in (self.work / "node").rglob("*.ready*")}
            if not want - ready:
                return
            self._check(deadline, f"workers not ready: {sorted(want - ready)}")
            time.sleep(0.25)

    def _check(self, deadline: float, what: str) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"private engine: {name} exited with {p.returncode}; see {self.work}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"private engine: {what} within {self.timeout:.0f}s; see {self.work}")

    def pids(self) -> dict[str, int]:
        """role -> pid of every process this engine runs (the node's stage workers are its children)."""
        out = {name: p.pid for name, p in self.procs.items()}
        for s, name in zip(self.services, ("redis", "etcd"), strict=False):
            if getattr(s, "proc", None) is not None:
                out[name] = s.proc.pid
        return out

    def peak_rss_mb(self) -> dict[str, float]:
        """role -> summed peak resident memory (VmHWM) of its process tree, stage workers apart."""
        return tree_peak_rss_mb(self.pids())

    def pss_mb(self) -> dict[str, float]:
        """role -> summed proportional set size (now) of its process tree, stage workers apart."""
        return tree_pss_mb(self.pids())

    def stop(self) -> None:
        for name in ("proxy", "node"):  # the proxy first, then the node (it stops its workers)
            p = self.procs.get(name)
            if p is not None:
                procs.stop(p, signal.SIGINT)
        for s in reversed(self.services):
            s.stop()
        self.services.clear()
        self.procs.clear()
