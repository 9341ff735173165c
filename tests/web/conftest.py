"""Web fixtures: the platform against the real redis-server (its own database number), users, keys.

The engine is the in-process LocalEngineClient over the real job store unless
a test says otherwise; tests play the workers through :class:`JobStore`.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.test import APIClient

WEB_DB = 5  # engine tests flush db 0; the web tests keep to their own


@pytest.fixture
def web_redis(redis_server: Any, settings: Any) -> Iterator[str]:
    from channels.layers import channel_layers

    from onepiece_platform import redis_conn
    from onepiece_platform.engine_link.client import reset_engines

    url = redis_server.url.rsplit("/", 1)[0] + f"/{WEB_DB}"
    settings.REDIS_URL = url
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [url]}}}
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.local.LocalEngineClient",
                         "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}
    channel_layers.backends.clear()
    redis_conn.close_all()
    reset_engines()
    redis_conn.get_redis().flushdb()
    yield url
    redis_conn.close_all()
    reset_engines()
    channel_layers.backends.clear()


@pytest.fixture
def store(web_redis: str) -> Any:
    from engine.store import JobStore
    from onepiece_platform.redis_conn import get_redis

    return JobStore(get_redis())


def make_user(name: str, **extra: Any) -> tuple[Any, str]:
    from django.contrib.auth import get_user_model

    from onepiece_platform.accounts.models import ApiKey

    user = get_user_model().objects.create_user(name, password="pw-" + name, **extra)
    _, raw = ApiKey.issue(user, "test")
    return user, raw


def client_for(key: str) -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return c


@pytest.fixture
def alice(db: None, web_redis: str) -> tuple[Any, APIClient, str]:
    user, key = make_user("alice")
    return user, client_for(key), key


@pytest.fixture
def bob(db: None, web_redis: str) -> tuple[Any, APIClient, str]:
    user, key = make_user("bob")
    return user, client_for(key), key


def png(w: int = 64, h: int = 64) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def sd_body(**params: Any) -> dict[str, Any]:
    return {"workflow": "sd-t2i", "params": {"prompt": "a cat", "height": 64, "width": 64,
                                             "num_inference_steps": 2, **params}}


def wan_body(**params: Any) -> dict[str, Any]:
    return {"workflow": "wan2.1-i2v",
            "params": {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2,
                       **params},
            "inputs": {"image": base64.b64encode(png()).decode()}}
