"""Fixtures of the webhook tests: a real receiver (tests/web/webhooks/receiver.py), settings with fast
retries, helpers for endpoints and finished jobs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.webhooks.receiver import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def hooks_settings(settings: Any, web_redis: str) -> Any:
    """Webhooks as on one machine (private receivers allowed), with retries in milliseconds."""
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": True, "WEBHOOK_RETRY_DELAYS_S": (0.05,),
                         "WEBHOOK_RETRY_JITTER": 0.0, "WEBHOOK_TIMEOUT_S": 5.0}
    return settings


def add_endpoint(client: Any, url: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/api/v1/webhooks", {"url": url, **fields}, format="json")
    assert r.status_code == 201, r.content
    return r.json()


def finished_job(user: Any, key_prefix: str | None, state: str = "completed", workflow: str = "sd-t2i",
                 api: str = "native", webhook_url: str = "") -> Any:
    """A ledger row as a submission leaves it, moved to ``state`` by the ledger's own terminal transition."""
    import uuid

    from onepiece_platform.accounts.models import ApiKey
    from onepiece_platform.jobs import ledger
    from onepiece_platform.jobs.models import Job

    key = ApiKey.objects.get(prefix=key_prefix) if key_prefix else None
    job = Job.objects.create(uid=uuid.uuid4().hex, owner=user, workflow=workflow, api=api, api_key=key,
                             webhook_url=webhook_url, params={"prompt": "a cat"})
    assert ledger.finish(job.uid, state, "boom" if state != "completed" else "")
    job.refresh_from_db()
    return job


def key_prefix(raw_key: str) -> str:
    return raw_key.split("_")[1]
