"""Result URLs with expires_at (issue 38, item 3): ``response_format=url`` on /v1/images/generations and
``/v1/videos/{id}/content?response_format=url`` answer a presigned GET from the object store where clients reach
it (OBJECT_STORE_PUBLIC_URL), else the platform's own signed URL streaming from the store; Range works on both;
tampered and expired URLs are refused. The official openai client on pytest-django's live server, a real
redis-server and the real Swift s3api server. (A second replica: test_output_urls_replicas.py.)"""

from __future__ import annotations

import datetime
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from engine.store.objects import ObjectStore
from onepiece_platform.jobs import result_urls
from onepiece_platform.jobs.result_urls import Unsatisfiable, parse_range
from tests.fixtures.web import png
from tests.fixtures.workers import mp4

EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _http(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


@pytest.fixture
def stored(settings, s3_server, object_store: ObjectStore, workers) -> Iterator[str]:
    """The platform and the test's workers on one bucket of the real store (every output stored)."""
    from onepiece_platform.engine_link import objects

    settings.ONEPIECE = {**settings.ONEPIECE,
                         "OBJECT_STORE": s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}"}
    workers.store.objects = ObjectStore(object_store.config)
    yield s3_server.endpoint
    store, workers.store.objects = workers.store.objects, None
    store.close()
    objects._stores.clear()
    result_urls._public.clear()


def _public(settings, endpoint: str) -> None:
    settings.ONEPIECE = {**settings.ONEPIECE, "OBJECT_STORE_PUBLIC_URL": endpoint}


def _check_ranges(url: str, data: bytes) -> None:
    """A range gets exactly its bytes (206), a suffix too; past the end a 416; the whole a 200."""
    assert _http(url)[:2] == (200, data)
    status, body, headers = _http(url, {"Range": "bytes=10-99"})
    assert (status, body) == (206, data[10:100]) and headers["Content-Range"] == f"bytes 10-99/{len(data)}"
    assert _http(url, {"Range": "bytes=-7"})[:2] == (206, data[-7:])
    assert _http(url, {"Range": f"bytes={len(data) - 3}-"})[:2] == (206, data[-3:])
    assert _http(url, {"Range": f"bytes={len(data)}-"})[0] == 416


def _tampered(url: str) -> str:
    return url[:-3] + ("xyz" if not url.endswith("xyz") else "abc")


def test_image_url_is_a_presigned_get_where_clients_reach_the_store(oa, workers, stored, settings) -> None:
    _public(settings, stored)
    client, _ = oa
    before = int(time.time())
    r = client.images.generate(prompt="a cat", size="64x64", response_format="url", extra_body=EXTRA)
    url, expires_at = r.data[0].url, r.data[0].model_extra["expires_at"]
    assert url.startswith(stored + "/") and "X-Amz-Signature=" in url  # the bytes never pass through the web
    assert before + result_urls.URL_MAX_AGE_S <= expires_at <= int(time.time()) + result_urls.URL_MAX_AGE_S
    _check_ranges(url, png(64, 64))
    assert _http(_tampered(url))[0] == 403


def test_an_expired_presigned_url_is_refused(oa, workers, stored, settings, live_server, monkeypatch) -> None:
    import botocore.auth

    _public(settings, stored)
    client, _ = oa
    v = client.videos.create_and_poll(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1",
                                      extra_body=EXTRA, poll_interval_ms=50)
    real = botocore.auth.get_current_datetime
    # the URL signed two hours ago (the web process's clock back): an hour's URL, expired an hour ago
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: real() - datetime.timedelta(hours=2))
    status, body, _ = _http(f"{live_server.url}/v1/videos/{v.id}/content?response_format=url",
                            {"Authorization": f"Bearer {client.api_key}"})
    assert status == 200 and _http(json.loads(body)["url"])[0] == 403


def test_image_url_is_the_platforms_own_where_clients_do_not_reach_the_store(oa, workers, stored, live_server,
                                                                             monkeypatch) -> None:
    from django.core import signing

    from onepiece_platform.redis_conn import get_redis

    client, _ = oa
    r = client.images.generate(prompt="a cat", size="64x64", response_format="url", extra_body=EXTRA)
    url, expires_at = r.data[0].url, r.data[0].model_extra["expires_at"]
    assert url.startswith(live_server.url + "/v1/images/content/")
    token = url.rsplit("/", 1)[1]
    assert expires_at == signing.b62_decode(token.split(":")[-2]) + result_urls.URL_MAX_AGE_S
    get_redis().flushdb()  # Redis forgot the job and its reference: the platform streams from the store
    _check_ranges(url, png(64, 64))
    assert _http(_tampered(url))[0] == 404
    stale = int(time.time()) - result_urls.URL_MAX_AGE_S - 60
    monkeypatch.setattr(signing.TimestampSigner, "timestamp", lambda self: signing.b62_encode(stale))
    old = result_urls.sign_result_url("image", token.split(":")[1])
    assert _http(f"{live_server.url}/v1/images/content/{old}")[0] == 404  # expired


