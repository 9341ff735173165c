"""The simulation checked against the real engine on this machine.

A one-node engine (``onepiece node`` with a chosen number of instances per
stage, ``onepiece proxy``, a private redis-server and etcd so nothing else on
the host shares its routes or admission counters) runs the tiny models with
stage times stretched (``--stage-time``: a worker sleeps so each run of a stage
takes at least that long, which occupies the instance like a GPU kernel would
without taking a CPU core). Then:

1. calibration: a few requests one at a time on the idle engine; from their
   events, each stage's service time as the engine delivers it (stage_started
   to stage_finished, so the hand-off that keeps the worker busy is included)
   and the transit of each hop (stage_finished to the next stage_started, and
   intake to the first stage);
2. load: Poisson arrivals at several fractions of the capacity those service
   times imply (bounded count each); latency per request from the status hash
   (accepted -> completed, both stamped by the engine, so client polling adds
   nothing);
3. the same arrivals (the engine's own intake times) replayed through
   ``engine.bench.queueing.simulate`` with the same instance counts, the
   calibrated service times and hop transits; throughput and p50 compared.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import procs
from engine.bench.queueing import simulate, stats
from engine.store import keys

PARAMS = {"sd-t2i": {"prompt": "a cat on the moon", "height": 64, "width": 64, "num_inference_steps": 3}}


@dataclass
class ValidationConfig:
    workflow: str = "sd-t2i"
    # stage times well above the engine's per-hop cost (~20 ms), denoise the bottleneck
    stage_seconds: dict[str, float] = field(default_factory=lambda: {
        "text_encode": 0.1, "denoise": 0.4, "vae_decode": 0.15, "image_encode": 0.05})
    instances: dict[str, int] = field(default_factory=lambda: {
        "text_encode": 1, "denoise": 2, "vae_decode": 1, "image_encode": 1})
    loads: tuple[float, ...] = (0.3, 0.6, 0.85, 1.2)  # fractions of the calibrated capacity
    requests: int = 60  # per load
    calibration: int = 5
    warmup: float = 0.1
    seed: int = 0
    startup_timeout_s: float = 300.0


def _call(url: str, method: str = "GET", body: dict[str, Any] | None = None, timeout: float = 30,
          token: str | None = None) -> tuple[int, Any]:
    from engine.proxy.auth import auth_headers

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        **auth_headers(token), **({"Content-Type": "application/json"} if data else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None


class _Engine:
    """redis + etcd + ``onepiece node`` + ``onepiece proxy``; stops everything it started."""

    def __init__(self, cfg: ValidationConfig, model_dir: Path, work: Path, ring_prefix: str,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.model_dir, self.work, self.ring_prefix, self.log = cfg, model_dir, work, ring_prefix, log
        self.services: list[Any] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.proxy = ""
        self.token = secrets.token_urlsafe(24)  # the Proxy's credential, for this run only
        self.store: Any = None

    def start(self) -> _Engine:
        from engine import envs
        from engine.coord import etcd_client
        from engine.coord.keys import Keyspace, read_prefix
        from engine.embedded import EtcdServer, RedisServer
        from engine.store import JobStore
        from engine.worker.config import Assignment, InstanceSpec

        redis = RedisServer(envs.REDIS_SERVER_BIN, self.work / "redis").start()
        self.services.append(redis)
        etcd = EtcdServer(envs.ETCD_BIN, self.work / "etcd").start()
        self.services.append(etcd)
        self.store = JobStore.from_url(redis.url, ttl=3600)
        wf = self.cfg.workflow
        instances = tuple(InstanceSpec(f"{wf}.{st}.{k}", wf, st, "cpu")
                          for st, n in self.cfg.instances.items() for k in range(n))
        assignment = Assignment(instances, {wf: str(self.model_dir)})
        (self.work / "assignment.json").write_text(assignment.to_json())
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
        env.update(ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd.url, ONEPIECE_DEVICE="cpu",
                   ONEPIECE_PROXY_TOKEN=self.token,
                   ONEPIECE_PROGRESS_INTERVAL_MS="60000", ONEPIECE_ROUTE_REFRESH_S="0.2",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        timing = ",".join(f"{wf}/{s}={t}" for s, t in self.cfg.stage_seconds.items())
        cli = [sys.executable, "-m", "engine.cli"]
        node_cmd = [*cli, "node", "--node", "bench-node", "--run-dir", str(self.work / "node"), "--assignment",
                    str(self.work / "assignment.json"), "--ring-prefix", self.ring_prefix,
                    "--ring-bytes", str(8 << 20), "--ring-slots", "256", "--stage-time", timing]
        proxy_cmd = [*cli, "proxy", "--port", "0", "--max-queue", "100000"]
        for name, cmd in (("node", node_cmd), ("proxy", proxy_cmd)):
            with open(self.work / f"{name}.log", "wb") as out:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self.proxy:
            text = (self.work / "proxy.log").read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("proxy: "):
                    self.proxy = line.split(": ", 1)[1].strip()
            self._check(deadline, "the proxy did not print its address")
            time.sleep(0.1)
        client = etcd_client(etcd.url)
        want = {i.id for i in instances}
        while True:
            published = {name.rsplit("/", 1)[1] for name in read_prefix(client, Keyspace.from_env().routes())}
            if want <= published:
                status, doc = _call(self.proxy + "/readyz", token=self.token)
                checks = doc.get("checks", {}) if isinstance(doc, dict) else {}
                if checks.get(f"routes:{wf}") == "ok":  # other workflows have no instances here
                    break
            self._check(deadline, f"workers not ready: {sorted(want - published)}")
            time.sleep(0.25)
        self.log(f"engine up: {len(instances)} instances {self.cfg.instances}, stage times {self.cfg.stage_seconds}")
        return self

    def _check(self, deadline: float, what: str) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[3]} exited with {p.returncode}; see {self.work}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {self.cfg.startup_timeout_s:.0f}s; see {self.work}")

    def worker_pid(self, instance: str) -> int:
        """The pid of a ready worker, from the node's log (its last start's, should it have restarted)."""
        for line in reversed((self.work / "node.log").read_text(errors="replace").splitlines()):
            if f"worker {instance} ready (pid " in line:
                return int(line.rsplit("(pid ", 1)[1].split(")", 1)[0])
        raise LookupError(f"worker {instance} is not ready in {self.work / 'node.log'}")

    def stop(self) -> None:
        for p in reversed(self.procs):  # the proxy first, then the node (it stops its workers)
            procs.stop(p, signal.SIGINT)
        if self.store is not None:
            self.store.close()
        for s in reversed(self.services):
            s.stop()
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-{self.ring_prefix}")]
        if left:
            raise RuntimeError(f"rings left behind: {left}")

    # -- requests -------------------------------------------------------------------------------
    def submit(self, seed: int) -> str:
        params = {**PARAMS[self.cfg.workflow], "seed": seed}
        status, doc = _call(self.proxy + "/v1/requests", "POST", {"workflow": self.cfg.workflow, "params": params},
                            token=self.token)
        if status != 202:
            raise RuntimeError(f"submit refused: {status} {doc}")
        return str(doc["uid"])

    def wait_all(self, uids: list[str], timeout: float, poll_s: float = 0.5) -> dict[str, dict[str, Any]]:
        done: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < len(uids) and time.monotonic() < deadline:
            for uid in uids:
                if uid not in done:
                    st = self.store.status(uid)
                    if st is not None and st.terminal:
                        done[uid] = st.as_dict()
            if len(done) < len(uids):
                time.sleep(poll_s)
        return done


def _marks(eng: _Engine, uid: str, st: dict[str, Any], route: list[str]
           ) -> tuple[dict[str, float], dict[str, float]]:
    """One request's (stage_started, stage_finished) times per stage, from its events."""
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    for e in eng.store.events(uid):
        if e["type"] == "stage_started":
            started[e["stage"]] = float(e["ts"])
        elif e["type"] == "stage_finished":
            finished[e["stage"]] = float(e["ts"])
    finished[route[-1]] = float(st["updated"])
    return started, finished


