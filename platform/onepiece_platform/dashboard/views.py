"""The operator dashboard: the page (staff only) and the small JSON endpoints its script calls.

The live cluster state comes over ``/ws/cluster`` (consumers.py); these
endpoints cover what a websocket push does not: every user's jobs (the native
``/api/v1/jobs`` lists only the caller's own), and scaling actions with their
audit list. Session auth with Django's CSRF check on POST, as the admin uses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from engine.workflow import workflows
from onepiece_platform.engine_link.admin import dispatch, refresh
from onepiece_platform.engine_link.models import OperatorAction
from onepiece_platform.jobs.models import Job

JOBS_SHOWN = 50
ACTIONS_SHOWN = 20
# The dashboard offers the actions an operator takes under load; the admin keeps the rest.
DASHBOARD_ACTIONS = (OperatorAction.SCALE_STAGE, OperatorAction.DRAIN_NODE, OperatorAction.UNDRAIN_NODE)
VERDICT_WAIT_S = 2.0  # the leader ticks about once a second; a late verdict shows on the next refresh


def staff_json(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """JSON endpoints answer 403 rather than redirect: a script cannot follow a login page."""
    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if not (user.is_authenticated and user.is_active and user.is_staff):
            return JsonResponse({"error": "staff only"}, status=403)
        return view(request, *args, **kwargs)
    return wrapped


@staff_member_required
def index(request: HttpRequest) -> HttpResponse:
    # Stage order is the workflow's, not alphabetical: the page draws each chain in that order.
    stages = {name: [s.name for s in spec.stages] for name, spec in sorted(workflows().items())}
    return render(request, "dashboard/index.html", {"workflow_stages": stages})


def _job(job: Job) -> dict[str, Any]:
    return {"uid": job.uid, "owner": job.owner.get_username(), "workflow": job.workflow, "state": job.state,
            "progress": job.progress, "stage": job.stage, "queue_position": job.queue_position(),
            "detail": job.detail, "created_at": job.created_at.isoformat()}


@staff_json
@require_http_methods(["GET"])
def jobs(request: HttpRequest) -> JsonResponse:
    qs = Job.objects.filter(uid__isnull=False).select_related("owner")[:JOBS_SHOWN]
    return JsonResponse({"jobs": [_job(j) for j in qs]})


def _action(a: OperatorAction) -> dict[str, Any]:
    return {"id": a.pk, "created_at": a.created_at.isoformat(), "actor": a.actor.get_username() if a.actor else None,
            "action": a.action, "args": a.args, "status": a.status, "verdict": a.verdict}


def _valid_args(action: str, args: Any) -> str | None:
    """Shape only (the leader checks the cluster: that the stage or node exists, capacity)."""
    if not isinstance(args, dict):
        return "args must be an object"
    if action == OperatorAction.SCALE_STAGE:
        if not all(isinstance(args.get(k), str) and args[k] for k in ("workflow", "stage")):
            return "workflow and stage are required"
        n = args.get("instances")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            return "instances must be a whole number >= 0 (or null for automatic)"
    elif not (isinstance(args.get("node"), str) and args["node"]):
        return "node is required"
    return None


@staff_json
@require_http_methods(["GET", "POST"])
def actions(request: HttpRequest) -> JsonResponse:
    if request.method == "GET":
        for a in OperatorAction.objects.filter(status="submitted")[:ACTIONS_SHOWN]:
            refresh(a)  # pick up verdicts that came after the POST returned
        return JsonResponse({"actions": [_action(a) for a in OperatorAction.objects.all()[:ACTIONS_SHOWN]]})
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        return JsonResponse({"error": "body must be JSON"}, status=400)
    kind, args = body.get("action"), body.get("args", {})
    if kind not in DASHBOARD_ACTIONS:
        return JsonResponse({"error": f"action must be one of {', '.join(DASHBOARD_ACTIONS)}"}, status=400)
    problem = _valid_args(kind, args)
    if problem:
        return JsonResponse({"error": problem}, status=400)
    a = OperatorAction.objects.create(actor=request.user, action=kind, args=args)
    try:
        dispatch(a, request.user)  # audited there, like the admin's actions
        refresh(a, timeout=VERDICT_WAIT_S)
    except Exception as exc:  # etcd unreachable: the operator sees why, the row says so
        a.status, a.verdict = "refused", {"ok": False, "error": f"cluster unreachable: {exc}"}
        a.save(update_fields=["status", "verdict"])
    return JsonResponse({"action": _action(a)}, status=201)
