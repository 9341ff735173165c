"""The cluster side of the engine link: live state for the dashboard, and operators' scaling actions.

Actions are not sent to a manager replica: they are queued in etcd, where the
leading Node Manager validates and applies them (the queue: engine/coord/actions.py;
the decision: engine/manager/overrides.py); the verdict is read back from etcd. State is read from what the engine
publishes (nodes, routes, assignments in etcd; in-flight work in Redis).
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from engine.coord import actions, etcd_client
from engine.coord.keys import Keyspace, keyspace, read_json, read_prefix
from engine.store import JobStore
from engine.workflow import workflows
from onepiece_platform import conf
from onepiece_platform.keyed import Keyed
from onepiece_platform.redis_conn import get_redis


class ClusterClient:
    def __init__(self, etcd_url: str, root: str | None = None) -> None:
        self.etcd = etcd_client(etcd_url, timeout=3.0)
        self.keys: Keyspace = keyspace(root)
        self.root = self.keys.root

    def submit_action(self, action: str, args: dict[str, Any], actor: str) -> str:
        """Queue a scaling action for the leading Node Manager; returns its id. Raises ActionRefused."""
        from onepiece_platform.engine_link.models import OperatorAction

        if action not in OperatorAction.SCALING:
            raise actions.ActionRefused(f"not a scaling action: {action!r}")
        return actions.submit(self.etcd, self.root, action, args, actor)

    def action_result(self, action_id: str, timeout: float = 0.0) -> dict[str, Any] | None:
        """The leader's verdict (``{"ok": bool, "error"?: str, ...}``), or None while none has come."""
        return actions.result(self.etcd, self.root, action_id, timeout)

    def snapshot(self) -> dict[str, Any]:
        """Nodes (instances, devices), routes, overrides, in-flight work and capacity per workflow, as of now."""
        routes: dict[str, list[str]] = {}
        for path, r in read_prefix(self.etcd, self.keys.routes()).items():
            wf_stage = path.rsplit("/", 1)[0]
            routes.setdefault(wf_stage, []).append(r.get("instance", path) if isinstance(r, dict) else path)
        store = JobStore(get_redis())
        inflight = {}
        for name in sorted(workflows()):
            jobs, gpu_s = store.inflight(name)
            inflight[name] = {"jobs": jobs, "gpu_s": round(gpu_s, 3)}
        overrides = read_json(self.etcd, self.keys.overrides())
        # capacity: the leader's view per workflow (rps, bottleneck, instances it counts, Theorem 1's
        # recommended counts, the stage times it used); empty while no Node Manager leads. assignments:
        # the instance ids the leader placed on each node (what an operator can move)
        return {"ts": time.time(), "nodes": read_prefix(self.etcd, self.keys.nodes()), "routes": routes,
                "overrides": overrides or {}, "inflight": inflight,
                "capacity": read_prefix(self.etcd, self.keys.capacities()), "assignments": {
                    node: [i.get("id") for i in body.get("instances", [])] if isinstance(body, dict) else []
                    for node, body in read_prefix(self.etcd, self.keys.assignments()).items()}}

    def close(self) -> None:
        session = getattr(self.etcd, "session", None)
        if session is not None:
            session.close()


_clusters: Keyed[ClusterClient] = Keyed(lambda key: ClusterClient(*key), lambda c: c.close())


def get_cluster() -> ClusterClient:
    """The client for ``settings.ETCD_URL`` under ``ONEPIECE['ETCD_ROOT']``, one per (URL, root)."""
    return _clusters.get((settings.ETCD_URL, conf.get("ETCD_ROOT")))


def reset_clusters() -> None:
    _clusters.clear()
