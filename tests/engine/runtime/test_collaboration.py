"""Collaboration mode: two denoise instances split each guided step's two predictions; the video stays
bit-identical to Individual mode and to the one-call run. A helper killed mid-request costs time, not
the request."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.coord.keys import Keyspace
from engine.embedded.services import EtcdServer, RedisServer
from engine.store import keys
from tests.fixtures.runtime import Cluster, NodeRun, engine

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

WF = "wan2.1-i2v"
WAN = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=4, seed=5,
           guidance_scale=5.0)


@pytest.fixture(scope="module")
def collab(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Cluster]:
    from engine.worker.config import Assignment, InstanceSpec, default_assignment

    tmp = tmp_path_factory.mktemp("collab")
    redis = RedisServer("redis-server", tmp / "redis").start()
    etcd_srv = EtcdServer("etcd", tmp / "etcd").start()
    base = default_assignment({WF: str(tiny_models[WF])}, device="cpu")
    # two denoise instances, each slowed per step so a test can catch one mid-request
    instances = tuple(i for i in base.instances if i.stage != "denoise") + tuple(
        InstanceSpec(f"{WF}.denoise.{k}", WF, "denoise", "cpu", 0.3) for k in range(2))
    try:
        with engine(redis.url, etcd_srv.url, [NodeRun("n1", Assignment(instances, base.model_dirs))], tmp,
                    f"test-{os.getpid()}-collab-") as (c, _procs):
            yield c
    finally:
        etcd_srv.stop()
        redis.stop()


def _set_mode(c: Cluster, mode: str) -> None:
    """What the leading Node Manager publishes after a set_mode action (tested in tests/engine/manager), and the
    event the workers act on: a route table that watches the capacity keys, as the workers' do, sees the mode
    (its own full reads are a minute apart, so only the watch's event can show it)."""
    from engine.coord.routes import RouteTable

    table = RouteTable(c.etcd, refresh_s=0.2, keys=KEYS, full_read_s=60.0).start()
    try:
        deadline = time.monotonic() + 30
        while not table.watching:
            assert time.monotonic() < deadline, "the route table's watches did not open"
            time.sleep(0.02)
        c.etcd.put(KEYS.capacity(WF), json.dumps({"rps": 1.0, "mode": mode}))
        while table.mode(WF) != mode:
            assert time.monotonic() < deadline, f"no route table saw mode {mode!r}"
            time.sleep(0.02)
    finally:
        table.stop()


def _run(c: Cluster, png: bytes) -> tuple[str, bytes, str]:
    uid = c.submit(WF, WAN, {"image": png})
    done = c.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=180)
    assert done["state"] == "completed", (done, c.events(uid))
    _, mp4, _ = c.call("GET", f"/v1/requests/{uid}/result")
    finished = [e["detail"] for e in c.events(uid) if e["type"] == "stage_finished" and e["stage"] == "denoise"]
    return uid, bytes(mp4), finished[0]


def _halves(c: Cluster) -> int:
    return sum(int(c.store.instances.read(f"{WF}.denoise.{k}").get("cfg_halves", 0)) for k in range(2))


def test_collaboration_is_bit_identical_to_individual_mode(collab: Cluster, tiny_models: dict[str, Path],
                                                         input_png: bytes) -> None:
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    _set_mode(collab, "individual")
    _, alone, detail = _run(collab, input_png)
    assert "collaboration" not in detail
    _set_mode(collab, "collaboration")
    before = _halves(collab)
    _, together, detail = _run(collab, input_png)
    # every step's unconditional half came from the other instance
    assert f"collaboration: {WAN['num_inference_steps']} halves by {WF}.denoise." in detail, detail
    assert _halves(collab) - before == WAN["num_inference_steps"]
    assert together == alone
    reference = LocalRunner(WF, tiny_models[WF], "cpu").run(get_workflow(WF).resolve_params(WAN), {"image": input_png})
    assert together == bytes(reference.outputs["video"])


def test_a_helper_killed_mid_request_costs_time_not_the_request(collab: Cluster, input_png: bytes) -> None:
    _set_mode(collab, "individual")
    _, alone, _ = _run(collab, input_png)
    _set_mode(collab, "collaboration")
    uid = collab.submit(WF, WAN, {"image": input_png})
    deadline = time.monotonic() + 120
    while not any(e["type"] == "progress" and e["stage"] == "denoise" for e in collab.events(uid)):
        assert time.monotonic() < deadline, collab.events(uid)
        time.sleep(0.02)
    # the helper is the denoise instance that did not take the request
    leader = (collab.store.r.hget(keys.job_key(uid), "instance") or b"").decode()
    report = json.loads(collab.etcd.get(KEYS.node("n1"))[0])
    helper = next(i for i in (f"{WF}.denoise.0", f"{WF}.denoise.1") if i != leader)
    os.kill(report["instances"][helper]["pid"], signal.SIGKILL)
    done = collab.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=180)
    assert done["state"] == "completed", (done, collab.events(uid))
    _, mp4, _ = collab.call("GET", f"/v1/requests/{uid}/result")
    assert bytes(mp4) == alone  # the leader computed the rest itself, identically
    detail = next(e["detail"] for e in collab.events(uid) if e["type"] == "stage_finished" and e["stage"] == "denoise")
    helped = int(detail.split("collaboration: ")[1].split()[0])
    assert helped < WAN["num_inference_steps"], detail  # the helper died before the end
    _set_mode(collab, "individual")
