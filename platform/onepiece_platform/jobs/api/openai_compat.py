"""OpenAI-compatible endpoints beside the native API, so the official ``openai`` client works by base_url.

  POST   /v1/videos                  create (prompt, model, input_reference file or data: URL, seconds, size);
                                     multipart or JSON
  GET    /v1/videos                  list (after, limit, order)
  GET    /v1/videos/{id}             retrieve
  GET    /v1/videos/{id}/content     the mp4; ?variant=thumbnail (PNG) or spritesheet (JPEG)
  POST   /v1/videos/{id}/remix       the source's parameters with a new prompt
  DELETE /v1/videos/{id}             cancel if unfinished, then hide
  POST   /v1/images/generations      synchronous: waits for the image(s); b64_json or a signed url
  GET    /v1/images/content/{token}  the png behind a signed url (no API key: the signature is the grant)

Jobs go through the same services as the native API (validation, limits,
quota, ledger, engine). Errors use OpenAI's shape ``{"error": {message,
type, param, code}}`` with the same status codes and Retry-After as the
native API. OpenAI's statuses have no cancelled/expired: those show as
``failed`` with ``error.code`` saying which.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine import envs
from engine.workflow import get_workflow, workflows
from onepiece_platform import conf
from onepiece_platform.adapters.fields import lora_from_form
from onepiece_platform.api_errors import ApiError
from onepiece_platform.engine_link.client import EngineError, get_engine
from onepiece_platform.jobs import control, services
from onepiece_platform.jobs.api import openai_serializers as s
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

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 410: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 502: "server_error", 503: "server_error",
          504: "server_error"}
IMAGE_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(png: bytes, fmt: str, quality: int = 100) -> bytes:
    """The engine's png in ``fmt`` (png: unchanged; jpeg and webp at ``quality``, 0-100)."""
    if fmt == "png":
        return png
    import io

    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(png)) as im:
        im.convert("RGB").save(out, format=fmt.upper(), quality=int(quality))
    return out.getvalue()


def _openai_error(data: Any, status: int) -> dict[str, Any]:
    message, param = "error", None
    if isinstance(data, dict):
        if "detail" in data:
            message, param = str(data["detail"]), data.get("field")
        elif data:
            param = next(iter(data))
            v = data[param]
            message = f"{param}: {v[0] if isinstance(v, list) and v else v}"
    elif isinstance(data, list) and data:
        message = str(data[0])
    code = data.get("reason") if isinstance(data, dict) else None
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


ERRORS = {c: OpenApiResponse(s.OpenAIErrorSerializer) for c in (400, 401, 404, 409, 410, 413, 429, 502, 503, 504)}


def _errors(*codes: int) -> dict[int, OpenApiResponse]:
    """Errors in OpenAI's shape; 401 and 429 (failed-authentication limit) on every operation."""
    return {c: ERRORS[c] for c in sorted(set(codes) | {401, 429})}


class OpenAIView(APIView):
    """Errors in OpenAI's shape; everything else as the native API."""

    permission_classes = [IsAuthenticated]

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        response.data = _openai_error(response.data, response.status_code)
        return response

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(response, Response) and response.status_code >= 400 and "error" not in (response.data or {}):
            response.data = _openai_error(response.data, response.status_code)
        return super().finalize_response(request, response, *args, **kwargs)


def _video_workflows() -> list[str]:
    return sorted(n for n, w in workflows().items() if w.final_output == "video")


# the model a request without one gets: image-to-video when it brings a first frame, else text-to-video
DEFAULT_VIDEO_MODEL = {True: "wan2.1-i2v", False: "wan2.1-t2v"}
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
    p = job.params
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


def _levels(workflow: str) -> tuple[str, ...]:
    """The quality levels ``workflow`` serves (its spec's ``quality`` choices; none: the parameter is not its)."""
    spec = get_workflow(workflow)
    return next((p.choices for p in spec.params if p.name == "quality"), ())


def output_options(d: dict[str, Any]) -> services.OutputOptions:
    """The output's options of a validated create request (OnePiece extensions, sent in extra_body)."""
    return services.OutputOptions(d.get("retention"), d.get("output_upload_url", ""), d["keep_output"])


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
                   responses={200: s.VideoSerializer, **_errors(400, 401, 409, 413, 429, 503)})
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

    @extend_schema(operation_id="listVideos", parameters=[s.VideoListQuerySerializer], responses={200: s.VideoListSerializer, **_errors(400, 401)})
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
    @extend_schema(operation_id="retrieveVideo", responses={200: s.VideoSerializer, **_errors(401, 404)})
    def get(self, request: Request, video_id: str) -> Response:
        job = control.refresh(_own_video(request, video_id))
        response = with_eta_header(Response(_video(job)), job)
        if not job.terminal:  # the openai client's poll() sleeps this long between retrievals
            response["openai-poll-after-ms"] = str(poll_after_ms(job))
        return response

    @extend_schema(operation_id="deleteVideo", responses={200: s.VideoDeletedSerializer, **_errors(401, 404, 503)})
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
                              (200, "image/jpeg"): OpenApiTypes.BINARY, **_errors(400, 401, 404, 409, 410, 503)})
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
                   responses={200: s.VideoSerializer, **_errors(400, 401, 404, 409, 413, 429, 503)})
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
        params = {**source.params, "prompt": d["prompt"]}
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


