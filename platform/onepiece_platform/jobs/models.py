"""The job ledger: the truth about every job the platform accepted.

A row is created (with ``uid`` empty) before the engine is asked, so a
repeated Idempotency-Key collides on the database's unique constraint instead
of reaching the engine twice; it gets the engine's UID once accepted, and is
deleted if the engine refuses. Terminal transitions happen once, in
:mod:`onepiece_platform.jobs.ledger`.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED, EXPIRED = (
    "queued", "in_progress", "completed", "failed", "cancelled", "expired")
STATES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED, EXPIRED)
TERMINAL = (COMPLETED, FAILED, CANCELLED, EXPIRED)
NON_TERMINAL = (QUEUED, IN_PROGRESS)


class Job(models.Model):
    uid = models.CharField(max_length=32, unique=True, null=True, blank=True, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    workflow = models.CharField(max_length=64, db_index=True)
    params = models.JSONField(default=dict)
    api = models.CharField(max_length=16, default="native", help_text="native or openai")
    state = models.CharField(max_length=16, choices=[(s, s) for s in STATES], default=QUEUED, db_index=True)
    stage = models.CharField(max_length=64, blank=True)
    progress = models.PositiveSmallIntegerField(default=0)
    detail = models.TextField(blank=True, help_text="why it failed, was cancelled or expired")
    stage_times = models.JSONField(default=dict, blank=True, help_text="stage -> {started, finished} (unix s)")
    cost_estimate_gpu_s = models.FloatField(default=0.0)
    cost_measured_gpu_s = models.FloatField(null=True, blank=True)
    quota_day = models.CharField(max_length=8, blank=True, help_text="the UTC day whose budget was charged")
    idempotency_key = models.CharField(max_length=200, blank=True)
    hidden = models.BooleanField(default=False, help_text="deleted through /v1/videos")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "idempotency_key"], condition=~Q(idempotency_key=""),
                                    name="unique_idempotency_key_per_owner"),
        ]
        indexes = [models.Index(fields=["owner", "state"]), models.Index(fields=["workflow", "state", "created_at"])]

    def __str__(self) -> str:
        return f"{self.uid or '(submitting)'} {self.workflow} {self.state}"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def queue_position(self) -> int | None:
        """Jobs of the same workflow queued before this one (0: next); None unless queued."""
        if self.state != QUEUED:
            return None
        return Job.objects.filter(workflow=self.workflow, state=QUEUED, uid__isnull=False,
                                  created_at__lt=self.created_at).count()

    def measured_gpu_s(self) -> float | None:
        """GPU-seconds from the stage times the events reported; None if no stage both started and finished."""
        total, seen = 0.0, False
        for t in self.stage_times.values():
            if "started" in t and "finished" in t:
                total += max(0.0, float(t["finished"]) - float(t["started"]))
                seen = True
        return total if seen else None
