"""The engine's job store as the web process reads it: Redis, and the object store outputs may be in.

The platform reads the job store itself in a few places (a video's fragments while it streams, the
in-process engine client); with an object store (``ONEPIECE['OBJECT_STORE']``) a completed job's result is
there, and Redis holds only its reference. One client per store URL, made on first use.
"""

from __future__ import annotations

from typing import Any

from onepiece_platform import conf
from onepiece_platform.keyed import Keyed


def _make(url: Any) -> Any:
    from engine.store.objects import from_config

    return from_config(str(url))


_stores: Keyed[Any] = Keyed(_make, lambda store: store.close() if store is not None else None)


def get_object_store() -> Any:
    """The configured :class:`engine.store.objects.ObjectStore`, or None (results in Redis)."""
    return _stores.get(conf.get("OBJECT_STORE") or "")


def job_store() -> Any:
    """An :class:`engine.store.JobStore` on the web process's Redis client and the configured object store."""
    from engine.store import JobStore
    from onepiece_platform.redis_conn import get_redis

    return JobStore(get_redis(), objects=get_object_store())
