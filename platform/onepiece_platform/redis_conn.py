"""One Redis client per URL for the web process (counters, the engine's job store, events)."""

from __future__ import annotations

from typing import Any

import redis
from django.conf import settings

from onepiece_platform.keyed import Keyed

_clients: Keyed[Any] = Keyed(lambda url: redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2),
                             lambda client: client.close())


def get_redis() -> Any:
    """A ``redis.Redis`` (bytes responses) for ``settings.REDIS_URL``; cached per URL."""
    return _clients.get(settings.REDIS_URL)


def close_all() -> None:
    """Drop cached clients (tests, forked workers)."""
    _clients.clear()
