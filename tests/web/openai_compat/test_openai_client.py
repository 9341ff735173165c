"""The official openai client against a live OnePiece: only base_url changes."""

from __future__ import annotations

import base64
import io
import urllib.request

import openai
import pytest

from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas.models import Quota
from tests.fixtures.web import png
from tests.fixtures.workers import mp4

EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _ref() -> tuple[str, io.BytesIO, str]:
    return ("first.png", io.BytesIO(png()), "image/png")


def test_video_create_retrieve_list_content_delete(oa, workers) -> None:
    client, user = oa
    workers.hold = True
    v = client.videos.create(prompt="a cat", input_reference=_ref(), seconds="4", size="64x64",
                             model="wan2.1-i2v", extra_body=EXTRA)
    assert v.status == "queued" and v.object == "video" and v.size == "64x64" and v.seconds == "4"
    assert Job.objects.get(uid=v.id).params["num_frames"] == 65 and Job.objects.get(uid=v.id).api == "openai"
    with pytest.raises(openai.APIStatusError) as e:  # no result yet
        client.videos.download_content(v.id)
    assert e.value.status_code == 409
    workers.hold = False
    w = client.videos.create(prompt="a dog", input_reference=_ref(), size="64x64", extra_body={**EXTRA, "seed": 3})
    done = client.videos.poll(w.id, poll_interval_ms=50)
    assert done.status == "completed" and done.progress == 100 and done.completed_at
    assert client.videos.download_content(w.id).content == mp4()
    page = client.videos.list(limit=1)
    assert [x.id for x in page.data] == [w.id] and page.has_more
    assert [x.id for x in client.videos.list(limit=1, after=w.id).data] == [v.id]
    assert {x.id for x in client.videos.list(limit=1)} == {v.id, w.id}
    deleted = client.videos.delete(v.id)
    assert deleted.deleted and deleted.id == v.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(v.id)
    assert Job.objects.get(uid=v.id).cancel_requested_at is not None
    # a finished video's bytes go with it at once, not at the result store's TTL
    assert workers.store.result(w.id) == mp4()
    assert client.videos.delete(w.id).deleted and workers.store.result(w.id) is None
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(w.id)


def test_video_errors_are_openai_shaped(oa) -> None:
    client, _ = oa
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", size="64x64", model="wan2.1-i2v")
    assert e.value.body["param"] == "input_reference" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", input_reference=_ref(), model="sora-2")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", input_reference=_ref(), size="65x64", extra_body=EXTRA)
    assert e.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("0" * 32)
    bad = openai.OpenAI(api_key="op_nope_nope", base_url=client.base_url, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.videos.list()
    bad.close()


def test_failed_video_shows_failed_with_error(oa, workers) -> None:
    client, _ = oa
    workers.fail = True
    v = client.videos.create(prompt="a cat", input_reference=_ref(), size="64x64", extra_body=EXTRA)
    done = client.videos.poll(v.id, poll_interval_ms=50)
    assert done.status == "failed" and done.error.code == "failed" and done.error.message == "boom"


def test_images_b64_json_and_url(oa, workers) -> None:
    client, _ = oa
    r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body=EXTRA)
    assert base64.b64decode(r.data[0].b64_json) == png(64, 64)
    r = client.images.generate(prompt="a cat", size="64x64", n=2, response_format="url", extra_body=EXTRA)
    assert len(r.data) == 2
    with urllib.request.urlopen(r.data[0].url, timeout=10) as resp:  # no API key: the signature is the grant
        assert resp.headers["Content-Type"] == "image/png" and resp.read() == png(64, 64)
    tampered = r.data[0].url[:-3] + "xyz"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(tampered, timeout=10)
    assert e.value.code == 404


def test_image_failure_is_502_and_quota_is_429(oa, workers) -> None:
    client, user = oa
    workers.fail = True
    with pytest.raises(openai.APIStatusError) as e:
        client.images.generate(prompt="a cat", size="64x64", extra_body=EXTRA)
    assert e.value.status_code == 502 and "boom" in e.value.body["message"]
    Quota.objects.create(user=user, gpu_seconds_per_day=0.0)
    with pytest.raises(openai.RateLimitError) as e:
        client.images.generate(prompt="a cat", size="64x64", extra_body=EXTRA)
    assert int(e.value.response.headers["Retry-After"]) >= 1 and e.value.body["code"] == "gpu_seconds"
