"""Publish a job's state to its websocket group (``job.<uid>``); failures never break a transition."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def group_name(uid: str) -> str:
    return f"job.{uid}"


def job_payload(job: Any) -> dict[str, Any]:
    return {"uid": job.uid, "state": job.state, "stage": job.stage, "progress": job.progress,
            "detail": job.detail, "workflow": job.workflow}


def push_job(job: Any) -> None:
    layer = get_channel_layer()
    if layer is None or not job.uid:
        return
    try:
        async_to_sync(layer.group_send)(group_name(job.uid), {"type": "job.update", "job": job_payload(job)})
    except Exception:  # the client resyncs from REST; the ledger is the truth
        log.warning("could not push %s to its websocket group", job.uid, exc_info=True)
