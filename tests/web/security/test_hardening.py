"""Issue 16 on the platform: every bad input is a 4xx (never a 500, never someone else's job), signed
URLs are bound to their kind and time, production refuses a placeholder secret, and the smaller items of
finding 6. One test per property."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from django.core import signing
from django.test import Client

from engine.store import keys
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body, wan_body

pytestmark = pytest.mark.django_db
REPO_ROOT = Path(__file__).resolve().parents[3]


def _bomb_png(w: int, h: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    idat = b"".join(z.compress(b"\x00" * (w + 1)) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_nan_in_multipart_params_is_400_and_never_someone_elses_job(alice, bob) -> None:
    _, a, _ = alice
    _, b, _ = bob
    assert a.post("/api/v1/jobs", sd_body(prompt="alice's"), format="json").status_code == 202
    for bad in ('{"prompt": "x", "guidance_scale": NaN}', '{"prompt": "x", "guidance_scale": Infinity}',
                '{"prompt": "x", "height": 1e999}', "[" * 50_000 + "]" * 50_000):
        r = b.post("/api/v1/jobs", {"workflow": "sd-t2i", "params": bad}, format="multipart")
        assert r.status_code == 400, (bad[:40], r.content[:200])
        assert b"alice" not in r.content
    assert Job.objects.filter(owner=bob[0]).count() == 0 and Job.objects.count() == 1


def test_an_over_long_prompt_is_refused_before_the_ledger(alice, store) -> None:
    _, c, _ = alice
    for prompt in ("x" * 1_100_000, "é" * 200_000):
        r = c.post("/api/v1/jobs", sd_body(prompt=prompt), format="json")
        assert r.status_code in (400, 413), r.status_code
        if r.status_code == 400:
            assert r.json()["field"] == "prompt"
    r = c.post("/api/v1/jobs", sd_body(prompt="x" * 5000), format="json")
    assert r.status_code == 400 and r.json()["field"] == "prompt"
    assert Job.objects.count() == 0 and store.events() == []


def test_deeply_nested_json_is_400_on_every_route(alice) -> None:
    _, c, _ = alice
    nested = "[" * 100_000 + "]" * 100_000
    for path in ("/api/v1/jobs", "/v1/images/generations", "/v1/videos"):
        r = c.generic("POST", path, nested, content_type="application/json")
        assert r.status_code == 400, (path, r.status_code)
    session = Client()
    session.force_login(alice[0])
    assert session.generic("POST", "/api/v1/keys", nested, content_type="application/json").status_code == 400
    r = c.generic("POST", "/api/v1/jobs", b'{"workflow": "sd-t2i", "params": {"prompt": "\xff"}}',
                  content_type="application/json")
    assert r.status_code == 400  # not UTF-8


def test_bombs_and_huge_images_are_400_by_the_shared_check(alice, store) -> None:
    _, c, _ = alice
    for img in (_bomb_png(20_000, 20_000), _bomb_png(9_000, 9_000), b"%!PS-Adobe-3.0 EPSF-3.0\n"):
        body = wan_body()
        body["inputs"]["image"] = base64.b64encode(img).decode()
        r = c.post("/api/v1/jobs", body, format="json")
        assert r.status_code == 400 and r.json()["field"] == "image", r.content[:200]
    assert store.events() == []


def test_unknown_fields_are_refused_on_both_surfaces(alice) -> None:
    _, c, _ = alice
    r = c.post("/api/v1/jobs", {**sd_body(), "priorty": 5}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "priorty"
    r = c.post("/v1/images/generations", {"prompt": "a cat", "qualty": "hd"}, format="json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "qualty"
    assert Job.objects.count() == 0


def test_an_idempotency_key_is_scoped_to_its_route(alice) -> None:
    _, c, _ = alice
    r = c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert r.status_code == 202
    assert c.post("/api/v1/jobs", sd_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-1").json()["uid"] == r.json()["uid"]
    from django.core.files.uploadedfile import SimpleUploadedFile

    from tests.fixtures.web import png

    v = c.post("/v1/videos", {"prompt": "a cat", "size": "64x64", "seconds": 1, "num_inference_steps": 2,
                              "input_reference": SimpleUploadedFile("first.png", png(), "image/png")},
               format="multipart",
               HTTP_IDEMPOTENCY_KEY="k-1")
    assert v.status_code == 409, v.content  # never the sd-t2i job shown as a "video"
    assert "error" in v.json() and Job.objects.count() == 1


def test_signed_image_urls_name_their_kind_and_refuse_future_timestamps(alice, store, settings) -> None:
    import secrets

    from onepiece_platform.jobs.result_urls import URL_SALT, sign_result_url

    settings.SECRET_KEY = secrets.token_urlsafe(50)  # as onepiece up generates it: not the public default

    _, c, _ = alice
    sd = c.post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    vid = c.post("/api/v1/jobs", wan_body(), format="json").json()["uid"]
    store.finish(sd, "sd-t2i", keys.COMPLETED, "image_encode", result=b"\x89PNG image")
    store.finish(vid, "wan2.1-i2v", keys.COMPLETED, "video_encode", result=b"mp4 video")
    from onepiece_platform.jobs import control

    for uid in (sd, vid):
        control.refresh(Job.objects.get(uid=uid))  # the ledger learns they completed
    anon = Client()
    assert anon.get(f"/v1/images/content/{sign_result_url('image', sd)}").status_code == 200
    ten_years = int(time.time()) + 10 * 365 * 86400
    forged = [
        sign_result_url("video", vid),  # a real signature of the wrong kind
        sign_result_url("image", vid),  # the right kind naming a video job
        signing.TimestampSigner(salt="images").sign(sd),  # the old format, kind-less
        signing.Signer(salt=URL_SALT).sign(f"image:{sd}:{signing.b62_encode(ten_years)}"),  # dated ahead
        signing.TimestampSigner(salt=URL_SALT, key="insecure-development-key-change-me").sign(f"image:{sd}"),
        # ^ the key that used to be fixed in the source
    ]
    for token in forged:
        r = anon.get(f"/v1/images/content/{token}")
        assert r.status_code == 404, token
        assert b"mp4 video" not in r.content and b"PNG" not in r.content


def test_n_images_are_all_or_none(alice, store) -> None:
    from onepiece_platform.quotas.models import Quota

    user, c, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=2)
    r = c.post("/v1/images/generations", {"prompt": "a cat", "n": 4, "size": "64x64"}, format="json")
    assert r.status_code == 429
    submitted = list(Job.objects.filter(owner=user))
    assert submitted and all(j.cancel_requested_at is not None or j.terminal for j in submitted)
    assert all(store.cancel_requested(j.uid) for j in submitted)  # the engine was told to drop them


def test_chunked_bodies_over_the_limit_are_413_as_they_stream(settings) -> None:
    from onepiece_platform.asgi import application

    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    chunk = b"x" * (1 << 20)
    sent = {"n": 0}

    async def receive() -> dict[str, Any]:
        sent["n"] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}  # never ends: only a count stops it

    out: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        out.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/v1/jobs", "headers": [(b"host", b"localhost"),
             (b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "query_string": b"", "scheme": "http", "server": ("localhost", 80), "client": ("127.0.0.1", 5)}
    asyncio.run(application(scope, receive, send))
    assert out[0]["status"] == 413 and json.loads(out[1]["body"])["field"] == "body"
    assert sent["n"] * len(chunk) <= limit + len(chunk)  # stopped as soon as it was over


def test_an_api_key_cannot_mint_keys(alice) -> None:
    from onepiece_platform.accounts.models import ApiKey

    user, c, _ = alice
    before = ApiKey.objects.filter(user=user).count()
    assert c.post("/api/v1/keys", {"name": "child"}, format="json").status_code == 403
    assert ApiKey.objects.filter(user=user).count() == before


def test_admin_sign_in_failures_are_limited(db, web_redis, settings) -> None:
    from django.contrib.auth import get_user_model

    settings.ONEPIECE = {**settings.ONEPIECE, "AUTH_FAILURES_LIMIT": 3}
    get_user_model().objects.create_superuser("root", password="a-long-admin-password")
    c = Client()
    codes = [c.post("/admin/login/", {"username": "root", "password": f"guess-{i}"}).status_code for i in range(4)]
    assert codes == [200, 200, 200, 429]
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        validate_password("12345678")


def _manage(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "ONEPIECE_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_production_refuses_an_empty_or_placeholder_secret_key(tmp_path) -> None:
    prod = {"DJANGO_SETTINGS_MODULE": "onepiece_platform.settings.production",
            "DJANGO_ALLOWED_HOSTS": "onepiece.example.com", "ONEPIECE_STATE_DIR": str(tmp_path)}
    r = _manage({**prod, "DJANGO_SECRET_KEY": ""}, "manage.py", "check")
    assert r.returncode != 0 and "SECRET_KEY" in r.stderr  # Django's own refusal of an empty key
    for key in ("change-me", "insecure-development-key-change-me", "django-insecure-" + "a1b2c3" * 10):
        r = _manage({**prod, "DJANGO_SECRET_KEY": key}, "manage.py", "check")
        assert r.returncode != 0 and "onepiece.E001" in r.stdout + r.stderr, key
    r = _manage({**prod, "DJANGO_SECRET_KEY": "change-me", "PYTHONPATH": str(REPO_ROOT / "platform")},
                "-c", "import onepiece_platform.asgi")
    assert r.returncode != 0 and "onepiece.E001" in r.stderr  # the server itself refuses to start


def test_local_settings_run_without_debug_unless_asked(tmp_path) -> None:
    code = "import django; django.setup(); from django.conf import settings; print(settings.DEBUG)"
    local = {"DJANGO_SETTINGS_MODULE": "onepiece_platform.settings.local", "ONEPIECE_STATE_DIR": str(tmp_path),
             "PYTHONPATH": str(REPO_ROOT / "platform")}
    assert _manage(local, "-c", code).stdout.strip() == "False"
    assert _manage({**local, "ONEPIECE_DEBUG": "1"}, "-c", code).stdout.strip() == "True"


def test_local_settings_take_the_production_egress_policy_when_asked(tmp_path) -> None:
    """``onepiece up`` lets webhooks and output uploads reach private addresses; ONEPIECE_WEBHOOK_ALLOW_PRIVATE=0
    refuses them as production does (the submission's vetting: a 400 naming output_upload_url)."""
    code = ("import django; django.setup(); from onepiece_platform.jobs import services\n"
            "for url in ('http://127.0.0.1:9/put', 'http://169.254.169.254/latest', 'http://10.0.0.1/put'):\n"
            "    try:\n        services.vet_upload_url(url); print('allowed')\n"
            "    except services.Invalid as exc:\n        print('refused', exc.field)\n")
    local = {"DJANGO_SETTINGS_MODULE": "onepiece_platform.settings.local", "ONEPIECE_STATE_DIR": str(tmp_path),
             "PYTHONPATH": str(REPO_ROOT / "platform")}
    assert _manage(local, "-c", code).stdout.split("\n")[:3] == ["allowed"] * 3
    refused = _manage({**local, "ONEPIECE_WEBHOOK_ALLOW_PRIVATE": "0"}, "-c", code)
    assert refused.stdout.split("\n")[:3] == ["refused output_upload_url"] * 3, refused.stderr
