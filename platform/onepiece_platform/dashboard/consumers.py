"""``/ws/cluster``: live cluster state to staff, at least once a second.

Each connection samples the cluster itself (etcd + Redis reads in a thread,
never on the event loop) rather than waiting for a broadcaster, so a client
sees state within one period of connecting and nothing central can stall
every dashboard. A client that reconnects simply gets the next snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from channels.db import database_sync_to_async

from onepiece_platform.jobs.consumers import SignedInConsumer

log = logging.getLogger(__name__)
PERIOD_S = 1.0
FORBIDDEN, UNAUTHENTICATED = 4403, 4401


def _snapshot() -> dict[str, Any]:
    from django.db.models import Count

    from onepiece_platform.engine_link.cluster import get_cluster
    from onepiece_platform.jobs.models import NON_TERMINAL, QUEUED, Job

    try:
        snap = get_cluster().snapshot()
    except Exception as exc:  # the dashboard shows that the cluster is unreachable, and keeps going
        snap = {"error": f"cluster state unavailable: {exc}"}
    rows = Job.objects.filter(uid__isnull=False).values("state").annotate(n=Count("id"))
    snap["jobs"] = {r["state"]: r["n"] for r in rows}
    # Where unfinished work is, per workflow: queued (not started), and per stage the jobs whose last
    # event came from it. The rings' own occupancy is not reported by the nodes; this is the ledger's view.
    waiting: dict[str, dict[str, Any]] = {}
    for r in (Job.objects.filter(uid__isnull=False, state__in=NON_TERMINAL)
              .values("workflow", "state", "stage").annotate(n=Count("id"))):
        w = waiting.setdefault(r["workflow"], {"queued": 0, "stages": {}})
        if r["state"] == QUEUED or not r["stage"]:
            w["queued"] += r["n"]
        else:
            w["stages"][r["stage"]] = w["stages"].get(r["stage"], 0) + r["n"]
    snap["waiting"] = waiting
    from onepiece_platform.ops.views import supervised

    # onepiece up's children as its supervisor sees them (absent where compose, Kubernetes or systemd supervise)
    processes = supervised()
    if processes is not None:
        snap["processes"] = processes
    return snap


class ClusterConsumer(SignedInConsumer):
    async def admit(self, user: Any) -> int | None:
        if not user.is_staff:
            return FORBIDDEN
        await self.accept()
        self._task = asyncio.create_task(self._push())
        return None

    async def _push(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                snap = await database_sync_to_async(_snapshot)()
            except Exception:  # keep pushing; one failed sample is not a dead dashboard
                log.exception("cluster snapshot failed")
            else:
                try:
                    await self.send_json({"type": "cluster", "cluster": snap})
                except Exception:  # the client has gone (disconnect() cancels this task): nothing to push to
                    log.debug("dashboard client gone", exc_info=True)
                    return
            await asyncio.sleep(max(0.0, PERIOD_S - (loop.time() - started)))

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
