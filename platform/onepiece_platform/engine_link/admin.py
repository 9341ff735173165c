"""Operators' actions from the admin (staff only, as all of the admin): scaling through the Node Manager, warm-up."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest

from engine.coord.actions import ActionRefused
from onepiece_platform.accounts.models import audit
from onepiece_platform.engine_link.cluster import get_cluster
from onepiece_platform.engine_link.models import DeadLetter, HeldEvent, OperatorAction, StreamCursor


def dispatch(action: OperatorAction, actor: Any) -> None:
    """Send the action on (etcd for the Node Manager, Celery for warm-up) and record what came back."""
    if action.action == OperatorAction.WARM_UP:
        from onepiece_platform.engine_link.tasks import warm_up

        args = action.args or {}
        res = warm_up.delay(list(args.get("workflows", [])), list(args.get("nodes", [])))
        action.request_id, action.status = res.id, "queued"
    else:
        try:
            action.request_id = get_cluster().submit_action(action.action, action.args or {}, str(actor))
            action.status = "submitted"
        except ActionRefused as exc:
            action.status, action.verdict = "refused", {"ok": False, "error": str(exc)}
    action.save()
    audit(actor, f"cluster.{action.action}", action.request_id, args=action.args, status=action.status)


def refresh(action: OperatorAction, timeout: float = 0.0) -> None:
    if action.action == OperatorAction.WARM_UP or action.status != "submitted" or not action.request_id:
        return
    verdict = get_cluster().action_result(action.request_id, timeout)
    if verdict is not None:
        action.verdict = verdict
        action.status = "accepted" if verdict.get("ok") else "refused"
        action.save(update_fields=["verdict", "status"])


@admin.register(OperatorAction)
class OperatorActionAdmin(admin.ModelAdmin):
    list_display = ["created_at", "action", "args", "actor", "status", "request_id"]
    list_filter = ["action", "status"]
    search_fields = ["request_id"]
    readonly_fields = ["actor", "request_id", "status", "verdict", "created_at"]
    actions = ["refresh_verdicts"]

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False  # an action is a record: to do something else, add another

    def save_model(self, request: HttpRequest, obj: OperatorAction, form: Any, change: bool) -> None:
        obj.actor = request.user
        super().save_model(request, obj, form, change)
        dispatch(obj, request.user)
        refresh(obj, timeout=2.0)
        level = messages.ERROR if obj.status == "refused" else messages.INFO
        self.message_user(request, f"{obj.action}: {obj.status} {obj.verdict or ''}", level)

    @admin.action(description="Read the Node Manager's verdicts")
    def refresh_verdicts(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        for a in queryset:
            refresh(a)


@admin.register(StreamCursor)
class StreamCursorAdmin(admin.ModelAdmin):
    list_display = ["name", "last_id", "updated_at", "applied", "retried", "held", "dead", "gaps"]
    readonly_fields = ["name", "last_id", "updated_at", "applied", "retried", "held", "dead", "gaps"]


class _ReadOnly(admin.ModelAdmin):
    """Records the reconciler writes; the admin reads them (and may delete what was dealt with)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(DeadLetter)
class DeadLetterAdmin(_ReadOnly):
    list_display = ["created_at", "entry_id", "uid", "reason", "detail"]
    list_filter = ["reason", "created_at"]
    search_fields = ["=uid", "=entry_id"]


@admin.register(HeldEvent)
class HeldEventAdmin(_ReadOnly):
    list_display = ["held_at", "entry_id", "uid", "fields"]
    search_fields = ["=uid"]
