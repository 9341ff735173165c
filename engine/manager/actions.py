"""Operators' scaling actions: requested through etcd, validated and applied by the leader.

The web platform (or ``onepiece`` tooling) never calls a manager replica
directly: it writes a request under ``<root>/actions/requests/<id>``; the leading
Node Manager picks it up on its next tick, validates it against the cluster
(bounds, capacity, that the node or stage exists), records the result under
``<root>/actions/results/<id>`` and, when accepted, changes the overrides the
allocator honours (``<root>/overrides``) with a fenced write. Every request,
accepted or refused, is appended to the audit log ``<root>/audit/``. Whichever
replica leads applies the action, and a deposed one cannot.

Actions:
  scale_stage   {workflow, stage, instances}   pin a stage's count (null: back to automatic)
  move_instance {instance, node}               place an instance on a node
  pin_instance  {instance, node}               same as move, kept across rebalancing
  drain_node    {node}                         move everything off a node (0 slots)
  undrain_node  {node}
  set_mode      {workflow, mode}               "individual" or "collaboration"
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.coord.keys import keyspace


class Action(enum.StrEnum):
    """What an operator may ask the leading Node Manager (the platform's OperatorAction kinds are checked
    against these by a test)."""

    SCALE_STAGE = "scale_stage"
    MOVE_INSTANCE = "move_instance"
    PIN_INSTANCE = "pin_instance"
    DRAIN_NODE = "drain_node"
    UNDRAIN_NODE = "undrain_node"
    SET_MODE = "set_mode"


ACTIONS = tuple(Action)
MODES = ("individual", "collaboration")


class ActionRefused(ValueError):
    """The action is invalid for the cluster as it is; the message says why."""


@dataclass
class Overrides:
    stages: dict[str, dict[str, int]] = field(default_factory=dict)  # "wf/stage" -> {"min", "max"}
    drained: list[str] = field(default_factory=list)
    pinned: dict[str, str] = field(default_factory=dict)  # instance id -> node
    modes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> Overrides:
        if not raw:
            return cls()
        d = json.loads(raw)
        return cls(d.get("stages", {}), d.get("drained", []), d.get("pinned", {}), d.get("modes", {}))


def submit(client: Any, root: str | None, action: str, args: dict[str, Any], actor: str) -> str:
    """Queue an action for the leader; returns its id (poll :func:`result`)."""
    if action not in ACTIONS:
        raise ActionRefused(f"unknown action {action!r}; known: {', '.join(ACTIONS)}")
    action_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    body = {"id": action_id, "action": action, "args": args, "actor": actor, "at": time.time()}
    client.put(keyspace(root).action_request(action_id), json.dumps(body))
    return action_id


def result(client: Any, root: str | None, action_id: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The leader's verdict on an action, waiting up to ``timeout`` seconds; None if none came."""
    deadline = time.monotonic() + timeout
    while True:
        got = client.get(keyspace(root).action_result(action_id))
        if got:
            return json.loads(got[0])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def validate(action: str, args: dict[str, Any], cluster: dict[str, Any], ov: Overrides) -> Overrides:
    """Return the overrides with ``action`` applied, or raise :class:`ActionRefused`.

    ``cluster``: {"nodes": [names], "slots_per_node": int, "stages": {workflow: [stage, ...]},
    "instances": {instance id: node}, "pools": [["workflow/stage", ...], ...] (optional: the stage pools)}.
    """
    nodes = set(cluster["nodes"])
    live = nodes - set(ov.drained)
    slots = cluster["slots_per_node"] * len(live)
    new = Overrides(dict(ov.stages), list(ov.drained), dict(ov.pinned), dict(ov.modes))

    def stage_of(wf: str, st: str) -> None:
        if st not in cluster["stages"].get(wf, []):
            raise ActionRefused(f"no stage {st!r} in workflow {wf!r}")

    def node_of(n: str) -> None:
        if n not in nodes:
            raise ActionRefused(f"no live node {n!r}; nodes: {sorted(nodes)}")

    # stage pools shared across workflows count once (engine.workflow.pools): a bound on any member bounds it
    pools = cluster.get("pools") or [[f"{w}/{s}"] for w, stages in cluster["stages"].items() for s in stages]

    def pinned_minimum(o: Overrides) -> int:
        # every pool needs at least one instance, a bounded one its largest member's minimum
        return sum(max([1, *(o.stages[m]["min"] for m in pool if m in o.stages)]) for pool in pools)

    if action == Action.SCALE_STAGE:
        wf, st, n = args.get("workflow", ""), args.get("stage", ""), args.get("instances")
        stage_of(wf, st)
        key = f"{wf}/{st}"
        if n is None:
            new.stages.pop(key, None)
        else:
            if not isinstance(n, int) or n < 1:
                raise ActionRefused(f"instances must be a positive integer (or null for automatic), got {n!r}")
            new.stages[key] = {"min": n, "max": n}
            if pinned_minimum(new) > slots:
                raise ActionRefused(f"{key} x{n} does not fit: {pinned_minimum(new)} instances needed, "
                                    f"{slots} slots on {len(live)} live nodes")
    elif action in (Action.MOVE_INSTANCE, Action.PIN_INSTANCE):
        inst, node = args.get("instance", ""), args.get("node", "")
        if inst not in cluster["instances"]:
            raise ActionRefused(f"no instance {inst!r}")
        node_of(node)
        if node in ov.drained:
            raise ActionRefused(f"node {node!r} is drained")
        here = [i for i, n in cluster["instances"].items() if n == node and i != inst]
        if len(here) >= cluster["slots_per_node"]:
            raise ActionRefused(f"node {node!r} has no free slot ({len(here)} of {cluster['slots_per_node']} used)")
        new.pinned[inst] = node
    elif action == Action.DRAIN_NODE:
        node = args.get("node", "")
        node_of(node)
        if node not in new.drained:
            new.drained.append(node)
        left = cluster["slots_per_node"] * len(nodes - set(new.drained))
        if pinned_minimum(new) > left:
            raise ActionRefused(f"draining {node!r} leaves {left} slots for {pinned_minimum(new)} required instances")
        new.pinned = {i: n for i, n in new.pinned.items() if n != node}
    elif action == Action.UNDRAIN_NODE:
        node = args.get("node", "")
        node_of(node)
        new.drained = [n for n in new.drained if n != node]
    elif action == Action.SET_MODE:
        wf, mode = args.get("workflow", ""), args.get("mode", "")
        if wf not in cluster["stages"]:
            raise ActionRefused(f"no workflow {wf!r}")
        if mode not in MODES:
            raise ActionRefused(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "collaboration":
            from engine.workflow import get_workflow

            spec = get_workflow(wf)
            if not any(spec.stage(s).cfg_parallel for s in spec.route()):
                raise ActionRefused(
                    f"{wf} has no stage that can collaborate bit-identically: its denoiser batches the "
                    f"conditional and unconditional predictions into one call, and splitting them changes the "
                    f"result in the last bits")
        new.modes[wf] = mode
    else:
        raise ActionRefused(f"unknown action {action!r}; known: {', '.join(ACTIONS)}")
    return new
