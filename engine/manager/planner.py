"""The Node Manager's decisions as one pure function: ``plan(observation, overrides, stage_times, config) -> Plan``.

No etcd, no clock of its own, nothing kept between calls: what a tick read (:class:`Observation`), the
operators' overrides, the stage times measured so far and the configuration go in; the Workflow Sets, each
set's instance counts (Theorem 1 over the stage pools, :mod:`engine.manager.allocator`), whether to apply
them (hysteresis), the placement on nodes and what to publish come out. The Node Manager
(:mod:`engine.manager.node_manager`) does the I/O around it: observe, operator actions, the fenced writes,
publishing only what changed, and the loop. ``onepiece bench rebalance`` drives this same function.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.coord.keys import default_root
from engine.manager import sets
from engine.manager.allocator import AllocationError, StageProfile, for_budget, throughput
from engine.manager.overrides import Overrides
from engine.stages.registry import pools
from engine.workflow import get_workflow
from engine.workflow.pools import Pool, pool_of

log = logging.getLogger(__name__)

NO_NODES = "no live nodes"
CAPACITY_TOLERANCE = 0.05  # a workflow's capacity is republished once it moved by more than this share


@dataclass
class ManagerConfig:
    workflows: dict[str, str]  # workflow -> model folder (the same path on every node)
    slots_per_node: int = 6  # instances one node holds (one per GPU on GPU nodes)
    # the workflows' relative request rates the slots are sized for before the Proxies report arrivals
    # (default equal); with arrivals, each workflow's measured rate times its weight
    weights: dict[str, float] = field(default_factory=dict)
    min_gain: float = 0.10
    cooldown: float = 30.0
    ewma: float = 0.3  # weight of a new measurement in the moving average
    root: str = field(default_factory=default_root)  # etcd key prefix (engine.coord.keys); tests use their own


@dataclass
class Observation:
    """What one tick read from etcd."""

    nodes: dict[str, dict[str, Any]]  # live node -> its report (drained ones too: the planner leaves them out)
    current: dict[str, dict[str, Any]]  # node -> its assignment as written (dead and drained ones too)
    chosen: dict[str, str]  # node -> the set a leader moved it to
    arrival: dict[str, dict[str, float]]  # set -> workflow -> requests/s its Proxies accept
    proxies: dict[str, list[str]]  # set -> its Proxies' URLs
    actions: dict[str, dict[str, Any]] = field(default_factory=dict)  # queued operator actions, id -> request


@dataclass
class SetsPlan:
    """Each live node's Workflow Set, with the one move this tick makes, if any."""

    member: dict[str, str]
    moved: tuple[str, str, str] | None  # (node, from set, to set)
    by_set: dict[str, list[str]]


@dataclass
class InstancePlan:
    """How many instances of each stage each set should run, and whether to apply it now."""

    desired_by: dict[str, dict[str, dict[str, int]]]
    have_by: dict[str, dict[str, dict[str, int]]]
    desired: dict[str, dict[str, int]]
    have: dict[str, dict[str, int]]
    apply: bool
    why: str


@dataclass
class Publication:
    """What the Proxies' admission, the platform and the dashboard read (the Node Manager adds the fence token
    to each capacity body and writes what changed)."""

    capacity: dict[str, dict[str, Any]]  # workflow -> throughput with the instances it has, Theorem 1's counts
    set_capacity: dict[tuple[str, str], dict[str, Any]]  # (set, workflow) -> the set's own throughput
    sets_state: dict[str, Any]  # set -> its nodes, Proxies, capacity and load (engine.coord.proxies.which_proxy reads it)


@dataclass
class Plan:
    """One tick's decisions. ``publish`` is None only when there is no live node (nothing to size)."""

    reason: str
    apply: bool = False
    sets: SetsPlan | None = None
    instances: InstancePlan | None = None
    placed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # node -> instances (apply only)
    publish: Publication | None = None

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """The counts this tick leaves the cluster with: the desired ones if applied, else those it has."""
        if self.instances is None:
            return {}
        return self.instances.desired if self.apply else self.instances.have


