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

    SCALE_STAGE, MOVE_INSTANCE, DRAIN_NODE, UNDRAIN_NODE, WARM_UP = (
        "scale_stage", "move_instance", "drain_node", "undrain_node", "warm_up")
    KINDS = [(SCALE_STAGE, "scale stage {workflow, stage, instances}"),
             (MOVE_INSTANCE, "move instance {instance, node}"),
             (DRAIN_NODE, "drain node {node}"), (UNDRAIN_NODE, "undrain node {node}"),
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
