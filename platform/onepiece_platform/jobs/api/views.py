"""Native jobs API (/api/v1): submit, list, detail, cancel, result, workflows.

Every lookup is scoped to the requesting user, so another user's UID is 404,
never 403 and never their data.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.proxy import eta
from engine.workflow import get_workflow, workflows
from onepiece_platform import conf
from onepiece_platform.accounts.models import ApiKey
from onepiece_platform.adapters.fields import lora_from_form
from onepiece_platform.api_errors import error
from onepiece_platform.api_schema import native_errors
from onepiece_platform.jobs import control, services
from onepiece_platform.jobs.api.serializers import (
    JobListFilter,
    JobPageSerializer,
    JobSerializer,
    SubmitSerializer,
    WorkflowSerializer,
    describe_workflow,
)
from onepiece_platform.jobs.models import COMPLETED, STATES, Job
from onepiece_platform.negotiation import BytesOrJsonNegotiation
from onepiece_platform.quotas.models import limits_for
from onepiece_platform.strict import AsciiPageNumberPagination
from onepiece_platform.strict import StrictJSONParser as JSONParser
from onepiece_platform.strict import StrictMultiPartParser as MultiPartParser
from onepiece_platform.strict import loads as strict_loads

CONTENT_TYPES = {"image": ("image/png", "png"), "video": ("video/mp4", "mp4")}
_errors = native_errors


def check_body_size(request: Request) -> None:
    """413 before parsing anything: the declared body is larger than an upload may be (+ base64 overhead)."""
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    limit = conf.get("MAX_UPLOAD_BYTES") * 4 // 3 + 64 * 1024
    if length > limit:
        raise services.Invalid("body", f"request body of {length} bytes is over the limit of {limit}", 413)


def with_eta_header(response: Response, job: Job) -> Response:
    """``response`` with the ``OnePiece-ETA`` header of an unfinished job the engine estimated."""
    est = getattr(job, "eta", None)
    if est and "eta_s" in est and "eta_p90_s" in est:
        response[eta.HEADER] = eta.header(est["eta_s"], est["eta_p90_s"], bool(est.get("provisional", True)))
    return response


def api_key_of(request: Request) -> ApiKey | None:
    """The API key a request authenticated with (None for a signed-in session): the job's webhook owner."""
    return request.auth if isinstance(request.auth, ApiKey) else None


def own_job(request: Request, uid: str) -> Job:
    return get_object_or_404(Job, uid=uid, owner=request.user, hidden=False)


class JobPagination(AsciiPageNumberPagination):
    page_size = 20
    page_size_query_param = "page_size"
    max_page_size = 100


IDEMPOTENCY = OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER, required=False,
                               description="a repeat with the same key returns the first submission's job")


class JobListCreateView(APIView):
    permission_classes = [IsAuthenticated]
    parser_classes = [JSONParser, MultiPartParser]

    @extend_schema(operation_id="listJobs", parameters=[OpenApiParameter("state", str, enum=list(STATES)),
                               OpenApiParameter("workflow", str),
                               OpenApiParameter("page", int), OpenApiParameter("page_size", int)],
                   responses={200: JobPageSerializer, **_errors(400, 401, 404)})
    def get(self, request: Request) -> Response:
        f = JobListFilter(data=request.query_params)
        f.is_valid(raise_exception=True)
        qs = (Job.objects.filter(owner=request.user, uid__isnull=False, hidden=False)
              .select_related("output_upload").prefetch_related("stage_runs"))
        if "state" in f.validated_data:
            qs = qs.filter(state=f.validated_data["state"])
        if "workflow" in f.validated_data:
            qs = qs.filter(workflow=f.validated_data["workflow"])
        pager = JobPagination()
        page = pager.paginate_queryset(qs, request, view=self)
        return pager.get_paginated_response(JobSerializer(page, many=True).data)

    @extend_schema(operation_id="submitJob", request=SubmitSerializer, parameters=[IDEMPOTENCY],
                   responses={202: JobSerializer, **_errors(400, 401, 409, 413, 429, 503)})
    def post(self, request: Request) -> Response:
        check_body_size(request)
        doc, inputs = self._read(request)
        s = SubmitSerializer(data=doc)
        s.is_valid(raise_exception=True)
        for name, value in s.validated_data["inputs"].items():
            if name in inputs:
                raise services.Invalid(name, f"input {name!r} is given twice (a file and in inputs)")
            try:
                inputs[name] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise services.Invalid(name, f"input {name!r} is not valid base64") from None
        key = services.idempotency_key(request.headers)
        hook = s.validated_data.get("webhook_url", "")
        if hook:
            from onepiece_platform.webhooks.per_request import vet_webhook_url

            hook = vet_webhook_url(request.auth, hook)
        params = dict(s.validated_data["params"])
        if "lora" in s.validated_data:  # LoRA adapters, beside params or inside them (not both)
            if "lora" in params:
                raise services.Invalid("lora", "lora is given twice (at the top and in params)")
            params["lora"] = s.validated_data["lora"]
        done = services.submit(request.user, s.validated_data["workflow"], params,
                               inputs, key, "native", s.validated_data.get("deadline_s"),
                               api_key=api_key_of(request), webhook_url=hook,
                               priority=s.validated_data["priority"],
                               output=services.OutputOptions(s.validated_data.get("retention"),
                                                             s.validated_data.get("output_upload_url", ""),
                                                             s.validated_data["keep_output"]))
        body = JobSerializer(done.job).data
        return Response(body, status=status.HTTP_202_ACCEPTED,
                        headers={"Location": body["links"]["self"]})

    @staticmethod
    def _read(request: Request) -> tuple[dict[str, Any], dict[str, bytes]]:
        """(the JSON document, uploaded inputs). A multipart form carries every field of the JSON document,
        ``params`` and ``inputs`` as JSON strings, ``lora`` as one JSON string or as ``lora[][name]`` /
        ``lora[][scale]`` entries; an unknown field is refused by the serializer, a repeated one here."""
        if not request.content_type.startswith("multipart/"):
            data = request.data
            return (dict(data) if isinstance(data, dict) else {"workflow": None}), {}
        inputs: dict[str, bytes] = {}
        for name, f in request.FILES.items():
            if f.size > conf.get("MAX_UPLOAD_BYTES"):
                raise services.Invalid(name, f"{name} is over {conf.get('MAX_UPLOAD_BYTES')} bytes", 413)
            inputs[name] = f.read()
        form = lora_from_form(request.data)
        doc: dict[str, Any] = {"workflow": None}
        for name in form:
            if name in request.FILES:
                continue
            if not name.startswith("lora[") and len(request.data.getlist(name)) > 1:
                raise services.Invalid(name, f"{name} is given more than once")
            doc[name] = form[name]
            if name in ("params", "inputs"):
                try:
                    doc[name] = strict_loads(form[name] or "{}")
                except ValueError:
                    raise services.Invalid(name, f"{name} must be a JSON object") from None
        return doc, inputs