def plan(seen: Observation, overrides: Overrides, stage_times: Mapping[tuple[str, str], float],
         config: ManagerConfig, *, now: float, last_change: float = -float("inf"), forced: bool = False,
         stage_pools: list[Pool] | None = None) -> Plan:
    """Workflow Sets, instance counts, the decision to apply, placement and publication for one tick.

    ``stage_times``: (workflow, stage) -> measured seconds (:func:`fold_stage_times`); ``last_change``: when
    the last plan was applied (hysteresis); ``forced``: an operator action was accepted since;
    ``stage_pools``: :func:`engine.stages.registry.pools` of the configured workflows (computed if None).
    Raises :class:`AllocationError` when the live slots cannot hold the stages' minimums."""
    live = {n: r for n, r in seen.nodes.items() if n not in overrides.drained}
    if not live:
        return Plan(NO_NODES)
    model = Model(config, overrides, stage_times, pools(config.workflows) if stage_pools is None else stage_pools,
                  seen.arrival)
    groups = _plan_sets(model, seen, live, now - last_change >= config.cooldown)
    counts = _plan_instances(model, seen, live, groups, forced, now - last_change < config.cooldown)
    state = _sets_state(model, groups.by_set, counts.have_by, seen.arrival, seen.proxies)
    publish = _publication(model, counts, state)
    placed = _placement(model, seen, groups, counts) if counts.apply else {}
    return Plan(counts.why, counts.apply, groups, counts, placed, publish)


def fold_stage_times(stage_times: Mapping[tuple[str, str], float], nodes: Mapping[str, dict[str, Any]],
                     ewma: float) -> dict[tuple[str, str], float]:
    """The moving average of each (workflow, stage)'s service time with the nodes' reports folded in (a new
    measurement weighs ``ewma``). A shared pool's instance measures each workflow's requests apart."""
    out = dict(stage_times)
    for report in nodes.values():
        for inst in report.get("instances", {}).values():
            per_workflow = inst.get("service_s") or {}
            serves = [tuple(m.split("/", 1)) for m in inst.get("serves") or ()] or [(inst["workflow"], inst["stage"])]
            for k in serves:
                t = float(per_workflow.get(k[0]) or (inst.get("last_stage_s") if len(serves) == 1 else 0) or 0.0)
                if t <= 0:
                    continue
                out[k] = t if k not in out else (1 - ewma) * out[k] + ewma * t  # type: ignore[index]
    return out  # type: ignore[return-value]


def stage_profiles(workflow: str, overrides: Overrides,
                   stage_times: Mapping[tuple[str, str], float]) -> list[StageProfile]:
    """Stage service times (measured where we have them, else the cost model's estimate) and the operators'
    bounds."""
    wf = get_workflow(workflow)
    estimate = wf.estimate_cost(wf.resolve_params({"prompt": "estimate"}))
    out = []
    for s in wf.route():
        bounds = overrides.stages.get(f"{workflow}/{s}", {})
        out.append(StageProfile(s, max(stage_times.get((workflow, s), estimate.get(s, 1.0)), 1e-4),
                                bounds.get("min", 1), bounds.get("max")))
    return out


