"""One Redis client per URL for the web process (counters, the engine's job store, events)."""

from __future__ import annotations

import threading
from typing import Any

import redis
from django.conf import settings

_clients: dict[str, Any] = {}
_lock = threading.Lock()


def get_redis() -> Any:
    """A ``redis.Redis`` (bytes responses) for ``settings.REDIS_URL``; cached per URL."""
    url = settings.REDIS_URL
    with _lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        return client


def close_all() -> None:
    """Drop cached clients (tests, forked workers)."""
    with _lock:
        for c in _clients.values():
            c.close()
        _clients.clear()
