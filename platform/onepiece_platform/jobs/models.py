"""The job ledger: the truth about every job the platform accepted.

A row is created with the UID the platform minted (``submitting`` set) before
the engine is asked, so a repeated Idempotency-Key collides on the database's
unique constraint instead of reaching the engine twice, and every event the
engine writes for that UID finds its row; the engine is handed that UID, and
the row is deleted if the engine refuses. Terminal transitions happen once, in
:mod:`onepiece_platform.jobs.ledger`.

Stage times are rows of their own (:class:`StageRun`, one per job, stage and
attempt), each column written once by a conditional UPDATE: concurrent writers
(the reconciler, a status read that finishes the job) never read-modify-write
a shared document.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from engine.store.keys import JobState
from engine.workflow import get_workflow
from engine.workflow.options import Options, Priority
from onepiece_platform.accounts.models import Priorities

# The ledger's states are the engine's (engine.store.keys.JobState), each its own label
States = models.TextChoices("States", [(s.name, (s.value, s.value)) for s in JobState])
QUEUED, IN_PROGRESS, COMPLETED = States.QUEUED, States.IN_PROGRESS, States.COMPLETED
FAILED, CANCELLED, EXPIRED = States.FAILED, States.CANCELLED, States.EXPIRED
STATES = tuple(States)
TERMINAL = (COMPLETED, FAILED, CANCELLED, EXPIRED)
NON_TERMINAL = (QUEUED, IN_PROGRESS)


class Job(models.Model):
    uid = models.CharField(max_length=32, unique=True, null=True, blank=True, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    workflow = models.CharField(max_length=64, db_index=True)
    params = models.JSONField(default=dict, help_text="the model's parameters, as its spec resolved them")
    # The request's options (engine.workflow.options: how it is served) whole: ``options`` holds those the API
    # takes among the params (quality, preview_every, lora) as Options.to_json writes them ({} for a plain
    # request), priority and deadline_s below are columns of their own (the admin, the queue and the
    # resubmission read them); request_options() is the one Options of the three.
    options = models.JSONField(default=dict, blank=True,
                               help_text="the request's quality, preview_every and lora (engine.workflow.options)")
    api = models.CharField(max_length=16, default="native", help_text="native or openai")
    # who submitted it: its endpoint gets the job's completion webhook (onepiece_platform.webhooks)
    api_key = models.ForeignKey("accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+", editable=False)
    webhook_url = models.CharField(max_length=2000, blank=True, help_text="the native API's per-request webhook")
    state = models.CharField(max_length=16, choices=States.choices, default=QUEUED, db_index=True)
    stage = models.CharField(max_length=64, blank=True)
    progress = models.PositiveSmallIntegerField(default=0)
    detail = models.TextField(blank=True, help_text="why it failed, was cancelled or expired")
    cost_estimate_gpu_s = models.FloatField(default=0.0)
    cost_measured_gpu_s = models.FloatField(null=True, blank=True,
                                            help_text="sum of the stage runs' device seconds, over attempts")
    charge_version = models.PositiveIntegerField(default=0, editable=False,
                                                 help_text="bumped each time the charge of a finished job is set")
    charge_settled = models.PositiveIntegerField(default=0, editable=False,
                                                 help_text="the charge_version the quota counters were told")
    submitting = models.BooleanField(default=False, editable=False,
                                     help_text="the engine has not answered the submission yet")
    quota_day = models.CharField(max_length=8, blank=True, help_text="the UTC day whose budget was charged")
    idempotency_key = models.CharField(max_length=200, blank=True)
    # the route and operation the key was given to (services.SCOPE_*): a repeat elsewhere is a 409, never
    # this job (a remix with the key that created its source must not answer the source)
    idempotency_scope = models.CharField(max_length=64, blank=True)
    hidden = models.BooleanField(default=False, help_text="deleted through /v1/videos")
    # What the engine needs to run the job again when its state died with Redis (the reconciler's sweep
    # submits it again under its UID: engine_link/resubmit.py): the params above, the uploaded inputs
    # (JobInput, kept until the job finishes) and the deadline the request asked for.
    deadline_s = models.FloatField(null=True, blank=True, help_text="seconds from submission the job had")
    priority = models.CharField(max_length=8, default=Priority.NORMAL.value, choices=Priorities.choices,
                                help_text="the priority every stage served it at (engine.dispatch.order)")
    resubmissions = models.PositiveSmallIntegerField(default=0, editable=False,
                                                     help_text="times submitted again after the engine lost it")
    attempt_base = models.PositiveSmallIntegerField(default=0, editable=False,
                                                    help_text="stage-run attempts before the latest submission: the "
                                                              "engine counts its own attempts from 1 again")
    # The completed job's output as the engine's completion event described it (engine.store.jobs): where it is
    # in the object store (blank: kept inline in Redis, under ONEPIECE_OBJECT_INLINE_BYTES), its size and the
    # SHA-256 of its bytes. Set once (ledger.record_output); blank for jobs that did not complete.
    output_key = models.CharField(max_length=1024, blank=True, editable=False,
                                  help_text="the output's key in the object store (blank: inline in Redis)")
    output_size = models.BigIntegerField(null=True, blank=True, editable=False, help_text="bytes")
    output_sha256 = models.CharField(max_length=64, blank=True, editable=False,
                                     help_text="hex SHA-256 of the output's bytes")
    output_content_type = models.CharField(max_length=100, blank=True, editable=False)
    # How long the output is kept after the job finished (the request's ``retention``, else its key tier's
    # default: services.check_retention); null for rows from before retention (kept as long as the row).
    # The clean-up task ``onepiece.expire_outputs`` deletes the objects once it has passed and sets
    # output_purged_at, as does a video's deletion and an upload to the client's bucket without keep_output.
    retention = models.DurationField(null=True, blank=True, editable=False,
                                     help_text="how long the output is kept after the job finished")
    output_purged_at = models.DateTimeField(null=True, blank=True, editable=False,
                                            help_text="when the stored output was deleted (retention, deletion, "
                                                      "delivered to the client's bucket)")
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

    def request_options(self) -> Options:
        """The request's options, whole: ``options`` with the ``priority`` and ``deadline_s`` columns."""
        return Options.from_json({**(self.options or {}), "priority": self.priority, "deadline_s": self.deadline_s})

    def api_params(self) -> dict[str, Any]:
        """The job's parameters as the API shows them: the model's, and among them the options the API takes
        there (``quality``, ``preview_every`` at their defaults too where the workflow takes them; ``lora``)."""
        try:
            taken = {p.name for p in get_workflow(self.workflow).params}
        except KeyError:  # a workflow no longer served: what the row has
            taken = set()
        return {**(self.params or {}), **self.request_options().params(taken)}

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def queue_position(self) -> int | None:
        """Jobs of the same workflow queued before this one (0: next); None unless queued."""
        if self.state != QUEUED:
            return None
        return Job.objects.filter(workflow=self.workflow, state=QUEUED, uid__isnull=False,
                                  created_at__lt=self.created_at).count()

    @property
    def output(self) -> dict[str, object] | None:
        """The recorded output (key None when inline in Redis), or None when none is recorded."""
        if not self.output_sha256:
            return None
        return {"key": self.output_key or None, "size": self.output_size, "sha256": self.output_sha256,
                "content_type": self.output_content_type or "application/octet-stream"}

    @property
    def retain_until(self) -> dt.datetime | None:
        """When the output's retention ends (finished + retention); None while unfinished or without one."""
        if self.finished_at is None or self.retention is None:
            return None
        return self.finished_at + self.retention

    def output_gone(self, now: dt.datetime | None = None) -> str:
        """Why the output can no longer be served ("" while it can): deleted, or its retention ended."""
        if self.output_purged_at is not None:
            return f"the output was deleted at {self.output_purged_at:%Y-%m-%dT%H:%M:%SZ}"
        until = self.retain_until
        if until is not None and until <= (now or timezone.now()):
            return f"the output's retention ended at {until:%Y-%m-%dT%H:%M:%SZ}"
        return ""

    @property
    def charge_gpu_s(self) -> float:
        """What the quota is charged: the measured cost once known, else the estimate."""
        return self.cost_estimate_gpu_s if self.cost_measured_gpu_s is None else self.cost_measured_gpu_s

    @property
    def stage_times(self) -> dict[str, dict[str, float | int]]:
        """stage -> {started, finished, attempt, device_s} of each stage's latest attempt (unix s)."""
        out: dict[str, dict[str, float | int]] = {}
        for r in sorted(self.stage_runs.all(), key=lambda r: (r.attempt, r.pk)):
            out[r.stage] = r.as_dict()
        return out


