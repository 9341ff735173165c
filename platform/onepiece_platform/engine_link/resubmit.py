"""A job whose engine state died with Redis is submitted again under its UID, from what the ledger kept.

Redis holds the engine's state of a job (status hash, first-stage message, events) and can lose it: a
restart comes back empty (no persistence), a fail-over drops acknowledged writes. The ledger holds
every accepted request: its resolved params, its uploads (:class:`JobInput`, until it finishes) and the
deadline it asked for. When the reconciler's sweep finds an unfinished job the engine no longer knows,
:func:`again` submits it to the engine once more, named as before, so clients keep polling the same
UID and get their result. Bounded: ``RESUBMIT_MAX`` times per job (``Job.resubmissions``, shown by the
API), then it is failed as lost. Each submission's stage runs are recorded as a new attempt
(``Job.attempt_base``: the engine counts from 1 again). A deadline that has passed meanwhile expires
the job instead.

The row is claimed (a conditional UPDATE on its count) before the engine is asked, so two reconcilers
never submit one job twice; the engine's own claim of the UID (409 when taken) guards the rest. An engine
that is busy or away leaves the job for the next sweep, its claim given back.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from django.db.models import F, Max
from django.utils import timezone

from onepiece_platform import conf
from onepiece_platform.engine_link.client import EngineClient, EngineError, EngineRejected
from onepiece_platform.jobs.models import EXPIRED, FAILED, NON_TERMINAL, QUEUED, Job, StageRun

log = logging.getLogger(__name__)
LOST = "lost: the engine no longer knows this job (its result store was restarted or the job expired)"


def again(job: Job, engine: EngineClient) -> tuple[str, str] | None:
    """Submit ``job`` (unfinished, unknown to the engine) again. None: submitted, or left for the next
    sweep; else the (terminal state, reason) to finish it with: out of attempts, past its deadline, or
    refused by the engine."""
    limit = int(conf.get("RESUBMIT_MAX"))
    if job.resubmissions >= limit:
        return FAILED, f"{LOST}; submitted again {job.resubmissions} times" if limit else LOST
    deadline = None
    if job.deadline_s is not None:
        deadline = job.deadline_s - (timezone.now() - job.created_at).total_seconds()
        if deadline < 1.0:
            return EXPIRED, "deadline passed while the engine had lost the job"
    inputs = {i.name: bytes(i.data) for i in job.inputs.all()}
    base = StageRun.objects.filter(job=job).aggregate(m=Max("attempt"))["m"] or job.attempt_base
    claim = Job.objects.filter(pk=job.pk, state__in=NON_TERMINAL, resubmissions=job.resubmissions)
    if not claim.update(resubmissions=F("resubmissions") + 1, attempt_base=base, state=QUEUED, stage="",
                        progress=0, submitting=False, updated_at=timezone.now()):
        return None  # finished meanwhile, or another reconciler took it
    try:
        engine.submit(job.workflow, job.params, inputs, replace(job.request_options(), deadline_s=deadline), uid=job.uid)
    except EngineRejected as exc:
        if exc.status == 400:  # it can never run (its inputs were not kept, a model gone)
            return FAILED, f"{LOST}; it could not be submitted again: {exc.message}"
        _give_back(job, reason=f"{exc.status} {exc.message}")  # busy, or known again (409): next sweep
        return None
    except EngineError as exc:
        _give_back(job, reason=str(exc))
        return None
    log.warning("job %s was lost with the engine's result store: submitted again (%d of %d)", job.uid,
                job.resubmissions + 1, limit)
    return None


def _give_back(job: Job, reason: str) -> None:
    log.warning("job %s not submitted again now (%s); the next sweep tries again", job.uid, reason)
    Job.objects.filter(pk=job.pk, resubmissions=job.resubmissions + 1).update(
        resubmissions=job.resubmissions, attempt_base=job.attempt_base)
