"""OpenAI's videos API (``/v1/videos``), so the official ``openai`` client works by base_url.

  POST   /v1/videos                  create (prompt, model, input_reference file or data: URL, seconds, size);
                                     multipart or JSON
  GET    /v1/videos                  list (after, limit, order)
  GET    /v1/videos/{id}             retrieve
  GET    /v1/videos/{id}/content     the mp4; ?variant=thumbnail (PNG) or spritesheet (JPEG)
  POST   /v1/videos/{id}/remix       the source's parameters with a new prompt
  DELETE /v1/videos/{id}             cancel if unfinished, then hide

Jobs go through the same services as the native API (validation, limits, quota, ledger, engine); errors
are OpenAI's shape (``onepiece_platform.jobs.api.openai_base``). OpenAI's statuses have no
cancelled/expired: those show as ``failed`` with ``error.code`` saying which.
"""

from __future__ import annotations

import logging
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from engine import envs
from engine.workflow import default_workflow, get_workflow, workflows
from onepiece_platform import conf
from onepiece_platform.adapters.fields import lora_from_form
from onepiece_platform.api_errors import ApiError
from onepiece_platform.jobs import control, services
from onepiece_platform.jobs.api import openai_serializers as s
from onepiece_platform.jobs.api.openai_base import ERRORS, OpenAIView, error_responses, output_options
from onepiece_platform.jobs.api.serializers import output_upload_of
from onepiece_platform.jobs.api.views import api_key_of, check_body_size, result_response, with_eta_header
from onepiece_platform.jobs.models import CANCELLED, COMPLETED, EXPIRED, FAILED, IN_PROGRESS, Job
from onepiece_platform.jobs.result_urls import URL_MAX_AGE_S as URL_MAX_AGE_S
from onepiece_platform.jobs.result_urls import URL_SALT as URL_SALT
from onepiece_platform.jobs.result_urls import issue_url, unsign_result_url
from onepiece_platform.jobs.result_urls import sign_result_url as sign_result_url
from onepiece_platform.negotiation import BytesOrJsonNegotiation
from onepiece_platform.strict import StrictFormParser as FormParser
from onepiece_platform.strict import StrictJSONParser as JSONParser
from onepiece_platform.strict import StrictMultiPartParser as MultiPartParser

log = logging.getLogger(__name__)

def _video_workflows() -> list[str]:
    return sorted(n for n, w in workflows().items() if w.final_output == "video")


# the model a request without one gets: the spec declared the default video workflow with an image when it
# brings a first frame, else the one without (engine.workflow.registry.default_workflow)
DEFAULT_VIDEO_MODEL = {image: default_workflow("video", image) for image in (True, False)}


# bounds of the poll interval the openai client is told to use (it keeps the first one it is given)
POLL_AFTER_MS = (250, 10_000)


def poll_after_ms(job: Job) -> int:
    """When an unfinished video is worth asking about again: a quarter of its estimated remaining time.

    The estimate is the elapsed time scaled by the progress once denoising reports some, else the job's
    cost estimate (GPU-seconds on the reference device) less its progress.
    """
    from django.utils import timezone

    remaining = job.cost_estimate_gpu_s * (100 - job.progress) / 100
    if job.state == IN_PROGRESS and job.started_at is not None and job.progress > 0:
        elapsed = (timezone.now() - job.started_at).total_seconds()
        remaining = elapsed * (100 - job.progress) / job.progress
    low, high = POLL_AFTER_MS
    return int(min(high, max(low, remaining * 1000 / 4)))


def content_expires_at(job: Job) -> int | None:
    """When a completed video's content stops being served (Unix s): its retention's end, and for an output
    kept inline in Redis (or with no object store) no later than the result store's TTL
    (ONEPIECE_RESULT_TTL_S); /content is 410 after it. None: unfinished, or kept as long as its ledger row."""
    import datetime as dt

    from onepiece_platform.engine_link.objects import get_object_store

    if job.finished_at is None or job.state != COMPLETED:
        return None
    ends = [job.retain_until] if job.retain_until is not None else []
    if not job.output_key and (job.output_sha256 or get_object_store() is None):
        ends.append(job.finished_at + dt.timedelta(seconds=envs.RESULT_TTL_S))
    return int(min(ends).timestamp()) if ends else None


