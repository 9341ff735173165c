"""Form fields that are not UTF-8 (issue 25): Django decodes multipart and urlencoded fields with
``errors="replace"``, so a prompt of bad bytes became U+FFFD and the job was accepted. Each is a 400
naming the field, on the native API and on /v1/videos, in multipart and urlencoded bodies."""

from __future__ import annotations

from typing import Any

import pytest

from onepiece_platform.jobs.models import Job

pytestmark = pytest.mark.django_db

BOUNDARY = "onepiece-test-boundary"


def _multipart(fields: list[tuple[bytes, bytes]]) -> bytes:
    out = b""
    for name, value in fields:
        out += (f"--{BOUNDARY}\r\n".encode() + b'Content-Disposition: form-data; name="' + name + b'"\r\n\r\n'
                + value + b"\r\n")
    return out + f"--{BOUNDARY}--\r\n".encode()


def _post(c: Any, path: str, body: bytes, content_type: str) -> Any:
    return c.generic("POST", path, body, content_type=content_type)


def _field(r: Any) -> str:
    doc = r.json()
    return doc["error"]["param"] if "error" in doc else doc["field"]


MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(("path", "body", "content_type", "field"), [
    ("/api/v1/jobs", _multipart([(b"workflow", b"sd-t2i"), (b"params", b'{"prompt": "a \xff cat"}')]), MULTIPART,
     "params"),
    ("/v1/videos", _multipart([(b"prompt", b"a \xff\xfe cat"), (b"size", b"64x64"), (b"seconds", b"1")]), MULTIPART,
     "prompt"),
    ("/v1/videos", b"prompt=a%20%FF%20cat&size=64x64&seconds=1", FORM, "prompt"),
    ("/v1/videos", b"prompt=a+cat&size=64x64&seconds=1&negative_prompt=%C3%28", FORM, "negative_prompt"),
])
def test_a_field_that_is_not_utf8_is_400_naming_it(alice, path: str, body: bytes, content_type: str,
                                                    field: str) -> None:
    _, c, _ = alice
    r = _post(c, path, body, content_type)
    assert r.status_code == 400, r.content
    assert _field(r) == field, r.json()
    assert Job.objects.count() == 0


def test_a_field_name_that_is_not_utf8_is_400(alice) -> None:
    _, c, _ = alice
    r = _post(c, "/v1/videos", _multipart([(b"prompt", b"a cat"), (b"si\xffze", b"64x64")]), MULTIPART)
    assert r.status_code == 400 and "\ufffd" in _field(r), r.content
    assert Job.objects.count() == 0


def test_utf8_fields_and_a_literal_replacement_character_still_pass(alice) -> None:
    _, c, _ = alice
    prompt = "a caf\u00e9 \ufffd cat \u732b".encode()
    r = _post(c, "/v1/videos", _multipart([(b"prompt", prompt), (b"size", b"64x64"), (b"seconds", b"1"),
                                           (b"num_inference_steps", b"2")]), MULTIPART)
    assert r.status_code == 200, r.content
    r = _post(c, "/v1/videos", b"prompt=a%20caf%C3%A9&size=64x64&seconds=1&num_inference_steps=2", FORM)
    assert r.status_code == 200, r.content
    assert sorted(j.params["prompt"] for j in Job.objects.all()) == ["a caf\u00e9", prompt.decode()]
