"""The operator dashboard: the page (staff only) and the small JSON endpoints its script calls.

The live cluster state comes over ``/ws/cluster`` (consumers.py); these
endpoints cover what a websocket push does not: every user's jobs (the native
``/api/v1/jobs`` lists only the caller's own), one job's timeline and result,
the traffic figures (traffic.py), and operators' actions with their audit list
(actions.py). Session auth with Django's CSRF check on POST, as the admin uses. Redis away (a job's
state, its previews) is a 503 with Retry-After from every JSON endpoint, never a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from engine.store import outage
from engine.workflow import get_workflow, workflows
from onepiece_platform.dashboard import traffic as traffic_
from onepiece_platform.jobs import control, previews
from onepiece_platform.jobs.api.views import JobResultView, result_response
from onepiece_platform.jobs.models import COMPLETED, QUEUED, Job

JOBS_SHOWN = 1000  # the page renders these in one go; older jobs are in the admin


def staff_json(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """JSON endpoints answer 403 rather than redirect: a script cannot follow a login page; and 503 with
    Retry-After while Redis is away (the job store, the previews), as the APIs do."""
    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if not (user.is_authenticated and user.is_active and user.is_staff):
            return JsonResponse({"error": "staff only"}, status=403)
        try:
            return view(request, *args, **kwargs)
        except outage.UNAVAILABLE:
            return JsonResponse({"error": "the service's store is unavailable; retry shortly"},
                                status=503, headers={"Retry-After": str(outage.RETRY_AFTER_S)})
    return wrapped


def _whole(request: HttpRequest, name: str, default: int) -> int:
    """The query value ``name`` as an integer written with ASCII digits (``int()`` also reads "１０");
    ``ValueError`` when it is not one."""
    raw = request.GET.get(name)
    if raw is None:
        return default
    if not raw.strip().lstrip("+-").isascii():
        raise ValueError(f"{name} must be written with ASCII digits")
    return int(raw)


@staff_member_required
def index(request: HttpRequest) -> HttpResponse:
    # Stage order is the workflow's, not alphabetical: the page draws each chain in that order.
    specs = sorted(workflows().items())
    stages = {name: [s.name for s in spec.stages] for name, spec in specs}
    return render(request, "dashboard/index.html", {"workflow_stages": stages})


def _queue_positions(jobs: list[Job]) -> dict[int, int]:
    """Every shown queued job's position in its workflow's queue, in one query (not one per row)."""
    wfs = {j.workflow for j in jobs if j.state == QUEUED}
    if not wfs:
        return {}
    out: dict[int, int] = {}
    seen: dict[str, int] = {}
    for pk, wf in Job.objects.filter(state=QUEUED, uid__isnull=False, workflow__in=wfs).order_by(
            "created_at", "id").values_list("id", "workflow"):
        out[pk] = seen.get(wf, 0)
        seen[wf] = out[pk] + 1
    return out


def _job(job: Job, position: int | None = None) -> dict[str, Any]:
    return {"uid": job.uid, "owner": job.owner.get_username(), "workflow": job.workflow, "state": job.state,
            "progress": job.progress, "stage": job.stage, "queue_position": position,
            "detail": job.detail, "created_at": job.created_at.isoformat()}


@staff_json
@require_http_methods(["GET"])
def jobs(request: HttpRequest) -> JsonResponse:
    try:
        limit = max(1, min(JOBS_SHOWN, _whole(request, "limit", JOBS_SHOWN)))
    except ValueError:
        return JsonResponse({"error": "limit must be a whole number"}, status=400)
    shown = list(Job.objects.filter(uid__isnull=False).select_related("owner")[:limit])
    positions = _queue_positions(shown)
    return JsonResponse({"jobs": [_job(j, positions.get(j.pk)) for j in shown],
                         "total": Job.objects.filter(uid__isnull=False).count()})


def result_kind(workflow: str) -> str | None:
    """"video" (shown in <video>), "image" (in <img>), or None for a workflow the engine does not know."""
    try:
        return get_workflow(workflow).final_output or None
    except KeyError:
        return None


@staff_json
@require_http_methods(["GET"])
def job_detail(request: HttpRequest, uid: str) -> JsonResponse:
    """One job: its stages in the workflow's order with start/finish times (the events the reconciler
    applied to the ledger), and where its result is once completed."""
    job = control.refresh(get_object_or_404(Job.objects.select_related("owner"), uid=uid))
    try:
        order = [s.name for s in get_workflow(job.workflow).stages]
    except KeyError:
        order = []
    order += [s for s in job.stage_times if s not in order]
    stages = [{"stage": s, "started": job.stage_times.get(s, {}).get("started"),
               "finished": job.stage_times.get(s, {}).get("finished")} for s in order]
    body = _job(job, _queue_positions([job]).get(job.pk))
    body.update(stages=stages, started_at=job.started_at.timestamp() if job.started_at else None,
                finished_at=job.finished_at.timestamp() if job.finished_at else None,
                created_ts=job.created_at.timestamp(), cost_estimate_gpu_s=job.cost_estimate_gpu_s,
                cost_measured_gpu_s=job.cost_measured_gpu_s,
                result=({"kind": result_kind(job.workflow), "url": f"/dashboard/api/jobs/{job.uid}/result"}
                        if job.state == COMPLETED else None),
                preview=_preview(job), eta=getattr(job, "eta", None))  # the engine's, read by refresh
    return JsonResponse({"job": body})


def _preview(job: Job) -> dict[str, Any] | None:
    """Where the job's latest live preview is (and its step), for a job submitted with preview_every."""
    if not job.request_options().preview_every:
        return None
    found = previews.meta(job.uid or "")
    return None if found is None else {**found, "url": f"/dashboard/api/jobs/{job.uid}/preview"}


@staff_json
@require_http_methods(["GET"])
def job_preview(request: HttpRequest, uid: str) -> HttpResponse:
    """Any user's job's latest live preview (PNG), to staff; 204 while there is none."""
    job = get_object_or_404(Job, uid=uid)
    return previews.latest_response(job.uid or "")


class JobResultForStaff(JobResultView):
    """The result endpoint's own response (``result_response``: 409 unfinished, 410 expired, the bytes
    with their type) for any user's job, to staff in a browser session; everyone else gets 403."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAdminUser]
    schema = None  # the dashboard's, not part of the public API's OpenAPI schema

    def get(self, request: Request, uid: str) -> HttpResponse | Response:
        job = control.refresh(get_object_or_404(Job, uid=uid))
        resp = result_response(job)
        if resp.status_code == 200:
            resp["Content-Disposition"] = resp["Content-Disposition"].replace("attachment", "inline", 1)
        return resp


job_result = JobResultForStaff.as_view()


@staff_json
@require_http_methods(["GET"])
def traffic(request: HttpRequest) -> JsonResponse:
    try:
        minutes, step = _whole(request, "minutes", 10), _whole(request, "step", 10)
    except ValueError:
        return JsonResponse({"error": "minutes and step must be whole numbers"}, status=400)
    return JsonResponse(traffic_.traffic(timezone.now(), minutes, step))

