"""Native jobs API: the submission document and the job as clients see it (all server fields read-only)."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from engine.workflow import workflows
from onepiece_platform.accounts.models import PRIORITIES
from onepiece_platform.adapters.fields import LoraField
from onepiece_platform.api_schema import PageSerializer
from onepiece_platform.jobs.models import STATES, Job
from onepiece_platform.strict import AsciiFloatField, AsciiIntegerField, RefuseUnknownFields


class SubmitSerializer(RefuseUnknownFields):
    workflow = serializers.ChoiceField(choices=[], help_text="a name from GET /api/v1/workflows")
    params = serializers.DictField(required=False, default=dict, help_text="the workflow's parameters")
    inputs = serializers.DictField(child=serializers.CharField(), required=False, default=dict,
                                   help_text="input name -> base64 bytes (e.g. image for image-to-video)")
    deadline_s = AsciiFloatField(required=False, min_value=1.0, max_value=86400.0)
    lora = LoraField(required=False)
    # default None: the highest the user's tier (and the key's cap) allows, up to normal (services.check_priority)
    priority = serializers.ChoiceField(choices=PRIORITIES, required=False, default=None,
                                       help_text="every stage serves higher priority first (a request waiting "
                                                 "10 s at a stage counts as high: none starves); the account's "
                                                 "tier, or the API key's lower cap, sets the highest allowed (403 "
                                                 "over it); default: the highest allowed, up to normal")
    retention = AsciiIntegerField(required=False, min_value=1, max_value=10 * 365 * 86400,
                                  help_text="seconds the output is kept after the job finishes, at most the "
                                            "ceiling of the API key's tier (400 naming retention over it); "
                                            "default: the tier's default")
    output_upload_url = serializers.CharField(required=False, max_length=8000,
                                              help_text="a presigned PUT URL of your bucket: the output is uploaded "
                                                        "there once the job completes (the webhooks' egress policy: "
                                                        "public addresses only, no redirect followed)")
    keep_output = serializers.BooleanField(required=False, default=False,
                                           help_text="with output_upload_url: keep the output here too after the "
                                                     "upload succeeded (default false: deleted then)")
    webhook_url = serializers.CharField(required=False, max_length=2000,
                                        help_text="also send the job's terminal event (job.completed, job.failed, "
                                                  "job.cancelled, job.expired) here, signed with the secret of "
                                                  "this API key's webhook endpoint")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = sorted(workflows())


class LinksSerializer(serializers.Serializer):
    self = serializers.CharField()
    result = serializers.CharField()
    cancel = serializers.CharField()


class StageRunSerializer(serializers.Serializer):
    stage = serializers.CharField()
    attempt = serializers.IntegerField(help_text="1, then 2, ... when the job was started again after a node loss")
    started = serializers.FloatField(allow_null=True, help_text="unix s")
    finished = serializers.FloatField(allow_null=True, help_text="unix s")
    device_s = serializers.FloatField(allow_null=True, help_text="finished - started: what the run is charged")
    stopped = serializers.BooleanField(help_text="gave up early (cancel, deadline, error)")
    batch_size = serializers.IntegerField(help_text="the most requests this run shared a step with, itself included "
                                          "(1: alone)")
    cache_skipped = serializers.FloatField(allow_null=True, help_text="the share of its transformer calls the step "
                                           "cache skipped (a quality below lossless; null: no cache)")


class OutputSerializer(serializers.Serializer):
    key = serializers.CharField(allow_null=True, help_text="the object's key in the deployment's object store; "
                                "null: kept inline in Redis (outputs under ONEPIECE_OBJECT_INLINE_BYTES)")
    size = serializers.IntegerField(help_text="bytes")
    sha256 = serializers.CharField(help_text="hex SHA-256 of the bytes (check a download against it)")
    content_type = serializers.CharField()


class OutputUploadSerializer(serializers.Serializer):
    url = serializers.CharField(help_text="the output_upload_url without its query (its signature)")
    keep_output = serializers.BooleanField(help_text="our copy is kept after the upload")
    state = serializers.ChoiceField(choices=["pending", "uploaded", "failed", "skipped"],
                                    help_text="pending until the PUT succeeded (uploaded) or failed for good; "
                                              "skipped: the job ended without an output")
    attempts = serializers.IntegerField()
    status = serializers.IntegerField(allow_null=True, help_text="the bucket's HTTP status on the last attempt")
    error = serializers.CharField(allow_null=True, help_text="why the last attempt failed")
    uploaded_at = serializers.DateTimeField(allow_null=True)


def output_upload_of(job: Job) -> dict[str, Any] | None:
    """The job's output upload (OutputUpload.as_dict), or None when the request had no output_upload_url."""
    from django.core.exceptions import ObjectDoesNotExist

    try:
        return job.output_upload.as_dict()  # type: ignore[attr-defined]
    except ObjectDoesNotExist:
        return None


class EtaSerializer(serializers.Serializer):
    eta_s = serializers.FloatField(help_text="seconds from now until the job is done: the estimate's median")
    eta_p90_s = serializers.FloatField(help_text="seconds from now it is done by, nine times in ten")
    provisional = serializers.BooleanField(help_text="true until this deployment's recent jobs met the "
                                                     "estimate's accuracy gate (docs/api.md)")
    queue_ahead = serializers.IntegerField(help_text="jobs the stages serve before it")


