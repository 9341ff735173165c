"""Where the reconciler stopped reading the engine's event stream (survives web restarts)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class StreamCursor(models.Model):
    name = models.CharField(max_length=64, primary_key=True)
    last_id = models.CharField(max_length=64, default="0-0")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} @ {self.last_id}"


class OperatorAction(models.Model):
    """An operator's request from the admin: a Node Manager scaling action, or a Celery warm-up.

    The row is the platform's record of who asked what; the verdict is the
    leader's (for scaling) or the task's report (for warm-up).
    """

    SCALE_STAGE, MOVE_INSTANCE, DRAIN_NODE, UNDRAIN_NODE, SET_MODE, WARM_UP = (
        "scale_stage", "move_instance", "drain_node", "undrain_node", "set_mode", "warm_up")
    KINDS = [(SCALE_STAGE, "scale stage {workflow, stage, instances}"),
             (MOVE_INSTANCE, "move instance {instance, node}"),
             (DRAIN_NODE, "drain node {node}"), (UNDRAIN_NODE, "undrain node {node}"),
             (SET_MODE, "set a workflow's scheduling mode {workflow, mode: individual|collaboration}"),
             (WARM_UP, "warm up {workflows: [...], nodes: [...]}")]

    created_at = models.DateTimeField(auto_now_add=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+", editable=False)
    action = models.CharField(max_length=32, choices=KINDS)
    args = models.JSONField(default=dict, blank=True)
    request_id = models.CharField(max_length=64, blank=True, editable=False, help_text="etcd action id / task id")
    status = models.CharField(max_length=16, default="submitted", editable=False)
    verdict = models.JSONField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.action} {self.args} ({self.status})"


class Rejection(models.Model):
    """A submission turned away under load: the engine's 503 (over capacity, or unreachable) or the
    user's quota (429). Accepted work is in the job ledger; this is the other half of the traffic
    view. A bad request (400) is not traffic turned away and is not recorded."""

    ENGINE_BUSY, ENGINE_UNREACHABLE, QUOTA = "engine_busy", "engine_unreachable", "quota"

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    workflow = models.CharField(max_length=64)
    reason = models.CharField(max_length=32)
    status = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.workflow} {self.status} {self.reason}"
