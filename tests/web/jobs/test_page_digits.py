"""The list routes' ``page`` and ``page_size`` take ASCII digits only (issue 39, finding 7): ``int()`` also
reads full-width ``２``. A page written so is an invalid page (404, as ``page=abc``); a page size written so
is ignored, as ``page_size=abc`` (the default of 20)."""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.django_db


def test_full_width_digits_are_not_a_page_or_a_page_size(alice) -> None:
    from onepiece_platform.jobs.models import Job

    user, c, _ = alice
    for _ in range(3):
        Job.objects.create(uid=uuid.uuid4().hex, owner=user, workflow="sd-t2i", params={}, cost_estimate_gpu_s=1.0)
    assert len(c.get("/api/v1/jobs", {"page_size": "1"}).json()["results"]) == 1
    assert len(c.get("/api/v1/jobs", {"page_size": "１"}).json()["results"]) == 3  # not 1: the default size
    assert c.get("/api/v1/jobs", {"page": "2", "page_size": "1"}).status_code == 200
    r = c.get("/api/v1/jobs", {"page": "２", "page_size": "1"})
    assert r.status_code == 404 and "ASCII" in str(r.json()), r.json()


def test_the_webhook_deliveries_page_reads_ascii_digits_only(alice, settings) -> None:
    _, c, _ = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": True}  # a loopback endpoint, never called
    endpoint = c.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/hook"}, format="json")
    assert endpoint.status_code == 201, endpoint.content
    pk = endpoint.json()["id"]
    assert c.get(f"/api/v1/webhooks/{pk}/deliveries", {"page": "1"}).status_code == 200
    assert c.get(f"/api/v1/webhooks/{pk}/deliveries", {"page": "１"}).status_code == 404
