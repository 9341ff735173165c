"""Publish a job's state to its websocket group (``job.<uid>``); failures never break a transition."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def group_name(uid: str) -> str:
    return f"job.{uid}"


def job_payload(job: Any) -> dict[str, Any]:
    return {"uid": job.uid, "state": job.state, "stage": job.stage, "progress": job.progress,
            "detail": job.detail, "workflow": job.workflow}


_deferred = threading.local()


@contextmanager
def deferred() -> Iterator[dict[str, int]]:
    """Inside, :func:`push_job` only notes the job (uid -> pk); the caller pushes each noted job once, with
    its state then, after its transaction commits (:func:`push_noted`): the reconciler applies a batch of
    events in one transaction, a dozen of them for one job, and a client needs only where the job is now
    (a push per event cost more CPU than the ledger's writes)."""
    noted: dict[str, int] = {}
    before = getattr(_deferred, "noted", None)
    _deferred.noted = noted
    try:
        yield noted
    finally:
        _deferred.noted = before


def push_noted(noted: dict[str, int]) -> None:
    """Push each job :func:`deferred` noted, as it is now in the database."""
    if not noted or get_channel_layer() is None:
        return
    from onepiece_platform.jobs.models import Job

    for job in Job.objects.filter(pk__in=list(noted.values())):
        push_job(job)


def push_job(job: Any, fresh: bool = True) -> None:
    """Publish ``job``'s state (``fresh=False``: read it again first, unless the push is deferred)."""
    noted = getattr(_deferred, "noted", None)
    if noted is not None:
        if job.uid:
            noted[job.uid] = job.pk
        return
    if not fresh:
        job.refresh_from_db()
    layer = get_channel_layer()
    if layer is None or not job.uid:
        return
    try:
        async_to_sync(layer.group_send)(group_name(job.uid), {"type": "job.update", "job": job_payload(job)})
    except Exception:  # the client resyncs from REST; the ledger is the truth
        log.warning("could not push %s to its websocket group", job.uid, exc_info=True)
