"""Operators' actions, the leader's side: each validated against the cluster and applied to the overrides.

The leading Node Manager picks up each request the action queue holds
(:mod:`engine.coord.actions`) on its next tick, validates it against the
cluster (bounds, capacity, that the node or stage exists), records the result
and, when accepted, changes the overrides the allocator honours
(``<root>/overrides``) with a fenced write. Every request, accepted or
refused, is appended to the audit log ``<root>/audit/``. Whichever replica
leads applies the action, and a deposed one cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.coord.actions import ACTIONS, MODES, Action, ActionRefused
from engine.workflow import get_workflow


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


def validate(action: str, args: dict[str, Any], cluster: dict[str, Any], ov: Overrides) -> Overrides:
    """Return the overrides with ``action`` applied, or raise :class:`ActionRefused`.

    ``cluster``: {"nodes": [names], "slots_per_node": int, "stages": {workflow: [stage, ...]},
    "instances": {instance id: node}, "pools": [["workflow/stage", ...], ...] (optional: the stage pools)}.
    """
    check = _Check(cluster, ov)
    step = {Action.SCALE_STAGE: check.scale_stage, Action.MOVE_INSTANCE: check.move_instance,
            Action.PIN_INSTANCE: check.move_instance, Action.DRAIN_NODE: check.drain_node,
            Action.UNDRAIN_NODE: check.undrain_node, Action.SET_MODE: check.set_mode}.get(action)  # type: ignore[call-overload]
    if step is None:
        raise ActionRefused(f"unknown action {action!r}; known: {', '.join(ACTIONS)}")
    step(args)
    return check.new


class _Check:
    """One action's validation against the cluster: each method checks its action's arguments and changes
    ``new``, a copy of the overrides, or raises :class:`ActionRefused`."""

    def __init__(self, cluster: dict[str, Any], ov: Overrides) -> None:
        self.cluster, self.ov = cluster, ov
        self.nodes = set(cluster["nodes"])
        self.live = self.nodes - set(ov.drained)
        self.slots = cluster["slots_per_node"] * len(self.live)
        self.new = Overrides(dict(ov.stages), list(ov.drained), dict(ov.pinned), dict(ov.modes))
        # stage pools shared across workflows count once (engine.workflow.pools): a bound on any member bounds it
        self.pools = cluster.get("pools") or [[f"{w}/{s}"] for w, stages in cluster["stages"].items() for s in stages]

    def stage_of(self, wf: str, st: str) -> None:
        if st not in self.cluster["stages"].get(wf, []):
            raise ActionRefused(f"no stage {st!r} in workflow {wf!r}")

    def node_of(self, n: str) -> None:
        if n not in self.nodes:
            raise ActionRefused(f"no live node {n!r}; nodes: {sorted(self.nodes)}")

    def pinned_minimum(self) -> int:
        # every pool needs at least one instance, a bounded one its largest member's minimum
        o = self.new
        return sum(max([1, *(o.stages[m]["min"] for m in pool if m in o.stages)]) for pool in self.pools)

    def scale_stage(self, args: dict[str, Any]) -> None:
        wf, st, n = args.get("workflow", ""), args.get("stage", ""), args.get("instances")
        self.stage_of(wf, st)
        key = f"{wf}/{st}"
        if n is None:
            self.new.stages.pop(key, None)
            return
        if not isinstance(n, int) or n < 1:
            raise ActionRefused(f"instances must be a positive integer (or null for automatic), got {n!r}")
        self.new.stages[key] = {"min": n, "max": n}
        if self.pinned_minimum() > self.slots:
            raise ActionRefused(f"{key} x{n} does not fit: {self.pinned_minimum()} instances needed, "
                                f"{self.slots} slots on {len(self.live)} live nodes")

    def move_instance(self, args: dict[str, Any]) -> None:
        """move_instance and pin_instance: the instance is pinned to the node."""
        inst, node = args.get("instance", ""), args.get("node", "")
        if inst not in self.cluster["instances"]:
            raise ActionRefused(f"no instance {inst!r}")
        self.node_of(node)
        if node in self.ov.drained:
            raise ActionRefused(f"node {node!r} is drained")
        here = [i for i, n in self.cluster["instances"].items() if n == node and i != inst]
        per_node = self.cluster["slots_per_node"]
        if len(here) >= per_node:
            raise ActionRefused(f"node {node!r} has no free slot ({len(here)} of {per_node} used)")
        self.new.pinned[inst] = node

    def drain_node(self, args: dict[str, Any]) -> None:
        node = args.get("node", "")
        self.node_of(node)
        if node not in self.new.drained:
            self.new.drained.append(node)
        left = self.cluster["slots_per_node"] * len(self.nodes - set(self.new.drained))
        if self.pinned_minimum() > left:
            raise ActionRefused(f"draining {node!r} leaves {left} slots for {self.pinned_minimum()} required instances")
        self.new.pinned = {i: n for i, n in self.new.pinned.items() if n != node}

    def undrain_node(self, args: dict[str, Any]) -> None:
        node = args.get("node", "")
        self.node_of(node)
        self.new.drained = [n for n in self.new.drained if n != node]

    def set_mode(self, args: dict[str, Any]) -> None:
        wf, mode = args.get("workflow", ""), args.get("mode", "")
        if wf not in self.cluster["stages"]:
            raise ActionRefused(f"no workflow {wf!r}")
        if mode not in MODES:
            raise ActionRefused(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "collaboration":
            spec = get_workflow(wf)
            if not any(spec.stage(s).cfg_parallel for s in spec.route()):
                raise ActionRefused(
                    f"{wf} has no stage that can collaborate bit-identically: its denoiser batches the "
                    f"conditional and unconditional predictions into one call, and splitting them changes the "
                    f"result in the last bits")
        self.new.modes[wf] = mode
