"""The Node Manager's tick on a real etcd: allocation, placement, hysteresis, fencing."""

from __future__ import annotations

import json
import uuid

import pytest

from engine.coord.keys import Keyspace
from engine.manager.allocator import for_budget
from engine.manager.election import Election, connect
from engine.manager.node_manager import ManagerConfig, NodeManager
from tests.fixtures.coord import leading_election

WF = "sd-t2i"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


ROOT = f"/onepiece-test-{uuid.uuid4().hex[:6]}"
KEYS = Keyspace(ROOT)  # the test's own root; the Proxies' route tables read the default one


@pytest.fixture
def reporting_nodes(etcd_server):
    """Live nodes reporting measured stage times (as TaskManagers do), under a key prefix of our own."""
    client = connect(etcd_server.url)
    client.delete_prefix(ROOT + "/")
    key = KEYS.leader()

    def report(node: str, times: dict[str, float]) -> None:
        instances = {f"{WF}.{s}.x{node}": {"workflow": WF, "stage": s, "last_stage_s": t} for s, t in times.items()}
        client.put(KEYS.node(node), json.dumps({"node": node, "instances": instances}))

    yield client, key, report
    client.delete_prefix(ROOT + "/")


def _manager(client, key, clock, **cfg) -> NodeManager:
    e = Election(client, f"nm-{uuid.uuid4().hex[:4]}", ttl=2, key=key)
    # every test makes its manager while nobody leads (a deposed one's lease is revoked first): it must win
    assert e.try_acquire() is not None, "another candidate holds the election key"
    return NodeManager(client, e, ManagerConfig(workflows={WF: "/models/sd"}, root=ROOT, **cfg), clock=clock)


def _assignments(client) -> dict[str, dict]:
    prefix = KEYS.assignments()
    return {meta["key"].decode()[len(prefix):]: json.loads(v) for v, meta in client.get_prefix(prefix)}


def test_first_tick_sizes_stages_by_theorem_1_and_writes_fenced_assignments(reporting_nodes) -> None:
    client, key, report = reporting_nodes
    times = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
    for n in ("n1", "n2"):
        report(n, times)
    nm = _manager(client, key, Clock(), slots_per_node=5)
    result = nm.tick()
    assert result.applied and result.leader
    want = for_budget(nm.profile(WF), 10).instances
    assert result.counts[WF] == want and want["denoise"] >= 5
    got = _assignments(client)
    assert set(got) == {"n1", "n2"}
    assert all(body["fence_token"] == nm.election.leadership.token for body in got.values())
    placed = [i["stage"] for body in got.values() for i in body["instances"]]
    assert {s: placed.count(s) for s in want} == want
    assert all(len(body["instances"]) <= 5 for body in got.values())
    assert nm.last_tick_seconds > 0
    nm.election.resign()


def test_hysteresis_keeps_the_allocation_for_small_changes_and_moves_for_a_new_bottleneck(reporting_nodes) -> None:
    client, key, report = reporting_nodes
    clock = Clock()
    base = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
    shifted = {**base, "vae_decode": 0.3}  # the mix shifts: decoding becomes as slow as denoising
    for n in ("n1", "n2"):
        report(n, base)
    nm = _manager(client, key, clock, slots_per_node=5, cooldown=100.0, ewma=1.0)
    assert nm.tick().applied
    before = _assignments(client)
    clock.t += 200
    report("n1", {**base, "denoise": 0.31})  # 3% slower: not worth moving anything
    assert not nm.tick().applied
    assert _assignments(client) == before
    for n in ("n1", "n2"):
        report(n, shifted)
    result = nm.tick()
    assert result.applied and result.counts[WF]["vae_decode"] > 1
    kept = {i["id"] for body in before.values() for i in body["instances"]}
    after = {i["id"] for body in _assignments(client).values() for i in body["instances"]}
    assert len(kept & after) >= len(after) - 3  # most instances stay where they were
    # and right after a change, even a large gain waits for the cooldown (no flapping)
    for n in ("n1", "n2"):
        report(n, base)
    clock.t += 10
    assert "hysteresis" in nm.tick().reason
    clock.t += 100
    assert nm.tick().applied
    nm.election.resign()


