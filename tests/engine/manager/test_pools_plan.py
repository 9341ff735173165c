"""The Node Manager plans stage pools shared across workflows: Theorem 1 over the union of the chains."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest

from engine.coord.keys import Keyspace
from engine.manager.election import connect
from engine.manager.node_manager import ManagerConfig, NodeManager
from tests.fixtures.coord import leading_election

WAN = ("wan2.1-i2v", "wan2.1-t2v")
ROOT = f"/onepiece-pools-{uuid.uuid4().hex[:6]}"
# the shared decoder is the slow stage of both workflows; everything else is quick
TIMES = {"text_encode": 0.01, "image_encode": 0.01, "vae_encode": 0.01, "denoise": 0.1, "vae_decode": 1.0,
         "video_encode": 0.01}


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def manager(etcd_server, tiny_models: dict[str, Path]):
    client = connect(etcd_server.url)
    client.delete_prefix(ROOT + "/")
    e = leading_election(client, ROOT, ttl=2)
    # one node's report: each workflow's requests measured apart, shared instances included
    instances = {f"{w}.{s}.x": {"workflow": w, "stage": s, "serves": [f"{w}/{s}"], "service_s": {w: t}}
                 for w in WAN for s, t in TIMES.items() if s != "image_encode" and s != "vae_encode" or w == WAN[0]}
    client.put(Keyspace(ROOT).node("n1"), json.dumps({"node": "n1", "instances": instances}))
    nm = NodeManager(client, e, ManagerConfig(workflows={w: str(tiny_models[w]) for w in WAN}, root=ROOT,
                                              slots_per_node=10, ewma=1.0), clock=Clock())
    yield client, nm
    e.resign()
    client.delete_prefix(ROOT + "/")


def _instances(client) -> list[dict]:
    body = json.loads(client.get(Keyspace(ROOT).assignment("n1"))[0])
    return body["instances"]


def test_a_shared_pool_is_sized_once_from_both_workflows_demand(manager) -> None:
    client, nm = manager
    result = nm.tick()
    assert result.applied
    placed = _instances(client)
    decoders = [i for i in placed if i["stage"] == "vae_decode"]
    # 7 pools (I2V's 6 stages, 3 of them shared with T2V, and T2V's denoise): 3 spare slots, all to the union's
    # bottleneck, the shared decoder, whose demand is both workflows' (2 x 1.0 s per unit of demand)
    assert len(placed) == 10 and len(decoders) == 4
    assert all(i["workflow"] == "wan2.1-i2v" and i["also"] == ["wan2.1-t2v/vae_decode"] for i in decoders)
    assert result.counts["wan2.1-i2v"]["vae_decode"] == result.counts["wan2.1-t2v"]["vae_decode"] == 4
    assert not any(i["workflow"] == "wan2.1-t2v" and i["stage"] in ("text_encode", "vae_decode", "video_encode")
                   for i in placed)  # no per-workflow copy of a shared stage
    cap = json.loads(client.get(Keyspace(ROOT).capacity("wan2.1-t2v"))[0])
    assert cap["shared"]["vae_decode"] == ["wan2.1-i2v/vae_decode", "wan2.1-t2v/vae_decode"]
    assert "denoise" not in cap["shared"]


def test_a_shared_pools_capacity_is_not_promised_to_both_workflows(manager) -> None:
    client, nm = manager
    nm.tick()
    nm.tick()  # capacity counts the instances assigned (the first tick wrote them)
    idle = json.loads(client.get(Keyspace(ROOT).capacity("wan2.1-t2v"))[0])["rps"]
    assert idle == pytest.approx(4 / 1.0)  # nobody else is using the four decoders
    # the I2V Proxy's arrivals take 2.5 decoders' worth (2.5 requests/s x 1.0 s): T2V is left with 1.5
    client.put(Keyspace(ROOT).proxy("default", "p1"), json.dumps({"url": "http://p1", "rps": {"wan2.1-i2v": 2.5}}))
    nm.cfg.cooldown = 0.0
    nm.tick()
    cap = json.loads(client.get(Keyspace(ROOT).capacity("wan2.1-t2v"))[0])
    decoders = cap["instances"]["vae_decode"]
    assert cap["rps"] == pytest.approx((decoders - 2.5) / 1.0) and cap["bottleneck"] == "vae_decode"
    # and the allocation follows the demand: the I2V-only stages may grow, the shared decoder stays the largest
    assert decoders == max(cap["instances"].values()) and not math.isnan(cap["rps"])


def test_operators_bounds_on_any_member_bound_the_pool(manager) -> None:
    from engine.coord import actions as act

    client, nm = manager
    nm.tick()
    rid = act.submit(client, ROOT, "scale_stage", {"workflow": "wan2.1-t2v", "stage": "vae_decode", "instances": 2},
                     "ops")
    nm.tick()
    assert act.result(client, ROOT, rid, timeout=2)["ok"]
    assert len([i for i in _instances(client) if i["stage"] == "vae_decode"]) == 2
