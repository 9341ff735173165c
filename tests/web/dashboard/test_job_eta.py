"""The engine's ETA in the operator dashboard's job view (issue 28 item 4): ``/dashboard/api/jobs/<uid>``
carries the job status's ``eta`` while the job is unfinished (what jobs.js shows), none once it ended. Against
the real Proxy (whose jobs never run here)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from engine.store import keys
from tests.fixtures.web import sd_body


@pytest.mark.django_db
def test_job_detail_carries_the_engines_eta_until_the_job_ends(proxy_url: str, alice: Any, store: Any) -> None:
    uid = alice[1].post("/api/v1/jobs", sd_body(), format="json").json()["uid"]
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    eta = staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]["eta"]
    assert set(eta) == {"eta_s", "eta_p90_s", "provisional", "queue_ahead"}, eta
    assert eta["eta_s"] > 0 and eta["eta_p90_s"] >= eta["eta_s"] and eta["provisional"] is True
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png!")
    job = staff.get(f"/dashboard/api/jobs/{uid}").json()["job"]
    assert job["state"] == "completed" and job["eta"] is None
