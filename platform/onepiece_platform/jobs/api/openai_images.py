"""OpenAI's images API (``/v1/images``), so the official ``openai`` client works by base_url.

  POST   /v1/images/generations      synchronous: waits for the image(s); b64_json or a signed url
  GET    /v1/images/content/{token}  the png behind a signed url (no API key: the signature is the grant)

Jobs go through the same services as the native API (validation, limits, quota, ledger, engine); errors
are OpenAI's shape (``onepiece_platform.jobs.api.openai_base``).
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from engine.workflow import get_workflow, workflows
from onepiece_platform import conf
from onepiece_platform.api_errors import ApiError
from onepiece_platform.engine_link.client import EngineError, get_engine
from onepiece_platform.jobs import control, services
from onepiece_platform.jobs.api import openai_serializers as s
from onepiece_platform.jobs.api.openai_base import ERRORS, OpenAIView, error_responses, output_options
from onepiece_platform.jobs.api.views import api_key_of, check_body_size, result_response
from onepiece_platform.jobs.models import COMPLETED, Job
from onepiece_platform.jobs.result_urls import URL_MAX_AGE_S as URL_MAX_AGE_S
from onepiece_platform.jobs.result_urls import URL_SALT as URL_SALT
from onepiece_platform.jobs.result_urls import issue_url, unsign_result_url
from onepiece_platform.jobs.result_urls import sign_result_url as sign_result_url
from onepiece_platform.negotiation import BytesOrJsonNegotiation
from onepiece_platform.strict import StrictJSONParser as JSONParser

log = logging.getLogger(__name__)

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


def served_levels(workflow: str) -> tuple[str, ...]:
    """The quality levels ``workflow`` serves (its spec's ``quality`` choices; none: the parameter is not its)."""
    spec = get_workflow(workflow)
    return next((p.choices for p in spec.params if p.name == "quality"), ())


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
                   responses={200: s.ImagesResponseSerializer, **error_responses(400, 401, 403, 409, 413, 429, 502, 503, 504)})
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
        if level in ("lossless", "extra-high") or (level == "high" and "high" in served_levels(model)):
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