def video_object(job: Job, remixed_from: str | None = None) -> dict[str, Any]:
    p = job.params  # the model's (prompt, size, frames)
    error = None
    status = job.state
    if job.state in (FAILED, CANCELLED, EXPIRED):
        # an exception inside a stage has its own stable code (engine.worker.taskworker.STAGE_FAILED)
        code = "stage_failed" if (job.detail or "").startswith("stage_failed:") else job.state
        status, error = "failed", {"code": code, "message": job.detail or job.state}
    return {
        "id": job.uid, "object": "video", "model": job.workflow, "status": status, "progress": job.progress,
        "created_at": int(job.created_at.timestamp()),
        "completed_at": int(job.finished_at.timestamp()) if job.finished_at and job.state == COMPLETED else None,
        "expires_at": content_expires_at(job),
        "prompt": p.get("prompt"),
        "seconds": str(round(get_workflow(job.workflow).clip_seconds(p))),
        "size": f"{p.get('width')}x{p.get('height')}", "remixed_from_video_id": remixed_from, "error": error,
        # OnePiece's own fields (the openai client keeps unknown ones: video.extra): an unfinished job's ETA, a
        # completed one's output (key, size, sha256: docs/api.md)
        "extra": {"eta": getattr(job, "eta", None), "output": job.output,
                  "retention_s": None if job.retention is None else int(job.retention.total_seconds()),
                  "output_upload": output_upload_of(job)},
    }


def _own_video(request: Request, video_id: str) -> Job:
    job = Job.objects.filter(uid=video_id, owner=request.user, hidden=False, workflow__in=_video_workflows()).first()
    if job is None:  # never get_object_or_404: its message names the model class
        raise NotFound(f"no video {video_id!r}")
    return job


def _remixed_from(jobs: list[Job]) -> dict[int, str]:
    """job pk -> the video it remixes, for those that are remixes (one query)."""
    from onepiece_platform.videos.models import Remix

    return dict(Remix.objects.filter(job__in=jobs).values_list("job_id", "source_uid"))


def _video(job: Job) -> dict[str, Any]:
    return video_object(job, _remixed_from([job]).get(job.pk))


def _image_input(model: str, ref: Any) -> dict[str, bytes]:
    """The request inputs of a video of ``model`` from ``input_reference`` (an upload, bytes, or None)."""
    if ref is None:  # wan2.2-ti2v-5b's image is optional: without one it is text to video
        if get_workflow(model).required_inputs():
            raise services.Invalid("input_reference", f"{model} is image-to-video: input_reference is required")
        return {}
    if not get_workflow(model).request_inputs:
        raise services.Invalid("input_reference", f"{model} is text-to-video: it takes no input_reference")
    size = len(ref) if isinstance(ref, bytes) else ref.size
    if size > conf.get("MAX_UPLOAD_BYTES"):
        raise services.Invalid("input_reference", "input_reference is too large", 413)
    return {"image": ref if isinstance(ref, bytes) else ref.read()}