def _timings(eng: _Engine, uid: str, st: dict[str, Any], route: list[str]
             ) -> tuple[dict[str, float], dict[str, float]]:
    """One request's (service seconds per stage, transit seconds into each stage), from its events."""
    started, finished = _marks(eng, uid, st, route)
    service, transit = {}, {}
    prev = float(st["created"])
    for s in route:
        transit[s] = started[s] - prev
        service[s] = finished[s] - started[s]
        prev = finished[s]
    return service, transit


def _observed(marks: list[tuple[dict[str, float], dict[str, float]]], created: list[float], route: list[str],
              transit: dict[str, float]) -> list[dict[str, float]]:
    """Each request's service time per stage as the instance delivered it under load.

    That is stage_started to stage_finished, plus any delay of the start beyond
    the calibrated hand-off once the request was ready and the instance free (a
    worker held off the CPU stalls its instance, not one request's transfer).
    The instance counts as free at the last finish at that stage before this
    start: exact for a stage of one instance, an upper bound on the freeing time
    (so a lower bound on the added delay) for more.
    """
    out = []
    for i, (started, finished) in enumerate(marks):
        service = {}
        ready = created[i]
        for s in route:
            freed = max((f[s] for j, (_, f) in enumerate(marks) if j != i and f[s] <= started[s]), default=ready)
            could = max(ready + transit[s], freed)
            service[s] = finished[s] - min(started[s], could)
            ready = finished[s]
        out.append(service)
    return out


