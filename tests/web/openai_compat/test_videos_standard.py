"""/v1/videos as video clients use it: text-to-video without an image, JSON bodies with a data: URL,
thumbnail and spritesheet variants, remix, expires_at, the poll-after header, size errors on ``size``."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Video
from PIL import Image

from engine import envs
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import make_user, png
from tests.fixtures.workers import mp4

EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _get(client: openai.OpenAI, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(str(client.base_url).rstrip("/") + path, headers={"Authorization": f"Bearer {client.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_text_to_video_thumbnail_spritesheet_and_remix(oa, workers) -> None:
    client, user = oa
    v = client.videos.create_and_poll(prompt="a cat on the moon", size="64x64", seconds="1", poll_interval_ms=50,
                                      extra_body={**EXTRA, "seed": 4})
    assert v.status == "completed" and v.model == "wan2.1-t2v"  # no image, no model: text-to-video
    assert Job.objects.get(uid=v.id).workflow == "wan2.1-t2v"
    assert v.expires_at == int(Job.objects.get(uid=v.id).finished_at.timestamp()) + envs.RESULT_TTL_S
    assert client.videos.download_content(v.id, variant="video").content == mp4()
    thumb = Image.open(io.BytesIO(client.videos.download_content(v.id, variant="thumbnail").content))
    assert thumb.format == "PNG" and thumb.size == (32, 32) and max(thumb.getpixel((16, 16))) < 12  # frame 0 is black
    sheet = Image.open(io.BytesIO(client.videos.download_content(v.id, variant="spritesheet").content))
    assert sheet.format == "JPEG" and sheet.size == (96, 96)  # 9 frames of 32x32 in a 3x3 grid, in time order
    assert sheet.getpixel((16, 16))[0] < sheet.getpixel((80, 80))[0] - 100
    status, body = _get(client, f"/videos/{v.id}/content?variant=poster")
    assert status == 400 and body["error"]["param"] == "variant"

    r = client.videos.remix(v.id, prompt="a red car in the snow")
    assert r.remixed_from_video_id == v.id and r.prompt == "a red car in the snow" and r.id != v.id
    src, remix = Job.objects.get(uid=v.id), Job.objects.get(uid=r.id)
    assert remix.workflow == src.workflow and {**src.params, "prompt": "a red car in the snow"} == remix.params
    assert client.videos.retrieve(r.id).remixed_from_video_id == v.id
    assert {x.id: x.remixed_from_video_id for x in client.videos.list()} == {v.id: None, r.id: v.id}
    # another user's video is not there to remix
    _, other_key = make_user("someone-else")
    other = openai.OpenAI(api_key=other_key, base_url=client.base_url, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.videos.remix(v.id, prompt="mine now")
    other.close()


def test_json_body_takes_a_data_url_first_frame(oa, workers) -> None:
    client, _ = oa
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    def create(**body: object) -> Video:
        # a JSON body through the client's own transport (videos.create() of openai 3.57 insists on a file part)
        return client.post("/videos", cast_to=Video, body=body)

    v = create(prompt="a cat", model="wan2.1-i2v", size="64x64", input_reference={"image_url": data_url}, **EXTRA)
    assert v.model == "wan2.1-i2v" and Job.objects.get(uid=v.id).workflow == "wan2.1-i2v"
    assert client.videos.poll(v.id, poll_interval_ms=50).status == "completed"
    for ref in ({"image_url": "https://example.com/cat.png"}, {"file_id": "file-123"},
                {"image_url": "data:image/png;base64,not base64!"}):
        with pytest.raises(openai.BadRequestError) as e:
            create(prompt="a cat", model="wan2.1-i2v", size="64x64", input_reference=ref)
        assert e.value.body["param"] == "input_reference"
    with pytest.raises(openai.BadRequestError) as e:  # an image-to-video source's remix needs its first frame again
        client.videos.remix(v.id, prompt="a dog")
    assert e.value.body["param"] == "input_reference"
    r = client.videos.remix(v.id, prompt="a dog", extra_body={"input_reference": {"image_url": data_url}})
    assert r.remixed_from_video_id == v.id
    with pytest.raises(openai.BadRequestError) as e:  # text-to-video takes no first frame
        create(prompt="a cat", model="wan2.1-t2v", input_reference={"image_url": data_url})
    assert e.value.body["param"] == "input_reference"


def test_poll_after_header_while_unfinished_and_size_errors(oa, workers) -> None:
    client, _ = oa
    workers.hold = True
    v = client.videos.create(prompt="a cat", size="64x64", extra_body=EXTRA)
    raw = client.videos.with_raw_response.retrieve(v.id)
    assert raw.parse().status == "queued" and raw.parse().expires_at is None
    assert 250 <= int(raw.headers["openai-poll-after-ms"]) <= 10_000
    workers.hold = False
    done = client.videos.create(prompt="a cat", size="64x64", extra_body=EXTRA)
    client.videos.poll(done.id, poll_interval_ms=50)
    assert "openai-poll-after-ms" not in client.videos.with_raw_response.retrieve(done.id).headers
    for size in ("65x64", "big", "4096x4096"):
        with pytest.raises(openai.BadRequestError) as e:
            client.videos.create(prompt="a cat", size=size, extra_body=EXTRA)
        assert e.value.body["param"] == "size", size