class JobInput(models.Model):
    """An uploaded input of an unfinished job (a first frame), kept so the job can be submitted again if
    the engine loses it; deleted when the job finishes. Bounded by the upload limit (MAX_UPLOAD_BYTES)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="inputs")
    name = models.CharField(max_length=64)
    data = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="one_input_per_name")]

    def __str__(self) -> str:
        return f"{self.job_id} {self.name}"


class StageRun(models.Model):
    """One run of one stage of a job: a restarted job (its node was lost) runs its stages again as the
    next attempt. ``started`` and ``finished`` are the engine's event times (unix s), each set once."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="stage_runs")
    stage = models.CharField(max_length=64)
    attempt = models.PositiveSmallIntegerField(default=1)
    started = models.FloatField(null=True, blank=True)
    finished = models.FloatField(null=True, blank=True)
    stopped = models.BooleanField(default=False, help_text="gave up early (cancel, deadline, error)")
    detail = models.CharField(max_length=500, blank=True)
    batch_size = models.PositiveSmallIntegerField(default=1, help_text="the most requests it shared a step with "
                                                  "(itself included; engine.worker.batching)")
    cache_skipped = models.FloatField(null=True, blank=True, help_text="the share of its transformer calls its "
                                      "step cache skipped (a quality below lossless; engine.stages.caching)")

    class Meta:
        ordering = ["job", "attempt", "started", "id"]
        constraints = [models.UniqueConstraint(fields=["job", "stage", "attempt"], name="one_stage_run_per_attempt")]

    def __str__(self) -> str:
        return f"{self.job_id} {self.stage}#{self.attempt}"

    @property
    def device_s(self) -> float | None:
        """How long the stage held its device; None until both ends are known."""
        if self.started is None or self.finished is None:
            return None
        return max(0.0, self.finished - self.started)

    def as_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = {"attempt": self.attempt}
        if self.started is not None:
            d["started"] = self.started
        if self.finished is not None:
            d["finished"] = self.finished
        if self.device_s is not None:
            d["device_s"] = round(self.device_s, 6)
        return d


