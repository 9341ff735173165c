"""Issue 39, finding 6 in the admin: uploading a malformed safetensors file (deep nesting, bad ``data_offsets``,
``shape`` or ``dtype``, a header length past the end, not UTF-8, not an object) is a form error on ``file``
(the page again, nothing recorded, nothing in the store), never a 500. Model-free: the header is checked before
the registry looks at the workflow's model."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from tests.engine.adapters.test_malformed import MALFORMED
from tests.fixtures.web import make_user

pytestmark = pytest.mark.django_db


def test_a_malformed_upload_is_a_form_error(web_redis: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.test import Client

    from engine.adapters.registry import store
    from onepiece_platform.adapters.models import AdapterAction

    monkeypatch.setenv("ONEPIECE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ONEPIECE_ADAPTER_STORE", str(tmp_path / "adapters"))
    staff, _ = make_user("op", is_staff=True, is_superuser=True)
    web = Client()
    web.force_login(staff)
    for name, raw in MALFORMED.items():
        upload: Any = io.BytesIO(raw)
        upload.name = f"{name}.safetensors"
        r = web.post("/admin/adapters/adapteraction/add/", {"action": "add", "name": "bad", "workflow": "sd-t2i",
                                                            "scale_default": "1", "file": upload})
        assert r.status_code == 200, (name, r.status_code)
        errors = r.context["adminform"].form.errors
        assert list(errors) == ["file"], (name, errors)
    pickle = io.BytesIO(b"\x80\x04K\x01.")
    pickle.name = "lora.bin"
    r = web.post("/admin/adapters/adapteraction/add/", {"action": "add", "name": "bad", "workflow": "sd-t2i",
                                                        "scale_default": "1", "file": pickle})
    assert r.status_code == 200 and "safetensors files only" in str(r.context["adminform"].form.errors["file"])
    assert AdapterAction.objects.count() == 0 and store().list() == []
