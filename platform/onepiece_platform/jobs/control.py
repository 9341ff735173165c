"""Reading a job's live state from the engine, cancelling it, and deleting its result."""

from __future__ import annotations

import logging

from django.utils import timezone

from engine.store import keys
from onepiece_platform.engine_link.client import EngineError, get_engine
from onepiece_platform.jobs import ledger
from onepiece_platform.jobs.models import CANCELLED, COMPLETED, IN_PROGRESS, NON_TERMINAL, Job

log = logging.getLogger(__name__)


def refresh(job: Job) -> Job:
    """Bring an unfinished row up to the engine's status (terminal states through the ledger).

    The reconciler does the same from the event stream; this makes a read
    current even when the reconciler lags. An unreachable engine leaves the
    row as it is.
    """
    if job.terminal or not job.uid:
        return job
    try:
        st = get_engine().status(job.uid)
    except EngineError:
        log.warning("engine unreachable while refreshing %s", job.uid)
        return job
    if st is None:
        return job  # the reconciler's sweep decides when an unknown job counts as lost
    if st.state in keys.TERMINAL:
        ledger.finish(job.uid, st.state, st.detail, st.stage or None)
    elif st.state == IN_PROGRESS:
        Job.objects.filter(pk=job.pk, state__in=NON_TERMINAL).update(
            state=IN_PROGRESS, stage=st.stage, progress=max(0, min(99, st.progress)), updated_at=timezone.now())
    job.refresh_from_db()
    job.eta = None if job.terminal else st.eta  # not stored: the job's status, the videos API and the socket show it
    return job


def cancel(job: Job) -> Job:
    """Idempotent: a finished job is returned as it is; otherwise every stage is asked to drop it.

    Raises EngineError when the engine cannot be reached (nothing recorded then).
    """
    job = refresh(job)
    if job.terminal or not job.uid:
        return job
    known = get_engine().cancel(job.uid)
    if not known:
        # the engine lost it (Redis restarted): nothing can still run it to completion
        ledger.finish(job.uid, CANCELLED, "cancelled; the engine no longer knew this job")
    elif job.cancel_requested_at is None:
        Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now())
    job.refresh_from_db()
    return job


def drop_result(job: Job) -> None:
    """A deleted job's result bytes go now, not at their TTL: the engine deletes them if the job has
    finished, and the platform deletes its objects from the store by the ledger (:func:`purge_output`: also
    when the engine no longer knows the job). Of one still running (cancelled but not yet stopped), or when
    the engine cannot be reached, the hourly clean-up (``onepiece.clean_up``) deletes them once they exist."""
    if not job.uid:
        return
    try:
        get_engine().drop_result(job.uid)
    except EngineError:
        log.warning("engine unreachable while deleting the result of %s; the clean-up will", job.uid)
    purge_output(job)


def purge_output(job: Job) -> tuple[int, int]:
    """Delete a finished job's objects from the object store now (every object under its UID), and record
    that on its row (``output_purged_at``: its result routes answer 410); (objects, bytes) freed. Nothing
    without a store in this process or for an unfinished job; a store that fails is logged (the retention
    clean-up, ``onepiece.expire_outputs``, deletes them at the latest when the retention ends)."""
    from engine.store.objects import ObjectStoreError, result_prefix
    from onepiece_platform.engine_link.objects import get_object_store

    store = get_object_store()
    if store is None or not job.uid or not job.terminal:
        return 0, 0
    try:
        freed = store.purge(result_prefix(job.uid))
    except ObjectStoreError:
        log.warning("could not delete the objects of %s now; the retention clean-up will", job.uid, exc_info=True)
        return 0, 0
    Job.objects.filter(pk=job.pk, state=COMPLETED, output_purged_at__isnull=True).update(
        output_purged_at=timezone.now())
    return freed
