"""Jobs whose node died: started again elsewhere, or failed with the reason; never left hanging.

Every hand-off records the receiving instance and its node on the job
(:meth:`JobStore.located`). A node that dies (SIGKILL, power, network) stops
refreshing its etcd lease; when the lease expires its registration and its
routes go. Each Proxy sweeps every ``interval`` seconds: an unfinished job
last handed to a node that is no longer registered was lost with that node
(its ring memory was on it). The sweep claims the job atomically in Redis (so
several Proxies retry it once), clears its per-stage done markers and
re-injects the request as it first entered (kept with the job since intake)
into the first stage of a live instance; after ``max_attempts`` starts it is
failed with the node and stage it was lost at.

The same sweep drops in-flight entries of jobs that no longer exist (their
status hash expired or was lost with Redis): admission counts those entries,
so one left behind would hold a queue place for ever.

If the lost node was only partitioned and comes back, its old copy may still
finish: the store's terminal-once transition keeps one result either way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.coord.routes import live_nodes
from engine.store import JobStore, keys
from engine.workflow import get_workflow, workflows

log = logging.getLogger("onepiece.proxy.recovery")


class OrphanSweeper:
    def __init__(self, store: JobStore, etcd: Any, injector: Any, max_attempts: int = 3) -> None:
        self.store, self.etcd, self.injector = store, etcd, injector
        self.max_attempts = max_attempts
        self.retried = 0
        self.failed = 0

    async def sweep(self) -> int:
        """One pass; returns how many lost jobs were started again."""
        live: set[str] | None
        try:
            live = await asyncio.to_thread(live_nodes, self.etcd)
        except Exception as exc:  # membership unknown: judge no job lost this round (stale entries still go)
            log.warning("cannot read node membership (%s); skipping the sweep", exc)
            live = None
        # one pass over the in-flight sets: stale entries dropped, and the jobs of lost nodes found
        pruned, orphans = await asyncio.to_thread(self.store.sweep_inflight, sorted(workflows()), live)
        if pruned:
            log.warning("dropped %d in-flight entries of jobs that no longer exist or are finished", pruned)
        if live is None:
            return 0
        started = 0
        for o in orphans:
            spec = get_workflow(o.workflow)
            route = spec.route()
            message = await asyncio.to_thread(self.store.retry, o, route, self.max_attempts)
            if message is None:
                if await asyncio.to_thread(self.store.state, o.uid) == keys.FAILED:
                    self.failed += 1
                continue
            try:
                target = await self.injector.inject(o.workflow, route[0], message, 0.0, nodes=live)
            except Exception as exc:
                # nowhere to go yet: point the job back at the lost node so the next sweep tries again
                # (each try counts as an attempt, so it ends failed with a reason, never hanging)
                log.warning("job %s lost with node %s could not restart: %s", o.uid, o.node, exc)
                await asyncio.to_thread(self.store.located, o.uid, o.node, o.instance)
                continue
            await asyncio.to_thread(self.store.located, o.uid, target.node, target.instance)
            log.warning("job %s lost with node %s at %s: started again on %s", o.uid, o.node,
                        o.instance or o.stage, target.instance)
            started += 1
            self.retried += 1
        return started