class JobSerializer(serializers.ModelSerializer):
    stage_times = serializers.DictField(
        child=serializers.DictField(), read_only=True,
        help_text="stage -> {started, finished, attempt, device_s} of each stage's latest attempt (unix s)")
    stage_runs = StageRunSerializer(many=True, read_only=True,
                                    help_text="every run of every stage, over attempts; the measured cost is "
                                              "the sum of their device_s")
    queue_position = serializers.SerializerMethodField()
    cancel_requested = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()
    eta = serializers.SerializerMethodField()
    params = serializers.SerializerMethodField(
        help_text="the workflow's parameters as resolved, with the options taken among them (quality, "
                  "preview_every, lora)")
    quality = serializers.SerializerMethodField(
        help_text="lossless (bit-exact), extra-high or high: the step caching the job asked for (params.quality)")
    output = serializers.SerializerMethodField(
        help_text="a completed job's output: where it is stored, its size and SHA-256 (null until recorded)")
    retention_s = serializers.SerializerMethodField(
        help_text="seconds the output is kept after the job finishes (null: as long as the ledger row)")
    output_upload = serializers.SerializerMethodField(
        help_text="where the output_upload_url upload went (the URL without its query) and how it went; null "
                  "without one")
    output_expires_at = serializers.SerializerMethodField(
        help_text="when the output's retention ends and it is deleted (null while unfinished)")

    class Meta:
        model = Job
        fields = ["uid", "workflow", "params", "state", "progress", "stage", "queue_position", "detail",
                  "stage_times", "stage_runs", "cost_estimate_gpu_s", "cost_measured_gpu_s", "priority", "quality",
                  "created_at", "started_at",
                  "finished_at", "cancel_requested", "webhook_url", "resubmissions", "output", "retention_s",
                  "output_expires_at", "output_upload", "eta", "links"]
        read_only_fields = fields

    def get_params(self, job: Job) -> dict[str, Any]:
        return job.api_params()

    def get_quality(self, job: Job) -> str:
        return job.request_options().quality

    @extend_schema_field(OutputSerializer(allow_null=True))
    def get_output(self, job: Job) -> dict[str, Any] | None:
        return job.output

    @extend_schema_field(OutputUploadSerializer(allow_null=True))
    def get_output_upload(self, job: Job) -> dict[str, Any] | None:
        return output_upload_of(job)

    def get_retention_s(self, job: Job) -> int | None:
        return None if job.retention is None else int(job.retention.total_seconds())

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_output_expires_at(self, job: Job) -> str | None:
        until = job.retain_until
        return None if until is None else serializers.DateTimeField().to_representation(until)

    def get_queue_position(self, job: Job) -> int | None:
        return job.queue_position()

    def get_cancel_requested(self, job: Job) -> bool:
        return job.cancel_requested_at is not None

    @extend_schema_field(EtaSerializer(allow_null=True))
    def get_eta(self, job: Job) -> dict[str, Any] | None:
        """The engine's estimate of an unfinished job, as its latest refresh read it (None otherwise)."""
        return getattr(job, "eta", None)

    @extend_schema_field(LinksSerializer)
    def get_links(self, job: Job) -> dict[str, str]:
        d = reverse("job-detail", args=[job.uid])
        return {"self": d, "result": reverse("job-result", args=[job.uid]), "cancel": d}


class JobPageSerializer(PageSerializer):
    results = JobSerializer(many=True)


class JobListFilter(serializers.Serializer):
    state = serializers.ChoiceField(choices=STATES, required=False)
    workflow = serializers.CharField(required=False, max_length=64)


class ParamSerializer(serializers.Serializer):
    """One parameter of a workflow, as the workflow's spec declares it (the API schema documents each)."""

    name = serializers.CharField(help_text="the key in a job's `params`")
    type = serializers.CharField(help_text="the Python type of its value: int, float, str or bool")
    default = serializers.JSONField(allow_null=True, help_text="the value a job gets when it leaves it out")
    minimum = serializers.FloatField(allow_null=True, help_text="the smallest value accepted; null: no bound")
    maximum = serializers.FloatField(allow_null=True, help_text="the largest value accepted; null: no bound")
    max_length = serializers.IntegerField(allow_null=True, help_text="the most characters a str value may have")
    doc = serializers.CharField(help_text="what it does")


class WorkflowSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    stages = serializers.ListField(child=serializers.CharField())
    inputs = serializers.ListField(child=serializers.CharField())
    output = serializers.CharField()
    params = ParamSerializer(many=True)
    limits = serializers.DictField()


def describe_workflow(spec: Any, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": spec.name, "description": spec.description, "stages": spec.route(),
        "inputs": [t.name for t in spec.request_inputs], "output": spec.final_output,
        "params": [{"name": p.name, "type": p.type.__name__, "default": p.default, "minimum": p.minimum,
                    "maximum": p.maximum, "max_length": p.max_length, "doc": p.doc} for p in spec.params],
        "limits": limits,
    }
