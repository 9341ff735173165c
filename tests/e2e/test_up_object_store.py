"""``onepiece up --object-store embedded``: outputs go to the embedded Swift s3api server, Redis keeps only
their reference, and a completed job's result is still downloadable after Redis is SIGKILLed (the supervisor
restarts it empty).

The tiny sd-t2i's 64x64 PNG is far under ``ONEPIECE_OBJECT_INLINE_BYTES``'s default (such outputs stay in
Redis, and go with it: tests/engine/store/test_jobs_objects.py), so this run sets the threshold to 0: every
output is one the store keeps, which is what must survive the kill."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from engine.store import JobStore, keys
from engine.store.objects import ObjectStore, result_prefix
from tests.e2e.up import start_up, stop_up


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _readyz(web: str) -> dict[str, Any]:
    return json.loads(_get(web + "readyz")[1])


@pytest.mark.timeout(600)
def test_up_keeps_outputs_in_the_embedded_store_across_a_redis_kill(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc, lines = start_up(state, "--object-store", "embedded", "--workflows", "sd-t2i", "--spare-slots", "0",
                           env_extra={"ONEPIECE_OBJECT_INLINE_BYTES": "0"})
    try:
        web, key = lines["web"], lines["api key"]
        assert lines["object store"].startswith("http://127.0.0.1:"), lines
        secret = json.loads((state / "s3" / "s3-credentials.json").read_text())["secret_key"]
        assert secret not in "".join(lines.values())
        assert "s3" in _readyz(web)["processes"]

        body = {"workflow": "sd-t2i", "params": {"prompt": "a lighthouse", "height": 64, "width": 64,
                                                 "num_inference_steps": 2}}
        req = urllib.request.Request(web + "api/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            uid = json.loads(r.read())["uid"]
        deadline = time.monotonic() + 180
        while (job := json.loads(_get(web + f"api/v1/jobs/{uid}", key)[1]))["state"] != "completed":
            assert job["state"] in ("queued", "in_progress") and time.monotonic() < deadline, job
            time.sleep(0.2)
        status, png = _get(web + f"api/v1/jobs/{uid}/result", key)
        assert status == 200 and png.startswith(b"\x89PNG"), (status, png[:200])

        # the bytes are in the store, Redis holds only their reference
        port = int(lines["object store"].split(":")[2].split("/")[0])
        store = ObjectStore.from_url(f"http://onepiece%3Aengine:{quote(secret, safe='')}@127.0.0.1:{port}"
                                     "/onepiece-outputs")
        ref = store.newest(result_prefix(uid))
        assert ref is not None and ref.sha256 == hashlib.sha256(png).hexdigest() and ref.size == len(png)
        redis_password = (state / "secrets" / "redis-password").read_text().strip()
        assert lines["redis"].startswith("redis://:***@"), lines["redis"]  # printed without its password
        jobs = JobStore.from_url(lines["redis"].replace("***", quote(redis_password, safe=""), 1))
        assert jobs.r.get(keys.result_key(uid)) is None and jobs.r.get(keys.result_ref_key(uid)) is not None

        # Redis SIGKILLed: the supervisor restarts it empty; the output is still downloadable
        before = _readyz(web)["processes"]["redis"]
        os.kill(before["pid"], signal.SIGKILL)
        while (now := _readyz(web)["processes"]["redis"])["restarts"] == 0 or now["state"] == "down":
            assert time.monotonic() < deadline + 60, now
            time.sleep(0.1)
        assert jobs.r.ping()  # the supervisor counts a restart once the server answers (RedisServer.start)
        assert jobs.status(uid) is None  # Redis forgot the job ...
        assert _get(web + f"api/v1/jobs/{uid}/result", key) == (200, png)  # ... the store did not
        jobs.close()
        store.close()
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out
