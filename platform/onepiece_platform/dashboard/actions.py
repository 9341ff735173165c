"""Operators' actions from the dashboard, with their audit list.

Scaling and scheduling actions go to the leading Node Manager through etcd
(engine_link.admin.dispatch, as the admin's do) and come back with its
verdict; a warm-up goes to Celery and reports when the task has finished.
Arguments are checked for shape here, before anything is recorded; the
leader checks them against the cluster (that the node, stage or instance
exists, that the counts fit).
"""

from __future__ import annotations

import logging
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_http_methods

from engine.coord.actions import MODES
from engine.workflow import workflows
from onepiece_platform.dashboard.views import staff_json
from onepiece_platform.engine_link.admin import dispatch, refresh
from onepiece_platform.engine_link.models import OperatorAction as Op
from onepiece_platform.strict import loads as strict_loads

log = logging.getLogger(__name__)
ACTIONS_SHOWN = 20
VERDICT_WAIT_S = 2.0  # the leader ticks about once a second; a late verdict shows on the next refresh


def _action(a: Op) -> dict[str, Any]:
    return {"id": a.pk, "created_at": a.created_at.isoformat(), "actor": a.actor.get_username() if a.actor else None,
            "action": a.action, "args": a.args, "status": a.status, "verdict": a.verdict}


def _text(args: dict[str, Any], *names: str) -> bool:
    return all(isinstance(args.get(k), str) and args[k] for k in names)


def valid_args(action: str, args: Any) -> str | None:
    """Shape only; None when fine, else why not."""
    if not isinstance(args, dict):
        return "args must be an object"
    if action == Op.SCALE_STAGE:
        if not _text(args, "workflow", "stage"):
            return "workflow and stage are required"
        n = args.get("instances")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            return "instances must be a whole number >= 0 (or null for automatic)"
    elif action in (Op.DRAIN_NODE, Op.UNDRAIN_NODE):
        if not _text(args, "node"):
            return "node is required"
    elif action == Op.MOVE_INSTANCE:
        if not _text(args, "instance", "node"):
            return "instance and node are required"
    elif action == Op.SET_MODE:
        if not _text(args, "workflow"):
            return "workflow is required"
        if args.get("mode") not in MODES:
            return f"mode must be one of {', '.join(MODES)}"
    elif action == Op.WARM_UP:
        wfs, nodes = args.get("workflows"), args.get("nodes", [])
        if not isinstance(wfs, list) or not wfs or not all(w in workflows() for w in wfs):
            return f"workflows must be a non-empty list of: {', '.join(sorted(workflows()))}"
        if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
            return "nodes must be a list of node names (empty: every node)"
    return None


def _warm_up_outcome(a: Op) -> None:
    """A queued warm-up's report, once its task has finished (the result backend holds it)."""
    from celery.result import AsyncResult

    from onepiece_platform.celery_app import app

    res = AsyncResult(a.request_id, app=app)
    if res.state == "SUCCESS":
        a.status, a.verdict = "done", {"ok": True, "report": res.result}
    elif res.state == "FAILURE":
        a.status, a.verdict = "failed", {"ok": False, "error": str(res.result)}
    else:
        return
    a.save(update_fields=["status", "verdict"])


@staff_json
@require_http_methods(["GET", "POST"])
def actions(request: HttpRequest) -> JsonResponse:
    if request.method == "GET":
        for a in Op.objects.filter(status__in=("submitted", "queued"))[:ACTIONS_SHOWN]:
            try:  # pick up verdicts that came after the POST returned
                _warm_up_outcome(a) if a.action == Op.WARM_UP else refresh(a)
            except Exception:  # etcd or the result backend away: the row stays as it is, shown as such
                log.warning("could not refresh action %s", a.pk, exc_info=True)
        return JsonResponse({"actions": [_action(a) for a in Op.objects.select_related("actor")[:ACTIONS_SHOWN]]})
    try:  # strict: NaN refused, and nesting past the parser's stack a ValueError, not a RecursionError (500)
        body = strict_loads(request.body or b"{}")
    except ValueError:  # UnicodeDecodeError included
        return JsonResponse({"error": "body must be JSON"}, status=400)
    if not isinstance(body, dict):  # a list, null, a string: .get would be a 500
        return JsonResponse({"error": "body must be a JSON object: {\"action\": ..., \"args\": {...}}"}, status=400)
    kind, args = body.get("action"), body.get("args", {})
    if kind not in Op.ALL:
        return JsonResponse({"error": f"action must be one of {', '.join(Op.ALL)}"}, status=400)
    problem = valid_args(kind, args)
    if problem:
        return JsonResponse({"error": problem}, status=400)
    a = Op.objects.create(actor=request.user, action=kind, args=args)
    try:
        dispatch(a, request.user)  # audited there, like the admin's actions
        refresh(a, timeout=VERDICT_WAIT_S)
    except Exception as exc:  # etcd or the broker unreachable: the operator sees why, the row says so
        a.status, a.verdict = "refused", {"ok": False, "error": f"not sent: {exc}"}
        a.save(update_fields=["status", "verdict"])
    return JsonResponse({"action": _action(a)}, status=201)