def same_capacity(last: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether a workflow's capacity body is not worth republishing: throughput within the tolerance, the same
    recommendation and scheduling mode (the Proxies' admission needs no finer news)."""
    return (abs(new["rps"] - last["rps"]) <= CAPACITY_TOLERANCE * max(last["rps"], 1e-9)
            and last["recommended"] == new["recommended"] and last["mode"] == new["mode"])


class Model:
    """One plan's cost model: stage profiles, Theorem 1 over the stage pools on a number of slots, and each
    workflow's throughput with shared pools charged once."""

    def __init__(self, config: ManagerConfig, overrides: Overrides,
                 stage_times: Mapping[tuple[str, str], float], stage_pools: list[Pool],
                 arrival_by: Mapping[str, Mapping[str, float]]) -> None:
        self.cfg, self.overrides, self.service_s = config, overrides, stage_times
        self.pools, self.pool_of = stage_pools, pool_of(stage_pools)
        self.arrival_by = arrival_by
        self.arrival: dict[str, float] = {}  # requests/s per workflow, summed over the sets
        for rates in arrival_by.values():
            for w, r in rates.items():
                self.arrival[w] = self.arrival.get(w, 0.0) + r
        self._profiles: dict[str, list[StageProfile]] = {}

    def profile(self, workflow: str) -> list[StageProfile]:
        if workflow not in self._profiles:  # computed once per plan (allocation, gain and capacity share it)
            self._profiles[workflow] = stage_profiles(workflow, self.overrides, self.service_s)
        return self._profiles[workflow]

    def mix(self, arrival: Mapping[str, float] | None) -> dict[str, float]:
        """Each workflow's share of the demand the slots are sized for: the Proxies' measured arrival rates
        (times the weights) once any arrive, the weights before."""
        wfs = sorted(self.cfg.workflows)
        weights = {w: max(0.0, self.cfg.weights.get(w, 1.0)) for w in wfs}
        rates = {w: (arrival or {}).get(w, 0.0) * weights[w] for w in wfs}
        return rates if sum(rates.values()) > 0 else weights

    def pool_profiles(self, mix: Mapping[str, float]) -> list[StageProfile]:
        """One profile per stage pool: Theorem 1 over the union of the chains. A pool's seconds per unit of
        demand are its members' service times weighted by their workflows' shares, so ``n_p / seconds_p``
        is the demand scale it sustains; operators' bounds on any member bound the pool."""
        wfs = set(self.cfg.workflows)
        stages = {w: {p.name: p for p in self.profile(w)} for w in wfs}
        out = []
        for pool in self.pools:
            members = [(w, st) for w, st in pool.members if w in wfs]
            if not members:
                continue
            seconds = sum(mix.get(w, 0.0) * stages[w][st].seconds for w, st in members)
            lows = [stages[w][st].min_instances for w, st in members]
            highs = [stages[w][st].max_instances for w, st in members if stages[w][st].max_instances is not None]
            out.append(StageProfile(pool.name, max(seconds, 1e-12), max(lows),
                                    max(max(lows), min(highs)) if highs else None))
        return out

    def allocate(self, slots: int, arrival: Mapping[str, float] | None = None) -> dict[str, dict[str, int]]:
        """Instances per stage of every workflow on ``slots``: every pool first gets its minimum, then the
        slots left go where they raise the demand the cluster sustains most (water-filling over the pools,
        :func:`engine.manager.allocator.for_budget`). A shared pool counts once, and its count is listed under
        each workflow it serves."""
        profiles = self.pool_profiles(self.mix(arrival))
        minimum = sum(p.min_instances for p in profiles)
        if minimum > slots:
            raise AllocationError(
                f"{slots} instance slots on the live nodes cannot hold the stages' minimums ({minimum} for "
                f"{len(profiles)} stage pools of {', '.join(sorted(self.cfg.workflows))}); add nodes or slots per node"
            )
        counts = for_budget(profiles, slots).instances
        return {w: {st: counts[self.pool_of[w, st].name] for st in get_workflow(w).route()}
                for w in sorted(self.cfg.workflows)}

    def throughput(self, workflow: str, counts: Mapping[str, int],
                   arrival: Mapping[str, float] | None = None) -> tuple[float, str]:
        """(requests/s, bottleneck) of ``workflow`` with ``counts`` instances per stage. A shared pool's
        instances first serve the other workflows' arrivals (their measured rates x their measured service
        times there; a stage time not measured yet, the cost model's prior for a reference GPU, is not
        charged): what is left is this workflow's, so no pool's capacity is promised twice."""
        prof = self.profile(workflow)
        if not arrival:
            return throughput(prof, counts)
        left = {}
        for p in prof:
            pool = self.pool_of.get((workflow, p.name))
            others = 0.0
            if pool is not None and pool.shared:
                for w, st in pool.members:
                    if w != workflow and w in self.cfg.workflows and (w, st) in self.service_s:
                        others += arrival.get(w, 0.0) * self.service_s[w, st]
            left[p.name] = max(0.0, counts.get(p.name, 0) - others)
        rates = {p.name: left[p.name] / p.seconds for p in prof}
        neck = min(rates, key=lambda k: rates[k])
        return rates[neck], neck

    def set_capacity(self, workflow_set: str, n_nodes: int) -> dict[str, float]:
        """Each workflow's throughput a set would have with ``n_nodes`` nodes, allocated by Theorem 1."""
        if n_nodes <= 0:
            return {}
        try:
            arrival = self.arrival_by.get(workflow_set)
            alloc = self.allocate(self.cfg.slots_per_node * n_nodes, arrival)
        except AllocationError:
            return dict.fromkeys(self.cfg.workflows, 0.0)
        return {w: self.throughput(w, alloc[w], arrival)[0] for w in self.cfg.workflows}

    def gain(self, have: Mapping[str, Mapping[str, int]], desired: Mapping[str, Mapping[str, int]]) -> float:
        gains = []
        for w, want in desired.items():
            prof = self.profile(w)
            old = throughput(prof, have.get(w, {}))[0]
            new = throughput(prof, want)[0]
            gains.append(float("inf") if old == 0 else new / old - 1)
        return max(gains, default=0.0)


def _plan_sets(model: Model, seen: Observation, live: Mapping[str, dict[str, Any]], may_move: bool) -> SetsPlan:
    """Each live node's current set, and at most one move between sets (engine.manager.sets), once the last
    change is ``cooldown`` old."""
    home = {n: str(r.get("set") or sets.DEFAULT) for n, r in live.items()}
    member = sets.current_sets(home, {n: s for n, s in seen.chosen.items() if n in live})
    moved = None
    if may_move and len(set(member.values())) > 1:
        moved = sets.rebalance_sets(home, member, model.set_capacity, seen.arrival)
        if moved is not None:
            member[moved[0]] = moved[2]
    by_set: dict[str, list[str]] = {}
    for n in sorted(live):
        by_set.setdefault(member[n], []).append(n)
    return SetsPlan(member, moved, by_set)


def _plan_instances(model: Model, seen: Observation, live: Mapping[str, Any], groups: SetsPlan,
                    forced: bool, cooling: bool) -> InstancePlan:
    """Theorem 1 per set on its slots, and the decision to apply it: only if it raises predicted throughput by
    ``min_gain`` outside the cooldown (hysteresis), or instances are missing, or an operator action, a
    stranded or unpinned instance or a set move asks for it."""
    current, moved, cfg = seen.current, groups.moved, model.cfg
    desired_by = {sn: model.allocate(cfg.slots_per_node * len(ns), seen.arrival.get(sn))
                  for sn, ns in groups.by_set.items()}
    have_by = {sn: counts(current, set(ns), sn) for sn, ns in groups.by_set.items()}
    desired, have = _sum_counts(desired_by.values()), _sum_counts(have_by.values())
    missing = any(have_by[sn].get(w, {}).get(st, 0) < 1 for sn, d in desired_by.items() for w in d for st in d[w])
    gain = max((model.gain(have_by[sn], desired_by[sn]) for sn in groups.by_set), default=0.0)
    # instances still assigned to a drained or dead node must move: apply regardless
    stranded = any(body.get("instances") for n, body in current.items() if n not in live)
    where = {i["id"]: n for n, body in current.items() for i in body.get("instances", [])}
    unpinned = any(where.get(i, n) != n for i, n in model.overrides.pinned.items() if n in live)
    if forced and desired == have and not (stranded or unpinned):
        forced = False
    forced = forced or stranded or unpinned or moved is not None
    if not missing and not forced and (gain < cfg.min_gain or cooling):
        return InstancePlan(desired_by, have_by, desired, have, False, f"kept (gain {gain:.2f}, hysteresis)")
    why = ("operator action" if forced and moved is None else f"node {moved[0]} moved to set {moved[2]}"
           if moved else "missing instances" if missing else f"gain {gain:.2f}")
    return InstancePlan(desired_by, have_by, desired, have, True, why)


def _placement(model: Model, seen: Observation, groups: SetsPlan,
               counts_: InstancePlan) -> dict[str, list[dict[str, Any]]]:
    """Every node's instance list (fewest moves); drained and dead nodes get an empty one."""
    placed: dict[str, list[dict[str, Any]]] = {}
    used_ids: set[str] = set()
    for sn, ns in sorted(groups.by_set.items()):
        placed.update(place(model, counts_.desired_by[sn], seen.current, ns, used_ids, sn))
    for gone in set(seen.current) - set(placed):
        placed[gone] = []
    return placed


def place(model: Model, desired: Mapping[str, Mapping[str, int]], current: Mapping[str, dict[str, Any]],
          nodes: list[str], used_ids: set[str] | None = None,
          workflow_set: str = sets.DEFAULT) -> dict[str, list[dict[str, Any]]]:
    """Per node of one Workflow Set, its instance list: keep what stays (operators' pins first), then fill free
    slots with what is new. ``used_ids`` is shared across the sets' calls so instance ids stay unique."""
    plan_: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
    slots = model.cfg.slots_per_node
    # one entry per stage pool (a shared pool's count is listed under each of its workflows)
    want = {(p.workflow, p.stage, _also(p)): desired[p.workflow][p.stage] for p in model.pools
            if p.stage in desired.get(p.workflow, {})}
    used_ids = set() if used_ids is None else used_ids
    known = {i["id"]: i for body in current.values() for i in body.get("instances", [])
             if i.get("workflow_set", sets.DEFAULT) == workflow_set}
    keep = [(node, known[i]) for i, node in sorted(model.overrides.pinned.items()) if i in known and node in plan_]
    keep += [(n, inst) for n in nodes for inst in current.get(n, {}).get("instances", [])
             if inst.get("workflow_set", sets.DEFAULT) == workflow_set]
    for node, inst in keep:
        k = _key(inst)
        if inst["id"] not in used_ids and want.get(k, 0) > 0 and len(plan_[node]) < slots:
            plan_[node].append(inst)
            used_ids.add(inst["id"])
            want[k] -= 1
    lowest: dict[tuple[str, str], int] = {}
    for (w, s, also), count in sorted(want.items()):
        for _ in range(count):
            n = min(nodes, key=lambda x: len(plan_[x]))
            if len(plan_[n]) >= slots:
                log.warning("no free slot for %s.%s", w, s)
                break
            plan_[n].append(_new_instance(w, s, also, workflow_set, used_ids, lowest))
    return plan_


def _new_instance(workflow: str, stage: str, also: tuple[str, ...], workflow_set: str,
                  used_ids: set[str], lowest: dict[tuple[str, str], int]) -> dict[str, Any]:
    """A new instance with the lowest free id ``workflow.stage.i``. ``used_ids`` only grows while one set is
    placed, so the search resumes where the last one for this stage stopped (``lowest``) instead of at 0:
    the same ids, without a quadratic scan at a thousand instances."""
    i = lowest.get((workflow, stage), 0)
    while f"{workflow}.{stage}.{i}" in used_ids:
        i += 1
    lowest[workflow, stage] = i + 1
    used_ids.add(f"{workflow}.{stage}.{i}")
    inst: dict[str, Any] = {"id": f"{workflow}.{stage}.{i}", "workflow": workflow, "stage": stage}
    if also:
        inst["also"] = list(also)
    if workflow_set != sets.DEFAULT:
        inst["workflow_set"] = workflow_set
    return inst


def _sets_state(model: Model, by_set: Mapping[str, list[str]], have_by: Mapping[str, dict[str, dict[str, int]]],
                arrival: Mapping[str, Mapping[str, float]], proxies: Mapping[str, list[str]]) -> dict[str, Any]:
    """What :func:`engine.coord.proxies.which_proxy` reads: per set, its nodes, Proxies, capacity and load."""
    out: dict[str, Any] = {}
    for sn in sorted(set(by_set) | set(proxies)):
        wfs = {w: {"capacity": model.throughput(w, have_by.get(sn, {}).get(w, {}), arrival.get(sn))[0]
                   if have_by.get(sn, {}).get(w) else 0.0,
                   "arrival": arrival.get(sn, {}).get(w, 0.0)} for w in model.cfg.workflows}
        out[sn] = {"nodes": by_set.get(sn, []), "proxies": sorted(u for u in proxies.get(sn, []) if u),
                   "workflows": wfs}
    return out


def _publication(model: Model, counts_: InstancePlan, state: dict[str, Any]) -> Publication:
    """Each workflow's throughput with the instances it has now (the sum over Workflow Sets; each set's own
    apart), what Theorem 1 recommends for the live slots, and the stage times used."""
    have, have_by = counts_.have, counts_.have_by
    per_set = {sn: {w: model.throughput(w, h.get(w, {}), model.arrival_by.get(sn)) for w in model.cfg.workflows}
               for sn, h in have_by.items()}
    by_set = {(sn, w): {"rps": rps, "bottleneck": neck, "instances": have_by[sn].get(w, {})}
              for sn, caps in per_set.items() for w, (rps, neck) in caps.items()}
    capacity = {}
    for w in model.cfg.workflows:
        capacity[w] = {
            "rps": sum(per_set[sn][w][0] for sn in per_set if have_by[sn].get(w)),
            "bottleneck": model.throughput(w, have.get(w, {}), model.arrival)[1],
            "instances": have.get(w, {}), "mode": model.overrides.modes.get(w, "individual"),
            "recommended": counts_.desired.get(w, {}),
            "service_s": {p.name: p.seconds for p in model.profile(w)},
            # the stages this workflow shares with others: one pool's instances serve them all
            "shared": {st: ["/".join(m) for m in model.pool_of[w, st].members]
                       for st in get_workflow(w).route() if model.pool_of[w, st].shared},
        }
    return Publication(capacity, by_set, state)


def counts(current: Mapping[str, dict[str, Any]], live: set[str],
           workflow_set: str | None = None) -> dict[str, dict[str, int]]:
    """Instances per stage of each workflow that the live nodes' assignments hold (of one set, if given)."""
    out: dict[str, dict[str, int]] = {}
    for node, body in current.items():
        if node not in live:
            continue  # a dead node's instances do not count
        for inst in body.get("instances", []):
            if workflow_set is not None and inst.get("workflow_set", sets.DEFAULT) != workflow_set:
                continue  # serving another set until it is re-made
            for w, st in _members(inst):  # an instance of a shared pool serves each member
                d = out.setdefault(w, {})
                d[st] = d.get(st, 0) + 1
    return out


def _sum_counts(parts: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for w, stages in part.items():
            for st, n in stages.items():
                out.setdefault(w, {})[st] = out.setdefault(w, {}).get(st, 0) + n
    return out


def _members(inst: dict[str, Any]) -> list[tuple[str, str]]:
    """The (workflow, stage) pairs an assignment's instance serves (its own, then a shared pool's others)."""
    return [(inst["workflow"], inst["stage"]), *(tuple(m.split("/", 1)) for m in inst.get("also") or ())]  # type: ignore[misc]


def _also(pool: Pool) -> tuple[str, ...]:
    return tuple("/".join(m) for m in pool.members[1:])


def _key(inst: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """What an existing instance is: an instance of a pool that since gained or lost members is not kept."""
    return inst["workflow"], inst["stage"], tuple(inst.get("also") or ())