def _wait(jobs: list[Job], timeout: float) -> list[Job]:
    """Each job once it has finished or ``timeout`` (for them all) has passed: one engine long poll per job
    (EngineClient.wait), then the row brought up to date through the ledger."""
    deadline = time.monotonic() + timeout
    out = []
    for j in jobs:
        if not j.terminal and j.uid:
            try:
                get_engine().wait(j.uid, max(0.0, deadline - time.monotonic()))
            except EngineError:
                log.warning("engine unreachable while waiting for %s", j.uid)
        out.append(control.refresh(j))
    return out


class ImageGenerationView(OpenAIView):
    parser_classes = [JSONParser]

    @extend_schema(operation_id="createImage", request=s.ImageGenerateSerializer,
                   responses={200: s.ImagesResponseSerializer, **_errors(400, 401, 409, 413, 429, 502, 503, 504)})
    def post(self, request: Request) -> Response:
        check_body_size(request)
        v = s.ImageGenerateSerializer(data=request.data)
        v.is_valid(raise_exception=True)
        d = v.validated_data
        model = d["model"]
        image_models = sorted(n for n, w in workflows().items() if w.final_output == "image")
        if model not in image_models:
            raise services.Invalid("model", f"unknown image model {model!r}; known: {', '.join(image_models)}")
        params = {name: d[name] for name in (*s.IMAGE_PARAMS, "lora") if name in d and name != "seed"}
        if d.get("size", "auto") != "auto":  # else the loaded model's own size (SD 1.5: 512x512)
            params["width"], params["height"] = s.parse_size(d["size"])
        # SGLang's quality levels are the engine's; OpenAI's values change nothing. "high" is both: the level
        # where the model serves it, else OpenAI's no-op as before (an OpenAI client's request stays valid)
        level = d.get("quality")
        if level in ("lossless", "extra-high") or (level == "high" and "high" in _levels(model)):
            params["quality"] = level
        seed = d.get("seed", 0)
        jobs: list[Job] = []
        try:
            for i in range(d["n"]):
                # the engine refuses at once (503) what it could not finish within the wait, instead of
                # accepting work this call would cancel at the end of it
                jobs.append(services.submit(request.user, model, {**params, "seed": seed + i}, {}, "", "openai",
                                            deadline_s=float(conf.get("IMAGE_WAIT_S")),
                                            api_key=api_key_of(request), priority=d["priority"],
                                            output=output_options(d)).job)
        except Exception:
            # all n or none: a request refused part-way (quota, engine busy) must not leave its first
            # images running, charged, for a caller who was told it failed
            for j in jobs:
                try:
                    control.cancel(j)
                except Exception:  # the refusal is the answer; a cancel that fails is retried by nobody
                    pass
            raise
        jobs = _wait(jobs, float(conf.get("IMAGE_WAIT_S")))
        unfinished = [j for j in jobs if not j.terminal]
        if unfinished:
            for j in unfinished:
                control.cancel(j)
            raise ApiError(504, f"the image was not ready within {conf.get('IMAGE_WAIT_S')}s; cancelled")
        bad = [j for j in jobs if j.state != COMPLETED]
        if bad:
            raise ApiError(502, f"generation {bad[0].state}: {bad[0].detail or bad[0].state}")
        fmt, quality = d["output_format"], d.get("output_compression", 100)
        data = []
        for j in jobs:
            if d["response_format"] == "b64_json":
                data.append({"b64_json": base64.b64encode(encode_image(_result(j), fmt, quality)).decode()})
            else:  # a presigned GET from the store where clients reach it, else the platform's signed URL
                data.append(issue_url(j, request, "image", fmt, quality))
        first = jobs[0].params
        return Response({"created": int(time.time()), "data": data, "output_format": fmt,
                         "size": f"{first.get('width')}x{first.get('height')}"})


def _result(job: Job) -> bytes:
    data = get_engine().result(job.uid or "")
    if data is None:
        raise ApiError(502, "the result was lost before it could be returned")
    return data


class ImageContentView(OpenAIView):
    """The png behind a signed url; a bad or expired signature is 404 (nothing to learn from it)."""

    content_negotiation_class = BytesOrJsonNegotiation
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(operation_id="getImageContent", auth=[], responses={(200, "image/png"): OpenApiTypes.BINARY,
                                                                 (206, "image/png"): OpenApiTypes.BINARY,
                                                                 404: ERRORS[404], 410: ERRORS[410],
                                                                 416: OpenApiTypes.NONE},
                   parameters=[OpenApiParameter("token", str, OpenApiParameter.PATH)])
    def get(self, request: Request, token: str) -> Any:
        grant = unsign_result_url(token, "image")
        if grant is None:
            raise NotFound("no such image")
        uid, _, rest = grant.partition(".")
        fmt, _, quality = rest.partition(".")
        images = [n for n, w in workflows().items() if w.final_output == "image"]
        job = Job.objects.filter(uid=uid, state=COMPLETED, hidden=False, workflow__in=images).first()
        if job is None:
            raise NotFound("no such image")
        if fmt not in IMAGE_TYPES or fmt == "png":
            return result_response(job, request)  # streamed from the store where it is there; Range honoured
        response = result_response(job)
        if response.status_code != 200:
            return response
        from onepiece_platform.jobs.result_urls import bytes_response

        return bytes_response(encode_image(response.content, fmt, int(quality or 100)),
                              request.META.get("HTTP_RANGE"), IMAGE_TYPES[fmt])
