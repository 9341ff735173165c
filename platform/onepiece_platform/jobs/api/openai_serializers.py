"""Request and response shapes of the OpenAI-compatible surface (/v1/videos, /v1/images/generations)."""

from __future__ import annotations

import re
from typing import Any

from rest_framework import serializers

from engine.workflow import workflows
from onepiece_platform.strict import RefuseUnknownFields

SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# A prompt: something besides whitespace, and no NUL (the schema says so, and DRF refuses NULs)
PROMPT = r"^[^\u0000]*\S[^\u0000]*$"
IMAGE_SIZES = ["64x64", "256x256", "512x512", "768x768", "1024x1024", "512x768", "768x512"]


def models_for(output: str) -> list[str]:
    """Workflow names whose final output is ``output`` (video, image): the models this surface offers."""
    return sorted(n for n, w in workflows().items() if w.final_output == output)


def parse_size(value: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    m = SIZE.match(value)
    if not m:
        raise serializers.ValidationError("size must look like WIDTHxHEIGHT, e.g. 832x480")
    return int(m.group(1)), int(m.group(2))


class VideoCreateSerializer(RefuseUnknownFields):
    prompt = serializers.RegexField(PROMPT, max_length=4000)
    model = serializers.ChoiceField(choices=[], required=False, default="wan2.1-i2v")
    seconds = serializers.IntegerField(required=False, min_value=1, max_value=60,
                                       help_text="clip length; frames = seconds x fps + 1")
    size = serializers.CharField(required=False, max_length=16, help_text="WIDTHxHEIGHT")
    input_reference = serializers.FileField(required=False, help_text="the first frame (image-to-video)")
    # OnePiece extensions (the openai client sends them through extra_body)
    num_inference_steps = serializers.IntegerField(required=False, min_value=1, max_value=1000)
    seed = serializers.IntegerField(required=False, min_value=0, max_value=2**63 - 1)
    negative_prompt = serializers.CharField(required=False, allow_blank=True, max_length=4000)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = models_for("video")

    def validate_size(self, value: str) -> str:
        parse_size(value)
        return value


class VideoErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


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
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)
    order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="desc")


class ContentQuerySerializer(serializers.Serializer):
    variant = serializers.ChoiceField(choices=["video"], required=False, default="video")


class ImageGenerateSerializer(RefuseUnknownFields):
    prompt = serializers.RegexField(PROMPT, max_length=4000)
    model = serializers.ChoiceField(choices=[], required=False, default="sd-t2i")
    n = serializers.IntegerField(required=False, default=1, min_value=1, max_value=4)
    size = serializers.ChoiceField(choices=IMAGE_SIZES, required=False, default="512x512")
    response_format = serializers.ChoiceField(choices=["url", "b64_json"], required=False, default="url")
    user = serializers.CharField(required=False, max_length=200)
    num_inference_steps = serializers.IntegerField(required=False, min_value=1, max_value=150)
    seed = serializers.IntegerField(required=False, min_value=0, max_value=2**63 - 5)
    negative_prompt = serializers.CharField(required=False, allow_blank=True, max_length=4000)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = models_for("image")


class ImageDataSerializer(serializers.Serializer):
    b64_json = serializers.CharField(required=False)
    url = serializers.CharField(required=False)


class ImagesResponseSerializer(serializers.Serializer):
    created = serializers.IntegerField()
    data = ImageDataSerializer(many=True)


class OpenAIErrorBodySerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class OpenAIErrorSerializer(serializers.Serializer):
    error = OpenAIErrorBodySerializer()
