"""Issue 39, finding 1: a ``lora`` nested deeper than Python's recursion limit, as a JSON string (the form the
field takes in a multipart or urlencoded body) or as JSON in the body itself, is a 400 naming ``lora`` on every
route that takes the field, never a ``RecursionError`` (500). The refusal comes from the field's parsing, before
any adapter is looked up, so no registry or model is needed here."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import pytest

from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db
DEEP = "[" * 1999 + "]" * 1999  # 3,998 characters: under the field's 4,000-character bound
VIDEO = {"prompt": "a wave", "model": "wan2.1-t2v", "size": "64x64"}
IMAGE = {"prompt": "a cat", "size": "64x64"}


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _native_field(r: Any) -> str:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    return r.json()["field"]


def _openai_param(r: Any) -> str:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    return r.json()["error"]["param"]


def test_a_deeply_nested_lora_string_is_400_naming_lora_on_every_route(alice: Any) -> None:
    _, c, _ = alice
    assert len(DEEP) == 3998
    assert _native_field(c.post("/api/v1/jobs", {**sd_body(), "lora": DEEP}, format="json")) == "lora"
    # inside params (JSON body, and the multipart form's params string)
    assert _native_field(c.post("/api/v1/jobs", sd_body(lora=DEEP), format="json")) == "lora"
    form = {"workflow": "sd-t2i", "params": json.dumps(sd_body(lora=DEEP)["params"])}
    assert _native_field(c.post("/api/v1/jobs", form, format="multipart")) == "lora"
    # beside params in the form, as the JSON submit takes it (the native multipart submit reads every field)
    form = {"workflow": "sd-t2i", "params": json.dumps(sd_body()["params"]), "lora": DEEP}
    assert _native_field(c.post("/api/v1/jobs", form, format="multipart")) == "lora"
    assert _openai_param(c.post("/v1/images/generations", {**IMAGE, "lora": DEEP}, format="json")) == "lora"
    for fmt in ("json", "multipart"):
        assert _openai_param(c.post("/v1/videos", {**VIDEO, "lora": DEEP}, format=fmt)) == "lora", fmt
    r = c.generic("POST", "/v1/videos", urlencode({**VIDEO, "lora": DEEP}),
                  content_type="application/x-www-form-urlencoded")
    assert _openai_param(r) == "lora"
    assert Job.objects.count() == 0


def test_a_deeply_nested_lora_in_a_json_body_is_400_not_500(alice: Any) -> None:
    """Shallow enough for the body's parser and deeper than it allows: a 400 either way (naming ``lora``
    where the body parsed, a parse error where it did not)."""
    _, c, _ = alice
    for depth in (200, 700, 950, 1999, 5000):
        deep = json.dumps(_nested(depth)) if depth < 900 else "[" * depth + "]" * depth
        for path, body in (("/api/v1/jobs", sd_body()), ("/v1/images/generations", IMAGE), ("/v1/videos", VIDEO)):
            raw = json.dumps({**body, "lora": "LORA"}).replace('"LORA"', deep)
            r = c.generic("POST", path, raw, content_type="application/json")
            assert r.status_code == 400, (depth, path, r.status_code, r.content[:300])
            text = json.dumps(r.json())
            assert "lora" in text or "nested too deeply" in text, (depth, path, text[:300])
    assert Job.objects.count() == 0