class JobDetailView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="getJob", responses={200: JobSerializer, **_errors(401, 404)})
    def get(self, request: Request, uid: str) -> Response:
        job = control.refresh(own_job(request, uid))
        return with_eta_header(Response(JobSerializer(job).data), job)

    @extend_schema(operation_id="cancelJob", request=None, responses={200: JobSerializer, 202: JobSerializer, **_errors(401, 404, 503)})
    def delete(self, request: Request, uid: str) -> Response:
        """Cancel: 202 while stages are being told, 200 once the job is finished (repeats are harmless)."""
        job = control.cancel(own_job(request, uid))
        return Response(JobSerializer(job).data, status=200 if job.terminal else 202)


class JobResultView(APIView):
    permission_classes = [IsAuthenticated]
    content_negotiation_class = BytesOrJsonNegotiation

    @extend_schema(operation_id="getJobResult", responses={(200, "image/png"): OpenApiTypes.BINARY, (200, "video/mp4"): OpenApiTypes.BINARY,
                              (206, "video/mp4"): OpenApiTypes.BINARY, 416: OpenApiTypes.NONE,
                              **_errors(401, 404, 409, 410, 503)})
    def get(self, request: Request, uid: str) -> HttpResponse | Response:
        from onepiece_platform.videos.stream import stream_query, stream_video

        stream = stream_query(request.query_params.get("stream"))
        if stream is None:
            return error(400, "stream must be true or false", field="stream")
        job = control.refresh(own_job(request, uid))
        if stream:  # the result as it is made (a video's fragmented mp4; any other result once it is there)
            from django.core.handlers.asgi import ASGIRequest

            ctype, _ext = CONTENT_TYPES.get(get_workflow(job.workflow).final_output, ("application/octet-stream", ""))
            return stream_video(job.uid or "", job.state, isinstance(request._request, ASGIRequest), ctype)
        return result_response(job, request)


LOST = "the result expired or was lost with the result store; submit the job again"


def result_response(job: Job, request: Any = None) -> Any:
    """A completed job's output. With ``request``: its ``Range`` honoured (206), and an output in the object
    store streamed from there (jobs.result_urls); without: the whole output in memory (the video variants
    render from it)."""
    from engine.store.objects import ObjectStoreError
    from onepiece_platform.engine_link.client import get_engine
    from onepiece_platform.jobs import result_urls

    if job.state != COMPLETED:
        return error(409, f"the job is {job.state}; there is no result", state=job.state)
    if job.output_gone():  # deleted, or past its retention (the clean-up may not have run yet)
        return error(410, job.output_gone())
    ctype, ext = CONTENT_TYPES.get(get_workflow(job.workflow).final_output, ("application/octet-stream", "bin"))
    name, span = f"{job.uid}.{ext}", request.META.get("HTTP_RANGE") if request is not None else None
    if request is not None:
        from django.core.handlers.asgi import ASGIRequest

        try:
            ref = result_urls.stored_ref(job)
            if ref is not None:
                asgi = isinstance(getattr(request, "_request", request), ASGIRequest)
                return result_urls.object_response(ref, span, ctype, name, asgi) or error(410, LOST)
        except ObjectStoreError:
            return error(503, "the object store is unavailable; retry shortly", retry_after=5)
    data = get_engine().result(job.uid or "")
    if data is None:
        return error(410, LOST)
    if request is not None:
        return result_urls.bytes_response(data, span, ctype, name)
    resp = HttpResponse(data, content_type=ctype)
    resp["Content-Disposition"] = f'attachment; filename="{name}"'
    return resp


class WorkflowListView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="listWorkflows", responses={200: WorkflowSerializer(many=True), **_errors(401)})
    def get(self, request: Request) -> Response:
        from onepiece_platform.engine_link.client import get_engine

        limits = limits_for(request.user.pk).__dict__
        engine = get_engine()
        # the parameters as the loaded models allow them (their defaults and bounds), where the engine says
        return Response([describe_workflow(spec.bound(engine.limits(name)), limits)
                         for name, spec in sorted(workflows().items())])