def test_a_deposed_managers_tick_writes_nothing(reporting_nodes) -> None:
    client, key, report = reporting_nodes
    report("n1", {"denoise": 0.3})
    a = _manager(client, key, Clock())
    a.election._lease.revoke()  # its lease lapses (as after a long stall)
    b = _manager(client, key, Clock())
    assert b.election.leadership is not None
    assert b.tick().applied
    client.delete_prefix(KEYS.assignments())  # a node lost its assignment: a wants to write one
    result = a.tick()  # a still believes it leads: etcd refuses its writes
    assert not result.leader and "stale" in result.reason
    assert _assignments(client) == {}
    assert not a.election.is_leader
    assert b.tick().applied  # the real leader repairs it
    b.election.resign()


def test_the_manager_feeds_measured_capacity_to_the_proxies(reporting_nodes, etcd_server) -> None:
    from engine.coord.routes import RouteTable

    client, key, report = reporting_nodes
    for n in ("n1", "n2"):
        report(n, {"text_encode": 0.01, "denoise": 0.5, "vae_decode": 0.05, "image_encode": 0.01})
    nm = _manager(client, key, Clock(), slots_per_node=5)
    result = nm.tick()
    assert result.applied
    nm.tick()  # with the instances now assigned, the capacity is theirs
    raw = client.get(KEYS.capacity(WF))
    body = json.loads(raw[0])
    denoise = result.counts[WF]["denoise"]
    assert body["rps"] == pytest.approx(denoise / 0.5)
    assert body["bottleneck"] == "denoise" and body["fence_token"] == nm.election.leadership.token
    # the Proxies' route table reads it (under the real root, /onepiece)
    client.put(Keyspace().capacity(WF), raw[0])
    try:
        table = RouteTable(connect(etcd_server.url))
        table.refresh()
        assert table.capacity(WF) == pytest.approx(body["rps"])
        assert table.capacity("wan2.1-i2v") is None
    finally:
        client.delete(Keyspace().capacity(WF))
    nm.election.resign()


def test_the_scheduling_mode_is_published_with_the_capacity(reporting_nodes, etcd_server) -> None:
    """set_mode reaches the workers through the capacity key their route tables read."""
    from engine.coord import actions as act
    from engine.coord.routes import RouteTable

    client, key, report = reporting_nodes
    wan = "wan2.1-i2v"
    stages = ["text_encode", "image_encode", "vae_encode", "denoise", "vae_decode", "video_encode"]
    for n in ("n1", "n2"):
        instances = {f"{wan}.{s}.x{n}": {"workflow": wan, "stage": s, "last_stage_s": 0.1} for s in stages}
        client.put(KEYS.node(n), json.dumps({"node": n, "instances": instances}))
    e = leading_election(client, ROOT, "nm-mode", ttl=2)
    nm = NodeManager(client, e, ManagerConfig(workflows={wan: "/models/wan"}, root=ROOT, slots_per_node=8),
                     clock=Clock())
    nm.tick()
    assert json.loads(client.get(KEYS.capacity(wan))[0])["mode"] == "individual"
    action_id = act.submit(client, ROOT, "set_mode", {"workflow": wan, "mode": "collaboration"}, "ops")
    nm.tick()
    assert act.result(client, ROOT, action_id, timeout=1)["ok"]
    nm.tick()
    raw = client.get(KEYS.capacity(wan))
    assert json.loads(raw[0])["mode"] == "collaboration"
    client.put(Keyspace().capacity(wan), raw[0])
    try:
        table = RouteTable(connect(etcd_server.url))
        table.refresh()
        assert table.mode(wan) == "collaboration" and table.mode(WF) == "individual"
    finally:
        client.delete(Keyspace().capacity(wan))
    e.resign()


def test_two_workflows_share_the_slots_and_each_gets_its_minimums(reporting_nodes) -> None:
    client, key, report = reporting_nodes
    report("n1", {"denoise": 0.3})
    e = leading_election(client, ROOT, "nm-two", ttl=2)
    nm = NodeManager(client, e, ManagerConfig(workflows={WF: "/a", "wan2.1-i2v": "/b"}, root=ROOT,
                                              slots_per_node=10), clock=Clock())
    result = nm.tick()
    assert result.applied
    assert set(result.counts) == {WF, "wan2.1-i2v"}
    assert all(n >= 1 for counts in result.counts.values() for n in counts.values())
    assert sum(n for counts in result.counts.values() for n in counts.values()) <= 10
    nm.cfg.slots_per_node = 5  # fewer slots than the two workflows' ten stages need
    with pytest.raises(Exception, match="cannot hold the stages' minimums"):
        nm.tick()
    e.resign()
