"""Request and response shapes of the OpenAI-compatible surface (/v1/videos, /v1/images/generations)."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, ClassVar

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from engine.workflow import default_workflow, get_workflow, workflows
from engine.workflow.options import PARAM_OPTIONS
from onepiece_platform.accounts.models import PRIORITIES
from onepiece_platform.adapters.fields import LoraField
from onepiece_platform.jobs.api.serializers import EtaSerializer, OutputSerializer, OutputUploadSerializer
from onepiece_platform.strict import (
    AsciiFloatField,
    AsciiIntegerField,
    RefuseUnknownFields,
    StrictCharField,
    StrictRegexField,
)

SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$", re.ASCII)  # ASCII digits only: \d alone matches "６４"
# A prompt: something besides whitespace, and no NUL (the schema says so, and DRF refuses NULs)
PROMPT = r"^[^\u0000]*\S[^\u0000]*$"
IMAGE_SIZES = ["64x64", "256x256", "512x512", "768x768", "1024x1024", "512x768", "768x512"]
# OpenAI's image parameters that change nothing here, each with what it is taken as (docs/web-platform.md):
# quality (OpenAI's values; SGLang's levels are the engine's ``quality``), style and moderation have no
# counterpart in the engine's workflows; background "auto" and "opaque"
# are what every image is; stream false is what this route does. Values that would need more are refused.
IMAGE_NO_OPS = ("quality", "style", "moderation", "background", "stream", "partial_images")
# ``model: "default"`` (vLLM-Omni's client sends it when no model is named): the route's own default workflow
DEFAULT_MODEL = "default"


def offered_sizes() -> list[str]:
    """The image sizes a user with the default quota may ask for (a size in the list is one that runs)."""
    from onepiece_platform.quotas.models import Quota

    most = Quota._meta.get_field("max_pixels").default
    return [v for v in IMAGE_SIZES if (lambda w, h: w * h)(*parse_size(v)) <= most]


def models_for(output: str) -> list[str]:
    """Workflow names whose final output is ``output`` (video, image): the models this surface offers."""
    return sorted(n for n, w in workflows().items() if w.final_output == output)


# -- bounds written once: a route's model parameters are fields generated from the workflows' ParamSpecs --
#: The workflow parameters each route takes under their own names (copied into the request's params as sent).
#: Their fields are generated: the type, and the widest bounds over the route's models; each model's own
#: limits (and the loaded model's, engine.workflow.limits) are checked where the request is resolved.
#: The request options among the params (engine.workflow.options) come with them: every one a video route takes
#: (``lora`` has a field of its own, LoraField), and on the images route all but ``quality``, whose field takes
#: OpenAI's values too (ImageGenerateSerializer.quality).
_OPTIONS = tuple(o for o in PARAM_OPTIONS if o != "lora")
VIDEO_PARAMS = ("prompt", "negative_prompt", "num_inference_steps", "seed", "guidance_scale", "guidance_scale_2",
                "fps", "num_frames", "width", "height", *_OPTIONS)
IMAGE_PARAMS = ("prompt", "negative_prompt", "num_inference_steps", "seed", "guidance_scale",
                *(o for o in _OPTIONS if o != "quality"))
#: The job's options every generation route takes (not the model's): who may use which is services' rule.
OPTION_FIELDS = ("lora", "priority", "retention", "output_upload_url", "keep_output")
#: Each route's own fields: how OpenAI's API names a model's size and length, and its no-ops (IMAGE_NO_OPS).
VIDEO_ROUTE_FIELDS = ("model", "size", "seconds", "input_reference")
IMAGE_ROUTE_FIELDS = ("model", "n", "size", "response_format", "output_format", "output_compression", "user",
                      *IMAGE_NO_OPS)


def param_bounds(output: str, name: str) -> dict[str, Any]:
    """The widest bounds of parameter ``name`` over the workflows whose final output is ``output``: its
    ``type``, ``min_value``/``max_value`` (numbers), ``max_length`` (text), ``choices`` (text every model
    limits to a list), ``help_text``. ``LookupError`` if no such workflow takes it."""
    specs = [p for w in models_for(output) for p in get_workflow(w).params if p.name == name]
    if not specs:
        raise LookupError(f"no {output} workflow takes {name!r}")
    kinds = {p.type for p in specs}
    if len(kinds) != 1:
        raise TypeError(f"{name!r} is {sorted(k.__name__ for k in kinds)} across the {output} workflows")
    kind = kinds.pop()
    out: dict[str, Any] = {"type": kind, "help_text": next((p.doc for p in specs if p.doc), "")}
    if kind is str:
        out["max_length"] = max(int(p.max_length or 0) for p in specs)
        if all(p.choices for p in specs):
            out["choices"] = list(dict.fromkeys(c for p in specs for c in p.choices))
    else:
        out["min_value"] = kind(min(p.minimum for p in specs if p.minimum is not None))
        out["max_value"] = kind(max(p.maximum for p in specs if p.maximum is not None))
    return out


def param_field(output: str, name: str, regex: str | None = None, **kwargs: Any) -> serializers.Field:
    """The serializer field of a model parameter, from :func:`param_bounds` (not sent: the model's default)."""
    b = param_bounds(output, name)
    kwargs.setdefault("required", False)
    kwargs.setdefault("help_text", b["help_text"])
    if "choices" in b:
        return serializers.ChoiceField(choices=b["choices"], **kwargs)
    if b["type"] is int:
        return AsciiIntegerField(min_value=b["min_value"], max_value=b["max_value"], **kwargs)
    if b["type"] is float:
        return AsciiFloatField(min_value=b["min_value"], max_value=b["max_value"], **kwargs)
    if regex is not None:
        return StrictRegexField(regex, max_length=b["max_length"], **kwargs)
    return StrictCharField(max_length=b["max_length"], allow_blank=True, **kwargs)


def parse_size(value: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    m = SIZE.match(value)
    if not m:
        raise serializers.ValidationError("size must look like WIDTHxHEIGHT, e.g. 832x480")
    return int(m.group(1)), int(m.group(2))


@extend_schema_field({"oneOf": [
    {"type": "string", "format": "binary"},
    {"type": "object", "properties": {"image_url": {"type": "string", "pattern": "^data:[^,]*;base64,"}},
     "required": ["image_url"], "additionalProperties": False},
]})
class InputReferenceField(serializers.Field):
    """The first frame: a file (multipart) or, in JSON, ``{"image_url": "data:image/png;base64,..."}``.

    Only ``data:`` URLs: the platform fetches nothing from the network on a client's behalf (SSRF), and keeps
    no files to name by ``file_id``. Yields the image bytes (checked as an image later, with the size limit).
    """

    default_error_messages = {
        # str.format'ed by fail(): braces doubled
        "shape": 'input_reference must be a file or {{"image_url": "data:image/...;base64,..."}}',
        "file_id": "input_reference.file_id is not served (OnePiece keeps no uploaded files); send image_url "
                   "as a data: URL or upload the file",
        "data_url": "input_reference.image_url must be a base64 data: URL (OnePiece fetches no remote URLs)",
    }

    def to_internal_value(self, data: Any) -> Any:
        if hasattr(data, "read") and hasattr(data, "size"):
            return data  # an upload: read by the view after its size check
        if not isinstance(data, dict) or not data or set(data) - {"image_url", "file_id"}:
            self.fail("shape")
        if "file_id" in data:
            self.fail("file_id")
        url = data.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:"):
            self.fail("data_url")
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            self.fail("data_url")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            self.fail("data_url")

    def to_representation(self, value: Any) -> Any:
        return None


@extend_schema_field({"type": "boolean", "enum": [False], "description": "false only: images are returned whole"})
class StreamOffField(serializers.BooleanField):
    """``stream``: false is what this route does; true is refused with the reason (no streaming here)."""

    def to_internal_value(self, data: Any) -> Any:
        if super().to_internal_value(data):
            raise serializers.ValidationError("streaming is not served on this route; send stream: false or "
                                              "leave it out")
        return False


@extend_schema_field({"type": "integer", "enum": [0], "description": "0 only (no streaming)"})
class NoPartialImagesField(AsciiIntegerField):
    def to_internal_value(self, data: Any) -> Any:
        if super().to_internal_value(data):
            raise serializers.ValidationError("partial images need streaming, which is not served; send 0 or "
                                              "leave it out")
        return 0


@extend_schema_field({"type": "string", "enum": ["auto", "opaque"],
                      "description": "auto or opaque (every image is opaque); transparent is refused"})
class OpaqueBackgroundField(serializers.ChoiceField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=["auto", "opaque", "transparent"], **kwargs)

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if value == "transparent":
            raise serializers.ValidationError("transparent is not served: images have no alpha channel; use "
                                              "auto or opaque")
        return value


class _GenerateSerializer(RefuseUnknownFields):
    # A generation request: its ``model`` field offers the workflows whose final output is ``output``.
    # (No docstring: it would become the request's description in the OpenAPI schema.)
    output: ClassVar[str]
    lora = LoraField(required=False)  # OnePiece extension (extra_body): LoRA adapters of the operators' registry
    # OnePiece extension (extra_body): low, normal or high, within the account's tier and the API key's cap
    # (403 over it); None (not sent): the highest allowed, up to normal (services.check_priority)
    priority = serializers.ChoiceField(choices=PRIORITIES, required=False, default=None)
    # OnePiece extension (extra_body): seconds the output is kept, within the API key tier's ceiling (checked
    # where the request is submitted: services.check_retention); not sent: the tier's default
    retention = AsciiIntegerField(required=False, min_value=1, max_value=10 * 365 * 86400)
    # OnePiece extension (extra_body): a presigned PUT URL of the client's bucket the output is uploaded to once
    # the job completes (the webhooks' egress policy; webhooks.uploads), our copy kept only with keep_output
    output_upload_url = serializers.CharField(required=False, max_length=8000)
    keep_output = serializers.BooleanField(required=False, default=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = [*models_for(self.output), DEFAULT_MODEL]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("model") == DEFAULT_MODEL:  # as if none was named: the field's default, or the view's
            default = self.fields["model"].default
            if default is serializers.empty:
                del attrs["model"]
            else:
                attrs["model"] = default
        return attrs


class VideoCreateSerializer(_GenerateSerializer):
    output = "video"

    prompt = param_field("video", "prompt", PROMPT, required=True)
    model = serializers.ChoiceField(choices=[], required=False,
                                    help_text=f'the workflow; default (or "default") {default_workflow("video", True)} '
                                              f'with input_reference, else {default_workflow("video")}')
    seconds = AsciiIntegerField(required=False, min_value=1, max_value=60,
                                help_text="clip length; frames = seconds x fps + 1 (default: the model's)")
    size = StrictCharField(required=False, max_length=16, help_text="WIDTHxHEIGHT (default: the model's)")
    input_reference = InputReferenceField(required=False, help_text="the first frame (image-to-video): a file, or "
                                          'in JSON {"image_url": "data:image/png;base64,..."}')
    # vLLM-Omni's and SGLang's video fields, in place of size and seconds (an OpenAI client sends them in
    # extra_body); when both forms are given they must agree
    width = param_field("video", "width", help_text="with height, instead of size")
    height = param_field("video", "height", help_text="with width, instead of size")
    num_frames = param_field("video", "num_frames", help_text="instead of seconds")
    fps = param_field("video", "fps", help_text="frames per second of the clip")
    guidance_scale = param_field("video", "guidance_scale")
    # OnePiece extensions (the openai client sends them through extra_body)
    # the low-noise expert's guidance (the Wan2.2 A14B models; a model without a second expert refuses it)
    guidance_scale_2 = param_field("video", "guidance_scale_2")
    num_inference_steps = param_field("video", "num_inference_steps")
    seed = param_field("video", "seed")
    negative_prompt = param_field("video", "negative_prompt")
    # a live preview every N denoising steps (0: off)
    preview_every = param_field("video", "preview_every")
    # SGLang's name and levels: lossless (default, bit-exact), extra-high or high (step caching); which levels a
    # model serves is checked where the request is resolved (its spec)
    quality = param_field("video", "quality")

    def validate_size(self, value: str) -> str:
        parse_size(value)
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        if ("width" in attrs) != ("height" in attrs):
            missing = "height" if "width" in attrs else "width"
            raise serializers.ValidationError({missing: ["width and height go together (or send size)"]})
        if "size" in attrs and "width" in attrs and parse_size(attrs["size"]) != (attrs["width"], attrs["height"]):
            raise serializers.ValidationError({"size": [f"size {attrs['size']} disagrees with width "
                                                        f"{attrs['width']} and height {attrs['height']}"]})
        return attrs


class VideoErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class VideoExtraSerializer(serializers.Serializer):
    eta = EtaSerializer(allow_null=True, help_text="an unfinished job's ETA as its latest read estimated it")
    output = OutputSerializer(allow_null=True, help_text="a completed video's stored output: key (null: inline "
                              "in Redis), size, sha256, content_type (docs/api.md)")
    retention_s = serializers.IntegerField(allow_null=True, help_text="seconds the video is kept after it "
                                           "finished (null: as long as its ledger row)")
    output_upload = OutputUploadSerializer(allow_null=True, help_text="the output_upload_url upload: where it "
                                           "went and how it went (null without one)")


class VideoSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="video")
    model = serializers.CharField()
    status = serializers.ChoiceField(choices=["queued", "in_progress", "completed", "failed"])
    progress = serializers.IntegerField()
    created_at = serializers.IntegerField()
    completed_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField(allow_null=True)
    prompt = serializers.CharField(allow_null=True)
    seconds = serializers.CharField()
    size = serializers.CharField()
    remixed_from_video_id = serializers.CharField(allow_null=True)
    error = VideoErrorSerializer(allow_null=True)
    extra = VideoExtraSerializer(help_text="OnePiece's own fields (the openai client passes them through)")


class VideoListSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = VideoSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class VideoDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="video.deleted")
    deleted = serializers.BooleanField()


class VideoListQuerySerializer(serializers.Serializer):
    after = serializers.CharField(required=False, max_length=64)
    limit = AsciiIntegerField(required=False, min_value=0, max_value=100, default=20)
    order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="desc")

    def to_internal_value(self, data: Any) -> Any:
        # DRF reads an empty query value of an optional field as absent (the default); a client that sent
        # ``order=`` or ``limit=`` asked for something, and is told it is not a value. ``after=`` is absent
        # (OpenAI's spec allows an empty cursor: the first page), as DRF reads it
        for name in ("limit", "order"):
            if hasattr(data, "get") and name in data and data.get(name) == "":
                raise serializers.ValidationError({name: ["must not be empty"]})
        return super().to_internal_value(data)


