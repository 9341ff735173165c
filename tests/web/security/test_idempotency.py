"""Idempotency-Key on the video surface (issue 25): a key names one request of one route and operation,
is taken whole, and a deleted video's key never answers the deleted id."""

from __future__ import annotations

from typing import Any

import pytest

from onepiece_platform.jobs.models import Job
from onepiece_platform.videos.models import Remix

pytestmark = pytest.mark.django_db

VIDEO = {"prompt": "a cat", "size": "64x64", "seconds": "1", "num_inference_steps": 2}


def _create(c: Any, key: str, **extra: Any) -> Any:
    return c.post("/v1/videos", {**VIDEO, **extra}, format="json", HTTP_IDEMPOTENCY_KEY=key)


def _remix(c: Any, video_id: str, key: str) -> Any:
    return c.post(f"/v1/videos/{video_id}/remix", {"prompt": "a dog"}, format="json", HTTP_IDEMPOTENCY_KEY=key)


def _refused_on_the_key(r: Any, status: int) -> None:
    assert r.status_code == status, r.content
    assert r.json()["error"]["param"] == "Idempotency-Key", r.json()


def test_a_remix_with_the_key_that_made_its_source_is_409_never_the_source(alice) -> None:
    _, c, _ = alice
    source = _create(c, "k-made").json()["id"]
    _refused_on_the_key(_remix(c, source, "k-made"), 409)
    assert not Remix.objects.exists()  # the source is not marked a remix of itself
    assert Job.objects.count() == 1


def test_a_remix_key_names_a_remix_of_one_source(alice) -> None:
    _, c, _ = alice
    a, b = _create(c, "k-a").json()["id"], _create(c, "k-b").json()["id"]
    first = _remix(c, a, "k-remix")
    assert first.status_code == 200 and first.json()["remixed_from_video_id"] == a
    again = _remix(c, a, "k-remix")
    assert again.json()["id"] == first.json()["id"]  # a repeat of the same remix: the same video
    _refused_on_the_key(_remix(c, b, "k-remix"), 409)  # another source: never a's remix
    assert Job.objects.count() == 3


def test_keys_over_the_limit_are_400_never_cut(alice) -> None:
    _, c, _ = alice
    long_a, long_b = "k" * 200 + "-a", "k" * 200 + "-b"
    _refused_on_the_key(_create(c, long_a), 400)
    _refused_on_the_key(_create(c, long_b), 400)
    source = _create(c, "k" * 200)  # exactly the limit: taken
    assert source.status_code == 200
    _refused_on_the_key(_remix(c, source.json()["id"], long_a), 400)
    assert Job.objects.count() == 1


def test_a_deleted_videos_key_answers_409_not_the_deleted_id(alice) -> None:
    _, c, _ = alice
    gone = _create(c, "k-gone").json()["id"]
    assert c.delete(f"/v1/videos/{gone}").json()["deleted"] is True
    r = _create(c, "k-gone")
    _refused_on_the_key(r, 409)
    assert gone not in r.content.decode()