@pytest.mark.parametrize("public", [True, False])
def test_video_content_url_with_expires_at(oa, workers, stored, settings, live_server, public: bool) -> None:
    if public:
        _public(settings, stored)
    client, _ = oa
    v = client.videos.create_and_poll(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1",
                                      extra_body=EXTRA, poll_interval_ms=50)
    assert v.status == "completed"
    auth = {"Authorization": f"Bearer {client.api_key}"}
    status, body, _ = _http(f"{live_server.url}/v1/videos/{v.id}/content?response_format=url", auth)
    assert status == 200, body
    got = json.loads(body)
    assert got["id"] == v.id and got["expires_at"] > time.time() + 3000
    assert got["url"].startswith(stored + "/" if public else live_server.url + "/v1/videos/content/")
    _check_ranges(got["url"], mp4())
    assert _http(_tampered(got["url"]))[0] in (403, 404)
    # the authenticated route itself honours Range too (a player seeks)
    assert _http(f"{live_server.url}/v1/videos/{v.id}/content", {**auth, "Range": "bytes=4-11"})[:2] == \
        (206, mp4()[4:12])


def test_a_token_for_one_kind_opens_no_other(oa, workers, stored, live_server) -> None:
    client, _ = oa
    v = client.videos.create_and_poll(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1",
                                      extra_body=EXTRA, poll_interval_ms=50)
    for token in (result_urls.sign_result_url("image", v.id), result_urls.sign_result_url("video", "0" * 32)):
        assert _http(f"{live_server.url}/v1/videos/content/{token}")[0] == 404
    assert _http(f"{live_server.url}/v1/images/content/{result_urls.sign_result_url('video', v.id)}")[0] == 404


def test_video_url_requests_that_cannot_be_served(oa, workers, stored, live_server) -> None:
    client, _ = oa
    auth = {"Authorization": f"Bearer {client.api_key}"}
    workers.hold = True
    v = client.videos.create(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1", extra_body=EXTRA)
    base = f"{live_server.url}/v1/videos/{v.id}/content"
    status, body, _ = _http(base + "?response_format=url", auth)
    assert status == 409 and json.loads(body)["error"]["message"].startswith("the video is queued")
    for query, param in (("response_format=mp4", "response_format"),
                         ("response_format=url&variant=thumbnail", "response_format"),
                         ("response_format=url&stream=true", "response_format")):
        status, body, _ = _http(f"{base}?{query}", auth)
        assert status == 400 and json.loads(body)["error"]["param"] == param, (query, body)


@pytest.mark.parametrize("header, size, span", [
    (None, 10, None), ("", 10, None), ("bytes=0-0", 10, (0, 0)), ("bytes=2-5", 10, (2, 5)),
    ("bytes=2-", 10, (2, 9)), ("bytes=2-500", 10, (2, 9)), ("bytes=-3", 10, (7, 9)), ("bytes=-30", 10, (0, 9)),
    ("bytes=5-2", 10, None), ("bytes=0-1,4-5", 10, None), ("items=0-1", 10, None), ("bytes=-", 10, None),
    ("bytes=١-٢", 10, None),  # Arabic-Indic digits are not a range
])
def test_parse_range(header: str | None, size: int, span: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == span


@pytest.mark.parametrize("header, size", [("bytes=10-", 10), ("bytes=10-12", 10), ("bytes=-0", 10), ("bytes=-1", 0)])
def test_parse_range_past_the_end(header: str, size: int) -> None:
    with pytest.raises(Unsatisfiable):
        parse_range(header, size)


@pytest.mark.parametrize("bad", ["127.0.0.1:9000", "ftp://h", "http://k:s@h:1", "http://h:1/bucket", "http://h?x=1"])
def test_a_bad_public_endpoint_is_a_configuration_error(bad: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="OBJECT_STORE_PUBLIC_URL"):
        result_urls.public_endpoint(bad)
    assert result_urls.public_endpoint("https://s3.example.net:443/") == "https://s3.example.net:443"


def test_an_inline_output_gets_the_platforms_url_even_where_the_store_is_public(oa, workers, stored, settings,
                                                                                live_server) -> None:
    """An output under ONEPIECE_OBJECT_INLINE_BYTES is in Redis, not the store: nothing to presign."""
    _public(settings, stored)
    workers.store.inline_bytes = 1 << 20
    client, _ = oa
    r = client.images.generate(prompt="a cat", size="64x64", response_format="url", extra_body=EXTRA)
    assert r.data[0].url.startswith(live_server.url + "/v1/images/content/")
    _check_ranges(r.data[0].url, png(64, 64))
