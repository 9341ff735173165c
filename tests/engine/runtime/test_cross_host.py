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
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.embedded.services import EtcdServer, RedisServer
from tests.engine.runtime.conftest import Cluster, _stop
from tests.engine.stages.conftest import tiny_models  # noqa: F401 - fixture reused here
from tests.netns import Hosts, hosts

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
        raw = self.cluster.etcd.get(f"/onepiece/nodes/{node}")
        return int(json.loads(raw[0])["instances"][instance]["pid"])


@pytest.fixture(scope="module")
def two_hosts(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory  # noqa: F811
              ) -> Iterator[TwoHosts]:
    from engine.store import JobStore
    from engine.worker.config import Assignment, InstanceSpec
    from engine.worker.routes import etcd_client

    with hosts(2) as net:
        print(f"cross-host test: {net.kind} ({', '.join(h.address for h in net.hosts)})")
        tmp = tmp_path_factory.mktemp("xhost")
        redis = RedisServer("redis-server", tmp / "redis", host=net.gateway).start()
        etcd_srv = EtcdServer("etcd", tmp / "etcd", host=net.gateway).start()
        store = JobStore.from_url(redis.url, ttl=600)
        etcd = etcd_client(etcd_srv.url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
        env.update(ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd_srv.url, ONEPIECE_DEVICE="cpu",
                   ONEPIECE_PROGRESS_INTERVAL_MS="0", ONEPIECE_ROUTE_REFRESH_S="0.2")
        onepiece = [sys.executable, "-m", "engine.cli"]
        stage_time = ",".join(f"{s}={STAGE_TIME_S}" for s in ROUTE)
        nodes: dict[str, subprocess.Popen[str]] = {}
        proxy = None
        prefix = f"test-{os.getpid()}-x"
        try:
            for i, (name, stages) in enumerate(ON.items()):
                run_dir = tmp / f"node-{name}"
                run_dir.mkdir()
                a = Assignment(tuple(InstanceSpec(f"sd-t2i.{s}.{name}", "sd-t2i", s, "cpu") for s in stages),
                               {"sd-t2i": str(tiny_models["sd-t2i"])})
                (run_dir / "assignment.json").write_text(a.to_json())
                nodes[name] = subprocess.Popen(net[i].wrap([
                    *onepiece, "node", "--node", f"host-{name}", "--run-dir", str(run_dir), "--assignment",
                    str(run_dir / "assignment.json"), "--ring-prefix", f"{prefix}{name}-", "--ring-bytes",
                    str(8 << 20), "--ring-slots", "64", "--transport", "tcp", "--data-host", net[i].address,
                    "--stage-time", stage_time]), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
            proxy = subprocess.Popen([*onepiece, "proxy", "--port", "0"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
            assert proxy.stdout is not None
            line = proxy.stdout.readline()
            assert line.startswith("proxy: "), line + _stop(proxy)
            c = Cluster(line.split(": ", 1)[1].strip(), nodes["a"], proxy, store, etcd, tmp, prefix)
            deadline = time.monotonic() + 240
            while True:
                status, doc, _ = c.call("GET", "/readyz")
                checks = doc.get("checks", {}) if isinstance(doc, dict) else {}
                if status == 200 and checks.get("routes:sd-t2i") == "ok":
                    break
                for n in nodes.values():
                    assert n.poll() is None, _stop(n)
                assert time.monotonic() < deadline, f"not ready: {doc}"
                time.sleep(0.25)
            yield TwoHosts(c, net, nodes)
        finally:
            outs = {n: _stop(p) for n, p in nodes.items()}
            proxy_out = _stop(proxy) if proxy is not None else ""
            store.close()
            etcd_srv.stop()
            redis.stop()
            left = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-{prefix}")]
            assert not left, f"rings left behind: {left}"
            for name, p in nodes.items():
                assert p.returncode == 0, outs[name]
            assert proxy is None or proxy.returncode == 0, proxy_out


def _reference(tiny_models: dict[str, Path]) -> np.ndarray:  # noqa: F811
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


def test_a_request_crosses_hosts_over_tcp(two_hosts: TwoHosts, tiny_models: dict[str, Path]) -> None:  # noqa: F811
    c, net = two_hosts.cluster, two_hosts.hosts
    routes = {m["key"].decode().rsplit("/", 1)[1]: json.loads(v) for v, m in c.etcd.get_prefix("/onepiece/routes/")}
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


def test_sigkill_of_each_stage_worker_in_turn(two_hosts: TwoHosts, tiny_models: dict[str, Path]) -> None:  # noqa: F811
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
            raw = c.etcd.get(f"/onepiece/nodes/host-{node}")
            inst = json.loads(raw[0])["instances"][f"sd-t2i.{stage}.{node}"]
            if inst["restarts"] >= 1 and inst["ready"]:
                break
            assert time.monotonic() < deadline, inst
            time.sleep(0.2)