def _video_params(spec: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The workflow parameters of a validated create request, in either dialect: OpenAI's ``size`` and
    ``seconds``, or vLLM-Omni's and SGLang's ``width``/``height``, ``num_frames`` and ``fps``. What is
    not sent is the loaded model's default (filled where the request is resolved)."""
    params: dict[str, Any] = {name: d[name] for name in (*s.VIDEO_PARAMS, "lora") if name in d}
    if "size" in d:
        params["width"], params["height"] = s.parse_size(d["size"])
    if "seconds" in d:
        frames = spec.frames_for(d["seconds"], d.get("fps"))
        if "num_frames" in d and d["num_frames"] != frames:
            raise services.Invalid("num_frames", f"num_frames {d['num_frames']} disagrees with seconds "
                                   f"{d['seconds']} ({frames} frames at {d.get('fps') or 'the default'} fps)")
        params["num_frames"] = frames
    return params


# the workflow's parameter -> the field a client of this route sent it as, when that is not its own name
_SENT_AS = {"width": "size", "height": "size", "num_frames": "seconds"}


def _submit_video(request: Request, model: str, params: dict[str, Any], inputs: dict[str, bytes],
                  scope: str = services.SCOPE_VIDEOS, priority: str | None = None,
                  deadline_s: float | None = None, output: services.OutputOptions | None = None) -> Job:
    """Submit as the native API does; a size or length the workflow refuses is reported on the field the
    client sent (``size`` / ``seconds``, or ``width`` / ``num_frames`` when it sent those). The Idempotency-Key is taken whole (over the limit:
    400) and belongs to ``scope``, the route and operation (a remix: of that one source)."""
    key = services.idempotency_key(request.headers)
    try:
        return services.submit(request.user, model, params, inputs, key, "openai",
                               api_key=api_key_of(request), scope=scope, priority=priority,
                               deadline_s=deadline_s, output=output).job
    except services.Invalid as exc:
        sent = _SENT_AS.get(exc.field)
        if sent is not None and sent in request.data and exc.field not in request.data:
            raise services.Invalid(sent, f"{sent}: {exc.message}", exc.status) from None
        raise


class VideoListCreateView(OpenAIView):
    parser_classes = [MultiPartParser, FormParser, JSONParser]

    @extend_schema(operation_id="createVideo", request={"multipart/form-data": s.VideoCreateSerializer,
                            "application/json": s.VideoCreateSerializer},
                   responses={200: s.VideoSerializer, **error_responses(400, 401, 403, 409, 413, 429, 503)})
    def post(self, request: Request) -> Response:
        check_body_size(request)
        v = s.VideoCreateSerializer(data=lora_from_form(request.data))
        v.is_valid(raise_exception=True)
        d = v.validated_data
        ref = d.get("input_reference")
        model = d.get("model") or DEFAULT_VIDEO_MODEL[ref is not None]
        if model not in _video_workflows():
            raise services.Invalid("model", f"unknown video model {model!r}; known: {', '.join(_video_workflows())}")
        params = _video_params(get_workflow(model), d)
        return Response(_video(_submit_video(request, model, params, _image_input(model, ref),
                                             priority=d["priority"], output=output_options(d))))

    @extend_schema(operation_id="listVideos", parameters=[s.VideoListQuerySerializer], responses={200: s.VideoListSerializer, **error_responses(400, 401)})
    def get(self, request: Request) -> Response:
        q = s.VideoListQuerySerializer(data=request.query_params)
        q.is_valid(raise_exception=True)
        order = q.validated_data["order"]
        qs = Job.objects.filter(owner=request.user, hidden=False, uid__isnull=False,
                                workflow__in=_video_workflows()).order_by(
            "created_at" if order == "asc" else "-created_at", "id" if order == "asc" else "-id")
        after = q.validated_data.get("after")
        if after:
            pivot = Job.objects.filter(owner=request.user, uid=after).first()
            if pivot is not None:
                if order == "asc":
                    qs = qs.filter(created_at__gte=pivot.created_at).exclude(pk__lte=pivot.pk)
                else:
                    qs = qs.filter(created_at__lte=pivot.created_at).exclude(pk__gte=pivot.pk)
        limit = q.validated_data["limit"]
        rows = list(qs[: limit + 1])
        remixes = _remixed_from(rows[:limit])
        data = [video_object(j, remixes.get(j.pk)) for j in rows[:limit]]
        return Response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})


class VideoDetailView(OpenAIView):
    @extend_schema(operation_id="retrieveVideo", responses={200: s.VideoSerializer, **error_responses(401, 404)})
    def get(self, request: Request, video_id: str) -> Response:
        job = control.refresh(_own_video(request, video_id))
        response = with_eta_header(Response(_video(job)), job)
        if not job.terminal:  # the openai client's poll() sleeps this long between retrievals
            response["openai-poll-after-ms"] = str(poll_after_ms(job))
        return response

    @extend_schema(operation_id="deleteVideo", responses={200: s.VideoDeletedSerializer, **error_responses(401, 404, 503)})
    def delete(self, request: Request, video_id: str) -> Response:
        job = control.cancel(_own_video(request, video_id))
        Job.objects.filter(pk=job.pk).update(hidden=True)
        control.drop_result(job)
        return Response({"id": job.uid, "object": "video.deleted", "deleted": True})


