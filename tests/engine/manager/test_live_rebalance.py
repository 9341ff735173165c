"""The Node Manager on a live engine: a load shift moves instances to the new bottleneck, the result is as
good as the best static allocation, and SIGKILL of the leading replica under load fails no request.

sd-t2i on one node with 6 slots. Stage times are stretched so the bottleneck is clear on 2 busy CPU
cores: vae_decode takes 0.9 s, each denoising step 0.15 s more than its compute. Short requests (2 steps,
~0.35 s of denoise) make vae_decode the bottleneck (best: denoise x1, vae_decode x3); long ones (20 steps,
~3.3 s) make denoise the bottleneck (best: denoise x3, vae_decode x1). Each worker computes on one CPU
thread (OMP_NUM_THREADS=1), as each instance would have a device of its own: otherwise six workers' torch
thread pools fight over two cores and an instance's speed depends on how many others run. A closed
loop of clients keeps requests in flight; a 503 is retried (a refusal, never a loss), and every accepted
request must complete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import pytest

from engine.coord.keys import Keyspace
from engine.embedded.services import EtcdServer, RedisServer
from tests.fixtures.runtime import Cluster, NodeRun, engine, stop

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

WF = "sd-t2i"
ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
SLOTS = 6
SHORT, LONG = 2, 20
STEP_S, VAE_S = 0.15, 0.9
WINDOW_S = 20  # ~17 long requests a window; rebalanced vs the next-best allocation measured 1.40-1.52x
# each allocation's rate is the better of two windows, the same protocol for both sides: the suite's other
# xdist worker runs model tests meanwhile, and one window that meets one of them says nothing of the manager
# (a CI run measured 0.13 rps rebalanced against 0.47 static that way)
WINDOWS = 2
CLIENTS = 8
TTL = 3


@dataclass
class Load:
    """A closed loop of clients: each submits, waits for the end, and submits again."""

    c: Cluster
    steps: int = SHORT
    done: list[tuple[float, str, str]] = field(default_factory=list)  # (finished at, uid, state)
    refused: int = 0
    inflight: set[str] = field(default_factory=set)  # accepted and not ended yet
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(CLIENTS):
            t = threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _client(self, i: int) -> None:
        seed = i * 1000
        while not self._stop.is_set():
            seed += 1
            params = dict(prompt="a boat", height=64, width=64, num_inference_steps=self.steps, seed=seed)
            status, doc, headers = self.c.call("POST", "/v1/requests", {"workflow": WF, "params": params})
            if status == 503:
                self.refused += 1
                time.sleep(0.2)
                continue
            assert status == 202, doc
            uid = str(doc["uid"])
            self.inflight.add(uid)
            st = self.c.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=300)
            self.done.append((time.monotonic(), uid, st["state"]))
            self.inflight.discard(uid)

    def rate(self, since: float, until: float) -> float:
        """Completions per second between the window's first and last completion (no quantisation at the
        window's edges: with ~1 request/s, whole-window counts are off by up to one request each side)."""
        times = sorted(t for t, _, s in self.done if since <= t < until and s == "completed")
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 2 else 0.0

    def drained(self, timeout: float = 120) -> None:
        """Wait until every request in flight now has ended: the queues a move built at the stages have then
        drained out, and what runs next entered the new allocation."""
        queued = set(self.inflight)
        deadline = time.monotonic() + timeout
        while queued & self.inflight:
            assert time.monotonic() < deadline, f"{len(queued & self.inflight)} requests still in flight"
            time.sleep(0.05)

    def measure(self, seconds: float) -> float:
        t0 = time.monotonic()
        time.sleep(seconds)
        return self.rate(t0, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


@dataclass
class Live:
    c: Cluster
    managers: dict[str, subprocess.Popen[str]]
    etcd_url: str


@pytest.fixture  # function scope: the leak check after the test sees the engine stopped
def live(tiny_models: dict[str, Path], tmp_path: Path) -> Iterator[Live]:
    from engine.worker.config import Assignment, InstanceSpec

    tmp = tmp_path
    redis = RedisServer("redis-server", tmp / "redis").start()
    etcd_srv = EtcdServer("etcd", tmp / "etcd").start()
    counts = {"text_encode": 1, "denoise": 2, "vae_decode": 2, "image_encode": 1}
    instances = tuple(InstanceSpec(f"{WF}.{s}.{k}", WF, s, "cpu") for s in ROUTE for k in range(counts[s]))
    node = NodeRun("n1", Assignment(instances, {WF: str(tiny_models[WF])}),
                   ("--step-time", f"denoise={STEP_S}", "--stage-time", f"vae_decode={VAE_S}"))
    managers: dict[str, subprocess.Popen[str]] = {}
    try:
        with engine(redis.url, etcd_srv.url, [node], tmp, f"test-{os.getpid()}-live-",
                    {"OMP_NUM_THREADS": "1"}) as (c, _procs):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
            for name in ("nm-a", "nm-b"):  # nm-a leads, nm-b stands by (the fail-over below shows it does)
                managers[name] = subprocess.Popen(
                    [sys.executable, "-m", "engine.cli", "manager", "--etcd-url", etcd_srv.url, "--name", name,
                     "--workflow", f"{WF}={tiny_models[WF]}", "--slots-per-node", str(SLOTS), "--ttl", str(TTL),
                     "--interval", "0.5", "--cooldown", "3", "--min-gain", "0.1"],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                deadline = time.monotonic() + 60
                while name == "nm-a" and _leader(c) != "nm-a":  # the election key names nm-a before nm-b starts
                    assert managers[name].poll() is None and time.monotonic() < deadline, "nm-a did not lead"
                    time.sleep(0.05)
            yield Live(c, managers, etcd_srv.url)
            for p in managers.values():
                stop(p)
    finally:
        for p in managers.values():
            if p.poll() is None:
                p.kill()
        etcd_srv.stop()
        redis.stop()


def _capacity(c: Cluster) -> dict[str, Any]:
    raw = c.etcd.get(KEYS.capacity(WF))
    return json.loads(raw[0]) if raw else {}


def _settled(c: Cluster, want: dict[str, int], timeout: float) -> float:
    """Wait until the assignment has ``want`` and every instance serves; returns when."""
    deadline = time.monotonic() + timeout
    while True:
        raw = c.etcd.get(KEYS.assignment("n1"))
        assigned = json.loads(raw[0])["instances"] if raw else []
        have: dict[str, int] = {}
        for i in assigned:
            have[i["stage"]] = have.get(i["stage"], 0) + 1
        report = json.loads(c.etcd.get(KEYS.node("n1"))[0])
        ready = all(i["ready"] for i in report["instances"].values())
        # the node reports every 2 s: a report written before it applied the assignment still shows the old
        # instances, all ready and none draining, so the report must serve exactly the assignment's instances
        # (a CI run took such a stale report for "settled" and measured the move itself as the new allocation)
        serving = set(report["instances"]) == {i["id"] for i in assigned}
        if have == want and ready and serving and not report["draining"]:
            return time.monotonic()
        assert time.monotonic() < deadline, (have, want, report["draining"], json.dumps({k: _capacity(c).get(k) for k in ("service_s", "recommended", "rps")}))
        time.sleep(0.2)


def _pin(live: Live, counts: dict[str, int | None]) -> None:
    from engine.coord import actions as act

    for stage, n in counts.items():
        aid = act.submit(live.c.etcd, "/onepiece", "scale_stage", {"workflow": WF, "stage": stage, "instances": n},
                         "test")
        verdict = act.result(live.c.etcd, "/onepiece", aid, timeout=20)
        assert verdict is not None and verdict["ok"], verdict


def _instances(c: Cluster) -> list[str]:
    """The instances the node's assignment holds now, by id."""
    return sorted(i["id"] for i in json.loads(c.etcd.get(KEYS.assignment("n1"))[0])["instances"])


def _leader(c: Cluster) -> str:
    raw = c.etcd.get(KEYS.leader())
    return json.loads(raw[0])["candidate"] if raw else ""


def test_a_load_shift_moves_instances_to_the_new_bottleneck(live: Live) -> None:
    from engine.manager.allocator import StageProfile, throughput

    c = live.c
    phases: list[tuple[str, float]] = [("start", time.monotonic())]  # where the test's minutes go
    load = Load(c).start()
    try:
        # short requests: vae_decode is the bottleneck; the manager measures and sizes for it
        _settled(c, {"text_encode": 1, "denoise": 1, "vae_decode": 3, "image_encode": 1}, timeout=120)
        phases.append(("short settled", time.monotonic()))
        short_rps = load.measure(15)
        # the shift: long requests make denoise the bottleneck
        load.steps = LONG
        shift, shift_m = time.time(), time.monotonic()
        want = {"text_encode": 1, "denoise": 3, "vae_decode": 1, "image_encode": 1}
        settled = _settled(c, want, timeout=180)
        assignment = json.loads(c.etcd.get(KEYS.assignment("n1"))[0])
        decided = assignment["decided_at"] - shift
        report = json.loads(c.etcd.get(KEYS.node("n1"))[0])
        drains = [m["drain_s"] for m in report["moves"] if m["event"] == "drained" and m["at"] > shift]
        startups = [m for m in report["moves"] if m["event"] == "ready" and m["at"] > shift]
        load.drained()  # the queues built during the move drained out
        phases.append(("long settled", time.monotonic()))
        rebalanced = max(load.measure(WINDOW_S) for _ in range(WINDOWS))
        # the allocation measured is the one the manager settled on: the same instances (a plan applied again
        # rewrites the assignment with a new decided_at and nothing moved; only a move would spoil the window)
        kept = _instances(c) == sorted(i["id"] for i in assignment["instances"])
        service = _capacity(c)["service_s"]

        # every split of the 6 slots ranked by Theorem 1's throughput on the measured stage times: the
        # manager's choice must be the best, and the engine must bear it out against the next best, run
        # pinned (the manager's own is not run again: pinned it is the allocation just measured as
        # ``rebalanced``, and a second window of it would measure this host's noise, not the manager)
        profile = [StageProfile(s, float(service[s])) for s in ROUTE]
        splits = [dict(zip(ROUTE, n, strict=True)) for n in product(range(1, SLOTS), repeat=4) if sum(n) == SLOTS]
        ranked = sorted(splits, key=lambda n: -throughput(profile, n)[0])
        assert ranked[0] == want, (ranked[:3], service)
        predicted = throughput(profile, want)[0] / throughput(profile, ranked[1])[0]
        candidates = [ranked[1]]
        static: dict[int, float] = {}
        failover, leader, now_leader = -1.0, "", ""
        for k, n in enumerate(candidates):
            _pin(live, n)
            _settled(c, n, timeout=180)
            load.drained()  # the queues built during the move drained out
            t0 = time.monotonic()
            if k == len(candidates) - 1:
                # leader SIGKILL under load: the standby leads within TTL + 1 s; no accepted request fails
                leader = _leader(c)
                live.managers[leader].kill()
                killed = time.monotonic()
                while (now_leader := _leader(c)) in ("", leader):
                    assert time.monotonic() - killed < TTL + 5, "no standby took over"
                    time.sleep(0.02)
                failover = time.monotonic() - killed
            time.sleep(max(0.0, WINDOW_S - (time.monotonic() - t0)))
            static[n["denoise"]] = max([load.rate(t0, time.monotonic())] +
                                       [load.measure(WINDOW_S) for _ in range(WINDOWS - 1)])
            phases.append((f"static {n['denoise']}", time.monotonic()))
        _pin(live, dict.fromkeys(ROUTE))  # back to automatic
    finally:
        load.stop()
        phases.append(("clients stopped", time.monotonic()))
    best = max(static.values())
    print(f"\nshort load: {short_rps:.2f} rps; long load rebalanced (denoise x3): {rebalanced:.2f} rps; "
          f"static (by denoise count) {static}; "
          f"rebalanced/best static = {rebalanced / best:.2f} (Theorem 1 predicts {predicted:.2f})")
    print(f"shift -> decision {decided:.1f}s; settled {settled - shift_m:.1f}s "
          f"after the shift; drains {drains} s; start-ups "
          f"{[(m['instance'], m.get('load_s'), m.get('ring_s'), m.get('ready_s')) for m in startups]}; "
          f"fail-over {failover:.2f}s ({leader} -> {now_leader}); refused {load.refused}")
    print("phases (s): " + ", ".join(f"{name} {t - phases[0][1]:.0f}" for name, t in phases[1:]))
    assert kept, "the manager moved instances again while the rebalanced allocation was measured"
    assert failover <= TTL + 1.0
    # Theorem 1 predicts ~1.5x over the next best here; the engine must show a clear part of that gain
    assert rebalanced >= 1.1 * best, (rebalanced, static, predicted)
    assert drains and startups
    failed = [(u, s) for _, u, s in load.done if s != "completed"]
    assert not failed, failed  # every accepted request completed, through moves and the fail-over
