"""Across hosts: two TaskManagers in two network namespaces, their rings linked by the tcp transport.

Host A runs sd-t2i's text_encode and denoise, host B its vae_decode and
image_encode; Redis, etcd and the Proxy run in the root namespace on the
bridge both hosts reach. Every request crosses from A to B. Stage times are
stretched (``--stage-time``) so a test can catch each stage's worker in the
middle of a request and SIGKILL it; over tcp the worker's ring memory is a
segment on its host, which the restarted worker re-opens and serves again at
the same address.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.coord.keys import Keyspace
from engine.embedded.services import EtcdServer, RedisServer
from tests.fixtures.runtime import Cluster, NodeRun, engine
from tests.netns import Hosts, hosts

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
ON = {"a": ROUTE[:2], "b": ROUTE[2:]}
STAGE_TIME_S = 1.0  # long enough to catch each stage mid-request
PARAMS = dict(prompt="a lighthouse at dusk", height=64, width=64, num_inference_steps=3, seed=5)


@dataclass
class TwoHosts:
    cluster: Cluster
    hosts: Hosts
    nodes: dict[str, subprocess.Popen[str]]

    def pid(self, node: str, instance: str) -> int:
        raw = self.cluster.etcd.get(KEYS.node(node))
        return int(json.loads(raw[0])["instances"][instance]["pid"])


@pytest.fixture(scope="module")
def two_hosts(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[TwoHosts]:
    from engine.worker.config import Assignment, InstanceSpec

    with hosts(2) as net:
        print(f"cross-host test: {net.kind} ({', '.join(h.address for h in net.hosts)})")
        tmp = tmp_path_factory.mktemp("xhost")
        redis = RedisServer("redis-server", tmp / "redis", host=net.gateway).start()
        etcd_srv = EtcdServer("etcd", tmp / "etcd", host=net.gateway).start()
        stage_time = ",".join(f"{s}={STAGE_TIME_S}" for s in ROUTE)
        runs = [NodeRun(f"host-{name}",
                        Assignment(tuple(InstanceSpec(f"sd-t2i.{s}.{name}", "sd-t2i", s, "cpu") for s in stages),
                                   {"sd-t2i": str(tiny_models["sd-t2i"])}),
                        ("--transport", "tcp", "--data-host", net[i].address, "--stage-time", stage_time),
                        net[i].wrap)
                for i, (name, stages) in enumerate(ON.items())]
        try:
            with engine(redis.url, etcd_srv.url, runs, tmp, f"test-{os.getpid()}-x") as (c, procs):
                yield TwoHosts(c, net, procs)
        finally:
            etcd_srv.stop()
            redis.stop()


def _reference(tiny_models: dict[str, Path]) -> np.ndarray:
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_models["sd-t2i"])
    kwargs = {k: v for k, v in PARAMS.items() if k != "seed"}
    image = pipe(generator=torch.Generator().manual_seed(PARAMS["seed"]), output_type="pil", **kwargs).images[0]
    return np.asarray(image)


def _image(c: Cluster, uid: str) -> np.ndarray:
    from PIL import Image

    status, png, _ = c.call("GET", f"/v1/requests/{uid}/result")
    assert status == 200
    return np.asarray(Image.open(io.BytesIO(png)))


def _submit_retrying(c: Cluster) -> str:
    """Submit as a client does: a 503 (a first-stage worker restarting after the previous kill: over tcp
    its ring is unreachable until then) is retried after Retry-After; it is a refusal, never a loss."""
    deadline = time.monotonic() + 120
    while True:
        status, doc, headers = c.call("POST", "/v1/requests", {"workflow": "sd-t2i", "params": PARAMS})
        if status == 202:
            return str(doc["uid"])
        assert status == 503 and "Retry-After" in headers, doc
        assert time.monotonic() < deadline, doc
        time.sleep(min(float(headers["Retry-After"]), 1.0))


def test_a_request_crosses_hosts_over_tcp(two_hosts: TwoHosts, tiny_models: dict[str, Path]) -> None:
    c, net = two_hosts.cluster, two_hosts.hosts
    routes = {m["key"].decode().rsplit("/", 1)[1]: json.loads(v) for v, m in c.etcd.get_prefix(KEYS.routes())}
    for name, stages in ON.items():
        host = net[0 if name == "a" else 1].address
        for s in stages:
            assert routes[f"sd-t2i.{s}.{name}"]["address"].startswith(f"tcp://{host}:"), routes
    uid = c.submit("sd-t2i", PARAMS)
    done = c.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=120)
    assert done["state"] == "completed", done
    np.testing.assert_array_equal(_image(c, uid), _reference(tiny_models))
    finished = {e["stage"]: float(e["detail"].rstrip("s")) for e in c.events(uid) if e["type"] == "stage_finished"}
    assert all(finished[s] >= STAGE_TIME_S for s in ROUTE[:-1]), finished  # the stretch reached every worker


def test_sigkill_of_each_stage_worker_in_turn(two_hosts: TwoHosts, tiny_models: dict[str, Path]) -> None:
    """One request per stage; each stage's worker is killed while it runs its request. All complete, once."""
    c = two_hosts.cluster
    uids: list[str] = []
    for stage in ROUTE:
        node = "a" if stage in ON["a"] else "b"
        instance = f"sd-t2i.{stage}.{node}"
        pid = two_hosts.pid(f"host-{node}", instance)
        uid = _submit_retrying(c)
        uids.append(uid)
        deadline = time.monotonic() + 120
        while not any(e["type"] == "stage_started" and e["stage"] == stage for e in c.events(uid)):
            assert time.monotonic() < deadline, c.events(uid)
            time.sleep(0.02)
        os.kill(pid, 9)  # mid-stage: the stretched stage takes STAGE_TIME_S
        print(f"killed {instance} (pid {pid}) while it ran {uid}")
    reference = _reference(tiny_models)
    for uid, stage in zip(uids, ROUTE, strict=True):
        done = c.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=240)
        assert done["state"] == "completed", (done, c.events(uid))
        events = c.events(uid)
        types = [e["type"] for e in events]
        assert types.count("completed") == 1, types
        # the killed stage ran again in the restarted worker (it was killed mid-stage), once more only
        starts = [e["stage"] for e in events if e["type"] == "stage_started"]
        assert starts.count(stage) == 2, starts
        np.testing.assert_array_equal(_image(c, uid), reference)
    # every killed worker was restarted by its TaskManager at the same address
    for stage in ROUTE:
        node = "a" if stage in ON["a"] else "b"
        deadline = time.monotonic() + 30
        while True:
            raw = c.etcd.get(KEYS.node(f"host-{node}"))
            inst = json.loads(raw[0])["instances"][f"sd-t2i.{stage}.{node}"]
            if inst["restarts"] >= 1 and inst["ready"]:
                break
            assert time.monotonic() < deadline, inst
            time.sleep(0.2)
