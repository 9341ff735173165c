"""Ledger transitions. Every write that changes a job's state, stage runs or charge goes through here.

Contract:
  * a job leaves ``queued``/``in_progress`` for a terminal state exactly once.
    The transition is a conditional ``UPDATE ... WHERE state IN (non-terminal)``,
    so of any number of racing callers (the reconciler, a status refresh, a
    cancel) exactly one changes the row, and only that one publishes the
    final state;
  * a stage run's ``started`` and ``finished`` are each set once, by a
    conditional UPDATE of its own row; events may arrive in any order and any
    number of times (a restarted reconciler re-reads), with the same result;
  * the charge of a finished job is the sum of its stage runs' device seconds
    (the estimate while none is complete). It is computed in the transaction
    that finishes the job, and again in the transaction that completes a stage
    run of an already finished job (its event arrived after the terminal one),
    each time under the job row's lock so no stage run is missed; each new
    charge bumps ``charge_version`` and the quota counters are settled to it
    after the commit (:func:`settle`, idempotent);
  * the terminal transition writes the job's completion webhooks into the
    outbox in the same transaction (:mod:`onepiece_platform.webhooks.outbox`).
"""

from __future__ import annotations

import datetime as dt
import logging
import re

from django.db import transaction
from django.utils import timezone

from engine.store import keys
from onepiece_platform.jobs.models import (
    COMPLETED,
    IN_PROGRESS,
    NON_TERMINAL,
    QUEUED,
    TERMINAL,
    Job,
    JobInput,
    StageRun,
)
from onepiece_platform.jobs.push import push_job
from onepiece_platform.quotas import counters
from onepiece_platform.webhooks import outbox

log = logging.getLogger(__name__)

TIMELINE = (keys.STAGE_STARTED, keys.STAGE_FINISHED, keys.STAGE_STOPPED)
# a stage_finished event's detail names the batch its run shared steps with (engine.worker.taskworker.close_run)
BATCH = re.compile(r"\bbatch=(\d+)\b")
CACHE_SKIPPED = re.compile(r"\bcache_skipped=(\d(?:\.\d+)?)\b")  # engine.worker.taskworker.close_run
SHA256 = re.compile(r"[0-9a-f]{64}")


def _set_charge(job: Job, state: str, if_changed: bool = False) -> bool:
    """Inside the transaction holding the job's row (read after its lock was taken, so ``job`` has the row's
    charge version): its measured cost from the stage runs, a new version (with ``if_changed``, only when the
    cost moved). True if a new charge was set."""
    runs = list(StageRun.objects.filter(job_id=job.pk).values_list("started", "finished"))
    done = [max(0.0, f - s) for s, f in runs if s is not None and f is not None]
    measured: float | None = sum(done) if done else None
    if measured is None and state != COMPLETED and not runs:
        measured = 0.0  # nothing ran: the estimate is refunded
    if if_changed and measured == job.cost_measured_gpu_s:
        return False
    version = job.charge_version + 1
    Job.objects.filter(pk=job.pk).update(cost_measured_gpu_s=measured, charge_version=version)
    job.cost_measured_gpu_s, job.charge_version = measured, version
    return True


def settle(job: Job) -> None:
    """Tell the quota counters the job's charge (after the commit that set it); never raises.

    Redis down: the counters are re-seeded from this ledger when it returns, and the reconciler's
    sweep settles again what was not (``charge_settled`` < ``charge_version``).
    """
    if not job.quota_day or not job.uid:
        return
    try:
        counters.settle(job.owner_id, job.quota_day, job.uid, job.charge_gpu_s, job.charge_version)
        Job.objects.filter(pk=job.pk, charge_settled__lt=job.charge_version).update(charge_settled=job.charge_version)
    except Exception:
        log.warning("could not settle the quota of %s; the sweep will", job.uid, exc_info=True)


def output_fields(output: dict[str, object] | None) -> dict[str, object]:
    """The job's output columns from the completion event's description (:func:`parse_output`)."""
    if not output:
        return {}
    return {"output_key": output["key"], "output_size": output["size"], "output_sha256": output["sha256"],
            "output_content_type": output["content_type"]}


