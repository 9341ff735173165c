"""The OpenAI-compatible surface, mounted at /v1/ (the openai client's base_url is <host>/v1)."""

from django.urls import path

from onepiece_platform.jobs.api import openai_images as images
from onepiece_platform.videos import api as videos

urlpatterns = [
    path("videos", videos.VideoListCreateView.as_view(), name="openai-videos"),
    path("videos/content/<str:token>", videos.VideoSignedContentView.as_view(), name="openai-video-signed-content"),
    path("videos/<str:video_id>", videos.VideoDetailView.as_view(), name="openai-video"),
    path("videos/<str:video_id>/content", videos.VideoContentView.as_view(), name="openai-video-content"),
    path("videos/<str:video_id>/remix", videos.VideoRemixView.as_view(), name="openai-video-remix"),
    path("images/generations", images.ImageGenerationView.as_view(), name="openai-images"),
    path("images/content/<str:token>", images.ImageContentView.as_view(), name="openai-image-content"),
]
