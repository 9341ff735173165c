"""The platform pointed at an etcd root of its own for one test (its cluster view and scaling actions read
and write there); the root is deleted and the platform's cached cluster clients dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def cluster_root(etcd_url: str, settings: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(the root ``/<name>-<random>``, an etcd client) with Django's ``settings`` (pytest-django's fixture)
    naming that root and etcd."""
    from engine.manager.election import connect
    from onepiece_platform.engine_link.cluster import reset_clusters

    root = f"/{name}-{uuid.uuid4().hex[:6]}"
    settings.ETCD_URL = etcd_url
    settings.ONEPIECE = {**settings.ONEPIECE, "ETCD_ROOT": root}
    reset_clusters()
    client = connect(etcd_url)
    try:
        yield root, client
    finally:
        client.delete_prefix(root + "/")
        reset_clusters()
