"""Dashboard fixtures: the Celery app's client on the test Redis (broker and results), no worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def celery_broker(web_redis: str) -> Iterator[Any]:
    """What the dashboard queues can be read back from the broker; results can be stored as a worker would.
    The app caches its backend and connection pool from settings on first use: those are swapped too."""
    from onepiece_platform.celery_app import app

    def use(broker: str, results: str, backend_cache: Any, local_backend: Any) -> None:
        from kombu import pools

        app.pool.force_close_all()
        app._pool = None
        # kombu keeps producer pools per connection URL for the whole process: a later test on the same
        # URL would get the pool closed above
        pools.reset()
        app.amqp._producer_pool = None
        app.conf.update(broker_url=broker, result_backend=results)
        app._backend_cache = backend_cache
        app._local.backend = local_backend

    saved = (app.conf.broker_url, app.conf.result_backend, app._backend_cache, getattr(app._local, "backend", None))
    use(web_redis, web_redis, None, None)
    try:
        yield app
    finally:
        use(*saved)
