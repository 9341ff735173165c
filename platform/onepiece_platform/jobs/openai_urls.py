"""The OpenAI-compatible surface, mounted at /v1/ (the openai client's base_url is <host>/v1)."""

from django.urls import path

from onepiece_platform.jobs.api import openai_compat as v

urlpatterns = [
    path("videos", v.VideoListCreateView.as_view(), name="openai-videos"),
    path("videos/content/<str:token>", v.VideoSignedContentView.as_view(), name="openai-video-signed-content"),
    path("videos/<str:video_id>", v.VideoDetailView.as_view(), name="openai-video"),
    path("videos/<str:video_id>/content", v.VideoContentView.as_view(), name="openai-video-content"),
    path("videos/<str:video_id>/remix", v.VideoRemixView.as_view(), name="openai-video-remix"),
    path("images/generations", v.ImageGenerationView.as_view(), name="openai-images"),
    path("images/content/<str:token>", v.ImageContentView.as_view(), name="openai-image-content"),
]