class ContentQuerySerializer(serializers.Serializer):
    variant = serializers.ChoiceField(choices=["video", "thumbnail", "spritesheet"], required=False, default="video",
                                      help_text="video (mp4), thumbnail (PNG of the first frame) or spritesheet "
                                      "(JPEG grid of frames)")
    stream = serializers.BooleanField(required=False, default=False,
                                      help_text="true: the video (variant video only) as it is made, a fragmented "
                                                "mp4 in chunked transfer from its first fragment on")
    response_format = serializers.ChoiceField(choices=["url"], required=False,
                                              help_text="url: JSON with a URL of the finished mp4 and its "
                                                        "expires_at instead of the bytes (variant video only)")

    def validate(self, attrs: dict) -> dict:
        if attrs.get("stream") and attrs.get("variant", "video") != "video":
            raise serializers.ValidationError({"stream": "only the video variant streams"})
        if attrs.get("response_format") and (attrs.get("stream") or attrs.get("variant", "video") != "video"):
            raise serializers.ValidationError({"response_format": "a url is of the finished video variant only"})
        return attrs


class VideoRemixSerializer(RefuseUnknownFields):
    prompt = param_field("video", "prompt", PROMPT, required=True)
    # OnePiece extension: an image-to-video source's first frame is not kept, so its remix needs it again
    input_reference = InputReferenceField(required=False, help_text="image-to-video sources only: the first frame")
    # OnePiece extensions (extra_body), as on create: the remix's own output. retention not sent: the source's,
    # where this key's tier allows it, else the tier's default (services.inherited_retention); the source's
    # output_upload_url is never reused (a presigned PUT names one object of the client's)
    retention = AsciiIntegerField(required=False, min_value=1, max_value=10 * 365 * 86400)
    output_upload_url = serializers.CharField(required=False, max_length=8000)
    keep_output = serializers.BooleanField(required=False, default=False)