def _calibrate(eng: _Engine, n: int) -> tuple[dict[str, float], dict[str, float], float]:
    """(service seconds per stage, transit seconds into each stage, idle end-to-end median)."""
    from engine.workflow import get_workflow

    route = get_workflow(eng.cfg.workflow).route()
    service: dict[str, list[float]] = {s: [] for s in route}
    transit: dict[str, list[float]] = {s: [] for s in route}
    e2e = []
    for i in range(n + 2):
        uid = eng.submit(10_000 + i)
        st = eng.wait_all([uid], 60, poll_s=0.02).get(uid)
        if st is None or st["state"] != keys.COMPLETED:
            raise RuntimeError(f"calibration request {uid} did not complete: {st}")
        if i < 2:  # warm-up
            continue
        one_service, one_transit = _timings(eng, uid, st, route)
        for s in route:
            service[s].append(one_service[s])
            transit[s].append(one_transit[s])
        e2e.append(float(st["updated"]) - float(st["created"]))
    return ({s: statistics.median(v) for s, v in service.items()},
            {s: statistics.median(v) for s, v in transit.items()}, statistics.median(e2e))


def _load(eng: _Engine, rate: float, n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    uids: list[str] = []
    lock = threading.Lock()
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            uid = eng.submit(seed * 1000 + k)
        except (RuntimeError, OSError) as exc:
            errors.append(str(exc))
            return
        with lock:
            uids.append(uid)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        t = 0.0
        for k in range(n):
            t += rng.expovariate(rate)
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, k)
    if errors:
        raise RuntimeError(f"{len(errors)} submissions failed: {errors[0]}")
    done = eng.wait_all(uids, timeout=60 + 5 * n / rate)
    return [(u, done[u]) for u in uids if u in done]


