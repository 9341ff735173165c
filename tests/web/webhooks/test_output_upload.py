"""The client's own bucket (issue 38, item 5): ``output_upload_url`` on the native API and the OpenAI routes, the
output PUT there by the webhook delivery worker under the webhooks' egress policy, retried with backoff, the
job recording where it went and how it went, our copy kept only with ``keep_output``. A real presigned PUT URL
of a second bucket of the embedded Swift s3api server stands for the client's; real redis-server."""

from __future__ import annotations

import datetime as dt
import os
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from django.core.management import call_command

from engine.embedded import free_port
from engine.store import JobStore, keys
from engine.store.objects import ObjectStore, result_prefix
from onepiece_platform.jobs.models import Job, OutputUpload
from onepiece_platform.webhooks.uploads import Uploader
from tests.fixtures.web import sd_body
from tests.fixtures.workers import mp4

PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(3000)
EXTRA = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture
def bucket(s3_server: Any) -> Iterator[ObjectStore]:
    """The client's bucket: another bucket of the same real server, written only through presigned PUTs."""
    store = ObjectStore.from_url(s3_server.url.rsplit("/", 1)[0] + f"/client-{secrets.token_hex(5)}")
    store.ensure_bucket()
    yield store
    store.close()


@pytest.fixture
def ours(settings: Any, s3_server: Any, object_store: ObjectStore, hooks_settings: Any) -> Iterator[ObjectStore]:
    """The platform's store (a bucket of the same server) with the webhooks' local policy (loopback allowed)."""
    from onepiece_platform.engine_link import objects

    settings.ONEPIECE = {**settings.ONEPIECE, "OUTPUT_UPLOAD_RETRY_DELAYS_S": (5,),
                         "OBJECT_STORE": s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}"}
    yield object_store
    objects._stores.clear()


def _production(settings: Any) -> None:
    """The production settings' egress policy (settings/production.py): https only, public addresses only."""
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": False, "WEBHOOK_REQUIRE_HTTPS": True}


class Bucketish:
    """An HTTP server answering PUTs as scripted: a status, or ("redirect", url); 200 once the script is used up."""

    def __init__(self, *script: Any) -> None:
        self.script, self.bodies = list(script), []
        self.port = free_port()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = owner.script.pop(0) if owner.script else 200
                owner.bodies.append(body)
                if isinstance(answer, tuple):
                    self.send_response(307)
                    self.send_header("Location", answer[1])
                else:
                    self.send_response(answer)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/bucket/out.png?X-Amz-Signature=abc"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _submit(c: Any, url: str, **fields: Any) -> str:
    r = c.post("/api/v1/jobs", {**sd_body(), "output_upload_url": url, **fields}, format="json")
    assert r.status_code == 202, r.content
    return r.json()["uid"]


def _complete(c: Any, store: JobStore, uid: str, data: bytes = PNG) -> None:
    assert store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=data)
    assert c.get(f"/api/v1/jobs/{uid}").json()["state"] == "completed"


def test_a_video_goes_to_the_clients_bucket_and_our_copy_goes(oa, workers, ours: ObjectStore,
                                                              bucket: ObjectStore) -> None:
    """The openai client (extra_body), a real presigned PUT, the output streamed from our store to the client's
    bucket; without keep_output our object is deleted and /content says where it went (410)."""
    workers.store.objects = ObjectStore(ours.config)
    client, _ = oa
    put = bucket.presign_put("renders/cat.mp4", 600)
    try:
        v = client.videos.create_and_poll(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1",
                                          poll_interval_ms=50, extra_body={**EXTRA, "output_upload_url": put.url})
        assert v.status == "completed" and ours.newest(result_prefix(v.id)) is not None
        assert v.model_extra["extra"]["output_upload"]["state"] == "pending"
        assert Uploader().run_once() == ["uploaded"]
        assert bucket.get("renders/cat.mp4") == mp4()
        assert ours.newest(result_prefix(v.id)) is None  # keep_output false: ours is gone
        up = client.videos.retrieve(v.id).model_extra["extra"]["output_upload"]
        assert up["state"] == "uploaded" and up["status"] == 200 and up["attempts"] == 1
        assert up["url"] == put.url.split("?")[0] and "Signature" not in str(up)  # where, never the credential
        with pytest.raises(openai.APIStatusError) as e:
            client.videos.download_content(v.id)
        assert e.value.status_code == 410
    finally:
        workers.store.objects.close()
        workers.store.objects = None


@pytest.mark.django_db
def test_keep_output_keeps_ours_and_an_inline_output_uploads_from_redis(alice, store: JobStore, hooks_settings,
                                                                        bucket: ObjectStore) -> None:
    _, c, _ = alice
    uid = _submit(c, bucket.presign_put("a.png", 600).url, keep_output=True)
    _complete(c, store, uid)
    assert call_command_output().endswith("uploads attempted 1: 1 uploaded")
    assert bucket.get("a.png") == PNG
    got = c.get(f"/api/v1/jobs/{uid}").json()["output_upload"]
    assert (got["state"], got["keep_output"], got["error"]) == ("uploaded", True, None)
    assert c.get(f"/api/v1/jobs/{uid}/result").content == PNG  # still ours too


def call_command_output() -> str:
    """``manage.py deliver_webhooks --once``: one round of webhooks and of output uploads."""
    import io

    out = io.StringIO()
    call_command("deliver_webhooks", "--once", stdout=out)
    return out.getvalue().strip()


