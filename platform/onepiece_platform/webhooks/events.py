"""Which event a finished job makes, and the body every destination receives.

The event names follow the surface the job came through, so a client sees the names of the API it
uses:

  /v1/videos               video.completed, video.failed (a cancelled or expired video is ``failed``,
                           as the video object's ``status`` says; its ``error.code`` tells which)
  /v1/images/generations   image.completed, image.failed (one event per image job)
  native /api/v1/jobs      job.completed, job.failed, job.cancelled, job.expired (the job's own state)

The body is OpenAI's event shape: ``{id, object: "event", type, created_at, data: {id}}``, ``data.id``
being the video's or job's id (images have no id in OpenAI's API: it is the image job's UID). It
carries no result and nothing secret: a receiver fetches the object with its API key.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from onepiece_platform.jobs.models import COMPLETED, Job

VIDEO_EVENTS = ("video.completed", "video.failed")
IMAGE_EVENTS = ("image.completed", "image.failed")
JOB_EVENTS = ("job.completed", "job.failed", "job.cancelled", "job.expired")
EVENT_TYPES = (*VIDEO_EVENTS, *IMAGE_EVENTS, *JOB_EVENTS)


def event_type(job: Job) -> str:
    """The event of ``job``'s terminal state (the job must be finished)."""
    if job.api != "openai":
        return f"job.{job.state}"
    from engine.workflow import get_workflow

    try:
        kind = get_workflow(job.workflow).final_output
    except KeyError:  # a workflow no longer served: its output kind is unknown
        kind = "video"
    prefix = "image" if kind == "image" else "video"
    return f"{prefix}.{'completed' if job.state == COMPLETED else 'failed'}"


def new_event_id() -> str:
    return f"evt_{uuid.uuid4().hex}"


def new_message_id() -> str:
    """The ``webhook-id`` of one delivery: the same on every attempt, so a receiver can drop repeats."""
    return f"msg_{uuid.uuid4().hex}"


def body(event_id: str, type_: str, job: Job) -> str:
    """The exact text that is signed and sent (frozen in the outbox row: every attempt sends these bytes)."""
    at = job.finished_at or job.updated_at
    doc: dict[str, Any] = {"id": event_id, "object": "event", "type": type_,
                           "created_at": int(at.timestamp()), "data": {"id": job.uid}}
    return json.dumps(doc, separators=(",", ":"))
