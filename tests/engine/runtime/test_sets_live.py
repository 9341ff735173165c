"""Workflow Sets on a live engine: two sets, each a node with every sd-t2i stage and a Proxy of its own.
A request stays inside the set whose Proxy took it; a Node Manager measures each set's load from the
Proxies' registrations, and a client asking which Proxy to use gets the less loaded set's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.coord.keys import Keyspace
from engine.embedded.services import EtcdServer, RedisServer
from tests.fixtures.runtime import NodeRun, engine, stop

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

WF = "sd-t2i"
ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
PARAMS = dict(prompt="a red kite", height=64, width=64, num_inference_steps=2)


def test_requests_stay_in_their_set_and_clients_get_the_less_loaded_set(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.coord.proxies import which_proxy
    from engine.worker.config import Assignment, InstanceSpec

    redis = RedisServer("redis-server", tmp_path / "redis").start()
    etcd_srv = EtcdServer("etcd", tmp_path / "etcd").start()
    runs = [NodeRun(f"n{s.lower()}", Assignment(tuple(InstanceSpec(f"{WF}.{st}.{s.lower()}", WF, st, "cpu",
                                                                   workflow_set=s) for st in ROUTE),
                                                {WF: str(tiny_models[WF])}), ("--set", s)) for s in ("A", "B")]
    manager = None
    try:
        with engine(redis.url, etcd_srv.url, runs, tmp_path, f"test-{os.getpid()}-sets-",
                    proxy_args=(("--set", "A"), ("--set", "B"))) as (c, _procs):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
            manager = subprocess.Popen(
                [sys.executable, "-m", "engine.cli", "manager", "--etcd-url", etcd_srv.url, "--name", "nm",
                 "--workflow", f"{WF}={tiny_models[WF]}", "--slots-per-node", "4", "--interval", "0.5"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            proxy_a, proxy_b = c.proxy, c.other_proxies[0]
            # each Proxy registered itself in its set
            deadline = time.monotonic() + 60
            while True:
                regs = {m["key"].decode().split("/")[3]: json.loads(v)["url"]
                        for v, m in c.etcd.get_prefix(KEYS.proxies())}
                if regs == {"A": proxy_a, "B": proxy_b}:
                    break
                assert time.monotonic() < deadline, regs
                time.sleep(0.2)
            uids = [c.submit(WF, dict(PARAMS, seed=i)) for i in range(4)]
            for uid in uids:
                assert c.wait(uid, {"completed", "failed"}, timeout=120)["state"] == "completed"
            served = {s: sum(int(c.store.instances.read(f"{WF}.{st}.{s}").get("requests", 0)) for st in ROUTE)
                      for s in ("a", "b")}
            assert served["a"] == 4 * len(ROUTE) and served["b"] == 0, served  # nothing crossed into set B
            # the manager's view: set A carries the load, so a client is sent to set B's Proxy
            deadline = time.monotonic() + 60
            while True:
                raw = c.etcd.get(KEYS.sets_state())
                state = json.loads(raw[0]) if raw else {}
                ok = all(state.get(s, {}).get("workflows", {}).get(WF, {}).get("capacity", 0) > 0 for s in "AB")
                if ok and state["A"]["workflows"][WF]["arrival"] > 0:
                    break
                assert time.monotonic() < deadline, state
                c.submit(WF, dict(PARAMS, seed=99))  # keep set A busy while the manager measures
                time.sleep(0.3)
            assert which_proxy(c.etcd, WF) == proxy_b
            assert state["A"]["nodes"] == ["na"] and state["B"]["nodes"] == ["nb"]
    finally:
        if manager is not None:
            stop(manager)
        etcd_srv.stop()
        redis.stop()