UPLOAD_PENDING, UPLOADED, UPLOAD_FAILED, UPLOAD_SKIPPED = "pending", "uploaded", "failed", "skipped"


class OutputUpload(models.Model):
    """A request's ``output_upload_url``: the client's presigned PUT URL its output is uploaded to once the job
    completes, by the webhook delivery worker under the webhooks' egress policy
    (:mod:`onepiece_platform.webhooks.uploads`), and how that went. ``pending`` until a 2xx (``uploaded``), a
    refusal that retrying cannot change or the last attempt (``failed``), or the job ending without an output
    (``skipped``). Each attempt is claimed as a webhook delivery is (``next_attempt_at`` pushed by a lease)."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="output_upload")
    url = models.TextField(editable=False, help_text="the presigned PUT URL (a credential: the API shows it "
                                                     "without its query)")
    keep_output = models.BooleanField(default=False, help_text="keep the output in our store after it was "
                                                               "uploaded (false: deleted then)")
    state = models.CharField(max_length=8, default=UPLOAD_PENDING, db_index=True,
                             choices=[(s, s) for s in (UPLOAD_PENDING, UPLOADED, UPLOAD_FAILED, UPLOAD_SKIPPED)])
    attempt_count = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(help_text="due from then, once the job completed")
    claim_token = models.CharField(max_length=32, blank=True, editable=False)
    last_status = models.PositiveSmallIntegerField(null=True, blank=True, help_text="the bucket's HTTP status")
    last_error = models.CharField(max_length=500, blank=True)
    uploaded_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.job_id} -> {self.where} {self.state}"

    @property
    def where(self) -> str:
        """The URL without its query (the signature), as the API shows where the output went."""
        from urllib.parse import urlsplit

        p = urlsplit(self.url)
        return f"{p.scheme}://{p.hostname or ''}{f':{p.port}' if p.port else ''}{p.path}"

    def as_dict(self) -> dict[str, object]:
        return {"url": self.where, "keep_output": self.keep_output, "state": self.state,
                "attempts": self.attempt_count, "status": self.last_status, "error": self.last_error or None,
                "uploaded_at": self.uploaded_at.isoformat().replace("+00:00", "Z") if self.uploaded_at else None}
