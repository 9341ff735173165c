"""The Node Manager's control loop: the I/O around the planner (engine.manager.planner): observe, operator
actions, fenced apply, publish.

One replica leads (engine.manager.election); every tick the leader reconciles desired state with actual
state, in five steps (:meth:`NodeManager._tick` reads as them):

1. **observe** (:meth:`~NodeManager._observe`, reads only): the operators' overrides, the nodes' reports
   (``<root>/nodes/<node>``: instances, measured stage times, utilisation), the current assignments, the
   queued operator actions, the Proxies' arrival rates and the sets nodes were moved to (keys:
   :mod:`engine.coord.keys`); the measured stage times are folded into an exponential moving average (the
   workflow's cost model until there is a measurement);
2. **operator actions** (:meth:`~NodeManager._operator_actions`): validate each queued action and write its
   verdict, audit entry and the overrides it changes in one fenced transaction; an accepted one applies at
   once, past hysteresis;
3. **plan** (:func:`engine.manager.planner.plan`, pure): each node's Workflow Set (at most one move), every
   set's instances by Theorem 1 on its slots, whether to apply (only if it raises predicted throughput by
   ``min_gain`` and the last change is ``cooldown`` old, or instances are missing, or an operator action, a
   stranded or unpinned instance or a set move asks for it), the placement (fewest moves) and what to
   publish;
4. **apply** (:meth:`~NodeManager._apply`): write the set move and each node's assignment with
   :meth:`Election.fenced_put`, so a deposed leader's late tick writes nothing;
5. **publish** (:meth:`~NodeManager._publish`): each workflow's capacity, Theorem 1's recommendation and
   the sets' state, for the Proxies' admission, the platform and the dashboard, fenced; only the entries
   that changed are written (:class:`engine.manager.publish.Published`).

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

from engine.coord.actions import ActionRefused
from engine.coord.keys import Keyspace, read_prefix
from engine.manager import planner
from engine.manager.allocator import StageProfile
from engine.manager.election import Election, NotLeader
from engine.manager.overrides import Overrides, validate
from engine.manager.planner import ManagerConfig, Observation
from engine.manager.publish import Published
from engine.stages.registry import pools
from engine.workflow import get_workflow
from engine.workflow.pools import pool_of

__all__ = ["ManagerConfig", "NodeManager", "Observation", "TickResult"]

log = logging.getLogger(__name__)


@dataclass
class TickResult:
    leader: bool
    applied: bool = False
    reason: str = ""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    token: int | None = None


class NodeManager:
    """Reconciles stage instances across nodes; call :meth:`tick` (tests) or :meth:`start` (service)."""

    def __init__(self, client: Any, election: Election, config: ManagerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.election, self.cfg, self.clock = client, election, config, clock
        self.keys = Keyspace(config.root)
        self.service_s: dict[tuple[str, str], float] = {}  # the moving average of each (workflow, stage)'s time
        self.last_change = -float("inf")
        self.last_tick_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.overrides = Overrides()
        self._published = Published()  # what was last written under each published key
        self._force = False  # an accepted operator action applies at once, past hysteresis
        # stage pools: (workflow, stage) pairs of the same executor on the same component bytes share instances
        self.pools = pools(config.workflows)
        self.pool_of = pool_of(self.pools)
        shared = [p for p in self.pools if p.shared]
        if shared:
            log.info("stage pools shared across workflows: %s",
                     "; ".join(f"{p.name} serves {', '.join('/'.join(m) for m in p.members)}" for p in shared))

    def profile(self, workflow: str) -> list[StageProfile]:
        """The stage profiles the planner sizes ``workflow`` with now (measured times, else the estimate)."""
        return planner.stage_profiles(workflow, self.overrides, self.service_s)

    # one tick --------------------------------------------------------------------------------
    def tick(self) -> TickResult:
        started = time.perf_counter()
        try:
            return self._tick()
        finally:
            self.last_tick_seconds = time.perf_counter() - started

    def _tick(self) -> TickResult:
        ship = self.election.leadership
        if ship is None:
            return TickResult(leader=False, reason="not the leader")
        try:
            seen = self._observe()
            self._operator_actions(seen)
            now = self.clock()
            plan = planner.plan(seen, self.overrides, self.service_s, self.cfg, now=now,
                                last_change=self.last_change, forced=self._force, stage_pools=self.pools)
            if plan.publish is None:
                return TickResult(leader=True, reason=plan.reason, token=ship.token)
            self._force = False  # the plan took it into account
            if not plan.apply:
                self._publish(plan.publish)
                return TickResult(leader=True, reason=plan.reason, counts=plan.counts, token=ship.token)
            self._apply(plan, ship.token)
        except NotLeader as exc:
            log.warning("tick aborted: %s", exc)
            return TickResult(leader=False, reason=str(exc))
        self.last_change = now
        return TickResult(leader=True, applied=True, reason=plan.reason, counts=plan.counts, token=ship.token)

    # step 1 ------------------------------------------------------------------------------------
    def _observe(self) -> Observation:
        """Read the cluster (nothing is written here) and fold in the stage times measured."""
        got = self.client.get(self.keys.overrides())
        self.overrides = Overrides.from_json(got[0] if got else None)
        nodes = read_prefix(self.client, self.keys.nodes())
        current = read_prefix(self.client, self.keys.assignments())
        self.service_s = planner.fold_stage_times(self.service_s, nodes, self.cfg.ewma)
        chosen = {n: str(v) for n, v in read_prefix(self.client, self.keys.set_nodes()).items() if n in nodes}
        arrival: dict[str, dict[str, float]] = {}
        proxies: dict[str, list[str]] = {}
        for key, body in read_prefix(self.client, self.keys.proxies()).items():
            sname = key.split("/", 1)[0]
            proxies.setdefault(sname, []).append(str(body.get("url", "")))
            for w, r in (body.get("rps") or {}).items():
                arrival.setdefault(sname, {})[w] = arrival.get(sname, {}).get(w, 0.0) + float(r)
        actions = read_prefix(self.client, self.keys.action_requests())
        return Observation(nodes, current, chosen, arrival, proxies, actions)

    # step 2 ------------------------------------------------------------------------------------
    def _operator_actions(self, seen: Observation) -> None:
        """Validate and apply queued operator actions, oldest first; each result and audit entry is
        written in the same fenced transaction as the overrides it changes."""
        if not seen.actions:
            return
        cluster = {
            "nodes": sorted(seen.nodes), "slots_per_node": self.cfg.slots_per_node,
            "stages": {w: get_workflow(w).route() for w in self.cfg.workflows},
            "instances": {i["id"]: n for n, body in seen.current.items() for i in body.get("instances", [])},
            "pools": [["/".join(m) for m in p.members] for p in self.pools],
        }
        for rid in sorted(seen.actions):
            req = seen.actions[rid]
            try:
                new = validate(req.get("action", ""), req.get("args", {}), cluster, self.overrides)
                verdict: dict[str, Any] = {"ok": True}
            except ActionRefused as exc:
                new, verdict = self.overrides, {"ok": False, "error": str(exc)}
            verdict.update(id=rid, action=req.get("action"), args=req.get("args"), actor=req.get("actor"),
                           at=time.time(), fence_token=self._token())
            self.election.fenced_txn(
                {self.keys.overrides(): new.to_json(), self.keys.action_result(rid): json.dumps(verdict),
                 self.keys.audit(rid): json.dumps(verdict)},
                deletes=(self.keys.action_request(rid),),
            )
            if verdict["ok"]:
                self.overrides = new
                self._force = True

    # steps 4 and 5 -----------------------------------------------------------------------------
    def _apply(self, plan: planner.Plan, token: int) -> None:
        """Write the set move, what to publish and every node's assignment, fenced."""
        assert plan.sets is not None and plan.publish is not None
        if plan.sets.moved is not None:
            node, src, dst = plan.sets.moved
            self.election.fenced_put(self.keys.set_node(node), json.dumps(dst))
            log.warning("node %s moves from set %s to set %s (%s is short)", node, src, dst, dst)
        self._publish(plan.publish)  # before the moves
        for node, instances in plan.placed.items():
            body = {"instances": instances, "model_dirs": self.cfg.workflows, "fence_token": token,
                    "decided_at": time.time(), "reason": plan.reason}
            self.election.fenced_put(self.keys.assignment(node), json.dumps(body, sort_keys=True))

    def _publish(self, pub: planner.Publication) -> None:
        """Write (fenced, in one transaction) the published entries that changed: the sets' state and each
        set's capacity when they differ at all, a workflow's capacity when its throughput moved by more than
        the planner's tolerance or its recommendation or mode changed."""
        state = {self.keys.sets_state(): pub.sets_state}
        state.update({self.keys.set_capacity(sn, w): body for (sn, w), body in pub.set_capacity.items()})
        capacity = {self.keys.capacity(w): body for w, body in pub.capacity.items()}
        fresh = {**self._published.changed(state), **self._published.changed(capacity, planner.same_capacity)}
        if not fresh:
            return
        token = self._token()
        self.election.fenced_txn({k: json.dumps({**v, "fence_token": token} if k in capacity else v, sort_keys=True)
                                  for k, v in fresh.items()})
        self._published.remember(fresh)

    def _token(self) -> int | None:
        ship = self.election.leadership
        return ship.token if ship else None

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