def parse_output(raw: str) -> dict[str, object] | None:
    """The ``output`` field of the engine's completed event (engine.store.jobs: key, size, sha256, content
    type as JSON) checked; None when absent. Raises ValueError saying what is wrong with one that is there."""
    import json

    if not raw:
        return None
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("output is not a JSON object")
    key, size, sha, ctype = d.get("key"), d.get("size"), d.get("sha256"), d.get("content_type") or ""
    if not isinstance(key, str) or len(key) > 1024:
        raise ValueError("output.key must be a string of at most 1024 characters")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError("output.size must be a non-negative integer")
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):
        raise ValueError("output.sha256 must be 64 lowercase hex digits")
    if not isinstance(ctype, str) or len(ctype) > 100:
        raise ValueError("output.content_type must be a string of at most 100 characters")
    return {"key": key, "size": size, "sha256": sha, "content_type": ctype}


def record_output(uid: str, output: dict[str, object] | None) -> bool:
    """Record a completed job's output once (the completion event may arrive after a status read finished the
    row); True if this call wrote it."""
    if not output:
        return False
    return bool(Job.objects.filter(uid=uid, state=COMPLETED, output_sha256="").update(**output_fields(output)))


def finish(uid: str, state: str, detail: str = "", stage: str | None = None,
           output: dict[str, object] | None = None) -> bool:
    """Move ``uid`` to terminal ``state``; True if this call did it (and charged its quota). ``output``: a
    completed job's output (:func:`parse_output`), recorded with the transition, or afterwards when another
    caller finished the row without it."""
    if state not in TERMINAL:
        raise ValueError(f"not a terminal state: {state!r}")
    now = timezone.now()
    fields: dict[str, object] = {"state": state, "finished_at": now, "detail": detail[:2000], "updated_at": now,
                                 "submitting": False}
    if state == COMPLETED:
        fields.update(progress=100, **output_fields(output))
    if stage is not None:
        fields["stage"] = stage
    with transaction.atomic():
        if not Job.objects.filter(uid=uid, state__in=NON_TERMINAL).update(**fields):
            if state == COMPLETED:
                record_output(uid, output)
            return False
        job = Job.objects.get(uid=uid)
        _set_charge(job, state)
        JobInput.objects.filter(job=job).delete()  # kept only to run it again; it will not run again
        # the completion webhooks' outbox rows commit with the terminal state, or neither does
        outbox.enqueue(job)
    settle(job)
    from onepiece_platform.ops import metrics

    metrics.JOBS_FINISHED.labels(workflow=job.workflow, state=state).inc()
    push_job(job)
    return True


def _run_fields(type_: str, ts: float, detail: str) -> dict[str, object]:
    """What a stage run's end event writes besides ``finished``."""
    extra: dict[str, object] = {"stopped": True, "detail": detail[:500]} if type_ == keys.STAGE_STOPPED else {}
    if type_ == keys.STAGE_FINISHED and (m := BATCH.search(detail)):
        extra["batch_size"] = min(int(m.group(1)), 32767)
    if type_ == keys.STAGE_FINISHED and (m := CACHE_SKIPPED.search(detail)):
        extra["cache_skipped"] = min(1.0, float(m.group(1)))
    return extra


def _stage_run(job: Job, type_: str, stage: str, attempt: int, ts: float, detail: str,
               started_ts: float | None = None) -> StageRun | None:
    """Record one timeline event on its stage run; the run as now written if this changed it, else None.
    ``started_ts``: the run's start, when its stage_started event is applied with this one (one write per
    stage run). The caller holds the job's row, so no other writer makes the same run meanwhile: a new run is
    one INSERT with both its ends."""
    run = StageRun.objects.filter(job=job, stage=stage, attempt=attempt).first()
    if run is None:
        if type_ == keys.STAGE_STARTED:
            return StageRun.objects.create(job=job, stage=stage, attempt=attempt, started=ts)
        return StageRun.objects.create(job=job, stage=stage, attempt=attempt, started=started_ts, finished=ts,
                                       **_run_fields(type_, ts, detail))
    runs = StageRun.objects.filter(pk=run.pk)
    if type_ == keys.STAGE_STARTED:
        if run.started is not None or not runs.filter(started__isnull=True).update(started=ts):
            return None
        run.started = ts
        return run
    if started_ts is not None and run.started is None:
        runs.update(started=started_ts)
        run.started = started_ts
    if run.finished is not None:
        return None
    extra = _run_fields(type_, ts, detail)
    if not runs.filter(finished__isnull=True).update(finished=ts, **extra):
        return None
    run.finished = ts
    for k, v in extra.items():
        setattr(run, k, v)
    return run


