"""LoRA adapters on a live engine (``onepiece node --max-adapters 1`` and ``onepiece proxy``, a Redis and an
etcd of its own): sd-t2i with two denoise instances; requests alternating between two adapters complete with
the one-call pipeline's bytes, the text encoder's delivery keeps each adapter on one instance (affinity: with
room for one adapter each, nothing is evicted), the node reports the adapters loaded per instance, and the
Proxy answers a bad ``lora`` with a 400 naming it."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.coord.keys import Keyspace
from engine.embedded.services import EtcdServer, RedisServer
from tests.fixtures.runtime import NodeRun, engine

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.integration, pytest.mark.timeout(600)]

WF = "sd-t2i"
PARAMS = dict(prompt="a red kite", height=64, width=64, num_inference_steps=3)


def test_adapters_through_a_live_engine(tiny_models: dict[str, Path], adapters: Any, tmp_path: Path) -> None:
    import torch
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from engine.worker.config import Assignment, InstanceSpec
    from engine.workflow import get_workflow

    stages = get_workflow(WF).route()
    instances = [InstanceSpec(f"{WF}.{st}.0", WF, st, "cpu") for st in stages]
    instances.append(InstanceSpec(f"{WF}.denoise.1", WF, "denoise", "cpu"))
    node = NodeRun("lora-node", Assignment(tuple(instances), {WF: str(tiny_models[WF])}), ("--max-adapters", "1"))
    redis = RedisServer("redis-server", tmp_path / "redis").start()
    etcd_srv = EtcdServer("etcd", tmp_path / "etcd").start()
    env = {"ONEPIECE_ADAPTER_STORE": str(adapters.root), "ONEPIECE_THREADS_PER_INSTANCE": "1",
           "ONEPIECE_MAX_BATCH": "denoise=1"}
    try:
        with engine(redis.url, etcd_srv.url, [node], tmp_path, f"test-{os.getpid()}-lora-", env_extra=env) as (c, _):
            status, doc, _h = c.call("POST", "/v1/requests", {"workflow": WF, "params": {
                **PARAMS, "lora": [{"name": "../../etc/passwd"}]}})
            assert status == 400 and doc["field"] == "lora", doc
            status, doc, _h = c.call("POST", "/v1/requests", {"workflow": WF, "params": {
                **PARAMS, "lora": [{"name": "wave"}]}})
            assert status == 400 and doc["field"] == "lora" and "wan2.1-t2v" in doc["error"], doc
            # until the text encoder's delivery sees both denoise instances (each has served a request)
            denoisers = (f"{WF}.denoise.0", f"{WF}.denoise.1")
            for _ in range(20):
                for uid in [c.submit(WF, {**PARAMS, "seed": 99}) for _ in range(2)]:
                    assert c.wait(uid, {"completed", "failed"})["state"] == "completed"
                plain = {i: int(c.store.instances.read(i).get("requests", 0)) for i in denoisers}
                if all(plain.values()):
                    break
            else:
                raise AssertionError(f"one denoise instance never got a request: {plain}")
            results = {}
            for k, name in enumerate(["alpha", "beta", "alpha", "beta", "alpha"]):
                uid = c.submit(WF, {**PARAMS, "seed": k, "lora": [{"name": name, "scale": 0.8}]})
                assert c.wait(uid, {"completed", "failed"})["state"] == "completed"
                status, png, _h = c.call("GET", f"/v1/requests/{uid}/result")
                assert status == 200
                results[(k, name)] = np.asarray(Image.open(io.BytesIO(png)))
            report = {}
            for iid in (f"{WF}.denoise.0", f"{WF}.denoise.1"):
                report[iid] = c.store.instances.read(iid)
            import json

            loaded = {iid: json.loads(s["adapters"]) for iid, s in report.items()}
            assert sorted(a for r in loaded.values() for a in r["loaded"]) == ["alpha", "beta"], loaded
            assert all(r["evicted"] == 0 and r["max"] == 1 for r in loaded.values()), loaded  # affinity held
            assert sorted(int(s["requests"]) - plain[i] for i, s in report.items()) == [2, 3]
            # the node's report in etcd carries them per instance (what the dashboard shows)
            deadline = time.monotonic() + 15  # the node reports every 2 s: wait for the report that has them
            while True:
                values = c.etcd.get(KEYS.node("lora-node"))
                node_report = json.loads(values[0]) if values else {}
                shown = {iid: (i.get("adapters") or {}).get("loaded") or []
                         for iid, i in node_report.get("instances", {}).items() if iid.startswith(f"{WF}.denoise")}
                if sorted(sum(shown.values(), [])) == ["alpha", "beta"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert sorted(sum(shown.values(), [])) == ["alpha", "beta"], node_report
    finally:
        etcd_srv.stop()
        redis.stop()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: bytes are compared at the same one
    try:
        pipe = StableDiffusionPipeline.from_pretrained(tiny_models[WF])
        pipe.load_lora_weights(str(adapters.file(adapters.get("alpha"))), adapter_name="alpha")
        pipe.set_adapters(["alpha"], [0.8])
        ref = np.asarray(pipe(generator=torch.Generator().manual_seed(2), output_type="pil", **PARAMS).images[0])
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(results[(2, "alpha")], ref)
    assert not np.array_equal(results[(0, "alpha")], results[(2, "alpha")])
