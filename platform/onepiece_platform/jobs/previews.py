"""Live previews on the platform: the job API's ``GET /api/v1/jobs/<uid>/preview``, the
previews a job's websocket sends in order, the dashboard's copy of the route, and ``/jobs/<uid>/watch``, a
small page for a user's own job.

The previews are the engine's (a request with ``preview_every``: engine.worker.previews writes them to the
job store's preview stream); the platform reads them through the engine's public reader,
:class:`engine.store.JobStore`, and never writes them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.views import APIView

from engine.proxy.preview import headers
from engine.store import JobStore, keys
from onepiece_platform.negotiation import BytesOrJsonNegotiation

log = logging.getLogger(__name__)

#: how long one read of the preview stream waits for the next preview (a socket's tail; not a poll)
BLOCK_MS = 1000


def store() -> JobStore:
    from onepiece_platform.redis_conn import get_redis

    return JobStore(get_redis())


def latest_response(uid: str) -> HttpResponse:
    """The job's newest preview as its image (headers: step, total, stage), or 204 while there is none."""
    found = store().preview.latest(uid)
    if found is None:
        return HttpResponse(status=204, headers={"Cache-Control": "no-store"})
    return HttpResponse(found.image, content_type=found.mime, headers=headers(found))


def meta(uid: str) -> dict[str, Any] | None:
    """Where the job's newest preview was made (no bytes), for a JSON view; None while there is none."""
    found = store().preview.latest(uid)
    return None if found is None else {k: v for k, v in found.meta().items() if k != "mime"}


class JobPreviewView(APIView):
    permission_classes = [IsAuthenticated]
    content_negotiation_class = BytesOrJsonNegotiation

    @extend_schema(operation_id="getJobPreview", responses={(200, "image/jpeg"): OpenApiTypes.BINARY,
                                                            204: None, 401: None, 404: None})
    def get(self, request: Request, uid: str) -> HttpResponse:
        """The latest live preview of one of your jobs (submitted with ``preview_every``): a JPEG of at most
        256 px a side, with ``OnePiece-Preview-Step``, ``-Total`` and ``-Stage`` headers; 204 while none."""
        from onepiece_platform.jobs.api.views import own_job

        job = own_job(request, uid)
        return latest_response(job.uid or "")


def message(preview: Any) -> dict[str, Any]:
    """A preview as the websocket sends it: where it was made and the image as a data URL."""
    data = base64.b64encode(preview.image).decode("ascii")
    return {"type": "preview", "preview": {**preview.meta(), "image": f"data:{preview.mime};base64,{data}"}}


@database_sync_to_async
def _wants_previews(uid: str) -> bool:
    from onepiece_platform.jobs.models import Job

    options = Job.objects.filter(uid=uid).values_list("options", flat=True).first() or {}
    return int(options.get("preview_every") or 0) > 0  # Job.options: as Options.to_json wrote them


async def _tail(consumer: Any, uid: str) -> None:
    """Send the job's previews in stream (= step) order until it ends and none is left."""
    reader, after = store(), "0-0"
    while True:
        try:
            got = await asyncio.to_thread(reader.preview.since, uid, after, BLOCK_MS)
        except Exception:  # Redis away for a moment: the client still has REST (GET .../preview)
            log.warning("preview stream of %s unreadable; retrying", uid, exc_info=True)
            await asyncio.sleep(1.0)
            continue
        for p in got:
            after = p.id
            await consumer.send_json(message(p))
        if not got:
            state = await asyncio.to_thread(reader.state, uid)
            if state is None or state in keys.TERMINAL:
                return


async def tail(consumer: Any, uid: str) -> asyncio.Task[None] | None:
    """Start sending ``uid``'s previews on ``consumer`` (a job websocket) if the job asked for them."""
    if not await _wants_previews(uid):
        return None
    return asyncio.create_task(_tail(consumer, uid), name=f"onepiece-previews-{uid}")


def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


@login_required
def watch(request: HttpRequest, uid: str) -> HttpResponse:
    """A small page for one of the user's own jobs: its state and live previews (the job's websocket), then
    its result."""
    from engine.workflow import get_workflow
    from onepiece_platform.jobs.models import Job

    job = get_object_or_404(Job, uid=uid, owner=request.user, hidden=False)
    return render(request, "jobs/watch.html", {"job": job, "kind": get_workflow(job.workflow).final_output})
