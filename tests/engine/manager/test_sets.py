"""Workflow Sets: per-set allocation, lending a spare node to a short set, and which Proxy a client gets then."""

from __future__ import annotations

import json
import uuid

import pytest

from engine.coord import proxies
from engine.coord.keys import Keyspace
from engine.manager import sets
from engine.manager.election import connect
from engine.manager.node_manager import ManagerConfig, NodeManager
from tests.fixtures.coord import leading_election

WF = "sd-t2i"
ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
TIMES = {"text_encode": 0.01, "denoise": 0.5, "vae_decode": 0.05, "image_encode": 0.01}


def _cap(per_node: float):
    return lambda s, n: {WF: per_node * n}


def test_a_short_set_borrows_a_spare_node_and_gives_it_back() -> None:
    home = {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}
    # B takes 1.5/s on one node worth 1/s; A takes 0.5/s on three: A lends one of its own
    move = sets.rebalance_sets(home, home, _cap(1.0), {"A": {WF: 0.5}, "B": {WF: 1.5}})
    assert move == ("a1", "A", "B")
    lent = dict(home, a1="B")
    assert sets.rebalance_sets(home, lent, _cap(1.0), {"A": {WF: 0.5}, "B": {WF: 1.5}}) is None  # stays
    # B's load fell: the node goes home
    assert sets.rebalance_sets(home, lent, _cap(1.0), {"A": {WF: 0.5}, "B": {WF: 0.2}}) == ("a1", "B", "A")


def test_no_move_without_a_spare_node_or_a_short_set() -> None:
    home = {"a1": "A", "a2": "A", "b1": "B"}
    # A would be short without its second node: nothing to lend, B stays short
    assert sets.rebalance_sets(home, home, _cap(1.0), {"A": {WF: 1.2}, "B": {WF: 1.5}}) is None
    # nobody short
    assert sets.rebalance_sets(home, home, _cap(1.0), {"A": {WF: 0.1}, "B": {WF: 0.5}}) is None
    # a one-node set never lends its only node
    assert sets.rebalance_sets({"a1": "A", "b1": "B"}, {"a1": "A", "b1": "B"}, _cap(1.0),
                               {"A": {}, "B": {WF: 5.0}}) is None


def test_the_manager_allocates_per_set_and_lends_a_node_to_a_short_set(etcd_server) -> None:
    client = connect(etcd_server.url)
    root = f"/onepiece-test-{uuid.uuid4().hex[:6]}"

    def report(node: str, home: str) -> None:
        instances = {f"x.{s}.{node}": {"workflow": WF, "stage": s, "last_stage_s": t} for s, t in TIMES.items()}
        client.put(Keyspace(root).node(node), json.dumps({"node": node, "set": home, "instances": instances}))

    for n in ("a1", "a2", "a3"):
        report(n, "A")
    report("b1", "B")
    proxies.register_proxy(client, "A", "pa", "http://proxy-a", {WF: 5.0}, None, root)
    proxies.register_proxy(client, "B", "pb", "http://proxy-b", {WF: 0.1}, None, root)
    e = leading_election(client, root, "nm-sets", ttl=2)
    clock = [1000.0]
    nm = NodeManager(client, e, ManagerConfig(workflows={WF: "/m"}, root=root, slots_per_node=4, cooldown=5),
                     clock=lambda: clock[0])
    try:
        assert nm.tick().applied
        plans = {n: json.loads(client.get(Keyspace(root).assignment(n))[0])["instances"] for n in ("a1", "a2", "a3", "b1")}
        # each set serves every stage on its own nodes, and says so on every instance
        for members, name in ((("a1", "a2", "a3"), "A"), (("b1",), "B")):
            stages = [i["stage"] for n in members for i in plans[n]]
            assert set(stages) == set(ROUTE), (name, stages)
            assert all(i.get("workflow_set", "default") == name for n in members for i in plans[n])
        nm.tick()  # the next tick measures the sets as placed
        state = json.loads(client.get(Keyspace(root).sets_state())[0])
        assert state["B"]["proxies"] == ["http://proxy-b"] and state["A"]["nodes"] == ["a1", "a2", "a3"]
        cap_b = json.loads(client.get(Keyspace(root).set_capacity("B", WF))[0])["rps"]
        assert cap_b == pytest.approx(state["B"]["workflows"][WF]["capacity"]) and cap_b > 0
        assert proxies.which_proxy(client, WF, root) == "http://proxy-b"  # B is less loaded
        # B's load grows past its one node: after the cooldown A lends it a node
        proxies.register_proxy(client, "B", "pb", "http://proxy-b", {WF: 3 * cap_b}, None, root)
        clock[0] += 10
        result = nm.tick()
        assert result.applied and "moved to set B" in result.reason
        assert json.loads(client.get(Keyspace(root).set_node("a1"))[0]) == "B"
        lent = json.loads(client.get(Keyspace(root).assignment("a1"))[0])["instances"]
        assert lent and all(i["workflow_set"] == "B" for i in lent)
        nm.tick()
        state = json.loads(client.get(Keyspace(root).sets_state())[0])
        assert state["B"]["nodes"] == ["a1", "b1"]
        assert state["B"]["workflows"][WF]["capacity"] > cap_b  # two nodes' worth now
        assert proxies.which_proxy(client, WF, root) == "http://proxy-a"  # now A is the less loaded
    finally:
        e.resign()
        client.delete_prefix(root + "/")
