"""The Node Manager's planner as a pure function: Theorem 1 per set, placement, hysteresis, operators'
overrides, set moves, shared pools and what it publishes; no etcd."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.manager.allocator import AllocationError, for_budget
from engine.manager.overrides import Overrides, validate
from engine.manager.planner import (
    NO_NODES,
    ManagerConfig,
    Observation,
    Plan,
    fold_stage_times,
    plan,
    same_capacity,
    stage_profiles,
)
from engine.manager.publish import Published
from engine.workflow.pools import Pool

WF = "sd-t2i"
TIMES = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
WAN = ("wan2.1-i2v", "wan2.1-t2v")


def _times(times: dict[str, float], workflow: str = WF) -> dict[tuple[str, str], float]:
    return {(workflow, s): t for s, t in times.items()}


def _seen(nodes: dict[str, str] | list[str], current: dict[str, Any] | None = None, **kw: Any) -> Observation:
    """Live nodes (name -> home set, or names in the default set) and the assignments as written."""
    homes = nodes if isinstance(nodes, dict) else dict.fromkeys(nodes, "default")
    reports = {n: {"node": n, "set": s, "instances": {}} for n, s in homes.items()}
    return Observation(reports, current or {}, kw.get("chosen", {}), kw.get("arrival", {}), kw.get("proxies", {}))


def _written(p: Plan) -> dict[str, dict[str, Any]]:
    """The assignments as the Node Manager writes them from a plan."""
    return {n: {"instances": instances} for n, instances in p.placed.items()}


def _run(seen: Observation, times: dict[tuple[str, str], float], cfg: ManagerConfig, **kw: Any) -> Plan:
    return plan(seen, kw.pop("overrides", Overrides()), times, cfg, now=kw.pop("now", 1000.0), **kw)


def test_a_first_plan_sizes_stages_by_theorem_1_and_fills_every_node_within_its_slots() -> None:
    cfg = ManagerConfig(workflows={WF: "/models/sd"}, slots_per_node=5, root="/t")
    p = _run(_seen(["n1", "n2"]), _times(TIMES), cfg)
    want = for_budget(stage_profiles(WF, Overrides(), _times(TIMES)), 10).instances
    assert p.apply and p.reason == "missing instances" and p.counts[WF] == want and want["denoise"] >= 5
    assert set(p.placed) == {"n1", "n2"} and all(len(v) <= 5 for v in p.placed.values())
    placed = [i["stage"] for v in p.placed.values() for i in v]
    assert {s: placed.count(s) for s in want} == want
    ids = [i["id"] for v in p.placed.values() for i in v]
    assert len(ids) == len(set(ids))
    # the capacity published is that of the instances the cluster has (none yet), the recommendation Theorem 1's
    assert p.publish is not None and p.publish.capacity[WF]["rps"] == 0 and p.publish.capacity[WF]["recommended"] == want


def test_hysteresis_keeps_small_gains_moves_for_a_new_bottleneck_and_waits_for_the_cooldown() -> None:
    cfg = ManagerConfig(workflows={WF: "/models/sd"}, slots_per_node=5, cooldown=100.0, root="/t")
    nodes = ["n1", "n2"]
    first = _run(_seen(nodes), _times(TIMES), cfg)
    current = _written(first)
    kept = _run(_seen(nodes, current), _times({**TIMES, "denoise": 0.31}), cfg, now=1200.0, last_change=1000.0)
    assert not kept.apply and "hysteresis" in kept.reason and kept.placed == {}
    shifted = _times({**TIMES, "vae_decode": 0.3})  # decoding becomes as slow as denoising
    moved = _run(_seen(nodes, current), shifted, cfg, now=1200.0, last_change=1000.0)
    assert moved.apply and moved.reason.startswith("gain") and moved.counts[WF]["vae_decode"] > 1
    before = {i["id"] for v in current.values() for i in v["instances"]}
    after = {i["id"] for v in moved.placed.values() for i in v}
    assert len(before & after) >= len(after) - 3  # most instances stay where they were
    # right after a change even a large gain waits for the cooldown (no flapping)
    back = _run(_seen(nodes, _written(moved)), _times(TIMES), cfg, now=1210.0, last_change=1200.0)
    assert not back.apply and "hysteresis" in back.reason
    assert _run(_seen(nodes, _written(moved)), _times(TIMES), cfg, now=1310.0, last_change=1200.0).apply


def test_two_workflows_share_the_slots_each_with_its_minimums_and_too_few_slots_is_an_error() -> None:
    cfg = ManagerConfig(workflows={WF: "/a", "wan2.1-i2v": "/b"}, slots_per_node=10, root="/t")
    p = _run(_seen(["n1"]), _times({"denoise": 0.3}), cfg)
    assert p.apply and set(p.counts) == {WF, "wan2.1-i2v"}
    assert all(n >= 1 for c in p.counts.values() for n in c.values())
    assert sum(n for c in p.counts.values() for n in c.values()) <= 10
    cfg.slots_per_node = 5  # fewer slots than the two workflows' ten stages need
    with pytest.raises(AllocationError, match="cannot hold the stages' minimums"):
        _run(_seen(["n1"]), {}, cfg)


def test_no_live_node_plans_nothing_and_a_drained_nodes_instances_move_off_it() -> None:
    cfg = ManagerConfig(workflows={WF: "/m"}, slots_per_node=4, root="/t")
    assert _run(_seen([]), {}, cfg) == Plan(NO_NODES)
    first = _run(_seen(["n1", "n2", "n3"]), _times(TIMES), cfg)
    current = _written(first)
    assert current["n2"]["instances"]
    drained = Overrides(drained=["n2"])
    assert _run(_seen(["n1", "n2", "n3"]), {}, cfg, overrides=drained) != Plan(NO_NODES)
    p = _run(_seen(["n1", "n2", "n3"], current), _times(TIMES), cfg, overrides=drained,
             now=1001.0, last_change=1000.0)  # inside the cooldown: stranded instances move regardless
    assert p.apply and p.placed["n2"] == [] and p.sets is not None and "n2" not in p.sets.member
    # re-sized for the two live nodes' 8 slots, keeping what n1 and n3 ran
    assert sum(len(v) for v in p.placed.values()) == 8
    assert {i["id"] for n in ("n1", "n3") for i in current[n]["instances"]} <= {i["id"] for v in p.placed.values() for i in v}


def test_an_operators_pin_moves_an_instance_and_an_accepted_action_applies_past_hysteresis() -> None:
    cfg = ManagerConfig(workflows={WF: "/m"}, slots_per_node=4, root="/t")
    nodes = ["n1", "n2", "n3"]
    scaled = Overrides(stages={f"{WF}/denoise": {"min": 2, "max": 2}})  # leaves free slots
    current = _written(_run(_seen(nodes), _times(TIMES), cfg, overrides=scaled))
    inst, home = next((i["id"], n) for n, v in current.items() for i in v["instances"])
    target = next(n for n in nodes if n != home and len(current[n]["instances"]) < 4)
    pinned = Overrides(stages=scaled.stages, pinned={inst: target})
    p = _run(_seen(nodes, current), _times(TIMES), cfg, overrides=pinned, now=1001.0, last_change=1000.0)
    assert p.apply and p.reason == "operator action" and inst in [i["id"] for i in p.placed[target]]
    # a forced plan that changes nothing is not applied
    assert not _run(_seen(nodes, current), _times(TIMES), cfg, overrides=scaled, forced=True, now=1001.0,
                    last_change=1000.0).apply


def test_a_short_set_borrows_a_spare_node_after_the_cooldown() -> None:
    cfg = ManagerConfig(workflows={WF: "/m"}, slots_per_node=4, cooldown=5, root="/t")
    homes = {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}
    first = _run(_seen(homes, arrival={"A": {WF: 5.0}, "B": {WF: 0.1}}), _times({**TIMES, "denoise": 0.5}), cfg)
    assert first.apply and all(i.get("workflow_set") == "B" for i in first.placed["b1"])
    current = _written(first)
    arrival = {"A": {WF: 0.1}, "B": {WF: 50.0}}  # B's load grows far past its one node
    inside = _run(_seen(homes, current, arrival=arrival), _times({**TIMES, "denoise": 0.5}), cfg,
                  now=1001.0, last_change=1000.0)
    assert inside.sets is not None and inside.sets.moved is None  # no move inside the cooldown
    p = _run(_seen(homes, current, arrival=arrival, proxies={"B": ["http://b"]}), _times({**TIMES, "denoise": 0.5}),
             cfg, now=1010.0, last_change=1000.0)
    assert p.apply and p.sets is not None and p.sets.moved == ("a1", "A", "B") and "moved to set B" in p.reason
    assert p.placed["a1"] and all(i["workflow_set"] == "B" for i in p.placed["a1"])
    assert p.publish is not None and p.publish.sets_state["B"]["proxies"] == ["http://b"]
    assert p.publish.sets_state["B"]["nodes"] == ["a1", "b1"]


def _wan_pools() -> list[Pool]:
    """Wan I2V and T2V sharing the text encoder, the decoder and the video encoder (as their tiny models do)."""
    shared = ("text_encode", "vae_decode", "video_encode")
    out = [Pool(tuple((w, s) for w in WAN), f"d-{s}") for s in shared]
    out += [Pool(((WAN[0], s),)) for s in ("image_encode", "vae_encode", "denoise")] + [Pool(((WAN[1], "denoise"),))]
    return out


WAN_TIMES = {(w, s): t for w in WAN for s, t in {"text_encode": 0.01, "image_encode": 0.01, "vae_encode": 0.01,
                                                    "denoise": 0.1, "vae_decode": 1.0, "video_encode": 0.01}.items()}


def test_a_shared_pool_is_sized_once_and_its_capacity_is_not_promised_to_both_workflows() -> None:
    cfg = ManagerConfig(workflows={w: "/m" for w in WAN}, slots_per_node=10, root="/t")
    p = _run(_seen(["n1"]), WAN_TIMES, cfg, stage_pools=_wan_pools())
    decoders = [i for i in p.placed["n1"] if i["stage"] == "vae_decode"]
    # 7 pools: 3 spare slots, all to the union's bottleneck, the shared decoder (2 x 1.0 s per unit of demand)
    assert len(p.placed["n1"]) == 10 and len(decoders) == 4
    assert all(i["workflow"] == WAN[0] and i["also"] == [f"{WAN[1]}/vae_decode"] for i in decoders)
    assert p.counts[WAN[0]]["vae_decode"] == p.counts[WAN[1]]["vae_decode"] == 4
    current = _written(p)
    idle = _run(_seen(["n1"], current), WAN_TIMES, cfg, stage_pools=_wan_pools())
    assert idle.publish is not None and idle.publish.capacity[WAN[1]]["rps"] == pytest.approx(4 / 1.0)
    assert idle.publish.capacity[WAN[1]]["shared"]["vae_decode"] == [f"{w}/vae_decode" for w in WAN]
    # the I2V Proxy's arrivals take 2.5 decoders' worth: T2V is left with 1.5
    busy = _run(_seen(["n1"], current, arrival={"default": {WAN[0]: 2.5}}), WAN_TIMES, cfg,
                stage_pools=_wan_pools(), now=1001.0, last_change=1000.0)
    assert busy.publish is not None
    cap = busy.publish.capacity[WAN[1]]
    assert cap["rps"] == pytest.approx((4 - 2.5) / 1.0) and cap["bottleneck"] == "vae_decode"
    assert not math.isnan(cap["rps"])


def test_an_operators_bound_on_any_member_bounds_the_shared_pool() -> None:
    cfg = ManagerConfig(workflows={w: "/m" for w in WAN}, slots_per_node=10, root="/t")
    pools = _wan_pools()
    cluster = {"nodes": ["n1"], "slots_per_node": 10, "instances": {},
               "stages": {w: [s for x, s in WAN_TIMES if x == w] for w in WAN},
               "pools": [["/".join(m) for m in p.members] for p in pools]}
    bound = validate("scale_stage", {"workflow": WAN[1], "stage": "vae_decode", "instances": 2}, cluster,
                     Overrides())
    p = _run(_seen(["n1"]), WAN_TIMES, cfg, overrides=bound, stage_pools=pools)
    assert len([i for i in p.placed["n1"] if i["stage"] == "vae_decode"]) == 2


def test_stage_times_fold_into_a_moving_average_per_workflow() -> None:
    nodes = {"n1": {"instances": {"a": {"workflow": WF, "stage": "denoise", "last_stage_s": 1.0}}},
             "n2": {"instances": {"b": {"workflow": WAN[0], "stage": "vae_decode", "serves": [f"{w}/vae_decode" for w in WAN],
                                        "service_s": {WAN[0]: 2.0}}}}}
    first = fold_stage_times({}, nodes, 0.5)
    assert first == {(WF, "denoise"): 1.0, (WAN[0], "vae_decode"): 2.0}  # T2V measured nothing there
    nodes["n1"]["instances"]["a"]["last_stage_s"] = 3.0
    assert fold_stage_times(first, nodes, 0.5)[WF, "denoise"] == pytest.approx(2.0)


def test_only_what_changed_is_republished() -> None:
    pub = Published()
    body = {"rps": 10.0, "recommended": {"denoise": 2}, "mode": "individual"}
    assert pub.changed({"k": body}, same_capacity) == {"k": body}
    pub.remember({"k": body})
    assert pub.changed({"k": {**body, "rps": 10.4}}, same_capacity) == {}  # within 5%
    assert pub.changed({"k": {**body, "rps": 10.6}}, same_capacity) != {}
    assert pub.changed({"k": {**body, "mode": "collaboration"}}, same_capacity) != {}
    assert pub.changed({"k": {**body, "recommended": {"denoise": 3}}}, same_capacity) != {}
    pub.remember({"s": {"a": 1}})
    assert pub.changed({"s": {"a": 1}}) == {} and pub.changed({"s": {"a": 2}}) == {"s": {"a": 2}}