class VideoContentView(OpenAIView):
    content_negotiation_class = BytesOrJsonNegotiation
    @extend_schema(operation_id="downloadVideoContent", parameters=[s.ContentQuerySerializer],
                   responses={(200, "video/mp4"): OpenApiTypes.BINARY, (200, "image/png"): OpenApiTypes.BINARY,
                              (200, "application/json"): s.VideoContentUrlSerializer,
                              (206, "video/mp4"): OpenApiTypes.BINARY,
                              (200, "image/jpeg"): OpenApiTypes.BINARY, **error_responses(400, 401, 404, 409, 410, 503)})
    def get(self, request: Request, video_id: str) -> Any:
        from django.http import HttpResponse

        from onepiece_platform.videos.assets import VARIANTS

        q = s.ContentQuerySerializer(data=request.query_params)
        q.is_valid(raise_exception=True)
        job = control.refresh(_own_video(request, video_id))
        if q.validated_data["stream"]:  # the fragmented mp4 as it is written (onepiece_platform.videos.stream)
            from django.core.handlers.asgi import ASGIRequest

            from onepiece_platform.videos.stream import stream_video

            return stream_video(job.uid or "", job.state, isinstance(request._request, ASGIRequest))
        variant = q.validated_data["variant"]
        if q.validated_data.get("response_format") == "url":  # a URL with expires_at (jobs.result_urls)
            if job.state != COMPLETED:
                raise ApiError(409, f"the video is {job.state}; there is no content")
            return Response({"id": job.uid, "object": "video.content_url", **issue_url(job, request, "video")})
        if variant == "video":
            return result_response(job, request)  # Range honoured: a player seeks
        response = result_response(job)
        if response.status_code != 200:
            return response
        render, ctype, ext = VARIANTS[variant]
        still = HttpResponse(render(response.content), content_type=ctype)
        still["Content-Disposition"] = f'attachment; filename="{job.uid}-{variant}.{ext}"'
        return still


class VideoSignedContentView(OpenAIView):
    """The mp4 behind a signed url (``/v1/videos/{id}/content?response_format=url`` where clients do not reach
    the object store); no API key: the signature is the grant. A bad or expired signature is 404."""

    content_negotiation_class = BytesOrJsonNegotiation
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(operation_id="getSignedVideoContent", auth=[],
                   responses={(200, "video/mp4"): OpenApiTypes.BINARY, (206, "video/mp4"): OpenApiTypes.BINARY,
                              404: ERRORS[404], 410: ERRORS[410], 416: OpenApiTypes.NONE},
                   parameters=[OpenApiParameter("token", str, OpenApiParameter.PATH)])
    def get(self, request: Request, token: str) -> Any:
        uid = unsign_result_url(token, "video")
        job = None if uid is None else Job.objects.filter(
            uid=uid, state=COMPLETED, hidden=False, workflow__in=_video_workflows()).first()
        if job is None:
            raise NotFound("no such video")
        return result_response(job, request)


class VideoRemixView(OpenAIView):
    parser_classes = [JSONParser, MultiPartParser, FormParser]

    @extend_schema(operation_id="remixVideo", request=s.VideoRemixSerializer,
                   responses={200: s.VideoSerializer, **error_responses(400, 401, 403, 404, 409, 413, 429, 503)})
    def post(self, request: Request, video_id: str) -> Response:
        """A new video with the source's parameters (size, frames, steps, seed, lora, ...) and options
        (priority, capped by what this key may use now; deadline_s; retention, within this key's tier), and
        a new prompt. Its output is its own: its objects go with it (deleted or expired), never with the
        source's."""
        from django.db import transaction

        from onepiece_platform.videos.models import Remix

        check_body_size(request)
        source = _own_video(request, video_id)
        v = s.VideoRemixSerializer(data=request.data)
        v.is_valid(raise_exception=True)
        d = v.validated_data
        # the source's model parameters and the options the API takes among them (quality, previews, lora)
        params = {**source.params, **source.request_options().params(), "prompt": d["prompt"]}
        key = api_key_of(request)
        retention = d["retention"] if "retention" in d else services.inherited_retention(
            request.user, key, source.retention)
        job = _submit_video(request, source.workflow, params,
                            _image_input(source.workflow, d.get("input_reference")),
                            services.remix_scope(source.uid), deadline_s=source.deadline_s,
                            priority=services.inherited_priority(request.user, key, source.priority),
                            output=services.OutputOptions(retention, d.get("output_upload_url", ""),
                                                          d["keep_output"]))
        with transaction.atomic():
            Remix.objects.get_or_create(job=job, defaults={"source_uid": source.uid})
        return Response(_video(job))
