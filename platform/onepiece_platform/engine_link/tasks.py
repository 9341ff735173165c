"""Celery tasks: administrative jobs only (warm-up, clean-up), never inference.

Both are idempotent: running one twice (a redelivery after a worker died,
since tasks are acked late) does no harm. Arguments and results are JSON.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from celery import shared_task
from django.utils import timezone

from engine.store import JobStore, keys
from engine.workflow import get_workflow
from onepiece_platform import conf
from onepiece_platform.engine_link.client import EngineError, EngineRejected, get_engine
from onepiece_platform.redis_conn import get_redis


@shared_task(name="onepiece.warm_up", acks_late=True, reject_on_worker_lost=True)
def warm_up(workflows: list[str], nodes: list[str], per_instance: int = 1, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send the smallest request of each workflow (its spec's ``warm_up``) once per first-stage instance on
    ``nodes`` and wait.

    Loads the models and compiles the kernels of every stage the requests
    pass through. The Proxy's delivery policy, not this task, picks the
    instance of each request, so the count (not the exact target) follows
    ``nodes``. Returns {workflow: {"sent", "completed", "failed", "seconds"}}.
    """
    from onepiece_platform.engine_link.cluster import get_cluster

    snapshot = get_cluster().snapshot() if nodes else {"nodes": {}}
    report: dict[str, Any] = {}
    engine = get_engine()
    for wf in workflows:
        spec = get_workflow(wf)
        first = f"{wf}/{spec.route()[0]}"
        instances = snapshot.get("routes", {}).get(first, [])
        # a TaskManager's registration lists its instances: {"node", "instances": {id: {...}}}
        placed = {i for n in nodes for i in (snapshot["nodes"].get(n) or {}).get("instances", {})}
        on_nodes = [i for i in instances if not nodes or i in placed]
        count = max(1, len(on_nodes or instances)) * per_instance
        t0, uids, failed = time.monotonic(), [], 0
        params, inputs = spec.warm_up_request()
        for _ in range(count):
            try:
                uids.append(engine.submit(wf, params, inputs).uid)
            except (EngineRejected, EngineError):
                failed += 1
        done = 0
        deadline = time.monotonic() + timeout_s
        pending = set(uids)
        for uid in uids:  # one long poll each (EngineClient.wait), all within the one deadline
            st = engine.wait(uid, max(0.0, deadline - time.monotonic()))
            if st is None or st.state in keys.TERMINAL:
                pending.discard(uid)
                done += st is not None and st.state == keys.COMPLETED
                failed += st is None or st.state != keys.COMPLETED
        report[wf] = {"sent": len(uids), "completed": done, "failed": failed + len(pending),
                      "seconds": round(time.monotonic() - t0, 3)}
    return report


@shared_task(name="onepiece.clean_up", acks_late=True, reject_on_worker_lost=True)
def clean_up(retention_days: int | None = None) -> dict[str, int]:
    """Delete finished ledger rows older than the retention, the result bytes of deleted jobs, and rows
    abandoned mid-submission (no UID after 10 minutes).

    A result whose row is hidden (deleted through /v1/videos) is dropped from
    Redis at once instead of waiting for its TTL.
    """
    from onepiece_platform.jobs.models import TERMINAL, Job

    days = int(retention_days if retention_days is not None else conf.get("LEDGER_RETENTION_DAYS"))
    cutoff = timezone.now() - dt.timedelta(days=days)
    old = Job.objects.filter(state__in=TERMINAL, finished_at__lt=cutoff)
    hidden = list(Job.objects.filter(hidden=True, uid__isnull=False).values_list("uid", flat=True))
    gone = list(old.values_list("uid", flat=True))
    results = JobStore(get_redis()).drop_results(sorted(u for u in {*hidden, *gone} if u))
    rows, _ = old.delete()
    # a row whose web process died mid-submit and that the engine never spoke of (the reconciler's sweep
    # failed it as lost; an event from the engine would have cleared ``submitting``)
    abandoned, _ = Job.objects.filter(submitting=True, state__in=TERMINAL,
                                      created_at__lt=timezone.now() - dt.timedelta(minutes=10)).delete()
    return {"ledger_rows": rows, "results": int(results), "abandoned": abandoned}
