"""Operators' scaling actions: validated, applied under the fencing token, audited."""

from __future__ import annotations

import json
import uuid

import pytest

from engine.coord import actions as act
from engine.coord.keys import Keyspace
from engine.manager.election import Election, connect
from engine.manager.node_manager import ManagerConfig, NodeManager
from engine.manager.overrides import Overrides
from tests.fixtures.coord import leading_election

WF = "sd-t2i"
TIMES = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(etcd_server):
    root = f"/onepiece-test-{uuid.uuid4().hex[:6]}"
    client = connect(etcd_server.url)
    for n in ("n1", "n2", "n3"):
        inst = {f"x.{s}": {"workflow": WF, "stage": s, "last_stage_s": t} for s, t in TIMES.items()}
        client.put(Keyspace(root).node(n), json.dumps({"node": n, "instances": inst}))
    e = leading_election(client, root, "nm", ttl=2)
    nm = NodeManager(client, e, ManagerConfig(workflows={WF: "/m"}, slots_per_node=4, root=root, ewma=1.0),
                     clock=Clock())
    assert nm.tick().applied  # the initial allocation
    yield client, root, nm
    e.resign()
    client.delete_prefix(root + "/")


def _do(client, root, nm, action, **args):
    rid = act.submit(client, root, action, args, actor="alice")
    nm.tick()
    return act.result(client, root, rid, timeout=2)


def _placed(client, root) -> dict[str, list[str]]:
    prefix = Keyspace(root).assignments()
    return {m["key"].decode()[len(prefix):]: [i["id"] for i in json.loads(v)["instances"]]
            for v, m in client.get_prefix(prefix)}


def test_scale_stage_applies_at_once_and_is_audited(env) -> None:
    client, root, nm = env
    r = _do(client, root, nm, "scale_stage", workflow=WF, stage="vae_decode", instances=3)
    assert r["ok"] and r["actor"] == "alice" and r["fence_token"] == nm.election.leadership.token
    placed = [i for ids in _placed(client, root).values() for i in ids]
    assert sum(1 for i in placed if ".vae_decode." in i) == 3
    audit = [json.loads(v) for v, _ in client.get_prefix(Keyspace(root).audits())]
    assert [a["action"] for a in audit] == ["scale_stage"]
    assert client.get_prefix(Keyspace(root).action_requests()) == []


@pytest.mark.parametrize(("action", "args", "why"), [
    ("scale_stage", {"workflow": WF, "stage": "nope", "instances": 2}, "no stage"),
    ("scale_stage", {"workflow": WF, "stage": "denoise", "instances": 50}, "does not fit"),
    ("scale_stage", {"workflow": WF, "stage": "denoise", "instances": 0}, "positive integer"),
    ("drain_node", {"node": "n9"}, "no live node"),
    ("move_instance", {"instance": "ghost", "node": "n1"}, "no instance"),
    ("set_mode", {"workflow": WF, "mode": "turbo"}, "mode must be"),
    # sd-t2i's UNet batches both CFG halves into one call: splitting them would change the result
    ("set_mode", {"workflow": WF, "mode": "collaboration"}, "bit-identically"),
])
def test_invalid_actions_are_refused_with_a_reason_and_audited(env, action, args, why) -> None:
    client, root, nm = env
    before = _placed(client, root)
    r = _do(client, root, nm, action, **args)
    assert not r["ok"] and why in r["error"]
    assert _placed(client, root) == before
    assert len(client.get_prefix(Keyspace(root).audits())) == 1


def test_drain_moves_everything_off_the_node(env) -> None:
    client, root, nm = env
    assert _placed(client, root)["n2"]
    r = _do(client, root, nm, "drain_node", node="n2")
    assert r["ok"]
    placed = _placed(client, root)
    assert placed["n2"] == []
    stages = {i.split(".")[1] for ids in placed.values() for i in ids}
    assert stages == set(TIMES)  # every stage still served, on n1 and n3


def test_move_instance_pins_it_to_the_node(env) -> None:
    client, root, nm = env
    assert _do(client, root, nm, "scale_stage", workflow=WF, stage="denoise", instances=2)["ok"]  # free slots
    placed = _placed(client, root)
    src = next(n for n, ids in placed.items() if any(".text_encode." in i for i in ids))
    inst = next(i for i in placed[src] if ".text_encode." in i)
    target = next(n for n, ids in sorted(placed.items()) if n != src and len(ids) < 4)
    r = _do(client, root, nm, "move_instance", instance=inst, node=target)
    assert r["ok"], r
    assert inst in _placed(client, root)[target]


def test_a_deposed_manager_cannot_apply_an_action(env, etcd_server) -> None:
    client, root, nm = env
    nm.election._lease.revoke()
    rid = act.submit(client, root, "scale_stage", {"workflow": WF, "stage": "denoise", "instances": 2}, "bob")
    assert not nm.tick().leader
    assert act.result(client, root, rid, timeout=0.2) is None  # not applied, still queued
    other = Election(connect(etcd_server.url), "nm2", ttl=2, key=Keyspace(root).leader())
    assert other.try_acquire() is not None
    nm2 = NodeManager(client, other, nm.cfg, clock=Clock())
    nm2.tick()
    assert act.result(client, root, rid, timeout=2)["ok"]  # the new leader applies it
    other.resign()


def test_observing_writes_nothing_and_the_actions_step_applies_what_it_saw(env) -> None:
    """The tick's first step only reads: a queued action is still queued, unanswered, after it; the
    operator-actions step answers it and changes the overrides (fenced)."""
    client, root, nm = env
    rid = act.submit(client, root, "scale_stage", {"workflow": WF, "stage": "denoise", "instances": 2}, "alice")
    before = {m["key"]: v for v, m in client.get_prefix(root + "/")}
    seen = nm._observe()
    assert {m["key"]: v for v, m in client.get_prefix(root + "/")} == before  # not one key written or deleted
    assert list(seen.actions) == [rid] and act.result(client, root, rid, timeout=0) is None
    nm._operator_actions(seen)
    assert act.result(client, root, rid, timeout=0)["ok"]
    assert Overrides.from_json(client.get(Keyspace(root).overrides())[0]).stages[f"{WF}/denoise"]["min"] == 2
    assert client.get_prefix(Keyspace(root).action_requests()) == []