@pytest.mark.django_db
def test_private_addresses_are_refused_in_production(alice, settings, bucket: ObjectStore) -> None:
    _, c, _ = alice
    _production(settings)
    for url in (bucket.presign_put("x", 600).url, "https://127.0.0.1:9/b/k", "https://10.0.0.7/b/k",
                "https://169.254.169.254/latest/meta-data", "https://[::1]/b/k", "ftp://example.com/b/k"):
        r = c.post("/api/v1/jobs", {**sd_body(), "output_upload_url": url}, format="json")
        assert r.status_code == 400 and r.json()["field"] == "output_upload_url", (url, r.content)
    assert not Job.objects.exists()


def test_the_openai_routes_refuse_a_private_url_in_production(oa, settings) -> None:
    client, _ = oa
    _production(settings)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a cat", size="64x64",
                               extra_body={**EXTRA, "output_upload_url": "https://192.168.1.2/b/k"})
    assert e.value.body["param"] == "output_upload_url"
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a cat", model="wan2.1-t2v", size="64x64",
                             extra_body={**EXTRA, "output_upload_url": "https://127.0.0.1/b/k"})
    assert e.value.body["param"] == "output_upload_url"
    with pytest.raises(openai.BadRequestError) as e:  # one URL, one object
        client.images.generate(prompt="a cat", size="64x64", n=2,
                               extra_body={**EXTRA, "output_upload_url": "https://example.com/b/k"})
    assert e.value.body["param"] == "output_upload_url"


@pytest.mark.django_db
def test_the_policy_is_checked_again_at_upload_time(alice, store: JobStore, settings, hooks_settings,
                                                    bucket: ObjectStore) -> None:
    """Accepted under the local policy, uploaded under production's (a name may resolve elsewhere later)."""
    _, c, _ = alice
    uid = _submit(c, bucket.presign_put("late.png", 600).url)
    _complete(c, store, uid)
    _production(settings)
    assert Uploader().run_once() == ["failed"]  # refused at once: retrying cannot change it
    got = c.get(f"/api/v1/jobs/{uid}").json()["output_upload"]
    assert got["state"] == "failed" and got["error"].startswith("refused:") and got["attempts"] == 1
    assert bucket.get("late.png") is None
    assert c.get(f"/api/v1/jobs/{uid}/result").content == PNG  # ours stays


@pytest.mark.django_db
def test_a_redirect_is_not_followed(alice, store: JobStore, hooks_settings, bucket: ObjectStore) -> None:
    _, c, _ = alice
    target = bucket.presign_put("redirected.png", 600).url
    server = Bucketish(("redirect", target))
    try:
        uid = _submit(c, server.url)
        _complete(c, store, uid)
        assert Uploader().run_once() == ["failed"]
    finally:
        server.close()
    got = OutputUpload.objects.get(job__uid=uid)
    assert (got.last_status, got.state) == (307, "failed") and "not followed" in got.last_error
    assert bucket.get("redirected.png") is None and server.bodies == [PNG]


@pytest.mark.django_db
def test_a_failed_upload_is_retried_with_backoff_then_given_up(alice, store: JobStore, settings,
                                                               hooks_settings) -> None:
    _, c, _ = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "OUTPUT_UPLOAD_RETRY_DELAYS_S": (5, 30), "OUTPUT_UPLOAD_ATTEMPTS": 3}
    server = Bucketish(503, 500, 200, 503, 503, 503)
    try:
        first, second = _submit(c, server.url), _submit(c, server.url)
        now = [dt.datetime.now(dt.UTC)]  # the uploader's clock, moved by the test
        up = Uploader(clock=lambda: now[0])
        _complete(c, store, first)
        assert up.run_once() == ["pending"]
        row = OutputUpload.objects.get(job__uid=first)
        assert (row.last_status, row.attempt_count, row.next_attempt_at) == (503, 1, now[0] + dt.timedelta(seconds=5))
        assert up.run_once() == []  # not due yet
        now[0] += dt.timedelta(seconds=5)
        assert up.run_once() == ["pending"]  # a 500: retried after the second delay
        now[0] += dt.timedelta(seconds=30)
        assert up.run_once() == ["uploaded"] and server.bodies[2] == PNG
        _complete(c, store, second)
        states = []
        for _ in range(3):
            states += up.run_once()
            now[0] += dt.timedelta(seconds=30)
        assert states == ["pending", "pending", "failed"]  # OUTPUT_UPLOAD_ATTEMPTS in all
    finally:
        server.close()
    assert OutputUpload.objects.get(job__uid=second).attempt_count == 3


@pytest.mark.django_db
def test_size_limit_and_jobs_without_an_output(alice, store: JobStore, settings, hooks_settings) -> None:
    _, c, _ = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "OUTPUT_UPLOAD_MAX_BYTES": 100}
    server = Bucketish()
    try:
        big, doomed = _submit(c, server.url), _submit(c, server.url)
        _complete(c, store, big)
        assert store.finish(doomed, "sd-t2i", keys.FAILED, "denoise", detail="boom")
        c.get(f"/api/v1/jobs/{doomed}")
        assert Uploader().run_once() == ["failed"]
    finally:
        server.close()
    assert server.bodies == []  # nothing was sent
    assert "over the limit of 100" in OutputUpload.objects.get(job__uid=big).last_error
    assert OutputUpload.objects.get(job__uid=doomed).state == "skipped"
