"""A plain OpenAI client of a low-tier account: a request that names no priority runs at the highest its key
allows, up to normal, on /v1/images/generations, /v1/videos and remix; a remix inherits its source's
options (priority, deadline_s, quality, preview_every, lora) and parameters, capped by what the remixing key may use."""

from __future__ import annotations

import pytest

from onepiece_platform.accounts.models import ApiKey, PriorityTier
from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas.models import Quota
from tests.fixtures.web import client_for

EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def test_a_low_tier_client_names_no_priority_and_is_served_at_low(oa, workers) -> None:
    client, user = oa
    PriorityTier.objects.create(user=user, max_priority="low")
    r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body=EXTRA)
    assert len(r.data) == 1 and Job.objects.get(workflow="sd-t2i").priority == "low"
    v = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v", poll_interval_ms=50,
                                      extra_body=EXTRA)
    assert v.status == "completed" and Job.objects.get(uid=v.id).priority == "low"
    remix = client.videos.remix(v.id, prompt="a dog")
    assert remix.remixed_from_video_id == v.id and Job.objects.get(uid=remix.id).priority == "low"


def test_an_unnamed_priority_is_at_most_normal(oa, workers) -> None:
    client, user = oa
    PriorityTier.objects.create(user=user, max_priority="high")
    v = client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v", extra_body=EXTRA)
    assert Job.objects.get(uid=v.id).priority == "normal"


def test_a_remix_inherits_its_sources_options_capped_by_the_key(oa, workers) -> None:
    client, user = oa
    workers.hold = True  # the sources stay queued: a remix needs only their parameters
    Quota.objects.create(user=user, max_concurrent_jobs=10)  # five jobs stay queued
    native = client_for(client.api_key)
    body = {"workflow": "wan2.1-t2v", "deadline_s": 600, "priority": "low",
            "params": {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2,
                       "quality": "high", "preview_every": 1}}
    r = native.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 202, r.content
    source = Job.objects.get(uid=r.json()["uid"])
    assert source.options == {"quality": "high", "preview_every": 1}  # the options apart from the model's params
    assert r.json()["params"] == {**source.params, **source.options} and r.json()["quality"] == "high"
    remix = Job.objects.get(uid=client.videos.remix(source.uid, prompt="a dog").id)
    assert (remix.priority, remix.deadline_s) == ("low", 600.0)  # not the default normal, not no deadline
    assert remix.params == {**source.params, "prompt": "a dog"}
    assert remix.request_options() == source.request_options()  # quality and previews copied with the params

    PriorityTier.objects.create(user=user, max_priority="high")
    high = client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                                extra_body={**EXTRA, "priority": "high"})
    assert Job.objects.get(uid=high.id).priority == "high"
    assert Job.objects.get(uid=client.videos.remix(high.id, prompt="a dog").id).priority == "high"
    ApiKey.objects.filter(user=user).update(max_priority="normal")  # the key is capped below its source's
    capped = client.videos.remix(high.id, prompt="a bird")  # served at what the key may use, not refused
    assert Job.objects.get(uid=capped.id).priority == "normal"
