"""Celery tasks: administrative jobs only (warm-up, clean-up), never inference.

Both are idempotent: running one twice (a redelivery after a worker died,
since tasks are acked late) does no harm. Arguments and results are JSON.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from celery import shared_task
from django.utils import timezone

from engine import envs
from engine.store import keys
from engine.workflow import get_workflow
from onepiece_platform import conf
from onepiece_platform.engine_link.client import EngineError, EngineRejected, get_engine
from onepiece_platform.engine_link.objects import job_store

log = logging.getLogger(__name__)


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
def clean_up(retention_days: int | None = None, batch: int = 1000) -> dict[str, int]:
    """Delete finished ledger rows older than the retention, the result bytes of deleted jobs, and rows
    abandoned mid-submission (no UID after 10 minutes).

    A result whose row is hidden (deleted through /v1/videos) is dropped from Redis at once instead of
    waiting for its TTL; hidden rows whose results expired long ago are not asked about again.

    Rows go ``batch`` at a time, each batch in its own short transaction, results first: the first run
    on a large ledger holds no lock for long and no list of every row in memory, and a run killed
    midway leaves only whole batches done (the next run, an hour later, goes on; the task is
    idempotent). ``ledger_rows`` counts jobs, not the stage runs and webhook rows deleted with them.
    """
    from onepiece_platform.jobs.models import TERMINAL, Job

    store = job_store()  # with an object store, a dropped result's objects are deleted too
    days = int(retention_days if retention_days is not None else conf.get("LEDGER_RETENTION_DAYS"))
    now = timezone.now()
    cutoff = now - dt.timedelta(days=days)
    # a result lives at most the engine's result TTL (ONEPIECE_RESULT_TTL_S, shared with the nodes) after
    # its job finished; an hour more covers the time between two runs
    alive_since = now - dt.timedelta(seconds=envs.RESULT_TTL_S + 3600)
    recently_hidden = Job.objects.filter(hidden=True, uid__isnull=False).exclude(finished_at__lt=alive_since)
    results = store.drop_results(recently_hidden.values_list("uid", flat=True).iterator(chunk_size=batch))
    rows = 0
    old = Job.objects.filter(state__in=TERMINAL, finished_at__lt=cutoff).order_by("pk")
    while chunk := list(old.values_list("pk", "uid")[:batch]):
        results += store.drop_results(uid for _, uid in chunk if uid)
        # their objects are gone: the rows' deletion need not look for them again (jobs.signals)
        Job.objects.filter(pk__in=[pk for pk, _ in chunk], output_purged_at__isnull=True).update(output_purged_at=now)
        _, per_model = Job.objects.filter(pk__in=[pk for pk, _ in chunk]).delete()
        rows += per_model.get(Job._meta.label, 0)
    # a row whose web process died mid-submit and that the engine never spoke of (the reconciler's sweep
    # failed it as lost; an event from the engine would have cleared ``submitting``)
    _, per_model = Job.objects.filter(submitting=True, state__in=TERMINAL,
                                      created_at__lt=now - dt.timedelta(minutes=10)).delete()
    return {"ledger_rows": rows, "results": int(results), "abandoned": per_model.get(Job._meta.label, 0)}


@shared_task(name="onepiece.expire_outputs", acks_late=True, reject_on_worker_lost=True)
def expire_outputs(batch: int = 500) -> dict[str, int]:
    """Delete the outputs of completed jobs whose retention has ended (the job's ``retention`` after it
    finished: the request's, or its key tier's default), from the object store and from Redis; returns and
    logs how many jobs, and how many objects and bytes that freed in the store.

    Each job's row keeps its ledger entry (until ``LEDGER_RETENTION_DAYS``) with ``output_purged_at`` set, so
    its result routes answer 410 and it is not looked at again. Batches of ``batch`` jobs, each marked once
    its objects are gone: a run killed midway leaves only whole jobs done, and the next run goes on
    (idempotent: deleting an object twice is no error)."""
    from django.db.models import DateTimeField, ExpressionWrapper, F

    from onepiece_platform.jobs.models import COMPLETED, Job

    store = job_store()
    now = timezone.now()
    due = (Job.objects.filter(state=COMPLETED, output_purged_at__isnull=True, retention__isnull=False,
                              finished_at__isnull=False, uid__isnull=False)
           .annotate(until=ExpressionWrapper(F("finished_at") + F("retention"), output_field=DateTimeField()))
           .filter(until__lte=now).order_by("pk"))
    freed = {"objects": 0, "bytes": 0}
    jobs = 0
    while chunk := list(due.values_list("pk", "uid")[:batch]):
        store.drop_results((uid for _, uid in chunk), freed=freed)
        jobs += Job.objects.filter(pk__in=[pk for pk, _ in chunk]).update(output_purged_at=now)
    report = {"jobs": jobs, **freed}
    log.info("expired outputs: %d jobs, %d objects, %d bytes freed", jobs, freed["objects"], freed["bytes"])
    return report
