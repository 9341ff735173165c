"""Ledger transitions. Every write that changes a job's state goes through here.

Contract: a job leaves ``queued``/``in_progress`` for a terminal state exactly
once. The transition is a conditional ``UPDATE ... WHERE state IN
(non-terminal)``, so of any number of racing callers (the reconciler, a
status refresh, a cancel) exactly one changes the row, and only that one
releases the quota and publishes the final state.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.utils import timezone

from engine.store import keys
from onepiece_platform.jobs.models import COMPLETED, IN_PROGRESS, NON_TERMINAL, TERMINAL, Job
from onepiece_platform.jobs.push import push_job
from onepiece_platform.quotas import counters

log = logging.getLogger(__name__)


def finish(uid: str, state: str, detail: str = "", stage: str | None = None) -> bool:
    """Move ``uid`` to terminal ``state``; True if this call did it (and released its quota)."""
    if state not in TERMINAL:
        raise ValueError(f"not a terminal state: {state!r}")
    now = timezone.now()
    fields: dict[str, object] = {"state": state, "finished_at": now, "detail": detail[:2000], "updated_at": now}
    if state == COMPLETED:
        fields["progress"] = 100
    if stage is not None:
        fields["stage"] = stage
    if not Job.objects.filter(uid=uid, state__in=NON_TERMINAL).update(**fields):
        return False
    job = Job.objects.get(uid=uid)
    measured = job.measured_gpu_s()
    if measured is None and state != COMPLETED and not job.stage_times:
        measured = 0.0  # nothing ran: the estimate is refunded
    if measured is not None:
        Job.objects.filter(pk=job.pk).update(cost_measured_gpu_s=measured)
        job.cost_measured_gpu_s = measured
    try:
        counters.release(job.owner_id, job.quota_day, job.cost_estimate_gpu_s, measured)
    except Exception:  # Redis down: its counters are re-seeded from this ledger when it returns
        log.exception("could not release the quota of %s", uid)
    from onepiece_platform.ops import metrics

    metrics.JOBS_FINISHED.labels(workflow=job.workflow, state=state).inc()
    push_job(job)
    return True


def _late_stage_time(job: Job, type_: str, stage: str, ts: float) -> None:
    """A stage event read after the row was finished (the sweep or a status read got there first):
    only the timeline takes it, so a job's stage times stay whole; its state and charge do not move."""
    field = {keys.STAGE_STARTED: "started", keys.STAGE_FINISHED: "finished", keys.STAGE_STOPPED: "finished"}
    if stage and type_ in field and field[type_] not in job.stage_times.get(stage, {}):
        times = dict(job.stage_times)
        times.setdefault(stage, {})[field[type_]] = ts
        Job.objects.filter(pk=job.pk).update(stage_times=times)


def apply_event(uid: str, type_: str, stage: str, progress: int, ts: float, detail: str) -> bool:
    """Apply one engine event to the ledger; False if the job is unknown or already finished."""
    if type_ in keys.TERMINAL:
        return finish(uid, type_, detail, stage or None)
    if type_ == keys.ACCEPTED:
        return False
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(uid=uid).first()
        if job is None:
            return False
        if job.terminal:
            _late_stage_time(job, type_, stage, ts)
            return False
        times = dict(job.stage_times)
        if type_ == keys.STAGE_STARTED and stage:
            times.setdefault(stage, {})["started"] = ts
            if job.started_at is None:
                job.started_at = dt.datetime.fromtimestamp(ts, dt.UTC)
        elif type_ in (keys.STAGE_FINISHED, keys.STAGE_STOPPED) and stage:
            times.setdefault(stage, {})["finished"] = ts
        job.stage_times = times
        job.state = IN_PROGRESS
        if stage:
            job.stage = stage
        job.progress = max(0, min(99, int(progress)))
        job.save(update_fields=["stage_times", "state", "stage", "progress", "started_at", "updated_at"])
    if type_ == keys.STAGE_FINISHED and "started" in times.get(stage, {}):
        from onepiece_platform.ops import metrics

        metrics.STAGE_SECONDS.labels(workflow=job.workflow, stage=stage).observe(
            max(0.0, float(times[stage]["finished"]) - float(times[stage]["started"])))
    push_job(job)
    return True
