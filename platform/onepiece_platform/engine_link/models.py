"""Where the reconciler stopped reading the engine's event stream (survives web restarts)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from engine.coord.actions import Action


class StreamCursor(models.Model):
    """Where the reconciler stopped, and what it did with the events before it. The cursor moves in the
    same transaction as the batch of events it passes is applied (or held, or dead-lettered), so the
    counts are exact across restarts and kills."""

    name = models.CharField(max_length=64, primary_key=True)
    last_id = models.CharField(max_length=64, default="0-0")
    updated_at = models.DateTimeField(auto_now=True)
    applied = models.PositiveBigIntegerField(default=0, help_text="events applied to the ledger")
    retried = models.PositiveBigIntegerField(default=0, help_text="transient failures met (a lost database "
                                             "connection, Redis away) and tried again, the cursor unmoved")
    held = models.PositiveBigIntegerField(default=0, help_text="events held because their job was not known yet")
    dead = models.PositiveBigIntegerField(default=0, help_text="events sent to the dead letters")
    gaps = models.PositiveBigIntegerField(default=0, help_text="times the engine's stream no longer held the "
                                          "cursor (trimmed by its cap, or Redis restarted): events after it may "
                                          "be lost; their jobs were swept at once, their stage runs and progress "
                                          "are not in the ledger")

    def __str__(self) -> str:
        return f"{self.name} @ {self.last_id}"


class HeldEvent(models.Model):
    """An event for a UID the ledger does not know yet (its row may still be on its way). Retried every
    tick; applied when the row appears, dead-lettered after ``ONEPIECE['HOLD_UNKNOWN_S']``."""

    entry_id = models.CharField(max_length=64, unique=True)
    uid = models.CharField(max_length=64, db_index=True)
    fields = models.JSONField()
    held_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.entry_id} {self.uid} {self.fields.get('type', '')}"


class DeadLetter(models.Model):
    """An engine event that can never apply (malformed, its job unknown after the grace period, or an
    error that is not transient), kept with the reason for an operator."""

    MALFORMED, UNKNOWN_JOB, FAILED = "malformed", "unknown_job", "failed"
    REASONS = [(MALFORMED, "malformed"), (UNKNOWN_JOB, "unknown job"), (FAILED, "could not apply")]

    entry_id = models.CharField(max_length=64, unique=True)
    uid = models.CharField(max_length=64, blank=True, db_index=True)
    fields = models.JSONField()
    reason = models.CharField(max_length=16, choices=REASONS)
    detail = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.entry_id} {self.reason}"


class OperatorAction(models.Model):
    """An operator's request from the admin: a Node Manager scaling action, or a Celery warm-up.

    The row is the platform's record of who asked what; the verdict is the
    leader's (for scaling) or the task's report (for warm-up).
    """

    class Kind(models.TextChoices):
        """The one list of what operators may ask (the admin, the dashboard and the engine link read it): the
        leading Node Manager's actions (engine.coord.actions.Action, the same names: a test checks;
        pin_instance is not offered) and a Celery warm-up."""

        SCALE_STAGE = Action.SCALE_STAGE.value, "scale stage {workflow, stage, instances}"
        MOVE_INSTANCE = Action.MOVE_INSTANCE.value, "move instance {instance, node}"
        DRAIN_NODE = Action.DRAIN_NODE.value, "drain node {node}"
        UNDRAIN_NODE = Action.UNDRAIN_NODE.value, "undrain node {node}"
        SET_MODE = Action.SET_MODE.value, "set a workflow's scheduling mode {workflow, mode: individual|collaboration}"
        WARM_UP = "warm_up", "warm up {workflows: [...], nodes: [...]}"

    SCALE_STAGE, MOVE_INSTANCE, DRAIN_NODE = Kind.SCALE_STAGE, Kind.MOVE_INSTANCE, Kind.DRAIN_NODE
    UNDRAIN_NODE, SET_MODE, WARM_UP = Kind.UNDRAIN_NODE, Kind.SET_MODE, Kind.WARM_UP
    KINDS = Kind.choices
    ALL = tuple(Kind)
    SCALING = tuple(filter(WARM_UP.__ne__, ALL))  # sent to the leading Node Manager through etcd

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
