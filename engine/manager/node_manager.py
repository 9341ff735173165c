"""The Node Manager's control loop: measure, allocate (Theorem 1), place, write fenced assignments.

One replica leads (engine.manager.election); every tick the leader reconciles
desired state with actual state, in five steps (:meth:`NodeManager._tick` reads as them):

1. **observe** (:meth:`~NodeManager._observe`): the operators' overrides, the nodes'
   reports (``<root>/nodes/<node>``: instances, measured stage times, utilisation), the
   current assignments, the Proxies' arrival rates and the sets nodes were moved to
   (keys: :mod:`engine.coord.keys`); fold the measured stage times into an exponential
   moving average (the workflow's cost model until there is a measurement); apply queued
   operator actions;
2. **plan Workflow Sets** (:meth:`~NodeManager._plan_sets`): each live node's current set,
   and at most one move of a node to a set that is short (:mod:`engine.manager.sets`);
3. **plan instances** (:meth:`~NodeManager._plan_instances`): size every set's stages with
   the allocator on the instance slots its nodes offer, and decide whether to apply: only if
   it raises predicted throughput by at least ``min_gain`` and the last change is
   ``cooldown`` seconds old (hysteresis, against flapping), or if instances are missing (a
   node died, a first start), or an operator action, a stranded or unpinned instance or a
   set move asks for it;
4. **apply** (:meth:`~NodeManager._apply`): place instances on nodes keeping every existing
   instance that still fits (fewest moves), and write the set move and each node's
   assignment with :meth:`Election.fenced_put`, so a deposed leader's late tick writes nothing;
5. **publish** (:meth:`~NodeManager._publish_capacity`): each workflow's capacity, Theorem 1's
   recommendation and the sets' state, for the Proxies' admission, the platform and the
   dashboard (written only when they changed).

A step that finds this replica deposed raises :class:`NotLeader`; the tick ends there.

The loop never dies: a tick that raises is logged and the next one runs. The
tick's duration is kept (``last_tick_seconds``) for the metrics endpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.coord.keys import Keyspace, default_root, read_prefix
from engine.manager import actions as act
from engine.manager import sets
from engine.manager.allocator import AllocationError, StageProfile, for_budget, throughput
from engine.manager.election import Election, NotLeader
from engine.workflow import get_workflow

log = logging.getLogger(__name__)


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
class TickResult:
    leader: bool
    applied: bool = False
    reason: str = ""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    token: int | None = None


@dataclass
class Observation:
    """What one tick read from etcd (step 1)."""

    nodes: dict[str, dict[str, Any]]  # live, undrained node -> its report
    current: dict[str, dict[str, Any]]  # node -> its assignment as written (dead and drained ones too)
    chosen: dict[str, str]  # node -> the set a leader moved it to
    arrival: dict[str, dict[str, float]]  # set -> workflow -> requests/s its Proxies accept
    proxies: dict[str, list[str]]  # set -> its Proxies' URLs


@dataclass
class SetsPlan:
    """Each live node's Workflow Set (step 2), with the one move this tick makes, if any."""

    member: dict[str, str]
    moved: tuple[str, str, str] | None  # (node, from set, to set)
    by_set: dict[str, list[str]]


@dataclass
class InstancePlan:
    """How many instances of each stage each set should run (step 3), and whether to apply it now."""

    desired_by: dict[str, dict[str, dict[str, int]]]
    have_by: dict[str, dict[str, dict[str, int]]]
    desired: dict[str, dict[str, int]]
    have: dict[str, dict[str, int]]
    apply: bool
    why: str