def _point(eng: _Engine, cfg: ValidationConfig, route: list[str], frac: float, rate: float,
           rows: list[tuple[str, dict[str, Any]]], service: dict[str, float], transit: dict[str, float],
           log: Callable[[str], None]) -> dict[str, Any]:
    """One load's measured figures against two simulations of the same arrivals.

    ``simulated`` is the prediction: every request at the calibrated service and
    transit times. ``replayed`` gives each request the service time at each stage
    that the engine's events show it had under this load (:func:`_observed`), so it
    checks the queueing model alone (instance counts, FCFS, hand-offs), whatever
    the host's other work did to the stage times since calibration.
    """
    ok = [(u, r) for u, r in rows if r["state"] == keys.COMPLETED]
    if len(ok) < max(3, cfg.requests // 2):
        raise RuntimeError(f"load {frac}: only {len(ok)} of {cfg.requests} requests completed")
    t0 = min(float(r["created"]) for _, r in ok)
    arrivals = [float(r["created"]) - t0 for _, r in ok]
    finishes = [float(r["updated"]) - t0 for _, r in ok]
    _, m_tp, m_p50, m_p99 = stats(arrivals, finishes, cfg.warmup)
    seen = _observed([_marks(eng, u, r, route) for u, r in ok], [float(r["created"]) for _, r in ok], route,
                     transit)
    hop0 = transit[route[0]]

    def after(s: str) -> str | None:
        return route[route.index(s) + 1] if s != route[-1] else None

    shifted = [a + hop0 for a in arrivals]
    sim = simulate(route, cfg.instances, lambda s, i: service[s], shifted,
                   lambda s, i: transit[n] if (n := after(s)) else 0.0, warmup=cfg.warmup)
    rep = simulate(route, cfg.instances, lambda s, i: seen[i][s], shifted,
                   lambda s, i: transit[n] if (n := after(s)) else 0.0, warmup=cfg.warmup)
    rep_p50 = rep.latency_p50 + hop0
    s_p50, s_p99 = sim.latency_p50 + hop0, sim.latency_p99 + hop0
    point = {
        "load_x_capacity": frac, "offered_rps": rate, "completed": len(ok), "requests": cfg.requests,
        "measured": {"throughput_rps": m_tp, "latency_p50_s": m_p50, "latency_p99_s": m_p99},
        "simulated": {"throughput_rps": sim.throughput, "latency_p50_s": s_p50, "latency_p99_s": s_p99},
        "replayed": {"throughput_rps": rep.throughput, "latency_p50_s": rep_p50},
        "throughput_diff_pct": _pct(sim.throughput, m_tp), "p50_diff_pct": _pct(s_p50, m_p50),
    }
    point["within_10pct"] = abs(point["throughput_diff_pct"]) <= 10 and abs(point["p50_diff_pct"]) <= 10
    log(f"load {frac:.2f}x ({rate:.2f} req/s, {len(ok)} done): throughput measured {m_tp:.2f} vs "
        f"simulated {sim.throughput:.2f} req/s ({point['throughput_diff_pct']:+.1f}%), p50 "
        f"{m_p50 * 1e3:.0f} vs {s_p50 * 1e3:.0f} ms ({point['p50_diff_pct']:+.1f}%); replayed with the "
        f"observed stage times: {rep.throughput:.2f} req/s, p50 {rep_p50 * 1e3:.0f} ms")
    return point


def _pct(sim: float, measured: float) -> float:
    return (sim - measured) / measured * 100 if measured else float("inf")


def run(cfg: ValidationConfig, model_dir: Path | None = None, work_dir: Path | None = None,
        ring_prefix: str | None = None, log: Callable[[str], None] = print,
        before_load: Callable[[_Engine], None] | None = None) -> dict[str, Any]:
    """Start the engine, calibrate, run the loads, simulate them; returns the comparison.

    ``before_load(engine)`` runs after the calibration (a test disturbs the engine there).
    """
    from engine.workflow import get_workflow

    route = get_workflow(cfg.workflow).route()
    if set(cfg.instances) != set(route) or set(cfg.stage_seconds) != set(route):
        raise ValueError(f"instances and stage_seconds must name every stage of {cfg.workflow}: {route}")
    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="onepiece-bench-resources-")
        work_dir = Path(tmp.name)
    work_dir.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        from engine.stages.tiny import make_tiny

        model_dir = make_tiny(work_dir / "models", cfg.workflow)[cfg.workflow]
    eng = _Engine(cfg, model_dir, work_dir, ring_prefix or f"bench-{os.getpid()}-", log)
    try:
        eng.start()
        service, transit, idle = _calibrate(eng, cfg.calibration)
        capacity = min(cfg.instances[s] / service[s] for s in route)
        log(f"calibrated: service {_fmt(service)}, transit {_fmt(transit)}, idle e2e {idle * 1e3:.0f} ms, "
            f"capacity {capacity:.2f} req/s")
        if before_load is not None:
            before_load(eng)
        points = []
        for k, frac in enumerate(cfg.loads):
            rows = _load(eng, frac * capacity, cfg.requests, cfg.seed + k + 1)
            points.append(_point(eng, cfg, route, frac, frac * capacity, rows, service, transit, log))
        return {"workflow": cfg.workflow, "instances": cfg.instances, "stage_seconds": cfg.stage_seconds,
                "calibrated_service_s": service, "calibrated_transit_s": transit, "idle_latency_s": idle,
                "capacity_rps": capacity, "requests_per_load": cfg.requests, "points": points,
                "all_within_10pct": all(p["within_10pct"] for p in points)}
    finally:
        eng.stop()
        if tmp is not None:
            tmp.cleanup()


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in d.items())