def apply_event(uid: str, type_: str, stage: str, progress: int, ts: float, detail: str, attempt: int = 1,
                started_ts: float | None = None, timeline_only: bool = False, output: dict | None = None) -> bool:
    """Apply one engine event to the ledger; False if it changed nothing (a repeat, or the job is finished).

    ``started_ts``: a stage_finished event carries its run's stage_started time (the reconciler applies the
    two as one write when one batch holds both). ``timeline_only``: record the event on its stage run only
    (and the job's start), not the job's state, stage and progress: a later event of the job sets those (one
    the reconciler applies in the same batch, or already did). ``output``: a completed event's description
    of the output (:func:`parse_output`).
    Raises :class:`Job.DoesNotExist` for a UID the ledger does not know (the caller holds the event).
    """
    if type_ in keys.TERMINAL:
        if finish(uid, type_, detail, stage or None, output=output):
            return True
        if not Job.objects.filter(uid=uid).exists():
            raise Job.DoesNotExist(uid)
        return False
    run: StageRun | None = None
    recharged = False
    # no savepoint of its own: the caller's (the reconciler applies each event in one) undoes it on an error
    with transaction.atomic(savepoint=False):
        # the row's lock orders this against a concurrent finish(): one of the two sees the other's stage run
        job = Job.objects.select_for_update().get(uid=uid)
        if job.submitting:
            Job.objects.filter(pk=job.pk).update(submitting=False)  # the engine knows it: the submit got through
        # the engine counts attempts from 1 again after the platform submitted the job again
        attempt = max(1, attempt) + job.attempt_base
        if type_ in TIMELINE and stage:
            run = _stage_run(job, type_, stage, attempt, ts, detail, started_ts)
        if job.terminal:
            # a stage's time read after the row was finished (the sweep or a status read got there first):
            # the timeline takes it and the charge follows; the state does not move
            recharged = run is not None and _set_charge(job, job.state, if_changed=True)
        else:
            _move(job, type_, stage, progress, ts, started_ts, timeline_only)
    if job.terminal:
        if recharged:
            settle(job)
        return run is not None
    if type_ == keys.STAGE_FINISHED and run is not None:
        from onepiece_platform.ops import metrics

        if run.device_s is not None:
            metrics.STAGE_SECONDS.labels(workflow=job.workflow, stage=stage).observe(run.device_s)
        metrics.STAGE_BATCH_SIZE.labels(workflow=job.workflow, stage=stage).observe(run.batch_size)
    if timeline_only:
        return run is not None
    push_job(job, fresh=False)
    return True


def _move(job: Job, type_: str, stage: str, progress: int, ts: float, started_ts: float | None,
          timeline_only: bool) -> None:
    """The job's row after a non-terminal event (inside the transaction holding it): its state, stage and
    progress, and its start the first time a stage starts (only the start with ``timeline_only``)."""
    start = ts if type_ == keys.STAGE_STARTED else started_ts
    started = {"started_at": dt.datetime.fromtimestamp(start, dt.UTC)} \
        if start is not None and job.started_at is None and type_ in TIMELINE else {}
    fields: dict[str, object]
    if timeline_only or type_ == keys.ACCEPTED:
        fields = started
    elif type_ == keys.RETRIED:  # started again from its first stage (its node was lost)
        fields = {"state": QUEUED, "progress": 0, "stage": ""}
    else:
        fields = {"state": IN_PROGRESS, "progress": max(0, min(99, int(progress))), **started}
        if stage:
            fields["stage"] = stage
    if fields:
        Job.objects.filter(pk=job.pk, state__in=NON_TERMINAL).update(updated_at=timezone.now(), **fields)
