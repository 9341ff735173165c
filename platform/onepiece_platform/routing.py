"""Websocket routes (served by asgi.py through AllowedHostsOriginValidator and session auth)."""

from django.urls import path

from onepiece_platform.dashboard.consumers import ClusterConsumer
from onepiece_platform.jobs.consumers import JobConsumer

websocket_urlpatterns = [
    path("ws/jobs/<str:uid>", JobConsumer.as_asgi()),
    path("ws/cluster", ClusterConsumer.as_asgi()),
]