class ImageGenerateSerializer(_GenerateSerializer):
    output = "image"

    prompt = param_field("image", "prompt", PROMPT, required=True)
    model = serializers.ChoiceField(choices=[], required=False, default=default_workflow("image"),
                                    help_text=f'the workflow; default (or "default") {default_workflow("image")}')
    n = AsciiIntegerField(required=False, default=1, min_value=1, max_value=4)
    size = serializers.ChoiceField(choices=IMAGE_SIZES, required=False,
                                   help_text="WIDTHxHEIGHT, or auto (default: the model's own size)")
    response_format = serializers.ChoiceField(choices=["url", "b64_json"], required=False, default="url")
    output_format = serializers.ChoiceField(choices=["png", "jpeg", "webp"], required=False, default="png")
    output_compression = AsciiIntegerField(required=False, min_value=0, max_value=100,
                                           help_text="jpeg and webp quality, 0-100 (default 100); png is lossless")
    # OpenAI's values are accepted as no-ops (IMAGE_NO_OPS); SGLang's levels (lossless, extra-high, high) ask
    # for step caching where the model serves it (engine.stages.caching; "high" is a no-op on a model without)
    quality = serializers.ChoiceField(choices=["auto", "low", "medium", "high", "standard", "hd", "lossless",
                                               "extra-high"], required=False)
    style = serializers.ChoiceField(choices=["vivid", "natural"], required=False)
    moderation = serializers.ChoiceField(choices=["auto", "low"], required=False)
    background = OpaqueBackgroundField(required=False)
    stream = StreamOffField(required=False)
    partial_images = NoPartialImagesField(required=False)
    user = StrictCharField(required=False, max_length=200)
    num_inference_steps = param_field("image", "num_inference_steps")
    guidance_scale = param_field("image", "guidance_scale")
    seed = param_field("image", "seed", help_text="the first image's; image i of n takes seed + i")
    negative_prompt = param_field("image", "negative_prompt")
    # a live preview every N denoising steps (0: off)
    preview_every = param_field("image", "preview_every")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sizes = self.fields["size"]
        sizes.choices = ["auto", *offered_sizes()]
        # DRF's message names only the value: the client is told what it may send (str.format'ed: {input})
        served = ", ".join(sizes.choices)
        sizes.error_messages["invalid_choice"] = f'"{{input}}" is not a valid choice; the sizes served: {served}'

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        top = param_bounds("image", "seed")["max_value"]
        if attrs.get("seed", 0) + attrs.get("n", 1) - 1 > top:  # image i takes seed + i
            raise serializers.ValidationError({"seed": [f"seed + n - 1 must be at most {top}: image i of n takes "
                                                        "seed + i"]})
        if attrs.get("output_upload_url") and attrs.get("n", 1) > 1:
            raise serializers.ValidationError({"output_upload_url": ["takes one image (n=1): one URL is one "
                                                                     "object"]})
        return attrs



class ImageDataSerializer(serializers.Serializer):
    b64_json = serializers.CharField(required=False)
    url = serializers.CharField(required=False, help_text="a presigned GET from the object store where clients "
                                "reach it, else the platform's own signed URL; either answers Range requests")
    expires_at = serializers.IntegerField(required=False, help_text="unix s the url stops working at")


class VideoContentUrlSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="video.content_url")
    url = serializers.CharField(help_text="the mp4: a presigned GET from the object store where clients reach it, "
                                "else the platform's own signed URL; either answers Range requests (seek)")
    expires_at = serializers.IntegerField(help_text="unix s the url stops working at")


class ImagesResponseSerializer(serializers.Serializer):
    created = serializers.IntegerField()
    data = ImageDataSerializer(many=True)
    output_format = serializers.CharField(required=False)
    size = serializers.CharField(required=False)


class OpenAIErrorBodySerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class OpenAIErrorSerializer(serializers.Serializer):
    error = OpenAIErrorBodySerializer()
