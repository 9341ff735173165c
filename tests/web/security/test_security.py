"""Security properties of the HTTP surface, one test each."""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from django.test import Client

from engine.store import keys
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import png, sd_body, wan_body

pytestmark = pytest.mark.django_db
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_another_users_uid_is_404_everywhere_and_leaks_nothing(alice, bob, store) -> None:
    _, a, _ = alice
    _, b, _ = bob
    sd = a.post("/api/v1/jobs", sd_body(prompt="alice's secret prompt"), format="json").json()["uid"]
    vid = a.post("/api/v1/jobs", wan_body(prompt="alice's secret video"), format="json").json()["uid"]
    store.finish(sd, "sd-t2i", keys.COMPLETED, "image_encode", result=png())
    store.finish(vid, "wan2.1-i2v", keys.COMPLETED, "video_encode", result=b"mp4")
    calls = [("get", f"/api/v1/jobs/{sd}"), ("delete", f"/api/v1/jobs/{sd}"), ("get", f"/api/v1/jobs/{sd}/result"),
             ("get", f"/v1/videos/{vid}"), ("delete", f"/v1/videos/{vid}"), ("get", f"/v1/videos/{vid}/content")]
    for method, path in calls:
        r = getattr(b, method)(path)
        assert r.status_code == 404, (method, path, r.status_code)
        assert b"secret" not in r.content and png() not in r.content
    assert b.get("/api/v1/jobs").json()["count"] == 0 and b.get("/v1/videos").json()["data"] == []
    assert all(not j.hidden and j.cancel_requested_at is None for j in Job.objects.all())


def test_server_fields_are_read_only(alice, bob) -> None:
    user, c, _ = alice
    body = {**sd_body(), "owner": bob[0].pk, "uid": "f" * 32, "state": "completed", "progress": 100,
            "cost_estimate_gpu_s": 0.0, "quota_day": "19700101", "max_concurrent_jobs": 999}
    r = c.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 400 and r.json()["field"] in body  # unknown fields are refused, never ignored
    assert Job.objects.count() == 0
    r = c.post("/api/v1/jobs", sd_body(), format="json")
    assert r.status_code == 202
    job = Job.objects.get(uid=r.json()["uid"])
    assert (job.owner_id, job.state, job.progress) == (user.pk, "queued", 0)
    assert job.uid != "f" * 32 and job.cost_estimate_gpu_s > 0
    for method in ("put", "patch"):
        assert getattr(c, method)(f"/api/v1/jobs/{job.uid}", {"state": "completed"}, format="json").status_code == 405
    assert Job.objects.get(pk=job.pk).state == "queued"


def test_oversized_body_is_413_before_any_engine_work(alice, store, settings) -> None:
    settings.ONEPIECE = {**settings.ONEPIECE, "MAX_UPLOAD_BYTES": 1000}
    _, c, _ = alice
    body = wan_body()
    body["inputs"]["image"] = "A" * 4000
    r = c.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 413
    assert store.events() == [] and Job.objects.count() == 0


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG that declares w x h pixels in a few bytes (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def test_image_dimensions_are_bounded_before_decoding(alice, store) -> None:
    import base64

    _, c, _ = alice
    body = wan_body()
    body["inputs"]["image"] = base64.b64encode(_png_header_only(5000, 5000)).decode()
    r = c.post("/api/v1/jobs", body, format="json")
    assert r.status_code == 400 and r.json()["field"] == "image" and "5000x5000; at most" in r.json()["detail"]
    assert store.events() == []


def test_admin_needs_staff(alice, db) -> None:
    from django.contrib.auth import get_user_model

    user, _, _ = alice
    c = Client()
    c.force_login(user)  # an ordinary user with a session
    for path in ("/admin/", "/admin/jobs/job/", "/admin/accounts/apikey/", "/admin/quotas/quota/"):
        r = c.get(path)
        assert r.status_code == 302 and "/admin/login/" in r["Location"], path
    staff = get_user_model().objects.create_superuser("root", password="pw")
    c.force_login(staff)
    assert c.get("/admin/jobs/job/").status_code == 200
    assert c.get("/admin/jobs/job/", {"q": "abc"}).status_code == 200
    from onepiece_platform.quotas.models import Quota

    Quota.objects.create(user=user)
    page = c.get("/admin/quotas/quota/")
    assert page.status_code == 200 and b"Running now" in page.content


def test_check_deploy_is_clean_with_production_settings(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "ONEPIECE_"))}
    env.update(DJANGO_SETTINGS_MODULE="onepiece_platform.settings.production",
               DJANGO_SECRET_KEY=secrets.token_urlsafe(50), DJANGO_ALLOWED_HOSTS="onepiece.example.com",
               ONEPIECE_STATE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
