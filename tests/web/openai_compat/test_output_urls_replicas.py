"""A second platform replica serves every result URL the first issued (issue 38, item 3).

Two web processes (uvicorn serving the ASGI app, as ``onepiece up`` and the manifests run it) over one SQLite
ledger, one ``SECRET_KEY``, one Redis and one bucket of the real Swift s3api server; no public store endpoint,
so the URLs are the platform's own signed ones (a presigned GET from the store answers from the store,
whichever replica signed it: test_output_urls.py). The test's thread plays the engine's workers. Each URL
replica A issued is fetched from replica B, whole and by range, and B refuses a tampered or an expired one.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import procs
from engine.embedded import free_port
from engine.store.objects import ObjectStore
from tests.fixtures import REPO_ROOT
from tests.fixtures.web import png
from tests.fixtures.workers import Workers, mp4

REPLICA_DB = 7  # a Redis database of its own (the engine's tests flush 0, the web tests 5)
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _http(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _serve(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "onepiece_platform.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if json.loads(r.read()).get("checks", {}).get("database") == "ok":
                    return
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the web process did not become ready"
        time.sleep(0.2)  # polling a process that is starting: no event to wait on


@pytest.fixture
def replicas(tmp_path: Path, redis_server: Any, s3_server: Any,
             object_store: ObjectStore) -> Iterator[tuple[str, str, str, str, Workers]]:
    """(replica A's URL, replica B's URL, an API key, the SECRET_KEY both sign with, the workers)."""
    secret = secrets.token_hex(32)
    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{REPLICA_DB}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEPIECE_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="tests.fixtures.process_settings", DJANGO_SECRET_KEY=secret,
               ONEPIECE_STATE_DIR=str(tmp_path / "state"), ONEPIECE_SQLITE_PATH=str(tmp_path / "db.sqlite3"),
               ONEPIECE_REDIS_URL=redis_url, ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"],
               ONEPIECE_ENGINE_CLIENT="onepiece_platform.engine_link.local.LocalEngineClient",
               ONEPIECE_OBJECT_STORE=s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}")
    manage = [sys.executable, str(REPO_ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=env, cwd=REPO_ROOT, check=True)
    key = subprocess.run([*manage, "ensure_demo_user"], env=env, cwd=REPO_ROOT, check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1].split(": ", 1)[1]
    workers = Workers(redis_url)
    workers.store.r.flushdb()
    workers.store.objects = ObjectStore(object_store.config)
    logs = [tmp_path / "web-a.log", tmp_path / "web-b.log"]
    procs_urls = [_serve(env, log) for log in logs]
    try:
        for (proc, url), log in zip(procs_urls, logs, strict=True):
            _ready(proc, url, log)
        yield procs_urls[0][1], procs_urls[1][1], key, secret, workers
    finally:
        for proc, _ in procs_urls:
            procs.stop(proc, timeout=20)
        workers.close()


def _issued(a: str, key: str) -> list[tuple[str, bytes]]:
    """The URLs replica A issues for an image (png, and jpeg converted on the way) and a video, with the
    bytes each must give."""
    import openai

    client = openai.OpenAI(api_key=key, base_url=a + "/v1", max_retries=0, timeout=60)
    out = []
    for fmt in ("png", "jpeg"):
        r = client.images.generate(prompt="a cat", size="64x64", response_format="url", output_format=fmt,
                                   extra_body={"num_inference_steps": 2})
        assert r.data[0].model_extra["expires_at"] > time.time() + 3000
        out.append((r.data[0].url, _http(r.data[0].url)[1]))
    assert out[0][1] == png(64, 64) and out[1][1].startswith(b"\xff\xd8\xff")  # as A serves them
    v = client.videos.create_and_poll(prompt="a cat", model="wan2.1-t2v", size="64x64", seconds="1",
                                      extra_body={"num_inference_steps": 2}, poll_interval_ms=50)
    status, body = _http(f"{a}/v1/videos/{v.id}/content?response_format=url", {"Authorization": f"Bearer {key}"})
    assert status == 200, body
    out.append((json.loads(body)["url"], mp4()))
    client.close()
    return out


@pytest.mark.timeout(400)
def test_a_second_replica_serves_every_url_the_first_issued(replicas) -> None:
    from django.core import signing

    from onepiece_platform.jobs.result_urls import URL_MAX_AGE_S, URL_SALT

    a, b, key, secret, _workers = replicas
    issued = _issued(a, key)
    for url, data in issued:
        assert url.startswith(a + "/v1/"), url
        on_b = b + url[len(a):]
        assert _http(on_b) == (200, data), on_b
        assert _http(on_b, {"Range": "bytes=3-40"}) == (206, data[3:41])
        assert _http(on_b[:-3] + ("xyz" if not on_b.endswith("xyz") else "abc"))[0] == 404  # tampered
    # a token A signed over an hour ago (the same SECRET_KEY): expired on B as on A
    video_uid = issued[-1][0].rsplit("/", 1)[1].split(":")[1]
    stale = signing.TimestampSigner(key=secret, salt=URL_SALT)
    stale.timestamp = lambda: signing.b62_encode(int(time.time()) - URL_MAX_AGE_S - 60)  # type: ignore[method-assign]
    token = stale.sign(f"video:{video_uid}")
    assert _http(f"{b}/v1/videos/content/{token}")[0] == 404
    fresh = signing.TimestampSigner(key=secret, salt=URL_SALT).sign(f"video:{video_uid}")
    assert _http(f"{b}/v1/videos/content/{fresh}") == (200, mp4())  # the same grant signed now: served