class NodeManager:
    """Reconciles stage instances across nodes; call :meth:`tick` (tests) or :meth:`start` (service)."""

    def __init__(self, client: Any, election: Election, config: ManagerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.election, self.cfg, self.clock = client, election, config, clock
        self.keys = Keyspace(config.root)
        self.service_s: dict[tuple[str, str], float] = {}
        self.last_change = -float("inf")
        self.last_tick_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.overrides = act.Overrides()
        self._capacity: dict[str, float] = {}  # last published, per workflow
        self._modes: dict[str, str] = {}  # scheduling mode last published, per workflow
        self._recommended: dict[str, dict[str, int]] = {}  # Theorem 1's counts last published
        self._profiles: dict[str, list[StageProfile]] = {}  # this tick's stage profiles
        self._force = False  # an accepted operator action applies at once, past hysteresis
        self._last_state = ""  # the Workflow Sets state last published
        self._arrival: dict[str, float] = {}  # this tick's requests/s per workflow, summed over the sets
        self._arrival_by: dict[str, dict[str, float]] = {}  # the same per Workflow Set
        from engine.workflow.pools import pool_of, pools

        # stage pools: (workflow, stage) pairs of the same executor on the same component bytes share instances
        self.pools = pools(config.workflows)
        self.pool_of = pool_of(self.pools)
        shared = [p for p in self.pools if p.shared]
        if shared:
            log.info("stage pools shared across workflows: %s",
                     "; ".join(f"{p.name} serves {', '.join('/'.join(m) for m in p.members)}" for p in shared))

    # reading the cluster ---------------------------------------------------------------------
    def _measure(self, nodes: dict[str, dict[str, Any]]) -> None:
        a = self.cfg.ewma
        for report in nodes.values():
            for inst in report.get("instances", {}).values():
                per_workflow = inst.get("service_s") or {}
                serves = [tuple(m.split("/", 1)) for m in inst.get("serves") or ()] or [(inst["workflow"], inst["stage"])]
                for k in serves:  # a shared pool's instance measures each workflow's requests apart
                    t = float(per_workflow.get(k[0]) or (inst.get("last_stage_s") if len(serves) == 1 else 0) or 0.0)
                    if t <= 0:
                        continue
                    self.service_s[k] = t if k not in self.service_s else (1 - a) * self.service_s[k] + a * t

    def profile(self, workflow: str) -> list[StageProfile]:
        """Stage service times (measured where we have them, else the cost model's estimate) and
        the operators' bounds."""
        if workflow in self._profiles:  # computed once per tick (allocation, gain and capacity share it)
            return self._profiles[workflow]
        from engine.workflow import get_workflow

        wf = get_workflow(workflow)
        estimate = wf.estimate_cost(wf.resolve_params({"prompt": "estimate"}))
        out = []
        for s in wf.route():
            bounds = self.overrides.stages.get(f"{workflow}/{s}", {})
            out.append(StageProfile(s, max(self.service_s.get((workflow, s), estimate.get(s, 1.0)), 1e-4),
                                    bounds.get("min", 1), bounds.get("max")))
        self._profiles[workflow] = out
        return out

    # one tick --------------------------------------------------------------------------------
    def tick(self) -> TickResult:
        started = time.perf_counter()
        try:
            return self._tick()
        finally:
            self.last_tick_seconds = time.perf_counter() - started

    def _tick(self) -> TickResult:
        self._profiles = {}
        ship = self.election.leadership
        if ship is None:
            return TickResult(leader=False, reason="not the leader")
        try:
            seen = self._observe()
            self._arrival_by = seen.arrival
            self._arrival = {}
            for rates in seen.arrival.values():
                for w, r in rates.items():
                    self._arrival[w] = self._arrival.get(w, 0.0) + r
            if not seen.nodes:
                return TickResult(leader=True, reason="no live nodes", token=ship.token)
            now = self.clock()
            groups = self._plan_sets(seen, now)
            plan = self._plan_instances(seen, groups, now)
            state = self._sets_state(groups.by_set, plan.have_by, seen.arrival, seen.proxies)
            if not plan.apply:
                self._publish_capacity(plan.have, plan.desired, plan.have_by, state)
                return TickResult(leader=True, reason=plan.why, counts=plan.have, token=ship.token)
            self._apply(seen, groups, plan, ship.token, state)
        except NotLeader as exc:
            log.warning("tick aborted: %s", exc)
            return TickResult(leader=False, reason=str(exc))
        self.last_change = now
        return TickResult(leader=True, applied=True, reason=plan.why, counts=plan.desired, token=ship.token)

    # step 1 ------------------------------------------------------------------------------------
    def _observe(self) -> Observation:
        """Read the cluster, fold in the stage times measured, and apply queued operator actions."""
        got = self.client.get(self.keys.overrides())
        self.overrides = act.Overrides.from_json(got[0] if got else None)
        nodes = read_prefix(self.client, self.keys.nodes())
        current = read_prefix(self.client, self.keys.assignments())
        self._measure(nodes)
        self._process_actions(nodes, current)
        nodes = {n: r for n, r in nodes.items() if n not in self.overrides.drained}
        chosen = {n: str(v) for n, v in read_prefix(self.client, self.keys.set_nodes()).items() if n in nodes}
        arrival: dict[str, dict[str, float]] = {}
        proxies: dict[str, list[str]] = {}
        for key, body in read_prefix(self.client, self.keys.proxies()).items():
            sname = key.split("/", 1)[0]
            proxies.setdefault(sname, []).append(str(body.get("url", "")))
            for w, r in (body.get("rps") or {}).items():
                arrival.setdefault(sname, {})[w] = arrival.get(sname, {}).get(w, 0.0) + float(r)
        return Observation(nodes, current, chosen, arrival, proxies)

    # step 2 ------------------------------------------------------------------------------------
    def _plan_sets(self, seen: Observation, now: float) -> SetsPlan:
        """Each node's current set, and at most one move between sets (engine.manager.sets)."""
        home = {n: str(r.get("set") or sets.DEFAULT) for n, r in seen.nodes.items()}
        member = sets.current_sets(home, seen.chosen)
        moved = None
        if now - self.last_change >= self.cfg.cooldown and len(set(member.values())) > 1:
            moved = sets.rebalance_sets(home, member, self._set_capacity, seen.arrival)
            if moved is not None:
                member[moved[0]] = moved[2]
        by_set: dict[str, list[str]] = {}
        for n in sorted(seen.nodes):
            by_set.setdefault(member[n], []).append(n)
        return SetsPlan(member, moved, by_set)

    # step 3 ------------------------------------------------------------------------------------
    def _plan_instances(self, seen: Observation, groups: SetsPlan, now: float) -> InstancePlan:
        """Theorem 1 per set on its slots, and the decision to apply it (hysteresis unless forced)."""
        nodes, current, moved = seen.nodes, seen.current, groups.moved
        desired_by = {sn: self._allocate(self.cfg.slots_per_node * len(ns), seen.arrival.get(sn))
                      for sn, ns in groups.by_set.items()}
        have_by = {sn: self._counts(current, set(ns), sn) for sn, ns in groups.by_set.items()}
        desired, have = _sum_counts(desired_by.values()), _sum_counts(have_by.values())
        missing = any(have_by[sn].get(w, {}).get(st, 0) < 1 for sn, d in desired_by.items() for w in d for st in d[w])
        gain = max((self._gain(have_by[sn], desired_by[sn]) for sn in groups.by_set), default=0.0)
        forced, self._force = self._force, False
        # instances still assigned to a drained or dead node must move: apply regardless
        stranded = any(body.get("instances") for n, body in current.items() if n not in nodes)
        where = {i["id"]: n for n, body in current.items() for i in body.get("instances", [])}
        unpinned = any(where.get(i, n) != n for i, n in self.overrides.pinned.items() if n in nodes)
        if forced and desired == have and not (stranded or unpinned):
            forced = False
        forced = forced or stranded or unpinned or moved is not None
        if not missing and not forced and (gain < self.cfg.min_gain or now - self.last_change < self.cfg.cooldown):
            return InstancePlan(desired_by, have_by, desired, have, False, f"kept (gain {gain:.2f}, hysteresis)")
        why = ("operator action" if forced and moved is None else f"node {moved[0]} moved to set {moved[2]}"
               if moved else "missing instances" if missing else f"gain {gain:.2f}")
        return InstancePlan(desired_by, have_by, desired, have, True, why)

    # step 4 ------------------------------------------------------------------------------------
    def _apply(self, seen: Observation, groups: SetsPlan, plan: InstancePlan, token: int,
               state: dict[str, Any]) -> None:
        """Place the planned instances on nodes (fewest moves) and write it all, fenced."""
        placed: dict[str, list[dict[str, Any]]] = {}
        used_ids: set[str] = set()
        for sn, ns in sorted(groups.by_set.items()):
            placed.update(self._place(plan.desired_by[sn], seen.current, ns, used_ids, sn))
        for gone in set(seen.current) - set(placed):  # drained (or dead) nodes get an empty assignment
            placed[gone] = []
        if groups.moved is not None:
            node, src, dst = groups.moved
            self.election.fenced_put(self.keys.set_node(node), json.dumps(dst))
            log.warning("node %s moves from set %s to set %s (%s is short)", node, src, dst, dst)
        self._publish_capacity(plan.have, plan.desired, plan.have_by, state)  # step 5, before the moves
        for node, instances in placed.items():
            body = {"instances": instances, "model_dirs": self.cfg.workflows, "fence_token": token,
                    "decided_at": time.time(), "reason": plan.why}
            self.election.fenced_put(self.keys.assignment(node), json.dumps(body, sort_keys=True))

    def _set_capacity(self, workflow_set: str, n_nodes: int) -> dict[str, float]:
        """Each workflow's throughput a set would have with ``n_nodes`` nodes, allocated by Theorem 1."""
        if n_nodes <= 0:
            return {}
        try:
            arrival = self._arrival_by.get(workflow_set)
            alloc = self._allocate(self.cfg.slots_per_node * n_nodes, arrival)
        except AllocationError:
            return dict.fromkeys(self.cfg.workflows, 0.0)
        return {w: self._throughput(w, alloc[w], arrival)[0] for w in self.cfg.workflows}

    def _sets_state(self, by_set: dict[str, list[str]], have_by: dict[str, dict[str, dict[str, int]]],
                    arrival: dict[str, dict[str, float]], proxies: dict[str, list[str]]) -> dict[str, Any]:
        """What :func:`engine.manager.sets.which_proxy` reads: per set, its nodes, Proxies, capacity and load."""
        out: dict[str, Any] = {}
        for sn in sorted(set(by_set) | set(proxies)):
            wfs = {w: {"capacity": self._throughput(w, have_by.get(sn, {}).get(w, {}), arrival.get(sn))[0]
                       if have_by.get(sn, {}).get(w) else 0.0,
                       "arrival": arrival.get(sn, {}).get(w, 0.0)} for w in self.cfg.workflows}
            out[sn] = {"nodes": by_set.get(sn, []), "proxies": sorted(u for u in proxies.get(sn, []) if u),
                       "workflows": wfs}
        return out

    def _publish_capacity(self, have: dict[str, dict[str, int]], desired: dict[str, dict[str, int]],
                          have_by: dict[str, dict[str, dict[str, int]]] | None = None,
                          state: dict[str, Any] | None = None) -> None:
        """Feed the Proxies' admission control (and the dashboard): each workflow's throughput with
        the instances it has now (the sum over Workflow Sets; each set's own under ``sets/capacity``),
        what Theorem 1 recommends for the live slots, and the stage times used. Written (fenced) only
        when the throughput moved by 5% or more or the recommendation, mode or sets changed."""
        puts = {}
        have_by = have_by if have_by is not None else {sets.DEFAULT: have}
        per_set = {sn: {w: self._throughput(w, h.get(w, {}), self._arrival_by.get(sn)) for w in self.cfg.workflows}
                   for sn, h in have_by.items()}
        if state is not None:
            text = json.dumps(state, sort_keys=True)
            if text != self._last_state:
                puts[self.keys.sets_state()] = text
                for sn, caps in per_set.items():
                    for w, (rps_s, neck) in caps.items():
                        puts[self.keys.set_capacity(sn, w)] = json.dumps(
                            {"rps": rps_s, "bottleneck": neck, "instances": have_by[sn].get(w, {})}, sort_keys=True)
                self._last_state = text
        for w in self.cfg.workflows:
            rps = sum(per_set[sn][w][0] for sn in per_set if have_by[sn].get(w))
            bottleneck = self._throughput(w, have.get(w, {}), self._arrival)[1]
            last = self._capacity.get(w)
            recommended = desired.get(w, {})
            mode = self.overrides.modes.get(w, "individual")
            if (last is not None and abs(rps - last) <= 0.05 * max(last, 1e-9)
                    and self._recommended.get(w) == recommended and self._modes.get(w) == mode):
                continue
            self._capacity[w], self._recommended[w], self._modes[w] = rps, recommended, mode
            body = {"rps": rps, "bottleneck": bottleneck, "instances": have.get(w, {}), "mode": mode,
                    "recommended": recommended, "service_s": {p.name: p.seconds for p in self.profile(w)},
                    # the stages this workflow shares with others: one pool's instances serve them all
                    "shared": {st: ["/".join(m) for m in self.pool_of[w, st].members]
                               for st in get_workflow(w).route() if self.pool_of[w, st].shared},
                    "fence_token": self.election.leadership.token if self.election.leadership else None}
            puts[self.keys.capacity(w)] = json.dumps(body, sort_keys=True)
        if puts:
            self.election.fenced_txn(puts)

    def _process_actions(self, nodes: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]) -> None:
        """Validate and apply queued operator actions, oldest first; each result and audit entry is
        written in the same fenced transaction as the overrides it changes."""
        from engine.workflow import get_workflow

        pending = read_prefix(self.client, self.keys.action_requests())
        if not pending:
            return
        cluster = {
            "nodes": sorted(nodes), "slots_per_node": self.cfg.slots_per_node,
            "stages": {w: get_workflow(w).route() for w in self.cfg.workflows},
            "instances": {i["id"]: n for n, body in current.items() for i in body.get("instances", [])},
            "pools": [["/".join(m) for m in p.members] for p in self.pools],
        }
        for rid in sorted(pending):
            req = pending[rid]
            try:
                new = act.validate(req.get("action", ""), req.get("args", {}), cluster, self.overrides)
                verdict: dict[str, Any] = {"ok": True}
            except act.ActionRefused as exc:
                new, verdict = self.overrides, {"ok": False, "error": str(exc)}
            token = self.election.leadership.token if self.election.leadership else None
            verdict.update(id=rid, action=req.get("action"), args=req.get("args"), actor=req.get("actor"),
                           at=time.time(), fence_token=token)
            self.election.fenced_txn(
                {self.keys.overrides(): new.to_json(), self.keys.action_result(rid): json.dumps(verdict),
                 self.keys.audit(rid): json.dumps(verdict)},
                deletes=(self.keys.action_request(rid),),
            )
            if verdict["ok"]:
                self.overrides = new
                self._force = True

    def _mix(self, arrival: dict[str, float] | None) -> dict[str, float]:
        """Each workflow's share of the demand the slots are sized for: the Proxies' measured arrival rates
        (times the weights) once any arrive, the weights before."""
        wfs = sorted(self.cfg.workflows)
        weights = {w: max(0.0, self.cfg.weights.get(w, 1.0)) for w in wfs}
        rates = {w: (arrival or {}).get(w, 0.0) * weights[w] for w in wfs}
        return rates if sum(rates.values()) > 0 else weights

    def _pool_profiles(self, mix: dict[str, float]) -> list[StageProfile]:
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

    def _allocate(self, slots: int, arrival: dict[str, float] | None = None) -> dict[str, dict[str, int]]:
        """Instances per stage of every workflow on ``slots``: every pool first gets its minimum, then the
        slots left go where they raise the demand the cluster sustains most (water-filling over the pools,
        :func:`engine.manager.allocator.for_budget`). A shared pool counts once, and its count is listed under
        each workflow it serves."""
        profiles = self._pool_profiles(self._mix(arrival))
        minimum = sum(p.min_instances for p in profiles)
        if minimum > slots:
            raise AllocationError(
                f"{slots} instance slots on the live nodes cannot hold the stages' minimums ({minimum} for "
                f"{len(profiles)} stage pools of {', '.join(sorted(self.cfg.workflows))}); add nodes or slots per node"
            )
        counts = for_budget(profiles, slots).instances
        return {w: {st: counts[self.pool_of[w, st].name] for st in get_workflow(w).route()}
                for w in sorted(self.cfg.workflows)}

    def _throughput(self, workflow: str, counts: dict[str, int],
                    arrival: dict[str, float] | None = None) -> tuple[float, str]:
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

    @staticmethod
    def _counts(current: dict[str, dict[str, Any]], live: set[str],
                workflow_set: str | None = None) -> dict[str, dict[str, int]]:
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

    def _gain(self, have: dict[str, dict[str, int]], desired: dict[str, dict[str, int]]) -> float:
        gains = []
        for w, want in desired.items():
            prof = self.profile(w)
            old = throughput(prof, have.get(w, {}))[0]
            new = throughput(prof, want)[0]
            gains.append(float("inf") if old == 0 else new / old - 1)
        return max(gains, default=0.0)

    def _place(self, desired: dict[str, dict[str, int]], current: dict[str, dict[str, Any]],
               nodes: list[str], used_ids: set[str] | None = None,
               workflow_set: str = sets.DEFAULT) -> dict[str, list[dict[str, Any]]]:
        """Per node of one Workflow Set, its instance list: keep what stays, then fill free slots with what
        is new. ``used_ids`` is shared across the sets' calls so instance ids stay unique in the cluster."""
        plan: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
        # one entry per stage pool (a shared pool's count is listed under each of its workflows)
        want = {(p.workflow, p.stage, _also(p)): desired[p.workflow][p.stage] for p in self.pools
                if p.stage in desired.get(p.workflow, {})}
        used_ids = set() if used_ids is None else used_ids
        known = {i["id"]: i for body in current.values() for i in body.get("instances", [])
                 if i.get("workflow_set", sets.DEFAULT) == workflow_set}
        for inst_id, node in sorted(self.overrides.pinned.items()):  # operators' pins first
            inst = known.get(inst_id)
            if inst is None or node not in plan:
                continue
            k = _key(inst)
            if want.get(k, 0) > 0 and len(plan[node]) < self.cfg.slots_per_node:
                plan[node].append(inst)
                used_ids.add(inst_id)
                want[k] -= 1
        for n in nodes:
            for inst in current.get(n, {}).get("instances", []):
                k = _key(inst)
                if inst["id"] in used_ids or inst.get("workflow_set", sets.DEFAULT) != workflow_set:
                    continue
                if want.get(k, 0) > 0 and len(plan[n]) < self.cfg.slots_per_node:
                    plan[n].append(inst)
                    used_ids.add(inst["id"])
                    want[k] -= 1
        for (w, s, also), count in sorted(want.items()):
            for _ in range(count):
                n = min(nodes, key=lambda x: len(plan[x]))
                if len(plan[n]) >= self.cfg.slots_per_node:
                    log.warning("no free slot for %s.%s", w, s)
                    break
                i = 0
                while f"{w}.{s}.{i}" in used_ids:
                    i += 1
                used_ids.add(f"{w}.{s}.{i}")
                inst = {"id": f"{w}.{s}.{i}", "workflow": w, "stage": s}
                if also:
                    inst["also"] = list(also)
                if workflow_set != sets.DEFAULT:
                    inst["workflow_set"] = workflow_set
                plan[n].append(inst)
        return plan

    # the service loop ------------------------------------------------------------------------
    def start(self, interval: float = 2.0) -> NodeManager:
        self.election.start()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="onepiece-node-manager",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.election.stop()

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                result = self.tick()
                if result.applied:
                    log.info("applied %s (token %s): %s", result.counts, result.token, result.reason)
            except Exception:
                log.exception("node manager tick failed")
            self._stop.wait(interval)


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


def _also(pool: Any) -> tuple[str, ...]:
    return tuple("/".join(m) for m in pool.members[1:])


def _key(inst: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """What an existing instance is: an instance of a pool that since gained or lost members is not kept."""
    return inst["workflow"], inst["stage"], tuple(inst.get("also") or ())
